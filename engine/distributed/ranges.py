"""Which decoder layers each rank owns: contiguous ranges, rank 0 first.

Rank 0 holds the embedding and runs the sampler, and the final hidden state
comes back to it for the norm and the LM head, so with an even split the
layers left over go to the last ranks.
"""

from __future__ import annotations


class LayerSplitError(ValueError):
    """`layer_split` does not fit the model or the number of ranks."""


def split_layers(num_layers: int, ranks: int, given: str | None = None) -> list[range]:
    """The layer range of each rank. `given` is a comma-separated count per rank
    ("10,14"); None splits evenly."""
    if ranks < 1:
        raise LayerSplitError("at least one rank is needed")
    if given:
        try:
            counts = [int(part) for part in given.split(",")]
        except ValueError:
            raise LayerSplitError(
                f"layer_split {given!r}: expected a comma-separated layer count per rank, "
                "e.g. 10,14"
            ) from None
        if len(counts) != ranks:
            raise LayerSplitError(
                f"layer_split {given!r} names {len(counts)} ranks, but {ranks} are running"
            )
        if any(c < 1 for c in counts) or sum(counts) != num_layers:
            raise LayerSplitError(
                f"layer_split {given!r}: every rank needs at least one layer and the counts "
                f"must add up to the model's {num_layers} layers"
            )
    else:
        if num_layers < ranks:
            raise LayerSplitError(f"{num_layers} layers cannot be split across {ranks} ranks")
        base, extra = divmod(num_layers, ranks)
        counts = [base + (1 if r >= ranks - extra else 0) for r in range(ranks)]
    out, start = [], 0
    for count in counts:
        out.append(range(start, start + count))
        start += count
    return out
