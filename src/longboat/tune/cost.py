"""The cost model that ranks the candidates the planner lets through: a predicted step time.

[Note: cost model] One optimizer step of a candidate on one rank is predicted as the sum of

- compute: the matrix flops of ``accumulation`` forwards and backwards at its micro-batch,
  counted by ``torch.utils.flop_counter`` on fake tensors (so attention and the recomputed
  forwards of activation checkpointing are counted as they run, where ``6 x parameters x
  tokens`` would count embedding tables as matrix work and miss attention), over this machine's
  measured matmul rate with one thread (``longboat.observe.flops.matmul_rate``), in fp32, or in
  bf16 for a candidate that computes in it (``precision.dtype``);
- overhead: the operators one micro-batch dispatches (counted in the same fake run) times the
  measured cost of an operator whose arithmetic is negligible (a forward and backward of
  tiny layers: dispatch, autograd's graph, module calls), per micro-batch: what makes many
  small micro-batches slower than few large ones beyond their flops;
- optimizer: the elements this rank's AdamW steps (its optimizer state from the plan, two fp32
  moments per element) over a measured AdamW rate;
- communication: the bytes this rank sends per step, as the planner counted them from the
  strategy's own collectives (ring algorithms; ZeRO-2 reduce-scatters after every micro-batch,
  ZeRO-3 gathers parameters in forward and backward), over the measured bandwidth of an
  all-reduce of a few MiB on the gloo group, plus each collective's measured latency, twice
  with the desync check on (a fingerprint exchange precedes each collective);
- disk: with ZeRO's state offloaded, the bytes read and written per step over a measured
  write-and-read rate of the offload directory;
- bubble: with pipeline stages (``mesh.pp``), the time the rank waits in its schedule. Each
  stage does ``1/pp`` of the counted flops and operators (the default split balances the
  stages), and the schedule's own simulator
  (:meth:`longboat.pipeline.PipelineSchedule.simulate`, a backward costing two forwards, a split
  one half and half) gives the step's makespan over a rank's busy time: the compute and overhead
  terms are of the busy time, the bubble term the rest. With tensor-parallel ranks
  (``mesh.tp``), each does ``1/tp`` of the flops (the plan divides every matrix product) but
  dispatches every operator; their all-reduces and gathers are in the planner's bytes and
  collectives, under ``tp`` names, and so in the communication term, on the step's critical path
  as they are.

The terms are added: overlap of communication with the backward is not modelled (on a CPU
whose cores the ranks share it is small), nor the per-step work outside these (the loss, the
loss and norm bookkeeping). The model ranks; measurement decides. Its prediction is reported
beside the measurement of every measured candidate, so how far it is off is on the record.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ADAMW_STATE_BYTES = 8  # two fp32 moments per element stepped


@dataclass(frozen=True)
class Rates:
    """What this machine does per second, measured at the start of a search
    (:mod:`longboat.tune.machine`)."""

    matmul_flops_per_s: float
    op_s: float  # seconds per operator of a forward and backward, beside its arithmetic
    adamw_elements_per_s: float
    link_bytes_per_s: float | None  # bytes one rank sends per second in a ring all-reduce
    latency_s: float  # one small all-reduce on the group
    disk_bytes_per_s: float | None = None  # written then read back, through the page cache
    #: the matmul rate in bf16, measured when a candidate computes in it (autocast)
    bf16_matmul_flops_per_s: float | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Work:
    """One micro-batch's forward and backward: matrix flops and operators dispatched."""

    flops: int
    ops: int


@dataclass(frozen=True)
class Planned:
    """The planner's figures for one candidate (``longboat.plan.simulate`` on fake tensors)."""

    peak: int  # live tensor bytes at the highest point, per rank
    model_state: dict[str, int]
    activations: int
    comm_bytes: dict[str, int]  # sent per optimizer step by this rank, per collective
    comm_calls: dict[str, int]  # collectives launched per optimizer step
    disk_moved: int = 0  # offloaded state read and written per step


@dataclass(frozen=True)
class Prediction:
    """A candidate's predicted step time and its terms ([Note: cost model]), in seconds."""

    compute_s: float
    overhead_s: float
    optimizer_s: float
    comm_s: float
    disk_s: float
    bubble_s: float = 0.0  # a pipeline rank's idle time in its schedule

    @property
    def total_s(self) -> float:
        busy = self.compute_s + self.overhead_s + self.optimizer_s + self.comm_s + self.disk_s
        return busy + self.bubble_s

    def to_json(self) -> dict[str, float]:
        return {**asdict(self), "total_s": self.total_s}


def predict(
    accumulation: int,
    work: Work,
    planned: Planned,
    rates: Rates,
    desync_check: bool = True,
    compute_dtype: str = "fp32",
    *,
    pp: int = 1,
    tp: int = 1,
    schedule: str = "1f1b",
) -> Prediction:
    """The step time of a candidate that runs ``accumulation`` micro-batches of ``work`` (the
    whole model's) per optimizer step and that the planner found to hold and send ``planned``;
    its matrix work in ``compute_dtype`` (``precision.dtype``: bf16 counts at the measured bf16
    rate; fp16 too, for want of a rate of its own); laid out on ``pp`` pipeline stages run by
    ``schedule`` and ``tp`` tensor-parallel ranks ([Note: cost model])."""
    comm_bytes = sum(planned.comm_bytes.values())
    calls = sum(planned.comm_calls.values())
    comm = 0.0
    if comm_bytes or calls:
        if rates.link_bytes_per_s is None:
            raise ValueError("a candidate communicates but no link bandwidth was measured")
        comm = comm_bytes / rates.link_bytes_per_s
        comm += calls * rates.latency_s * (2 if desync_check else 1)
    disk = 0.0
    if planned.disk_moved:
        if rates.disk_bytes_per_s is None:
            raise ValueError("a candidate offloads to disk but no disk rate was measured")
        disk = planned.disk_moved / rates.disk_bytes_per_s
    stepped = planned.model_state.get("optimizer_state", 0) / ADAMW_STATE_BYTES
    matmul = rates.matmul_flops_per_s
    if compute_dtype != "fp32":
        if rates.bf16_matmul_flops_per_s is None:
            raise ValueError(
                f"a candidate computes in {compute_dtype} but no bf16 rate was measured"
            )
        matmul = rates.bf16_matmul_flops_per_s
    compute = accumulation * work.flops / matmul / (pp * tp)
    overhead = accumulation * work.ops * rates.op_s / pp
    stretch = pipeline_stretch(schedule, pp, accumulation)
    return Prediction(
        compute_s=compute,
        overhead_s=overhead,
        optimizer_s=stepped / rates.adamw_elements_per_s,
        comm_s=comm,
        disk_s=disk,
        bubble_s=(stretch - 1.0) * (compute + overhead),
    )


def pipeline_stretch(schedule: str, pp: int, micro_batches: int) -> float:
    """A pipeline step's makespan over one rank's work in it, from ``schedule``'s simulator with
    equal stages (a backward of two forwards): 1.0 without stages."""
    if pp == 1:
        return 1.0
    from longboat.pipeline import build_pipeline_schedule

    timeline = build_pipeline_schedule(schedule, pp, micro_batches, 1).simulate()
    return timeline.makespan / max(timeline.busy)


class CountOps(TorchDispatchMode):  # type: ignore[no-untyped-call]  # torch's is unannotated
    """Counts the operators dispatched while active."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # torch's is unannotated
        self.ops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops += 1
        return func(*args, **(kwargs or {}))


def count_work(
    build: Callable[[], torch.nn.Module],
    example_input: Callable[[torch.nn.Module, int], tuple[Any, ...]],
    loss: Callable[[Any, tuple[Any, ...]], torch.Tensor],
    micro_batch: int,
    recompute: Sequence[str] = (),
) -> Work:
    """Flops and operators of one forward, loss and backward at ``micro_batch``, on fake
    tensors (nothing is allocated), with ``recompute``'s modules checkpointed as a run would
    (their forwards then run again in the backward, and are counted)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils.flop_counter import FlopCounterMode

    from longboat.config.sections import ActivationCheckpointingConfig
    from longboat.recompute import apply_activation_checkpointing

    with FakeTensorMode():
        model = build()
        if recompute:
            apply_activation_checkpointing(
                model, ActivationCheckpointingConfig(classes=list(recompute))
            )
        args = example_input(model, micro_batch)
        counter, ops = FlopCounterMode(display=False), CountOps()
        with counter, ops:
            loss(model(*args), args).backward()  # type: ignore[no-untyped-call]  # torch's is unannotated
    return Work(flops=int(counter.get_total_flops()), ops=ops.ops)
