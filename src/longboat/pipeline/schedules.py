"""Pipeline schedules as data: for every pipeline rank, the ordered list of forwards and
backwards it runs in one optimizer step. Built, printed, validated and simulated without
processes; :mod:`longboat.pipeline.runtime` executes them.

``p`` ranks hold ``p * v`` *stages* (``v`` virtual stages per rank when interleaved): stage ``s``
lives on rank ``s % p``, so the activations go round the ranks ``v`` times. ``m`` micro-batches
flow through; ``F3.1`` is micro-batch 3's forward through stage 1, ``B3.1`` its backward.

- ``gpipe``: every forward, then every backward. Peak: ``m`` micro-batches' activations held.
- ``1f1b``: ``p - r - 1`` forwards to fill the pipe, then one forward and one backward in turn,
  then the remaining backwards (PipeDream-Flush). Same bubble as GPipe, at most ``p - r``
  micro-batches' activations held on rank ``r``. Needs ``m >= p`` to fill the pipe.
- ``interleaved``: 1F1B over ``v`` virtual stages per rank (Megatron-LM's layout and order). The
  bubble shrinks by ``v``; micro-batches go in groups of ``p``, so ``m`` must be a multiple of
  ``p``.
- ``zb-h1``: 1F1B with each backward split in two ([Note: split backward]): ``I3`` computes
  micro-batch 3's input gradient, sent upstream at once, ``W3`` its weight gradients, which
  wait to fill the time 1F1B's cool-down spends idle (Qi et al. 2023, "Zero Bubble Pipeline
  Parallelism", ZB-H1). Same warm-up and peak activations as 1F1B; needs ``m >= p``.
- ``interleaved-zb``: interleaved 1F1B with each backward split the same way, the ``W``s
  trailing as in ZB-H1 ([Note: interleaved zero-bubble order]): the bubble shrinks by ``v``
  and by the weight gradients filling it; same warm-up, peak and ``m`` as interleaved.

With equal stages and a backward costing ``b`` forwards, GPipe's and 1F1B's bubble fraction is
``(p - 1) / (m + p - 1)`` on every rank (:func:`bubble_theory`, which also gives the
zero-bubble schedules');
:meth:`PipelineSchedule.simulate` computes it from the action lists. The runtime's sends never
block (``isend``) and its receives do, so a schedule runs exactly when the simulation finishes:
:meth:`PipelineSchedule.validate` refuses one that would deadlock and names the ranks and the
actions they would wait in.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from longboat.config.sections_parallel import SPLIT_BACKWARD_SCHEDULES


class ScheduleError(ValueError):
    """A schedule that cannot run: the message names the kind, the sizes and why."""


Op = Literal["F", "B", "I", "W"]

#: The actions that hand a stage's input gradient upstream: the whole backward, or its first part.
GRADIENT_OPS = ("B", "I")

#: The schedules whose backwards are split into ``I`` and ``W`` ([Note: split backward]): the
#: config's list, which its ZeRO-3 refusal reads, so that the two cannot drift apart.
SPLIT_KINDS = SPLIT_BACKWARD_SCHEDULES


@dataclass(frozen=True, order=True)
class Action:
    """One forward (``F``) or backward (``B``) of one micro-batch through one stage, or a
    backward split in two ([Note: split backward]): ``I``, the input gradient, and ``W``,
    the weight gradients."""

    op: Op
    micro_batch: int
    stage: int

    def label(self, virtual: int) -> str:
        return f"{self.op}{self.micro_batch}" + (f".{self.stage}" if virtual > 1 else "")


@dataclass(frozen=True)
class Timeline:
    """A schedule simulated with fixed costs: when each action runs, per rank."""

    makespan: float
    busy: tuple[float, ...]  # per rank
    # per rank: most forwards whose backward had not run yet (a split backward: its W)
    peak_in_flight: tuple[int, ...]
    start: dict[Action, float]

    @property
    def bubble(self) -> tuple[float, ...]:
        """Per rank, the fraction of the step it spends idle."""
        return tuple(1.0 - b / self.makespan for b in self.busy)


@dataclass(frozen=True)
class PipelineSchedule:
    """Every pipeline rank's actions for one optimizer step."""

    kind: str
    ranks: int  # p: pipeline ranks
    micro_batches: int  # m
    virtual: int  # v: stages per rank
    actions: tuple[tuple[Action, ...], ...]  # per rank, in order

    @property
    def stages(self) -> int:
        return self.ranks * self.virtual

    @property
    def split(self) -> bool:
        """Whether the backwards are split into ``I`` and ``W`` ([Note: split backward])."""
        return any(a.op == "I" for acts in self.actions for a in acts)

    def rank_of(self, stage: int) -> int:
        """The pipeline rank that holds ``stage``."""
        return stage % self.ranks

    def stages_of(self, rank: int) -> list[int]:
        """The stages ``rank`` holds, in model order."""
        return [c * self.ranks + rank for c in range(self.virtual)]

    def peak_held(self, rank: int, size: Callable[[int], int]) -> int:
        """The most ``rank`` holds at once, in order of its actions, when a forward through
        stage ``s`` keeps ``size(s)`` until its backward (the activations its micro-batch saved:
        ``size = lambda s: 1`` counts micro-batches in flight); a split backward frees them at
        its ``W``, the last action that reads them."""
        held = peak = 0
        for a in self.actions[rank]:
            held += _holding(a) * size(a.stage)
            peak = max(peak, held)
        return peak

    def describe(self) -> str:
        """One line per rank: ``rank 0: F0 F1 B0 F2 B1 ...``."""
        head = f"{self.kind}: {self.ranks} rank(s)"
        if self.virtual > 1:
            head += f" x {self.virtual} virtual stages"
        head += f", {self.micro_batches} micro-batches"
        lines = [head]
        for r, acts in enumerate(self.actions):
            lines.append(f"  rank {r}: " + " ".join(a.label(self.virtual) for a in acts))
        return "\n".join(lines)

    def validate(self) -> None:
        """Raise :class:`ScheduleError` unless every micro-batch runs forward and backward
        (or both halves of a split backward) exactly once through every stage, on the rank that
        holds it, and the ranks' orders cannot deadlock."""
        expected = {
            Action(op, mb, s)
            for op in (("F", "I", "W") if self.split else ("F", "B"))
            for mb in range(self.micro_batches)
            for s in range(self.stages)
        }
        seen: set[Action] = set()
        for r, acts in enumerate(self.actions):
            for a in acts:
                if a in seen or a not in expected:
                    raise ScheduleError(f"{self.kind}: rank {r} runs {a} twice or out of range")
                if self.rank_of(a.stage) != r:
                    raise ScheduleError(
                        f"{self.kind}: rank {r} runs {a} of stage {a.stage}, which lives on "
                        f"rank {self.rank_of(a.stage)}"
                    )
                seen.add(a)
        if missing := sorted(expected - seen):
            raise ScheduleError(f"{self.kind}: no rank runs {missing[:4]}")
        self.simulate()
        self._check_message_order()

    def messages(self, rank: int) -> tuple[list[tuple[int, Action]], list[tuple[int, Action]]]:
        """What ``rank``'s actions send and receive, in order: ``(peer rank, action)`` pairs.
        A forward receives its input from the stage before and sends its output to the stage
        after; a backward (or the ``I`` of a split one) receives its output's gradient from the
        stage after and sends its input's gradient to the stage before; a ``W`` moves nothing."""
        sends: list[tuple[int, Action]] = []
        recvs: list[tuple[int, Action]] = []
        last = self.stages - 1
        for a in self.actions[rank]:
            before, after = a.stage - 1, a.stage + 1
            if a.op == "F":
                if a.stage > 0:
                    recvs.append((self.rank_of(before), a))
                if a.stage < last:
                    sends.append((self.rank_of(after), a))
            elif a.op in GRADIENT_OPS:
                if a.stage < last:
                    recvs.append((self.rank_of(after), a))
                if a.stage > 0:
                    sends.append((self.rank_of(before), a))
        return sends, recvs

    def _check_message_order(self) -> None:
        # NCCL (and gloo without tags) match a pair's point-to-point messages in the order they
        # were posted: what one rank sends another must be what that one next expects.
        def key(a: Action, sent: bool) -> tuple[str, int, int]:
            # The message's identity: an activation leaving stage s is the one stage s + 1
            # receives; a gradient leaving stage s is the one stage s - 1 receives.
            if a.op == "F":
                return ("act", a.micro_batch, a.stage if sent else a.stage - 1)
            return ("grad", a.micro_batch, a.stage if sent else a.stage + 1)

        for src in range(self.ranks):
            sends, _ = self.messages(src)
            for dst in range(self.ranks):
                out = [key(a, True) for peer, a in sends if peer == dst]
                inbound = [key(a, False) for peer, a in self.messages(dst)[1] if peer == src]
                if out != inbound:
                    first = next(
                        i for i, (x, y) in enumerate(zip(out, inbound, strict=False)) if x != y
                    )
                    raise ScheduleError(
                        f"{self.kind}: rank {src} sends rank {dst} {out[first]} as message "
                        f"{first}, where rank {dst} expects {inbound[first]}"
                    )

    def simulate(
        self,
        forward_cost: float | Sequence[float] = 1.0,
        backward_cost: float | Sequence[float] = 2.0,
        weight_cost: float | Sequence[float] | None = None,
    ) -> Timeline:
        """Run the action lists with fixed costs and free, instant transfers: each action starts
        when its rank is free and its inputs exist (the forward of the stage before; for a
        backward, the backward of the stage after). A cost is the same for every stage, or one
        per stage (e.g. measured). A split backward's ``W`` costs ``weight_cost`` (default:
        half the backward) and its ``I`` the rest of ``backward_cost``. Raises
        :class:`ScheduleError` on a deadlock."""
        last = self.stages - 1
        fwd = _per_stage(forward_cost, self.stages, "forward")
        bwd = _per_stage(backward_cost, self.stages, "backward")
        w_of = (
            [b / 2 for b in bwd]
            if weight_cost is None
            else _per_stage(weight_cost, self.stages, "weight")
        )
        if any(w > b for w, b in zip(w_of, bwd, strict=True)):
            raise ValueError(
                f"weight costs {w_of} exceed the backward costs {bwd} they are part of"
            )
        cost_of = {
            "F": fwd,
            "B": bwd,
            "I": [b - w for b, w in zip(bwd, w_of, strict=True)],
            "W": w_of,
        }
        gradient_op: Op = "I" if self.split else "B"
        done: dict[Action, float] = {}
        start: dict[Action, float] = {}
        free = [0.0] * self.ranks
        busy = [0.0] * self.ranks
        held = [0] * self.ranks
        peak = [0] * self.ranks
        at = [0] * self.ranks

        def needs(a: Action) -> list[Action]:
            if a.op == "F":
                return [Action("F", a.micro_batch, a.stage - 1)] if a.stage > 0 else []
            if a.op == "W":  # the weight gradients need the output's, which its I received
                return [Action("I", a.micro_batch, a.stage)]
            deps = [Action("F", a.micro_batch, a.stage)]
            if a.stage < last:
                deps.append(Action(gradient_op, a.micro_batch, a.stage + 1))
            return deps

        progressed = True
        while progressed:
            progressed = False
            for r, acts in enumerate(self.actions):
                while at[r] < len(acts):
                    a = acts[at[r]]
                    deps = needs(a)
                    if any(d not in done for d in deps):
                        break
                    t0 = max([free[r], *(done[d] for d in deps)])
                    cost = cost_of[a.op][a.stage]
                    start[a] = t0
                    done[a] = free[r] = t0 + cost
                    busy[r] += cost
                    held[r] += _holding(a)
                    peak[r] = max(peak[r], held[r])
                    at[r] += 1
                    progressed = True
        stuck = [
            f"rank {r} waits in {acts[at[r]].label(self.virtual)}"
            for r, acts in enumerate(self.actions)
            if at[r] < len(acts)
        ]
        if stuck:
            raise ScheduleError(f"{self.kind} would deadlock: " + "; ".join(stuck))
        return Timeline(max(free), tuple(busy), tuple(peak), start)


def _holding(a: Action) -> int:
    """What ``a`` does to the micro-batches whose activations a rank holds: a forward adds
    one, the action that ends its backward (``B``, or a split backward's ``W``) frees it."""
    return {"F": 1, "B": -1, "I": 0, "W": -1}[a.op]


def _per_stage(cost: float | Sequence[float], stages: int, what: str) -> list[float]:
    if isinstance(cost, (int, float)):
        return [float(cost)] * stages
    if len(cost) != stages:
        raise ValueError(f"{len(cost)} {what} costs given for {stages} stages")
    return [float(c) for c in cost]


def bubble_theory(ranks: int, micro_batches: int, virtual: int = 1, kind: str = "1f1b") -> float:
    """The idle fraction with equal stages: ``(p - 1) / (m + p - 1)`` for GPipe and 1F1B,
    ``(p - 1) / (v m + p - 1)`` interleaved (each of a rank's ``v`` stages does ``1/v`` of its
    work); for ``zb-h1`` and ``interleaved-zb``, :func:`zero_bubble_theory` with the simulator's
    default costs (a backward of two forwards, split half and half)."""
    if kind in SPLIT_KINDS:
        return zero_bubble_theory(ranks, micro_batches, virtual=virtual)
    return (ranks - 1) / (virtual * micro_batches + ranks - 1)


def zero_bubble_theory(
    ranks: int,
    micro_batches: int,
    forward: float = 1.0,
    input_grad: float = 1.0,
    weight_grad: float = 1.0,
    virtual: int = 1,
) -> float:
    """ZB-H1's idle fraction with equal stages whose forward, ``I`` and ``W`` cost
    ``forward``, ``input_grad`` and ``weight_grad`` (Qi et al. 2023): each rank idles
    ``(p - 1) (F + I - W)`` of a step of ``m (F + I + W)`` work, against 1F1B's
    ``(p - 1) (F + I + W)``. With ``virtual`` stages per rank (``interleaved-zb``) each costs
    what it is given and a rank works ``v m (F + I + W)``. It holds where ``W <= I`` (weight
    gradients no slower than input gradients, as in matrix products);
    :meth:`PipelineSchedule.simulate` gives the others."""
    if weight_grad > input_grad:
        raise ValueError(
            f"zero_bubble_theory: W = {weight_grad} > I = {input_grad}; use "
            "PipelineSchedule.simulate for such costs"
        )
    idle = (ranks - 1) * (forward + input_grad - weight_grad)
    return idle / (virtual * micro_batches * (forward + input_grad + weight_grad) + idle)


# -- the schedules -----------------------------------------------------------------------------


def _one_stage_per_rank(kind: str, v: int) -> None:
    if v != 1:
        raise ScheduleError(
            f"{kind}: {v} virtual stages per rank need the interleaved schedule; "
            "set pipeline.virtual_stages = 1 or pipeline.schedule = 'interleaved'"
        )


def _gpipe(p: int, m: int, v: int) -> list[list[Action]]:
    _one_stage_per_rank("gpipe", v)
    return [
        [Action("F", mb, r) for mb in range(m)] + [Action("B", mb, r) for mb in range(m)]
        for r in range(p)
    ]


def _fills(kind: str, p: int, m: int) -> None:
    """Refuse fewer micro-batches than stages: a 1F1B-shaped warm-up could not fill the pipe."""
    if m < p:
        raise ScheduleError(
            f"{kind}: {m} micro-batch(es) cannot fill {p} stages; use at least {p} "
            "(batch.gradient_accumulation_steps) or the gpipe schedule"
        )


def _one_f_one_b(p: int, m: int, v: int) -> list[list[Action]]:
    _one_stage_per_rank("1f1b", v)
    _fills("1f1b", p, m)
    out = []
    for r in range(p):
        warm = p - r - 1
        acts = [Action("F", mb, r) for mb in range(warm)]
        for i in range(m - warm):
            acts += [Action("F", warm + i, r), Action("B", i, r)]
        acts += [Action("B", mb, r) for mb in range(m - warm, m)]
        out.append(acts)
    return out


def _zb_h1(p: int, m: int, v: int) -> list[list[Action]]:
    # [Note: ZB-H1 order] Rank r runs 1F1B's warm-up (p - r - 1 forwards), then forward and
    # input gradient in turn, sending each input gradient upstream as soon as it exists; its
    # weight gradients trail its input gradients by r micro-batches (the last rank's by p - 1),
    # so each rank holds at most p micro-batches' activations, 1F1B's peak on its first rank,
    # and the W's a rank has deferred fill the time it would wait in 1F1B's cool-down. With
    # W <= I the idle shrinks from 1F1B's (p - 1)(F + I + W) to (p - 1)(F + I - W).
    _one_stage_per_rank("zb-h1", v)
    _fills("zb-h1", p, m)
    out = []
    for r in range(p):
        warm = p - r - 1
        acts = [Action("F", mb, r) for mb in range(warm)]
        for i in range(m):
            if i < m - warm:
                acts.append(Action("F", warm + i, r))
            acts.append(Action("I", i, r))
            if i >= r:  # r micro-batches behind
                acts.append(Action("W", i - r, r))
        acts += [Action("W", mb, r) for mb in range(m - r, m)]
        out.append(acts)
    return out


def _interleaved(p: int, m: int, v: int) -> list[list[Action]]:
    if p < 2:
        raise ScheduleError("interleaved: needs at least 2 pipeline ranks (mesh.pp)")
    if m % p:
        raise ScheduleError(
            f"interleaved: {m} micro-batch(es) do not divide into groups of {p} (one per "
            f"pipeline rank); use a multiple of {p} (batch.gradient_accumulation_steps)"
        )
    total = m * v

    def mb_of(k: int) -> int:
        return (k // (p * v)) * p + k % p

    def chunk_of(k: int, forward: bool) -> int:
        c = (k % (p * v)) // p
        return c if forward else v - 1 - c

    out = []
    for r in range(p):

        def f(k: int, r: int = r) -> Action:
            return Action("F", mb_of(k), chunk_of(k, True) * p + r)

        def b(k: int, r: int = r) -> Action:
            return Action("B", mb_of(k), chunk_of(k, False) * p + r)

        warm = min((p - r - 1) * 2 + (v - 1) * p, total)
        acts = [f(k) for k in range(warm)]
        for i in range(total - warm):
            acts += [f(warm + i), b(i)]
        acts += [b(k) for k in range(total - warm, total)]
        out.append(acts)
    return out


def _interleaved_zb(p: int, m: int, v: int) -> list[list[Action]]:
    # [Note: interleaved zero-bubble order] Interleaved 1F1B's order, each B split into its I,
    # where the B was, and its W, which trails the rank's I's by r of them on rank r (the last
    # rank's by p - 1) and runs at the end for the last r: ZB-H1's rule ([Note: ZB-H1 order])
    # over the v-times-longer list. A W frees what its F saved, so the activations held grow
    # by at most r stages' worth past interleaved's on rank r, which stays within rank 0's
    # (interleaved's warm-up shrinks by 2 per rank). The cool-down's waits, which interleaved
    # spends idle, are filled by the deferred W's: with W <= I each rank idles
    # (p - 1)(F + I - W) against interleaved's (p - 1)(F + I + W), F, I, W per stage.
    out = []
    for r, acts in enumerate(_interleaved(p, m, v)):
        split: list[Action] = []
        deferred: list[Action] = []
        for a in acts:
            if a.op != "B":
                split.append(a)
                continue
            split.append(Action("I", a.micro_batch, a.stage))
            deferred.append(Action("W", a.micro_batch, a.stage))
            if len(deferred) > r:
                split.append(deferred.pop(0))
        out.append(split + deferred)
    return out


Builder = Callable[[int, int, int], list[list[Action]]]
#: A new schedule is one function and one line here.
SCHEDULES: dict[str, Builder] = {
    "gpipe": _gpipe,
    "1f1b": _one_f_one_b,
    "interleaved": _interleaved,
    "zb-h1": _zb_h1,
    "interleaved-zb": _interleaved_zb,
}


def build(kind: str, ranks: int, micro_batches: int, virtual: int = 1) -> PipelineSchedule:
    """The ``kind`` schedule for ``ranks`` pipeline ranks, ``micro_batches`` micro-batches and
    ``virtual`` stages per rank, validated."""
    if kind not in SCHEDULES:
        raise ScheduleError(
            f"pipeline schedule {kind!r} is unknown; choose one of {list(SCHEDULES)}"
        )
    if ranks < 1 or micro_batches < 1 or virtual < 1:
        raise ScheduleError(
            f"{kind}: ranks={ranks}, micro_batches={micro_batches}, virtual={virtual}; "
            "each needs to be at least 1"
        )
    sched = PipelineSchedule(
        kind,
        ranks,
        micro_batches,
        virtual,
        tuple(tuple(a) for a in SCHEDULES[kind](ranks, micro_batches, virtual)),
    )
    sched.validate()
    return sched
