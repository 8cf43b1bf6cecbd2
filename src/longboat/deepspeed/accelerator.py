"""DeepSpeed's ``deepspeed.accelerator.get_accelerator()``: the device questions a DeepSpeed
script asks, answered for the device longboat computes on ([Note: DeepSpeed call sites] in
``deepspeed/__init__.py``).

[Note: DeepSpeed accelerator] DeepSpeed picks an accelerator class per vendor (CUDA, CPU, NPU,
XPU, ...); longboat computes on CUDA GPUs or the CPU (``world.device_for``), so the one object
here answers for that device with DeepSpeed's meanings: ``device_name()`` is ``"cuda"`` or
``"cpu"`` (``"cuda:N"`` given an index; DeepSpeed's CPU accelerator ignores the index),
``current_device_name()`` this rank's device as ``torch.device`` takes it,
``communication_backend_name()`` the backend longboat joins with. The memory, stream and random
calls are torch's for that device; on the CPU they are DeepSpeed's CPU answers (no streams,
memory counters of 0, ``torch``'s generator).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from longboat.world import World, default_backend, device_for


class Accelerator:
    """The device this rank computes on, with DeepSpeed's accelerator methods."""

    def __init__(self) -> None:
        self._cuda = torch.cuda.is_available()
        self._name = "cuda" if self._cuda else "cpu"

    def device_name(self, device_index: int | None = None) -> str:
        """``"cuda"``/``"cpu"``, or ``"cuda:N"`` for a GPU index."""
        if device_index is None or not self._cuda:
            return self._name
        return f"cuda:{device_index}"

    def device(self, device_index: int | None = None) -> torch.device:
        return torch.device(self.device_name(device_index))

    def current_device(self) -> int:
        """This rank's GPU index (0 on the CPU, as DeepSpeed's CPU accelerator says)."""
        return device_for(World.from_env()).index or 0

    def current_device_name(self) -> str:
        return str(device_for(World.from_env()))

    def set_device(self, device_index: int) -> None:
        if self._cuda:
            torch.cuda.set_device(device_index)

    def device_count(self) -> int:
        return torch.cuda.device_count() if self._cuda else 1

    def is_available(self) -> bool:
        return True  # the CPU is always there, as DeepSpeed's CPU accelerator says

    def is_synchronized_device(self) -> bool:
        return not self._cuda

    def synchronize(self, device_index: int | None = None) -> None:
        if self._cuda:
            torch.cuda.synchronize(device_index)

    def communication_backend_name(self) -> str:
        return default_backend()

    def is_bf16_supported(self) -> bool:
        return torch.cuda.is_bf16_supported() if self._cuda else True

    def is_fp16_supported(self) -> bool:
        return self._cuda  # DeepSpeed's CPU accelerator says no unless IPEX is there

    def supported_dtypes(self) -> list[torch.dtype]:
        dtypes = [torch.float32, torch.bfloat16]
        return [*dtypes, torch.float16] if self.is_fp16_supported() else dtypes

    def manual_seed(self, seed: int) -> None:
        (torch.cuda if self._cuda else torch).manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        (torch.cuda.manual_seed_all if self._cuda else torch.manual_seed)(seed)

    def initial_seed(self) -> int:
        return torch.cuda.initial_seed() if self._cuda else torch.initial_seed()

    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        if self._cuda:
            return torch.cuda.get_rng_state(device_index or "cuda")
        return torch.get_rng_state()

    def set_rng_state(self, new_state: torch.Tensor, device_index: int | None = None) -> None:
        if self._cuda:
            torch.cuda.set_rng_state(new_state, device_index or "cuda")
        else:
            torch.set_rng_state(new_state)

    def empty_cache(self) -> None:
        if self._cuda:
            torch.cuda.empty_cache()

    def memory_allocated(self, device_index: int | None = None) -> int:
        return torch.cuda.memory_allocated(device_index) if self._cuda else 0

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        return torch.cuda.max_memory_allocated(device_index) if self._cuda else 0

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        if self._cuda:
            torch.cuda.reset_peak_memory_stats(device_index)

    def memory_reserved(self, device_index: int | None = None) -> int:
        return torch.cuda.memory_reserved(device_index) if self._cuda else 0

    def total_memory(self, device_index: int | None = None) -> int:
        if self._cuda:
            return int(torch.cuda.get_device_properties(device_index or 0).total_memory)
        import psutil  # a dependency of longboat; imported only when asked

        return int(psutil.virtual_memory().total)

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        del align_bytes
        return tensor.pin_memory() if self._cuda else tensor

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == self._name

    def stream(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        return torch.cuda.stream(stream) if self._cuda else contextlib.nullcontext()

    def range_push(self, msg: str) -> None:
        if self._cuda:
            torch.cuda.nvtx.range_push(msg)  # type: ignore[no-untyped-call]

    def range_pop(self) -> None:
        if self._cuda:
            torch.cuda.nvtx.range_pop()  # type: ignore[no-untyped-call]


def get_accelerator() -> Accelerator:
    """The accelerator this rank computes on (DeepSpeed's ``get_accelerator()``)."""
    return Accelerator()


__all__ = ["Accelerator", "get_accelerator"]
