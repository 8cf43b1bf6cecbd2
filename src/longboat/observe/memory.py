"""Model-state memory per rank, counted from tensor storages, beside the formula it should meet.

Counting storages (each once, whatever views point into it) is deterministic, unlike RSS, and
separates what a strategy keeps between steps from what it allocates for a moment.

[Note: memory formulas] With ``a`` trainable parameters of 4-byte fp32 master weights, ``k``
bytes of optimizer state per parameter (Adam/AdamW: 8, SGD with momentum: 4, plain SGD: 0) and
``n`` ranks, the persistent model state per rank is:

==============  ==================  ==============  ==================
strategy        parameters          gradients       optimizer state
==============  ==================  ==============  ==================
single          4a                  4a (at peak)    ka
replicate       4a                  4a (buckets)    ka
zero stage 1    4a                  4a              ka/n
zero stage 2    4a                  4a/n            ka/n
zero stage 3    4a/n                4a/n            ka/n
==============  ==================  ==============  ==================

Each strategy owns its row (its ``expected_memory``: the whole model's, ``whole_model_state``
in ``strategies/whole_state.py``, for single, replicate and a parameter server's worker;
``ZeroPolicy.model_state`` for a ZeRO stage), so with Adam: replicate 16a, ZeRO-1
4a + 4a + 8a/n, ZeRO-2 4a + 12a/n, ZeRO-3 16a/n. bf16 and
fp16 (autocast) keep fp32 master weights and create their low-precision copies only for the
duration of an operation, so the persistent figures are the same; a ``communication_data_type``
of 2 bytes adds only transient buffers. With ``precision.param_dtype = 'bf16'`` ZeRO stages 1-2
keep a whole bf16 copy beside the fp32 shard: parameters 2a + 4a/n ([Note: parameter dtype] in
``strategies/zero/gather.py``); stage 3's persistent shard stays 4a/n. Shards are padded to a
multiple of ``n`` per unit: at most ``n - 1`` elements per unit, counted in the measurement, not in
the formula.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

CATEGORIES = ("parameters", "gradients", "optimizer_state", "communication_buffers")


def optimizer_state_bytes_per_param(optimizer: torch.optim.Optimizer) -> int:
    """``k`` of [Note: memory formulas] for the common optimizers (fp32 states)."""
    if isinstance(
        optimizer,
        (
            torch.optim.Adam,
            torch.optim.AdamW,
            torch.optim.NAdam,
            torch.optim.RAdam,
            torch.optim.Adamax,
        ),
    ):
        return 8
    if isinstance(optimizer, torch.optim.SGD):
        return 4 if optimizer.defaults.get("momentum", 0) else 0
    if isinstance(optimizer, (torch.optim.RMSprop, torch.optim.Adagrad)):
        return 4
    raise ValueError(f"no memory formula for {type(optimizer).__name__}")


def model_state(parameters: float, gradients: float, optimizer_state: float) -> dict[str, int]:
    """One rank's row of [Note: memory formulas], in bytes per category: each strategy computes
    its own (``expected_memory``) and gives it here."""
    return {
        "parameters": int(parameters),
        "gradients": int(gradients),
        "optimizer_state": int(optimizer_state),
        "communication_buffers": 0,
    }


def _storage_key(st: torch.UntypedStorage) -> tuple[object, ...]:
    # Meta storages (``longboat plan``) have no address: every one reports 0. Their C++
    # object identifies them instead, and is shared by views as an address would be.
    if st.device.type == "meta":
        return ("meta", st._cdata)
    return (st.data_ptr(), st.nbytes())


def storage_bytes(tensors: Iterable[torch.Tensor | None], seen: set[tuple[object, ...]]) -> int:
    """Bytes of the storages behind ``tensors`` (None skipped), each counted once: a view
    adds nothing beyond its base, and a storage already in ``seen`` (updated here) adds
    nothing."""
    total = 0
    for t in tensors:
        if t is None:
            continue
        st = t.untyped_storage()
        key = _storage_key(st)
        if st.nbytes() == 0 or key in seen:
            continue
        seen.add(key)
        total += st.nbytes()
    return total


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]


@dataclass(frozen=True)
class MemoryReport:
    """Bytes of model state on one rank, measured and expected."""

    rank: int
    strategy: str
    trainable_params: int
    world_size: int
    measured: dict[str, int]
    expected: dict[str, int]
    #: model state kept on disk, per category (offload; empty without)
    on_disk: dict[str, int] = field(default_factory=dict)
    #: model state in host memory beside an accelerator, by kind (ZeRO-Offload; empty without)
    on_host: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.measured.values())

    @property
    def expected_total(self) -> int:
        return sum(self.expected.values())

    def __str__(self) -> str:
        rows = [
            f"model state on rank {self.rank} ({self.strategy}, {self.world_size} ranks, "
            f"{self.trainable_params:,} trainable parameters):"
        ]
        for c in CATEGORIES:
            rows.append(
                f"  {c:<22} {self.measured[c] / 2**20:10.2f} MiB   "
                f"formula {self.expected[c] / 2**20:10.2f} MiB"
            )
        rows.append(
            f"  {'total':<22} {self.total / 2**20:10.2f} MiB   "
            f"formula {self.expected_total / 2**20:10.2f} MiB"
        )
        for c, n in self.on_disk.items():
            rows.append(f"  {c + ' on disk':<22} {n / 2**20:10.2f} MiB")
        for c, n in self.on_host.items():
            rows.append(f"  {c + ' in host memory':<22} {n / 2**20:10.2f} MiB")
        return "\n".join(rows)


def measure(groups: dict[str, list[torch.Tensor]]) -> dict[str, int]:
    """Bytes per category, each storage counted once (in the first category that holds it)."""
    seen: set[tuple[object, ...]] = set()
    return {c: storage_bytes(groups.get(c, []), seen) for c in CATEGORIES}
