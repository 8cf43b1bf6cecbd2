"""Where DeepSpeed 0.19.8's ``PipelineModule`` puts each layer for ``partition_method=
'parameters'`` and ``'type:REGEX'``: pure arithmetic, as ``deepspeed.runtime.utils.
partition_balanced`` does it.

[Note: DeepSpeed's balanced partition] DeepSpeed's ``partition_balanced`` says it solves the
linear partition problem (the smallest largest stage), but what its dynamic programme minimises
is the spread, the largest stage's weight less the smallest's, ties going to the later cut. The
two differ often (a layer of 300 parameters among small ones: DeepSpeed may put 302 on one stage
where 300 was possible), and longboat's own ``parameters`` partition
(:func:`longboat.pipeline.partition.balanced`) minimises the largest stage. A DeepSpeed script
expects DeepSpeed's stages: the layers it builds on each rank, hence the weights they start
from, depend on them ([Note: DeepSpeed layer initialisation] in ``pipe.py``). So the DeepSpeed
``PipelineModule`` splits by this function; longboat's config keeps its own.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from longboat.pipeline import partition as partitions


def deepspeed_balanced(weights: Sequence[float], stages: int) -> list[int]:
    """The ``stages + 1`` boundaries DeepSpeed 0.19.8's ``partition_balanced(weights, stages)``
    returns (see [Note: DeepSpeed's balanced partition]); with no more layers than stages,
    :func:`~longboat.pipeline.partition.uniform`'s, as DeepSpeed's ``partition_uniform``."""
    n, m = len(weights), stages
    if n <= m:
        return partitions.uniform(n, m)
    inf = math.inf
    top = [[inf] * (m + 1) for _ in range(n + 1)]  # largest stage so far
    low = [[inf] * (m + 1) for _ in range(n + 1)]  # smallest stage so far
    cost = [[inf] * (m + 1) for _ in range(n + 1)]
    cut = [[0] * (m + 1) for _ in range(n + 1)]
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    top[0][0] = cost[0][0] = 0.0
    for i in range(1, n + 1):
        for j in range(1, min(i, m) + 1):
            for k in range(i):
                part = prefix[i] - prefix[k]
                hi, lo = max(top[k][j - 1], part), min(low[k][j - 1], part)
                if cost[i][j] >= hi - lo:  # ">=": the later cut wins a tie, as in DeepSpeed
                    cost[i][j], top[i][j], low[i][j], cut[i][j] = hi - lo, hi, lo, k
    bounds = [n]
    for j in range(m, 0, -1):
        bounds.append(cut[bounds[-1]][j])
    return bounds[::-1]
