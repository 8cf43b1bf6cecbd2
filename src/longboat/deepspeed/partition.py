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

The recurrence, which fixes the answer: stage by stage, the best split of the first ``i``
layers into ``j`` stages extends one best split of a shorter prefix into ``j - 1`` stages by one
stage, chosen by the spread it leaves (largest less smallest stage, each prefix carrying only
the one pair its own choice left); among equal spreads the longest prefix wins. It is not the
smallest possible spread (a prefix's one pair is not all one could carry): the answer is
DeepSpeed's, not an optimum, which is what a DeepSpeed script needs.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import NamedTuple

from longboat.pipeline import partition as partitions


class _Split(NamedTuple):
    """The chosen split of a prefix of layers: its spread, heaviest and lightest stage, and
    where its last stage begins."""

    spread: float
    heaviest: float
    lightest: float
    last_from: int


def deepspeed_balanced(weights: Sequence[float], stages: int) -> list[int]:
    """The ``stages + 1`` boundaries DeepSpeed 0.19.8's ``partition_balanced(weights, stages)``
    returns (see [Note: DeepSpeed's balanced partition]); with no more layers than stages,
    :func:`~longboat.pipeline.partition.uniform`'s, as DeepSpeed's ``partition_uniform``."""
    n = len(weights)
    if n <= stages:
        return partitions.uniform(n, stages)
    prefix = list(itertools.accumulate((float(w) for w in weights), initial=0.0))
    # splits[j][i]: the chosen split of the first i layers into j stages (None: i < j layers
    # cannot fill j stages); no stage yet is the empty split of no layers.
    splits: list[list[_Split | None]] = [[_Split(0.0, 0.0, math.inf, 0)] + [None] * n]
    for j in range(1, stages + 1):
        shorter = splits[-1]
        row: list[_Split | None] = [None] * (n + 1)
        for i in range(j, n + 1):
            for k in range(j - 1, i):
                before = shorter[k]
                if before is None:
                    continue
                stage = prefix[i] - prefix[k]
                heavy, light = max(before.heaviest, stage), min(before.lightest, stage)
                best = row[i]
                if best is None or heavy - light <= best.spread:  # a tie: the longer prefix
                    row[i] = _Split(heavy - light, heavy, light, k)
        splits.append(row)
    bounds = [n]
    for j in range(stages, 0, -1):
        chosen = splits[j][bounds[-1]]
        assert chosen is not None  # n > stages: every prefix on the way can fill its stages
        bounds.append(chosen.last_from)
    return bounds[::-1]
