"""One strategy's training step run for real, on meta tensors, by the engine itself.

The planner does not re-derive layouts: it builds the model on fake (meta) tensors, hands it to
:class:`longboat.engine.Engine` with :class:`MetaCollectives` (a world of ``n`` ranks in which
every collective is a no-op on tensors the strategy already allocated, and only counts bytes),
and runs the same ``setup``, forward, backward and optimizer step a rank would run (see
[Note: fake tensors]). Bucket
plans, units, padding to a multiple of ``n``, optimizer state and every transient buffer are
therefore the strategies' own; :class:`~longboat.plan.tracker.LiveBytes` records the live bytes
throughout, and ``strategy.memory_tensors`` gives the model state exactly as
``engine.memory_report()`` counts it.

[Note: peak model] The predicted peak is the highest live-tensor total from the moment the
model is built (the caller's baseline: after imports, before the model) through setup and two
optimizer steps (the second one holds the optimizer state the first created), each of the
config's ``batch.gradient_accumulation_steps`` micro-batches. Everything a rank holds is
in it: parameters, gradients, optimizer state, buckets and communication buffers, activations
saved for backward and the transient tensors of each operator, and the staging copy gloo makes
for a reduce-scatter ([Note: gloo staging]). What it cannot see: other memory inside kernels and
communication libraries, allocator overhead and fragmentation.

[Note: gloo staging] gloo has no reduce-scatter of its own: torch's ProcessGroupGloo runs it as
an all-reduce of a copy of the whole input, then copies this rank's chunk into the output. The
copy (the input's size, not the output's) is allocated on the calling thread when the operation
is issued and freed when its work object goes, after the wait: measured on this torch, three
asynchronous reduce-scatters of 40 MB each raise a rank's RSS by 115 MB before the peer has
issued any. ZeRO keeps each unit's reduction in flight from its launch in the backward to its
landing; at stage 1, whose full-size gradient buffer lives on, each in-flight unit holds a second
one. Stages 2-3 (and a gradient cast for the wire) hand the doorway a buffer they drop after the
landing, which the doorway then all-reduces in place with no copy ([Note: gloo reduce-scatter] in
``comm/collectives.py``). The
meta doorway makes the same copy (fake, so nothing is allocated) and hands it to the operation's
handle, for the backends that stage this way (:data:`STAGING_BACKENDS`); NCCL reduce-scatters in
place. A real run's live-tensor count sees the copy only from the wait (torch splits it into
chunks on the calling thread there), so where several reductions are in flight at once the plan
is above that count by the copies the count has not seen yet, and equal to the memory the rank
holds (``tests/test_plan.py`` counts them from the issue on a real run).

[Note: folded accumulation] Without pipeline stages, the micro-batches of one optimizer step are
of a few kinds: the first (gradients come into being; ZeRO reduces into the empty shard in
place), the second (what the first left in flight lands in it), the last (the reductions at the
boundary, then the optimizer), and those between, which repeat the second: each accumulates into
the buffers the first made, lands what the one before launched, launches what the strategy
launches per micro-batch (ZeRO-2's reduce-scatter, ZeRO-3's gathers, an offloaded shard's reads
and writes) and frees what it made. So a step of ``a > 4`` micro-batches is simulated as four,
the third standing for the ``a - 3`` between the second and the last: the peak is the same, and
the bytes, collectives and disk traffic of the third are counted ``a - 3`` times. With three
(no second) an offloaded ZeRO-3's disk traffic came out short: the first micro-batch's landing
differs. Planning at 8 micro-batches is about twice as fast (a ZeRO-3 candidate of the
reference GPT at 8 micro-batches of 1: 6.7 s unfolded, 3.8-4.3 s folded, on a shared machine);
``tests/test_plan.py`` checks every figure equal to the unfolded simulation's (``fold=False``)
for each strategy.

[Note: fake tensors] The run uses fake CPU tensors (``FakeTensorMode``): meta tensors underneath,
so nothing is allocated, but with the CPU device type. Plain meta tensors would be faster (about
4x) but wrong twice: the meta device has no autocast, so bf16/fp16 activations would be traced
in fp32; and scaled-dot-product attention dispatches by device, so on meta it takes the math
path (it keeps the B x H x T x T attention weights) where CPU takes its flash kernel. With fake
CPU tensors both are chosen as in a real CPU run, and the planned peak equals the live-tensor
peak of a real run to within the bytes of the example batch (tested). fp16 is traced as bf16:
the same element sizes, its loss scaling keeps no tensor of note, and its overflow check would
read a value that fake tensors do not have.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from longboat import placement
from longboat.comm.trace import CallRecord
from longboat.comm.works import Done
from longboat.config.sections import Config
from longboat.observe.memory import CATEGORIES, measure
from longboat.plan import stages
from longboat.plan.target import Target
from longboat.plan.tracker import LiveBytes
from longboat.strategies.base import Strategy
from longboat.topology import Topology
from longboat.world import World

#: Backends whose reduce-scatter stages the whole input in a copy ([Note: gloo staging]).
STAGING_BACKENDS = frozenset({"gloo"})
#: The backend a plan assumes: the planner traces a CPU run, whose ranks talk gloo.
DEFAULT_BACKEND = "gloo"
#: Micro-batches a step is simulated with at most ([Note: folded accumulation]).
FOLDED = 4


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class _InFlight(Done):
    """An asynchronous operation of the meta run: in flight until waited. A strategy that
    frees a buffer as soon as its reduction is over (ZeRO's reaping during backward) keeps it
    until it waits, as on a link too slow to finish early: the plan's peak is the upper one."""

    def __init__(self) -> None:
        self.waited = False
        # What the communication library holds until the handle goes ([Note: gloo staging]).
        self.staging: torch.Tensor | None = None

    def wait(self) -> bool:
        self.waited = True
        return True

    def is_completed(self) -> bool:
        return self.waited


@dataclass
class MetaCollectives:
    """The :class:`~longboat.comm.protocol.Comm` protocol for a group of ``world_size`` ranks,
    moving nothing. Counts the bytes each rank would send with ring algorithms (NCCL's and
    gloo's large-message choice): all-reduce ``2(n-1)/n`` of the buffer, reduce-scatter,
    all-gather and all-to-all ``(n-1)/n`` of the full buffer, broadcast the buffer once (the
    root's view), a send its buffer. The doorways of one simulated rank share ``sent``."""

    world_size: int
    rank: int = 0
    active: bool = False  # nothing to join or leave
    group: None = None
    timeout_s: float = 600.0
    blocked_seconds: float = 0.0
    seq: int = 0
    last: CallRecord | None = None  # none recorded: nothing runs
    # No observation: the planner counts bytes itself, in ``sent``.
    desync_check: bool = False
    log: bool = False
    observing: bool = False
    commlog: None = None
    sent: dict[str, int] = field(default_factory=dict)
    #: how many operations of each kind were launched (shared like ``sent``): a cost model
    #: charges each its latency
    calls: dict[str, int] = field(default_factory=dict)
    prefix: str = ""  # put before each operation's name in ``sent``
    #: bytes per tag (the tensor-parallel layers tag theirs with the module's name), or None
    by_tag: dict[str, int] | None = None
    #: the data plane's backend: whether a reduce-scatter stages its input in a copy
    #: ([Note: gloo staging])
    backend: str = DEFAULT_BACKEND

    def log_summary(self) -> list[dict[str, Any]]:
        return []

    def _count(self, op: str, nbytes: float, tag: str = "") -> _InFlight | Done:
        if self.world_size == 1:
            # A group of one moves nothing: the operation is over when issued, as the real
            # doorway's (and what a strategy frees once its reduction is over goes at once).
            return Done()
        key = self.prefix + op
        self.sent[key] = self.sent.get(key, 0) + int(nbytes)
        self.calls[key] = self.calls.get(key, 0) + 1
        if self.by_tag is not None and tag:
            self.by_tag[tag] = self.by_tag.get(tag, 0) + int(nbytes)
        return _InFlight()

    def global_rank(self, group_rank: int) -> int:
        return group_rank

    def all_reduce(
        self, tensor: torch.Tensor, op: str = "sum", async_op: bool = False, tag: str = ""
    ) -> Done:
        n = self.world_size
        return self._count("all_reduce", 2 * (n - 1) / n * _nbytes(tensor), tag)

    def reduce_scatter(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        async_op: bool = False,
        tag: str = "",
        scratch: bool = False,
    ) -> Done:
        n = self.world_size
        done = self._count("reduce_scatter", (n - 1) / n * _nbytes(input), tag)
        # [Note: gloo staging]; a scratch input is reduced in place, with no copy, and two
        # ranks exchange chunks with none ([Note: gloo reduce-scatter of two] in comm/works.py)
        if (
            isinstance(done, _InFlight)
            and n > 2
            and self.backend in STAGING_BACKENDS
            and not scratch
        ):
            done.staging = torch.empty_like(input)  # fake or meta like the input: no memory
        return done

    def all_gather(
        self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False, tag: str = ""
    ) -> Done:
        n = self.world_size
        return self._count("all_gather", (n - 1) / n * _nbytes(output), tag)

    def all_to_all(
        self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False, tag: str = ""
    ) -> Done:
        n = self.world_size
        return self._count("all_to_all", (n - 1) / n * _nbytes(input), tag)

    def count_replaced(self, op: str, nbytes: int) -> None:
        pass  # the planner compares runs with and without compression instead

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        self._count("broadcast", _nbytes(tensor))

    def barrier(self) -> None:
        pass

    def send(self, tensor: torch.Tensor, dst: int, async_op: bool = False, tag: str = "") -> Done:
        return self._count("send", _nbytes(tensor))

    def recv(self, tensor: torch.Tensor, src: int, async_op: bool = False, tag: str = "") -> Done:
        return Done()

    def close(self) -> None:
        pass


@dataclass(frozen=True)
class Simulated:
    """What one rank of one strategy holds and sends, from the meta run."""

    strategy: str
    world_size: int
    trainable_params: int
    model_state: dict[str, int]  # as engine.memory_report().measured, after a step
    peak: int  # highest live tensor bytes since the model was built ([Note: peak model])
    # Live after the forward (with the loss) above what was live before it; with pipeline
    # stages, the most the schedule keeps at once ([Note: stage activations] in stages.py).
    activations: int
    transient: int  # the rest of the peak: gradients of backward, buckets, gathered units, ...
    comm_bytes: dict[str, int]  # bytes sent per step by this rank, per collective
    stages: tuple[int, ...] = ()  # the pipeline stages this rank holds (none without)
    in_flight: int = 0  # most micro-batches whose backward had not run yet (pipeline)
    #: bytes each tensor-parallel layer sends per step, by module name
    tp_layers: dict[str, int] = field(default_factory=dict)
    #: with ZeRO's state offloaded: its bytes on disk, and read and written per step
    disk: int = 0
    disk_moved: int = 0
    #: operations launched per step by this rank, per collective (the keys of comm_bytes)
    comm_calls: dict[str, int] = field(default_factory=dict)
    #: planned for an accelerator: the most host memory ZeRO-Offload's home held at once
    host: int = 0


def _minus(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}


def _offloaded(strategy: Strategy) -> dict[str, int]:
    return strategy.offloaded or {"disk": 0, "moved": 0}


def simulate(
    target: Target,
    config: Config,
    world_size: int,
    micro_batch: int,
    make_optimizer: Any,
    rank: int = 0,
    shapes: stages.Shapes | None = None,
    service: Callable[[dict[str, int]], Any] | None = None,
    backend: str = DEFAULT_BACKEND,
    fold: bool = True,
    accelerator: bool = False,
) -> Simulated:
    """Run setup and two steps of ``config``'s strategy on meta tensors at ``world_size``, as
    rank ``rank`` would. With pipeline stages (``mesh.pp > 1``) the steps are a schedule's, and
    ``shapes`` holds what the other stages send ([Note: planning stages] in stages.py).
    ``service``: makes the ranks beside the mesh that the strategy talks to (a parameter
    server's, ``plan/parameter_server.py``), given the dict to count the bytes it sends in.
    ``backend``: the data plane's, for what its collectives stage ([Note: gloo staging]).
    ``fold``: simulate a long accumulation as four micro-batches ([Note: folded
    accumulation]); False runs every one (the tests compare the two). ``accelerator``: as on a
    GPU rank, whose ZeRO-Offload keeps state in host memory: ``peak`` is the device's, ``host``
    the host memory's ([Note: planning host offload] in ``placement.py``)."""
    from longboat.config.batch import resolve_batch
    from longboat.engine import assemble, resolve_mesh

    sent: dict[str, int] = {}
    calls: dict[str, int] = {}
    layers: dict[str, int] = {}
    mesh = resolve_mesh(config, world_size)
    # Control planes carry flags, headers and metadata as JSON: a few bytes, whose values fake
    # tensors do not have. The plan gives them doorways of one (no peer, nothing counted).
    topology = Topology.of(
        mesh,
        rank,
        # The tensor-parallel layers' traffic is told apart from the data-parallel strategy's,
        # and counted per layer.
        lambda n, r, axis: (
            MetaCollectives(
                n, r, sent=sent, calls=calls, prefix="tp ", by_tag=layers, backend=backend
            )
            if axis == "tp"
            else MetaCollectives(n, r, sent=sent, calls=calls, backend=backend)
        ),
        control=lambda: MetaCollectives(1),
    )
    world = World(rank=rank, local_rank=rank, world_size=world_size, local_world_size=world_size)
    tracker = LiveBytes()
    if config.precision.dtype == "fp16":  # see [Note: fake tensors]
        config = config.model_copy(
            update={"precision": config.precision.model_copy(update={"dtype": "bf16"})}
        )
    accumulation = (
        resolve_batch(config.batch, mesh.dp).gradient_accumulation_steps
        if config.batch.micro_batch_size or config.batch.train_batch_size
        else 1
    )
    repeats = 1  # how many micro-batches the third one stands for
    if fold and mesh.pp == 1 and accumulation > FOLDED:  # [Note: folded accumulation]
        repeats = accumulation - (FOLDED - 1)
        batch = config.batch.model_copy(
            update={"gradient_accumulation_steps": FOLDED, "train_batch_size": None}
        )
        config = config.model_copy(update={"batch": batch})
    on_accelerator = placement.accelerator(tracker) if accelerator else nullcontext()
    with FakeTensorMode(), tracker, on_accelerator:
        model = target.build()
        if accelerator:  # built on the CPU, the engine moves it ([Note: planning host offload])
            placement.built_on_host(model)
            tracker.restart_peaks()
        opt = make_optimizer(model.parameters())
        engine = assemble(
            model,
            opt,
            config,
            world,
            topology,
            device=torch.device("cpu"),
            service=None if service is None else service(sent),
        )
        if accelerator:
            _as_on_a_gpu(opt)
        try:
            steps: _Steps | stages.StageSteps
            if mesh.pp > 1:
                shapes = {} if shapes is None else shapes
                steps = stages.StageSteps(engine, target, model, micro_batch, tracker, shapes)
            else:
                steps = _Steps(engine, target, model, micro_batch, tracker)
            # A pipeline's schedule runs a step's micro-batches itself; otherwise each optimizer
            # step is the config's accumulation of micro-batches ([Note: peak model]).
            micro_steps = 1 if mesh.pp > 1 else engine.accumulation_steps
            counted = (sent, calls, layers)
            for step in range(2):
                if step == 1:
                    for counts in counted:  # the first step's are the same; count one step
                        counts.clear()
                    moved = _offloaded(engine.strategy)["moved"]
                for i in range(micro_steps):
                    # The second step's third micro-batch stands for the `repeats` between
                    # its second and last ([Note: folded accumulation]).
                    again = repeats - 1 if step == 1 and i == FOLDED - 2 else 0
                    before = [dict(c) for c in counted] if again else []  # else nothing to add
                    moved_before = _offloaded(engine.strategy)["moved"]
                    steps.step()
                    for counts, then in zip(counted, before, strict=False):
                        for k, v in _minus(counts, then).items():
                            counts[k] += again * v
                    if again:  # disk_moved is what moved since `moved`: count it again too
                        moved -= again * (_offloaded(engine.strategy)["moved"] - moved_before)
            off = _offloaded(engine.strategy)
            # One step's traffic: close() below may gather too (the masters a model is handed
            # back with), which no training step sends.
            per_step = dict(sent), dict(calls)
            state = measure(engine.strategy.memory_tensors(opt))
            trainable = engine.trainable_params
            name = engine.strategy.name
            host_kept = bool(engine.strategy.on_host)  # ZeRO-Offload beside an accelerator
            # [Note: peak model]: setup and the steps; not close(), which may gather the model
            # to hand it back (to the host, with parameter offload)
            peak, host_peak = tracker.max_peak, tracker.host_peak
        finally:
            engine.close()
    state_total = sum(state[c] for c in CATEGORIES)
    return Simulated(
        strategy=name,
        world_size=world_size,
        trainable_params=trainable,
        model_state=state,
        peak=peak,
        activations=steps.activations,
        transient=max(peak - state_total - steps.activations, 0),
        comm_bytes=per_step[0],
        comm_calls=per_step[1],
        stages=steps.stages,
        in_flight=steps.in_flight,
        tp_layers=dict(layers),
        disk=off["disk"],
        disk_moved=off["moved"] - moved,
        host=host_peak if host_kept else 0,
    )


def _as_on_a_gpu(optimizer: torch.optim.Optimizer) -> None:
    """The optimizer as torch runs it on a GPU where the user chose neither way: its
    multi-tensor kernels, whose temporaries (a square root of every second moment at once, for
    Adam) are whole state-sized buffers; on the CPU it steps parameter by parameter. Groups that
    chose (the host's fused Adam of ZeRO-Offload, [Note: host offload]) keep their choice."""
    for group in optimizer.param_groups:
        if "foreach" in group and group.get("foreach") is None and not group.get("fused"):
            group["foreach"] = True


class _Steps:
    """Without pipeline stages: one micro-batch (``engine.step()`` steps the optimizer at the
    accumulation boundary only), and the most a forward and loss leave live."""

    stages: tuple[int, ...] = ()
    in_flight = 0

    def __init__(
        self,
        engine: Any,
        target: Target,
        model: torch.nn.Module,
        micro_batch: int,
        tracker: LiveBytes,
    ) -> None:
        self.engine, self.target, self.model, self.micro_batch = engine, target, model, micro_batch
        self.tracker = tracker
        self.activations = 0

    def step(self) -> None:
        args = self.target.example_input(self.model, self.micro_batch)
        before = self.tracker.live
        loss = self.target.loss(self.engine(*args), args)
        self.activations = max(self.activations, self.tracker.live - before)
        self.engine.backward(loss)
        del loss
        self.engine.step()
        del args
