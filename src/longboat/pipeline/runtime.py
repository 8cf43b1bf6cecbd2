"""Running a pipeline schedule (:mod:`longboat.pipeline.schedules`) on this rank's stages.

:class:`Pipeline` is the engine's schedule when ``mesh.pp > 1``: it splits the model
(:meth:`prepare`), then for each optimizer step walks this rank's action list. A forward of
stage ``s`` takes its input from the micro-batch (first stage) or from the rank of stage
``s - 1``, and sends its output to the rank of stage ``s + 1`` unless it is the last stage,
where ``loss_fn`` makes the loss. A backward of the last stage is the engine's
``backward(loss)`` (the accumulation's ``1 / m`` and the fp16 loss scale are applied there);
any other stage's backward receives its output's gradient, runs autograd from it, and sends
its input's gradient back. A split backward ([Note: split backward]) does that in its ``I``, and
runs its ``W`` through the engine as the micro-batch's backward. Everything that depends on how
a stage's parameters are held (replicate, ZeRO) stays with the data-parallel strategy, which
the engine tells when the step's last backward begins.

The losses exist on the last stage; they are broadcast over the pipeline's control plane at
the step's end so that every rank reports the same step loss.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from longboat.comm.protocol import Comm, Handle
from longboat.config.errors import ConfigError
from longboat.pipeline import layered, measure, schedules, split_backward
from longboat.pipeline import stages as staging
from longboat.pipeline.measure import LayerCosts
from longboat.pipeline.module import PipelineModule
from longboat.pipeline.p2p import Link, Message
from longboat.pipeline.partition import StageInfo
from longboat.pipeline.schedule import LossFn, Steps
from longboat.pipeline.tied import Tie, TiedWeights
from longboat.topology import Topology


class Pipeline:
    """The schedule of ``kind`` over the ``pp`` axis of ``topology``."""

    def __init__(
        self,
        kind: str,
        virtual: int,
        partition: str | Sequence[int] | None,
        topology: Topology,
        device: torch.device,
        micro_batches: int | None = None,
    ) -> None:
        self.kind = kind
        # the step's micro-batches, if known when the stages are split: the measured split is
        # then the one this schedule runs fastest ([Note: a split for the schedule])
        self.micro_batches = micro_batches
        self.stages_per_rank = virtual
        self.partition = partition
        self.topology = topology
        self.data = topology.data("pp")
        self.control = topology.control("pp")
        self.ties = TiedWeights()  # [Note: tied weights], found by prepare()
        self.rank = self.data.rank
        self.ranks = self.data.world_size
        self.device = device
        self.link = Link(self.data, self.control, device)
        self._plans: dict[int, schedules.PipelineSchedule] = {}
        self.bounds: list[int] = []  # the stages' layer boundaries, chosen by prepare()
        self.trained: list[nn.Parameter] = []  # this rank's stages' parameters (prepare())
        # each stage's measured forward and backward seconds (the measured partition only)
        self.stage_costs: tuple[list[float], list[float]] | None = None
        self.log = logging.getLogger("longboat")

    @property
    def stages(self) -> int:
        return self.ranks * self.stages_per_rank

    @property
    def held_stages(self) -> list[int]:
        """This rank's stages: one per chunk, ``ranks`` apart (interleaved schedules)."""
        return [c * self.ranks + self.rank for c in range(self.stages_per_rank)]

    @property
    def reads_data(self) -> bool:
        """Whether this rank runs the first stage (the inputs) or the last (the labels)."""
        return bool({0, self.stages - 1} & set(self.held_stages))

    # -- setting up ----------------------------------------------------------------------------

    def prepare(self, model: nn.Module, example_input: Any = None) -> nn.Module:
        """Split ``model`` into ``pp x virtual_stages`` stages and keep this rank's: the module
        the engine trains. ``model`` is a :class:`PipelineModule`, an ``nn.Sequential``, or a
        model with ``pipeline_layers()`` (:mod:`longboat.pipeline.layered`).
        ``example_input`` (one micro-batch's model inputs) lets the ``measured`` partition,
        the default, time each layer first (:mod:`longboat.pipeline.measure`)."""
        stages, held = self.stages, self.held_stages
        try:
            model = staging.as_layers(model, self.partition)
        except TypeError as e:
            raise TypeError(f"mesh.pp = {self.ranks}: {e}") from None
        method = staging.requested(model, self.partition)
        costs = self._measure(model, method, example_input)
        bounds, info = staging.plan(model, stages, method, costs, self._score(costs))
        self.bounds = bounds
        if costs is not None:
            self.stage_costs = costs.stage_sums(bounds)
        self._announce(info)
        if isinstance(model, PipelineModule):
            tied = model.bind(bounds, held)
        else:
            model, tied = layered.split(model, bounds, held)
        self._tie(tied)
        self.trained = list(dict.fromkeys(model.parameters()))
        return model

    def _score(self, costs: LayerCosts | None) -> Callable[[list[int]], float] | None:
        """A split's step as the schedule simulator predicts it for this run's schedule and
        micro-batches, from the measured costs ([Note: a split for the schedule] in
        ``partition.py``); None where either is unknown or the schedule cannot run (``check``
        refuses it before any step)."""
        if costs is None or self.micro_batches is None:
            return None
        try:
            plan = self.plan(self.micro_batches)
        except schedules.ScheduleError:
            return None

        def score(bounds: list[int]) -> float:
            forward, backward = costs.stage_sums(bounds)
            return plan.simulate(forward, backward).makespan

        return score

    def _measure(self, model: nn.Module, method: staging.Method, example: Any) -> LayerCosts | None:
        """The layers' costs, measured by world rank 0 and the same on every rank ([Note: one
        measurement for every rank] in ``measure.py``); None where the method does not
        need them, or (the default only) where nothing can be measured."""
        if not staging.measures(method):
            return None
        meta = any(p.is_meta for p in model.parameters())
        if example is None or meta:
            why = (
                "the model is on the meta device"
                if meta
                else "no example input: pass longboat.initialize(..., example_input=...) one "
                "micro-batch's model inputs"
            )
            if method is not None:
                raise ConfigError(
                    f"key 'pipeline.partition' = {method!r} times each layer, but {why}; or "
                    "choose another partition ('parameters', 'uniform', 'type:REGEX', "
                    "boundaries)"
                )
            if self.rank == 0:
                self.log.info("pipeline: stages split by parameters (%s to split by time)", why)
            return None
        world = self.topology.control("world")
        local = None
        try:
            if world.rank == 0:
                local = measure.measure(staging.runnable(model), example, model)
        finally:  # reached on error too, so that no rank waits for rank 0 in vain
            costs = measure.agree(local, staging.layer_count(model), world)
        if costs is None:
            raise RuntimeError(
                "pipeline: world rank 0 could not time the layers on example_input (its own "
                "error says why); fix the example input or set pipeline.partition"
            )
        return costs

    def _tie(self, tied: list[tuple[Tie, nn.Parameter | None]]) -> None:
        """A doorway per tied weight over the pipeline ranks whose stages hold it (created by
        every rank, for every weight, in name order: collective), and equal starting values."""
        for tie, param in tied:
            ranks = sorted({s % self.ranks for s in tie.stages})
            comm = self.topology.subgroup("pp", ranks, f"tied weight {tie.name}")
            if param is not None:
                self.ties.held.append((tie, param, comm))
                if len(ranks) > 1:
                    self.ties.holders[tie.name] = ranks
            if self.rank == 0:
                self.log.info(
                    "pipeline: %s is tied across stages %s (kept equal by a gradient sum over "
                    "pipeline ranks %s)",
                    tie.name,
                    list(tie.stages),
                    ranks,
                )
        self.ties.broadcast_initial()

    def _announce(self, info: list[StageInfo]) -> None:
        if self.rank == 0:
            for s in info:
                self.log.info("pipeline %s", s.describe())

    def restrict(self, optimizer: torch.optim.Optimizer, model: nn.Module) -> None:
        """Keep in ``optimizer`` only the parameters of this rank's stages (the user built it
        over the whole model; the other stages' copies are not trained here)."""
        mine = {id(p) for p in model.parameters()}
        for group in optimizer.param_groups:
            group["params"] = [p for p in group["params"] if id(p) in mine]

    def norm_groups(self) -> list[Comm]:
        """Stages hold disjoint parameters: the gradient norm sums over the pipeline."""
        return [self.data]

    def check(self, micro_batches: int) -> None:
        """Refuse, before any step, a schedule that cannot run ``micro_batches``."""
        try:
            plan = self.plan(micro_batches)
        except schedules.ScheduleError as e:
            raise ConfigError(
                f"key 'pipeline.schedule' = {self.kind!r} with {micro_batches} micro-batches "
                f"(batch.gradient_accumulation_steps): {e}"
            ) from None
        if self.rank == 0:
            bubble = schedules.bubble_theory(
                self.ranks, micro_batches, self.stages_per_rank, kind=self.kind
            )
            self.log.info(
                "pipeline schedule %s, %d micro-batches per step: idle fraction %.0f%% with "
                "equal stages",
                self.kind,
                micro_batches,
                100 * bubble,
            )
            if self.stage_costs is not None:
                idle = self.predicted_idle(micro_batches)
                self.log.info(
                    "pipeline: predicted idle with the measured stages: %s",
                    ", ".join(f"rank {r} {100 * b:.0f}%" for r, b in enumerate(idle)),
                )
            self.log.debug("%s", plan.describe())

    def predicted_idle(self, micro_batches: int) -> tuple[float, ...]:
        """Per pipeline rank, the idle fraction of a step that the schedule simulator predicts
        from the stages' measured forward and backward times (transfers free)."""
        if self.stage_costs is None:
            raise ValueError("the stages were not measured (partition other than 'measured')")
        forward, backward = self.stage_costs
        return self.plan(micro_batches).simulate(forward, backward).bubble

    def plan(self, micro_batches: int) -> schedules.PipelineSchedule:
        if micro_batches not in self._plans:
            self._plans[micro_batches] = schedules.build(
                self.kind, self.ranks, micro_batches, self.stages_per_rank
            )
        return self._plans[micro_batches]

    # -- one step ------------------------------------------------------------------------------

    def run(
        self,
        steps: Steps,
        micro_batches: Sequence[Any],
        loss_fn: LossFn,
        inputs: Callable[[Any], tuple[Any, ...]],
    ) -> list[float]:
        plan = self.plan(len(micro_batches))
        last = plan.stages - 1
        link = self.link
        saved: dict[tuple[int, int], tuple[torch.Tensor | None, torch.Tensor]] = {}
        weights: dict[tuple[int, int], split_backward.WeightPass] = {}  # I done, W to come
        sends: list[Handle] = []
        losses: list[torch.Tensor] = []
        ahead = _Ahead(link, plan, self.rank, saved)
        for a in plan.actions[self.rank]:
            ahead.post()  # the last action may have made the activation a gradient is for
            mb, s = a.micro_batch, a.stage
            if a.op == "F":
                if s == 0:
                    x: torch.Tensor | None = None
                    out = steps.forward(*inputs(micro_batches[mb]), stage=s)
                else:
                    x = ahead.recv(plan.rank_of(s - 1), Message("activation", mb, s - 1, s))
                    if x.is_floating_point():
                        x.requires_grad_(True)
                    out = steps.forward(x, stage=s)
                if s == last:
                    out = loss_fn(out, micro_batches[mb])
                else:
                    sends += link.send(
                        out, plan.rank_of(s + 1), Message("activation", mb, s, s + 1)
                    )
                saved[(mb, s)] = (x, out)
            elif a.op == "W":
                steps.backward_with(weights.pop((mb, s)))
            elif a.op == "I":
                x, out = saved.pop((mb, s))
                if s == last:
                    root, grad = steps.scaled_loss(out), None
                    losses.append(out.detach())
                else:
                    root = out
                    grad = ahead.recv(
                        plan.rank_of(s + 1), Message("gradient", mb, s + 1, s), like=out
                    )
                found, weights[(mb, s)] = split_backward.backward_input(
                    root, grad, [x], self.trained
                )
                if s > 0:
                    assert x is not None
                    g = found[0] if found[0] is not None else torch.zeros_like(x)
                    sends += link.send(g, plan.rank_of(s - 1), Message("gradient", mb, s, s - 1))
            else:
                x, out = saved.pop((mb, s))
                if s == last:
                    steps.backward(out)
                    losses.append(out.detach())
                else:
                    grad = ahead.recv(
                        plan.rank_of(s + 1), Message("gradient", mb, s + 1, s), like=out
                    )
                    steps.backward_from(out, grad)
                if s > 0:
                    assert x is not None
                    g = x.grad if x.grad is not None else torch.zeros_like(x)
                    sends += link.send(g, plan.rank_of(s - 1), Message("gradient", mb, s, s - 1))
        for h in sends:
            h.wait()
        # The last stage's losses, on every rank of the pipeline.
        return link.share_losses(losses, len(micro_batches), src=self.ranks - 1)

    def evaluate(
        self,
        steps: Steps,
        micro_batches: Sequence[Any],
        loss_fn: LossFn,
        inputs: Callable[[Any], tuple[Any, ...]],
    ) -> list[float]:
        """The forward actions of the step's plan alone, in its order on each rank (a stage
        waits only for activations an earlier stage sent without waiting): the last stage's
        losses, on every rank of the pipeline."""
        plan = self.plan(len(micro_batches))
        last = plan.stages - 1
        sends: list[Handle] = []
        losses: list[torch.Tensor] = []
        for a in plan.actions[self.rank]:
            if a.op != "F":
                continue
            mb, s = a.micro_batch, a.stage
            if s == 0:
                out = steps.forward(*inputs(micro_batches[mb]), stage=s)
            else:
                x = self.link.recv(plan.rank_of(s - 1), Message("activation", mb, s - 1, s))
                out = steps.forward(x, stage=s)
            if s == last:
                losses.append(loss_fn(out, micro_batches[mb]))
            else:
                msg = Message("activation", mb, s, s + 1)
                sends += self.link.send(out, plan.rank_of(s + 1), msg)
        for h in sends:
            h.wait()
        return self.link.share_losses(losses, len(micro_batches), src=self.ranks - 1)


class _Ahead:
    """This rank's receives in its schedule's order, each posted ahead ([Note: receives
    posted ahead] in ``p2p.py``) as soon as the one before it was received and what it needs
    exists: the activation its gradient belongs to, or its stream's settled shape."""

    def __init__(
        self,
        link: Link,
        plan: schedules.PipelineSchedule,
        rank: int,
        saved: dict[tuple[int, int], tuple[torch.Tensor | None, torch.Tensor]],
    ) -> None:
        self.link, self.saved = link, saved
        self.due = [
            (peer, Message("activation", a.micro_batch, a.stage - 1, a.stage))
            if a.op == "F"
            else (peer, Message("gradient", a.micro_batch, a.stage + 1, a.stage))
            for peer, a in plan.messages(rank)[1]  # the schedule's own receives, in order
        ]
        self.next = 0

    def post(self) -> None:
        if self.next >= len(self.due) or self.link.posted is not None:
            return
        src, message = self.due[self.next]
        like = None
        if message.kind == "gradient":
            held = self.saved.get((message.micro_batch, message.dst))
            if held is None:
                return  # its activation is not made yet
            like = held[1]
        self.link.post(src, message, like)

    def recv(self, src: int, message: Message, like: torch.Tensor | None = None) -> torch.Tensor:
        got = self.link.recv(src, message, like)
        self.next += 1
        self.post()
        return got
