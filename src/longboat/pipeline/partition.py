"""Which layers each pipeline stage holds: contiguous runs of the layer list, chosen by a method
with DeepSpeed's ``partition_method`` meanings, or by each layer's measured cost. Pure
arithmetic on per-layer weights; nothing here builds a layer or touches a process group.

- ``measured`` (the default when the layers' costs were measured, :mod:`.measure`): balance
  each layer's forward plus backward time, so that the slowest stage, which sets the
  pipeline's pace, is as fast as it can be; then, given the run's schedule, the split whose
  step the schedule simulator predicts fastest ([Note: a split for the schedule]);
- ``uniform``: balance the number of layers (the first ``n % stages`` stages take one more);
- ``parameters``: balance the trainable parameters (DeepSpeed's default);
- ``type:REGEX``: balance the layers whose class name matches ``REGEX`` (case-insensitive, as in
  DeepSpeed), e.g. ``type:Block``; an error if no layer matches;
- explicit boundaries: ``[0, 3, 8]`` gives stage 0 layers 0-2 and stage 1 layers 3-7 (the last
  boundary, the number of layers, may be left out).

No method (None) is ``measured`` when costs are given and ``parameters`` otherwise.

A partition is a list of ``stages + 1`` increasing boundaries: stage ``s`` holds layers
``bounds[s]`` to ``bounds[s + 1] - 1``. Every stage holds at least one layer.

[Note: a split for the schedule] The slowest stage sets the pace of one stage per rank, but not
of every schedule. Under an interleaved schedule a rank holds several stages, and what it has to
do per micro-batch is their sum, so the split with the smallest slowest stage can leave one rank
with far more than the other (on the reference GPT, 1.07x the best split's step). The measured
split therefore starts from that split and, given a ``score`` (the run's schedule simulated on
the candidate's stage costs, ``runtime.py``), keeps the split whose predicted step is
shortest: every split where there are at most :data:`EXHAUSTIVE`, else boundaries moved one
layer at a time while the step gets shorter. A candidate must beat the best so far by more than
rounding to replace it, so where the first split is already best it stays, and every rank,
given the same numbers, chooses the same split.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any


class PartitionError(ValueError):
    """A partition that cannot be made; the message names the method and the sizes."""


def uniform(n_layers: int, stages: int) -> list[int]:
    """Boundaries giving every stage ``n_layers // stages`` layers, the first ones one more."""
    _check_counts(n_layers, stages, "uniform")
    base, extra = divmod(n_layers, stages)
    bounds = [0]
    for s in range(stages):
        bounds.append(bounds[-1] + base + (1 if s < extra else 0))
    return bounds


def balanced(weights: Sequence[int], stages: int) -> list[int]:
    """Boundaries of ``stages`` contiguous, non-empty runs of ``weights`` whose largest sum is
    as small as it can be (the pipeline's slowest stage sets its pace). Among partitions with
    that bottleneck, earlier stages take as much as they can."""
    _check_counts(len(weights), stages, "balanced")
    if any(w < 0 for w in weights):
        raise PartitionError(f"layer weights must not be negative: {list(weights)}")
    lo, hi = max(weights, default=0), sum(weights)
    while lo < hi:  # the smallest bottleneck that a greedy packing reaches
        mid = (lo + hi) // 2
        if _pack(weights, stages, mid) is None:
            lo = mid + 1
        else:
            hi = mid
    bounds = _pack(weights, stages, lo)
    assert bounds is not None
    return bounds


def _pack(weights: Sequence[int], stages: int, limit: int) -> list[int] | None:
    """Greedy left-to-right packing under ``limit`` that leaves at least one layer for every
    later stage; None if the layers do not fit in ``stages`` runs."""
    n = len(weights)
    bounds = [0]
    i = 0
    for s in range(stages):
        must_leave = stages - s - 1  # one layer for each later stage
        if i >= n - must_leave or weights[i] > limit:
            return None
        total = weights[i]
        i += 1
        while i < n - must_leave and total + weights[i] <= limit:
            total += weights[i]
            i += 1
        bounds.append(i)
    return bounds if i == n else None


#: the method that balances measured time
MEASURED = "measured"

#: the resolution of measured seconds: costs are balanced as whole nanoseconds, so that the
#: exact integer search of :func:`balanced` applies and every rank rounds alike
_NS = 1e9


#: a predicted step of a split (its boundaries), lower is better ([Note: a split for the
#: schedule])
Score = Callable[[list[int]], float]

#: the most splits scored one by one; beyond, a local search ([Note: a split for the schedule])
EXHAUSTIVE = 500

#: how much shorter a candidate's predicted step must be to replace the best so far
_RELATIVE = 1e-9


def measured(seconds: Sequence[float], stages: int, score: Score | None = None) -> list[int]:
    """Boundaries whose slowest stage (sum of its layers' ``seconds``) is as fast as it can be,
    to the nanosecond; among equally slow splits, earlier stages take as much as they can.
    Given ``score``, the split it ranks best, from that one ([Note: a split for the
    schedule])."""
    _check_counts(len(seconds), stages, MEASURED)
    if any(not s >= 0 for s in seconds):  # also refuses NaN
        raise PartitionError(f"partition {MEASURED}: layer costs must be >= 0 s: {list(seconds)}")
    start = balanced([round(s * _NS) for s in seconds], stages)
    return start if score is None else best_scored(score, len(seconds), stages, start)


def best_scored(score: Score, n_layers: int, stages: int, start: list[int]) -> list[int]:
    """The split of ``n_layers`` into ``stages`` that ``score`` ranks lowest, ``start`` kept
    unless another is lower by more than rounding ([Note: a split for the schedule])."""
    best, best_score = list(start), score(list(start))

    def better(bounds: list[int]) -> bool:
        nonlocal best, best_score
        s = score(bounds)
        if s < best_score * (1 - _RELATIVE):
            best, best_score = bounds, s
            return True
        return False

    if math.comb(n_layers - 1, stages - 1) <= EXHAUSTIVE:
        for cuts in itertools.combinations(range(1, n_layers), stages - 1):
            better([0, *cuts, n_layers])
        return best
    moved = True
    while moved:
        moved = False
        for i in range(1, stages):
            for step in (-1, 1):
                bounds = list(best)
                bounds[i] += step
                if bounds[i - 1] < bounds[i] < bounds[i + 1] and better(bounds):
                    moved = True
    return best


def by_type(class_names: Sequence[str], pattern: str, stages: int) -> list[int]:
    """Balance the layers whose class name matches ``pattern``."""
    try:
        regex = re.compile(pattern, re.IGNORECASE)
    except re.error as e:
        raise PartitionError(
            f"partition 'type:{pattern}': not a regular expression ({e})"
        ) from None
    weights = [1 if regex.search(name) else 0 for name in class_names]
    if not any(weights):
        raise PartitionError(
            f"partition 'type:{pattern}' matches no layer; the layers' classes are "
            f"{sorted(set(class_names))}"
        )
    return balanced(weights, stages)


def explicit(bounds: Sequence[int], n_layers: int, stages: int) -> list[int]:
    """Boundaries given by hand, checked: ``stages + 1`` of them (or ``stages``, the number of
    layers then added), from 0, strictly increasing, ending at ``n_layers``."""
    out = list(bounds)
    if len(out) == stages:
        out.append(n_layers)
    if (
        len(out) != stages + 1
        or out[0] != 0
        or out[-1] != n_layers
        or any(b <= a for a, b in itertools.pairwise(out))
    ):
        raise PartitionError(
            f"partition boundaries {list(bounds)}: {stages} stage(s) of {n_layers} layers need "
            f"{stages + 1} strictly increasing boundaries from 0 to {n_layers}, e.g. "
            f"{uniform(n_layers, stages) if n_layers >= stages else '(too few layers)'}"
        )
    return out


def partition(
    method: str | Sequence[int] | None,
    stages: int,
    *,
    parameters: Sequence[int],
    class_names: Sequence[str],
    seconds: Sequence[float] | None = None,
    score: Score | None = None,
) -> list[int]:
    """Boundaries by ``method`` (see the module docstring), given each layer's trainable
    parameter count and class name, and its measured forward plus backward seconds if known
    (and, for ``measured``, the ``score`` of a split under the run's schedule)."""
    n = len(parameters)
    if method is None:
        method = MEASURED if seconds is not None else "parameters"
    if not isinstance(method, str):
        return explicit(method, n, stages)
    m = method.strip()
    if m.lower() == MEASURED:
        if seconds is None:
            raise PartitionError(
                f"partition {MEASURED!r} needs each layer's measured cost: give "
                "longboat.initialize(..., example_input=...) one micro-batch's model inputs"
            )
        return measured(seconds, stages, score)
    if m.lower() == "uniform":
        return uniform(n, stages)
    if m.lower() == "parameters":
        return balanced(parameters, stages)
    if m.lower().startswith("type:"):
        return by_type(class_names, m[len("type:") :], stages)
    raise PartitionError(
        f"partition method {method!r} is unknown; choose 'measured', 'parameters', "
        "'uniform', 'type:REGEX' or a list of boundaries"
    )


def _check_counts(n_layers: int, stages: int, method: str) -> None:
    if stages < 1:
        raise PartitionError(f"partition {method}: {stages} stages; need at least 1")
    if n_layers < stages:
        raise PartitionError(
            f"partition {method}: {n_layers} layer(s) cannot fill {stages} pipeline stages "
            "(every stage needs at least one); use fewer stages (mesh.pp) or more layers"
        )


@dataclass(frozen=True)
class StageInfo:
    """Which layers a stage holds and its trainable parameter count (for logs and explain),
    with its measured forward plus backward seconds and saved activation bytes if known."""

    stage: int
    first: int
    last: int  # inclusive
    classes: tuple[str, ...]
    parameters: int
    seconds: float | None = None
    activation_bytes: int | None = None
    # the first and last pieces' names where a layer may be cut in parts (``3b``: layer 3's
    # second part, [Note: layers in parts] in ``layered.py``); None: layer numbers
    span: tuple[str, str] | None = None

    def describe(self) -> str:
        kinds: dict[str, int] = {}
        for c in self.classes:
            kinds[c] = kinds.get(c, 0) + 1
        what = ", ".join(f"{n} {c}" if n > 1 else c for c, n in kinds.items())
        first, last = self.span or (str(self.first), str(self.last))
        out = (
            f"stage {self.stage}: layers {first}-{last} ({what}), "
            f"{self.parameters:,} trainable parameters"
        )
        if self.seconds is not None:
            out += f", measured {1e3 * self.seconds:.3g} ms forward+backward per micro-batch"
        if self.activation_bytes is not None:
            out += f", {self.activation_bytes / 2**20:.3g} MiB saved for the backward"
        return out


def describe_stages(
    params: Sequence[int],
    classes: Sequence[str],
    bounds: Sequence[int],
    seconds: Sequence[float] | None = None,
    activation_bytes: Sequence[int] | None = None,
    pieces: Sequence[tuple[int, str, str]] | None = None,
) -> list[StageInfo]:
    """What each stage holds, from each layer's trainable parameters and class name (and its
    measured cost, if known). ``pieces``, where layers come in parts: per piece, its layer's
    index and its name as a stage's first and as its last."""

    def total(xs: Sequence[Any] | None, s: int) -> Any:
        return None if xs is None else sum(xs[bounds[s] : bounds[s + 1]])

    def held(s: int) -> tuple[str, ...]:
        if pieces is None:
            return tuple(classes[bounds[s] : bounds[s + 1]])
        # one name per layer: a layer cut in parts counts once, as a part where it is cut
        layer = [i for i, _, _ in pieces]
        here = layer[bounds[s] : bounds[s + 1]]
        out: dict[int, str] = {}
        for i in range(bounds[s], bounds[s + 1]):
            whole = layer.count(layer[i]) == here.count(layer[i])
            out[layer[i]] = classes[i] if whole else f"part of {classes[i]}"
        return tuple(out.values())

    return [
        StageInfo(
            s,
            bounds[s],
            bounds[s + 1] - 1,
            held(s),
            sum(params[bounds[s] : bounds[s + 1]]),
            total(seconds, s),
            total(activation_bytes, s),
            None if pieces is None else (pieces[bounds[s]][1], pieces[bounds[s + 1] - 1][2]),
        )
        for s in range(len(bounds) - 1)
    ]
