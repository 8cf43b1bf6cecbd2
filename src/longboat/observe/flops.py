"""Flops of one training step, counted by ``torch.utils.flop_counter``, and this machine's
measured matrix-multiply rate to compare the achieved rate with."""

from __future__ import annotations

import contextlib
import time

import torch
from torch.utils.flop_counter import FlopCounterMode


class StepFlops:
    """Counts the flops of the forwards and backwards of one chosen optimizer step.

    The counter is a dispatch mode entered at the step's first forward and left when the step
    ends, so it sees every micro-batch of that step and nothing of the optimizer (whose
    element-wise updates are not matrix work). ``count_step`` is the 0-based index of the
    counted step: 1 skips the first, whose one-off work (lazy init, allocator warm-up) is not
    representative, although the count itself would not differ.
    """

    def __init__(self, count_step: int = 1) -> None:
        self.count_step = count_step
        self.per_rank: int | None = None  # flops of the counted step on this rank
        self._mode: FlopCounterMode | None = None
        # Holds the entered mode between calls (FlopCounterMode's __enter__/__exit__ are untyped).
        self._entered = contextlib.ExitStack()

    def forward_begin(self, step_index: int) -> None:
        if self.per_rank is None and self._mode is None and step_index == self.count_step:
            self._mode = FlopCounterMode(display=False)
            self._entered.enter_context(self._mode)

    def step_end(self) -> None:
        if self._mode is not None:
            self._entered.close()
            self.per_rank = int(self._mode.get_total_flops())
            self._mode = None

    def close(self) -> None:
        self.step_end()


def matmul_rate(
    device: torch.device,
    seconds: float = 0.2,
    n: int | None = None,
    dtype: torch.dtype = torch.float32,
) -> float:
    """Measured matrix-multiply rate in flop/s on ``device`` with this process's threads, in
    ``dtype`` (fp32 by default): ``n x n`` products in a loop for about ``seconds`` after one
    warm-up product."""
    n = n or (4096 if device.type == "cuda" else 512)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    c = torch.empty(n, n, device=device, dtype=dtype)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    torch.mm(a, b, out=c)
    sync()
    count, t0 = 0, time.perf_counter()
    while True:
        torch.mm(a, b, out=c)
        count += 1
        if count % 4 == 0:
            sync()
            elapsed = time.perf_counter() - t0
            if elapsed >= seconds:
                return 2.0 * n**3 * count / elapsed
