"""Speculative decoding: several tokens verified per pass over the weights.

At 0% residency a decode step reads every streamed layer once for one token
per sequence. A pass over k+1 tokens reads them once too, so verifying k
drafted tokens in one pass turns one read into up to k+1 tokens.

* lookup.py: prompt-lookup drafts (an n-gram of the context's end matched
  earlier in the prompt or the output; no extra model).
* draft.py: draft-model drafts (a small resident model, same vocabulary,
  greedy; each sequence keeps its own cache of it).
* accept.py: which drafted tokens a pass accepts: exact argmax match when
  greedy, speculative sampling (accept with p(draft), else resample from the
  residual) when sampled, so the output distribution is unchanged.
* rollback.py: the KV cache taken back past rejected tokens, per sequence.
* adaptive.py: the batch's draft width each step (none where drafting does
  not pay the batch), from measured step times and each sequence's measured
  acceptance; the counters /metrics serves.
* batch.py: mlx-lm's GenerationBatch with a speculative `next()`.
* mlx_lm_internals.py: the private fields of mlx-lm the others use, in one
  place, and the check that the installed mlx-lm still has them.
"""
