"""Distributed serving: one model split across ranks by contiguous layer ranges
(pipeline parallelism) over MLX's distributed engine (`mx.distributed`: ring
over TCP, JACCL over Thunderbolt RDMA). May import config, compute, weights,
experts, streaming and loader; `generation` imports it (the worker's hooks).

- `group`     is this process a rank (launched by `mlx.launch`)? The group,
              the rank, and rank 0's address for the watchdog.
- `ranges`    which decoder layers each rank owns (`layer_split`, or even).
- `pipeline`  the model's layer list on one rank: owned layers run, the others
              are pass-through stubs; hidden states cross ranks at the boundaries.
- `channel`   rank 0's messages to the other ranks (over the watchdog's TCP lines).
- `mirror`    rank 0's side: the worker's batch, announced to the followers
              before each step; sampled tokens broadcast from rank 0.
- `follower`  the other ranks: replay rank 0's batch operations, step by step.
- `watchdog`  a TCP heartbeat between rank 0 and every other rank: a lost rank
              ends every rank with an error naming it; each rank's memory.
- `node`      one rank's setup: group, load, pipeline, watchdog.
- `launch`    `flashserve serve --hostfile`: the `mlx.launch` command line.
"""
