"""The sides ``longboat bench`` compares: longboat's strategies and, when installed, torch DDP,
torch FSDP2 and DeepSpeed, each behind the same small interface (:class:`Side`).

Every side trains with AdamW at the same learning rate and uses its library's defaults beyond
what is said here. Side names:

``single``, ``replicate``, ``zero1..3``
    ``longboat.initialize`` with that strategy (ZeRO-3 units: the spec's ``unit_classes``).
``pipeline``
    ``longboat.initialize`` with ``mesh.pp`` = the world size (one stage per rank, the model's
    own partition, the 1F1B schedule): the step's samples (the same global batch the
    data-parallel sides split) run as ``pipeline_micro_batches`` micro-batches through the
    stages, so every rank takes the whole batch. Not at one rank.
``tensor-parallel``
    ``longboat.initialize`` with ``mesh.tp`` = the world size and the model's built-in plan
    (GPT models only): every rank takes the whole global batch in one forward, its layers
    divided across the ranks. Not at one rank.
``parameter_server``
    ``longboat.initialize`` with ``strategy = "parameter_server"`` (sync, one server, the
    servers' AdamW): the last rank serves, from a thread beside its share of the other sides,
    and the others are workers that split the step's global batch between them. The same
    processes as every other side, one of them serving instead of training. Not at one rank.
``ddp``
    ``torch.nn.parallel.DistributedDataParallel`` (the peer of ``replicate``).
``fsdp2_zero2`` / ``fsdp2_zero3``
    ``fully_shard`` on each unit block, then the root; ``reshard_after_forward`` False / True.
``deepspeed_zero0..3``
    ``deepspeed.initialize`` with that ZeRO stage, CPU accelerator over our gloo group, and
    ``gradient_clipping: 0`` (DeepSpeed clips to 1.0 by default; the others do not clip).
``config:NAME``
    ``longboat.initialize`` with a whole longboat config given beside the name
    (``BenchSettings.configs``; ``longboat tune`` measures its candidates so), and
    ``engine.train_step`` on this rank's share of the step, which the engine splits into the
    config's micro-batches.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from longboat.bench.models import Batch, ModelSpec, share_of

if TYPE_CHECKING:
    from longboat.engine import Engine
    from longboat.ps.service import ServingThread

LONGBOAT_SIDES = (
    "single",
    "replicate",
    "zero1",
    "zero2",
    "zero3",
    "pipeline",
    "tensor-parallel",
    "parameter_server",
)
#: Sides whose every rank takes the whole global batch (the parameter server's workers split
#: it themselves), and which need two ranks or more.
WHOLE_BATCH = ("pipeline", "tensor-parallel", "parameter_server")
PEERS = ("ddp", "fsdp2", "deepspeed")
#: A side named ``config:NAME`` trains with the longboat config given for it whole.
CONFIG_PREFIX = "config:"


class Side(Protocol):
    """One way of training the model: build once, then step."""

    name: str
    shares_batch: bool  # every rank takes the whole global batch (pipeline, tensor-parallel)

    def step(self, batch: Batch) -> torch.Tensor | None:
        """Forward, loss, backward, optimizer step, zero_grad; returns the detached loss (None
        on a rank that trains nothing: a parameter server's server)."""
        ...

    def state_bytes(self) -> int | None:
        """Model-state bytes on this rank (parameters, gradients, optimizer state), or None
        where the library does not expose them."""
        ...

    def close(self) -> None:
        """Release hooks and buffers (never the process group)."""
        ...


def peer_sides(peers: tuple[str, ...], strategies: tuple[str, ...]) -> list[str]:
    """The peer sides to run: each peer at the setting that matches a chosen strategy
    (DDP for replicate, FSDP2 and DeepSpeed at the matching ZeRO stage)."""
    out: list[str] = []
    stages = [int(s[-1]) for s in strategies if s.startswith("zero")]
    if "ddp" in peers:
        out.append("ddp")
    if "fsdp2" in peers:
        # FSDP2 has two settings: ZeRO-2-like (no reshard) and ZeRO-3-like (its default).
        want = sorted({2 if k <= 2 else 3 for k in stages}) or [3]
        out += [f"fsdp2_zero{k}" for k in want]
    if "deepspeed" in peers:
        want = sorted(set(stages) | ({0} if "replicate" in strategies else set())) or [0]
        out += [f"deepspeed_zero{k}" for k in want]
    return out


def library(side: str) -> str:
    """``longboat``, ``ddp``, ``fsdp2`` or ``deepspeed``."""
    if side.startswith(CONFIG_PREFIX):
        return "longboat"
    return side if side == "ddp" else side.split("_")[0] if "_" in side else "longboat"


def exists_at(side: str, n: int) -> bool:
    """``single`` is one process only; a ``pipeline``, ``tensor-parallel`` and
    ``parameter_server`` need two ranks or more."""
    return not ((side == "single" and n > 1) or (side in WHOLE_BATCH and n < 2))


def _storage_bytes(tensors: list[torch.Tensor | None]) -> int:
    from longboat.observe.memory import storage_bytes

    local = []
    for t in tensors:
        if t is None:
            continue
        # DTensors (FSDP2) count their local shard.
        local.append(t.to_local() if hasattr(t, "to_local") else t)
    return storage_bytes(local, set())


def _plain_state_bytes(model: nn.Module, opt: torch.optim.Optimizer) -> int:
    params = _storage_bytes(list(model.parameters()))
    state = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    # Gradients are None between steps (zero_grad frees them); every step allocates one
    # buffer of each (local) parameter's size, so they count as much as the parameters.
    return 2 * params + _storage_bytes(state)  # type: ignore[arg-type]


class _EngineSide:
    """A side whose engine runs the forward, ``backward(loss)`` and ``step()`` itself: longboat's
    and DeepSpeed's have the same shape."""

    spec: ModelSpec
    engine: Any
    shares_batch = False

    def step(self, batch: Batch) -> torch.Tensor:
        loss = self.spec.loss(self.engine(*batch[:-1]), batch[-1])
        self.engine.backward(loss)
        self.engine.step()
        return loss.detach()


class LongboatSide(_EngineSide):
    """A longboat strategy through ``longboat.initialize``."""

    engine: Engine

    def __init__(
        self, name: str, spec: ModelSpec, model: nn.Module, lr: float, micro_batch: int
    ) -> None:
        import longboat

        self.name, self.spec = name, spec
        config: dict[str, Any] = {
            "strategy": name,
            "batch": {"micro_batch_size": micro_batch},
            "log": {"progress": False, "level": "WARNING"},
        }
        if name.startswith("zero"):
            zero: dict[str, Any] = {"stage": int(name[-1])}
            if name == "zero3" and spec.unit_classes:
                zero["unit_classes"] = list(spec.unit_classes)
            config.update(strategy="zero", zero=zero)
        self.engine = longboat.initialize(
            model, torch.optim.AdamW(model.parameters(), lr=lr), config=config
        )

    def state_bytes(self) -> int | None:
        return self.engine.memory_report().total

    def close(self) -> None:
        self.engine.close()


class ConfigSide:
    """A longboat config given whole (``config:NAME`` sides): ``engine.train_step`` runs its
    data-parallel rank's share of the step (the ranks of one pipeline or tensor-parallel group
    take the same samples, as a run's loader gives them) as the config's micro-batches."""

    shares_batch = True  # it takes its share of the whole batch itself, in step

    def __init__(
        self, name: str, spec: ModelSpec, model: nn.Module, lr: float, config: dict[str, Any]
    ) -> None:
        import longboat

        self.name, self.spec = name, spec
        quiet = {"log": {"progress": False, "level": "WARNING"}}
        self.engine = longboat.initialize(
            model, torch.optim.AdamW(model.parameters(), lr=lr), config={**config, **quiet}
        )

    def step(self, batch: Batch) -> torch.Tensor:
        loss = self.engine.train_step(
            share_of(batch, self.engine.topology.coords["dp"], self.engine.topology.mesh.dp),
            lambda out, mb: self.spec.loss(out, mb[-1]),
            inputs=lambda mb: tuple(mb[:-1]),
        )
        return torch.tensor(loss)  # the mean over this rank's micro-batches

    def state_bytes(self) -> int | None:
        return self.engine.memory_report().total

    def close(self) -> None:
        self.engine.close()


class PipelineSide:
    """longboat's pipeline: one stage per rank over ``mesh.pp``, 1F1B, ``micro_batches``
    micro-batches per step; ``step`` is ``engine.train_step`` on the whole global batch."""

    shares_batch = True

    def __init__(
        self,
        spec: ModelSpec,
        model: nn.Module,
        lr: float,
        batch: int,
        stages: int,
        micro_batches: int,
    ) -> None:
        import longboat

        self.name, self.spec = "pipeline", spec
        config: dict[str, Any] = {
            "mesh": {"pp": stages},
            "pipeline": {"schedule": "1f1b"},
            "batch": {
                "micro_batch_size": batch // micro_batches,
                "gradient_accumulation_steps": micro_batches,
            },
            "log": {"progress": False, "level": "WARNING"},
        }
        self.engine = longboat.initialize(
            model, torch.optim.AdamW(model.parameters(), lr=lr), config=config
        )

    def step(self, batch: Batch) -> torch.Tensor:
        loss = self.engine.train_step(
            batch,
            lambda out, mb: self.spec.loss(out, mb[-1]),
            inputs=lambda mb: tuple(mb[:-1]),
        )
        return torch.tensor(loss)  # the last stage's, shared with every stage

    def state_bytes(self) -> int | None:
        return self.engine.memory_report().total

    def close(self) -> None:
        self.engine.close()


class TensorParallelSide(_EngineSide):
    """longboat's tensor parallelism over ``mesh.tp`` = the world size, the model's built-in
    plan; every rank runs the whole global batch."""

    engine: Engine
    shares_batch = True

    def __init__(
        self, spec: ModelSpec, model: nn.Module, lr: float, batch: int, ranks: int
    ) -> None:
        import longboat

        self.name, self.spec = "tensor-parallel", spec
        config: dict[str, Any] = {
            "mesh": {"tp": ranks},
            "batch": {"micro_batch_size": batch},
            "log": {"progress": False, "level": "WARNING"},
        }
        self.engine = longboat.initialize(
            model, torch.optim.AdamW(model.parameters(), lr=lr), config=config
        )

    def state_bytes(self) -> int | None:
        return self.engine.memory_report().total

    def close(self) -> None:
        self.engine.close()


class ParameterServerSide:
    """longboat's parameter server: workers on every rank but the last, which serves from a
    thread (``longboat.engine.serve_beside``) and goes on with the other sides meanwhile."""

    shares_batch = True  # the workers split the whole batch between them, see step()

    def __init__(
        self, spec: ModelSpec, model: nn.Module, lr: float, batch: int, ranks: int
    ) -> None:
        import torch.distributed as dist

        import longboat
        from longboat.engine import serve_beside

        self.name, self.spec = "parameter_server", spec
        self.workers = ranks - 1
        self.rank = dist.get_rank()
        config: dict[str, Any] = {
            "strategy": "parameter_server",
            "parameter_server": {"servers": 1},
            "batch": {"micro_batch_size": batch // self.workers},
            "log": {"progress": False, "level": "WARNING"},
        }
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
        self.engine: Engine | None = None
        self.server: ServingThread | None = None
        if self.rank == self.workers:
            self.server = serve_beside(model, opt, config)
        else:
            self.engine = longboat.initialize(model, opt, config)

    def step(self, batch: Batch) -> torch.Tensor | None:
        if self.engine is None:
            return None  # the server's work is in its thread
        m = batch[0].shape[0] // self.workers
        mine = tuple(t[self.rank * m : (self.rank + 1) * m] for t in batch)
        loss = self.spec.loss(self.engine(*mine[:-1]), mine[-1])
        self.engine.backward(loss)
        self.engine.step()
        return loss.detach()

    def state_bytes(self) -> int | None:
        if self.engine is None:  # the server: its range of the values and optimizer state
            assert self.server is not None
            return sum(self.server.memory().values())
        return self.engine.memory_report().total

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
        if self.server is not None:
            self.server.join()  # returns once every worker has said goodbye
            if self.server.error is not None:
                raise self.server.error


class _PlainSide:
    """A wrapped model trained with a plain torch optimizer (DDP, FSDP2)."""

    shares_batch = False

    def __init__(
        self, name: str, spec: ModelSpec, model: nn.Module, wrapped: nn.Module, lr: float
    ) -> None:
        self.name, self.spec, self.model, self.wrapped = name, spec, model, wrapped
        self.opt = torch.optim.AdamW(model.parameters(), lr=lr)

    def step(self, batch: Batch) -> torch.Tensor:
        loss = self.spec.loss(self.wrapped(*batch[:-1]), batch[-1])
        loss.backward()  # type: ignore[no-untyped-call]  # torch's is unannotated
        self.opt.step()
        self.opt.zero_grad()
        return loss.detach()

    def state_bytes(self) -> int | None:
        return _plain_state_bytes(self.model, self.opt)

    def close(self) -> None:
        pass


def make_ddp(spec: ModelSpec, model: nn.Module, lr: float) -> _PlainSide:
    """torch DDP with its defaults (25 MB buckets)."""
    from torch.nn.parallel import DistributedDataParallel

    return _PlainSide("ddp", spec, model, DistributedDataParallel(model), lr)


def make_fsdp2(name: str, spec: ModelSpec, model: nn.Module, lr: float) -> _PlainSide:
    """``fully_shard`` each unit block, then the root; stage 3 reshards after forward."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    reshard = name.endswith("3")
    for module in model.modules():
        if type(module).__name__ in spec.unit_classes:
            fully_shard(module, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    return _PlainSide(name, spec, model, model, lr)


def deepspeed_config(stage: int, micro_batch: int, world_size: int) -> dict[str, Any]:
    """The DeepSpeed config of ``deepspeed_zero{stage}`` (recorded in the report)."""
    return {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "train_batch_size": micro_batch * world_size,
        "zero_optimization": {"stage": stage},
        "gradient_clipping": 0.0,
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


def import_deepspeed() -> str | None:
    """Import DeepSpeed on its CPU accelerator over our gloo group; the reason if it cannot."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        import deepspeed
        from deepspeed.utils import logger as ds_logger

        ds_logger.setLevel("WARNING")
        deepspeed.init_distributed(dist_backend="gloo")
    except Exception as e:
        return f"deepspeed could not be imported or set up: {type(e).__name__}: {e}"
    return None


class DeepSpeedSide(_EngineSide):
    """``deepspeed.initialize`` at one ZeRO stage."""

    def __init__(
        self,
        name: str,
        spec: ModelSpec,
        model: nn.Module,
        lr: float,
        micro_batch: int,
        world_size: int,
    ) -> None:
        import deepspeed

        self.name, self.spec = name, spec
        threads = torch.get_num_threads()
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
        self.engine, _, _, _ = deepspeed.initialize(
            model=model,
            optimizer=opt,
            config=deepspeed_config(int(name[-1]), micro_batch, world_size),
        )
        torch.set_num_threads(threads)  # DeepSpeed may change it

    def state_bytes(self) -> int | None:
        return None  # DeepSpeed keeps its partitions in its own flat buffers

    def close(self) -> None:
        pass


def micro_batch_of(side: str, global_batch: int, n: int, pipeline_micro_batches: int) -> int:
    """Samples per forward: a data-parallel rank's share, a pipeline's micro-batch, or the
    whole batch (tensor-parallel)."""
    if side == "pipeline":
        return global_batch // pipeline_micro_batches
    if side == "tensor-parallel":
        return global_batch
    if side == "parameter_server":
        return global_batch // (n - 1)  # a worker's share; the last rank serves
    return global_batch // n


def build_side(
    name: str,
    spec: ModelSpec,
    seed: int,
    lr: float,
    micro_batch: int,
    world_size: int,
    pipeline_micro_batches: int = 4,
    configs: dict[str, dict[str, Any]] | None = None,
) -> Side:
    """Build ``name`` on a model made right after ``torch.manual_seed(seed)``, so every side
    starts from the same weights. ``micro_batch`` is a data-parallel rank's share of the step.
    ``configs``: the longboat config of each ``config:NAME`` side, by side name."""
    torch.manual_seed(seed)
    model = spec.build()
    if name.startswith(CONFIG_PREFIX):
        return ConfigSide(name, spec, model, lr, (configs or {})[name])
    if name == "pipeline":
        return PipelineSide(
            spec, model, lr, micro_batch * world_size, world_size, pipeline_micro_batches
        )
    if name == "tensor-parallel":
        return TensorParallelSide(spec, model, lr, micro_batch * world_size, world_size)
    if name == "parameter_server":
        return ParameterServerSide(spec, model, lr, micro_batch * world_size, world_size)
    makers: dict[str, Callable[[], Side]] = {
        "longboat": lambda: LongboatSide(name, spec, model, lr, micro_batch),
        "ddp": lambda: make_ddp(spec, model, lr),
        "fsdp2": lambda: make_fsdp2(name, spec, model, lr),
        "deepspeed": lambda: DeepSpeedSide(name, spec, model, lr, micro_batch, world_size),
    }
    return makers[library(name)]()
