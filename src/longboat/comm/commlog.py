"""The comm log: per operation, how many collectives, how many bytes, how long, and the
algorithm and bus bandwidth (as nccl-tests defines them).

Times: synchronous collectives are timed around the call; asynchronous ones from launch to
completion (a callback on the work's future), not to the ``wait()`` that may come much later.
"""

from __future__ import annotations

import io
import logging
import threading
from dataclasses import dataclass
from typing import Any

from longboat.comm.trace import CallRecord


def bus_factor(op: str, n: int) -> float:
    """busbw = algbw x this (nccl-tests' PERFORMANCE.md)."""
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter"):
        return (n - 1) / n
    return 1.0


@dataclass
class OpStats:
    """Totals for one operation."""

    count: int = 0
    bytes: int = 0
    seconds: float = 0.0


class CommLog:
    """Collects one entry per collective; ``summary`` turns them into a table."""

    def __init__(self, world_size: int, rank: int, verbose: bool = False) -> None:
        self.world_size = world_size
        self.rank = rank
        self.verbose = verbose
        self.stats: dict[str, OpStats] = {}
        self._lock = threading.Lock()  # async completions arrive on the backend's thread
        self._log = logging.getLogger("longboat.comm")

    def add(self, rec: CallRecord, nbytes: int, seconds: float) -> None:
        with self._lock:
            s = self.stats.setdefault(rec.op, OpStats())
            s.count += 1
            s.bytes += nbytes
            s.seconds += seconds
        if self.verbose:
            self._log.info(
                "rank %d: %s %d B %.3f ms", self.rank, rec.describe(), nbytes, seconds * 1e3
            )

    def summary(self) -> list[dict[str, Any]]:
        """One row per operation: count, bytes, total/mean seconds, algbw and busbw (GB/s)."""
        rows = []
        with self._lock:
            items = sorted(self.stats.items())
        for op, s in items:
            algbw = s.bytes / s.seconds / 1e9 if s.seconds > 0 else 0.0
            rows.append(
                {
                    "op": op,
                    "count": s.count,
                    "bytes": s.bytes,
                    "total_s": s.seconds,
                    "mean_s": s.seconds / s.count if s.count else 0.0,
                    "algbw_gbps": algbw,
                    "busbw_gbps": algbw * bus_factor(op, self.world_size),
                }
            )
        return rows

    def table(self, axis: str = "") -> str:
        """The summary as a text table (rich); ``axis`` names the doorway's axis in the title."""
        from rich.console import Console
        from rich.table import Table

        where = f"{axis}, " if axis else ""
        t = Table(title=f"longboat comm log ({where}rank {self.rank}, {self.world_size} ranks)")
        for col in ("op", "count", "bytes", "total ms", "mean ms", "algbw GB/s", "busbw GB/s"):
            t.add_column(col, justify="left" if col == "op" else "right")
        for r in self.summary():
            t.add_row(
                r["op"],
                str(r["count"]),
                f"{r['bytes']:,}",
                f"{r['total_s'] * 1e3:.2f}",
                f"{r['mean_s'] * 1e3:.3f}",
                f"{r['algbw_gbps']:.3f}",
                f"{r['busbw_gbps']:.3f}",
            )
        out = io.StringIO()
        Console(width=100, file=out, color_system=None).print(t)
        return out.getvalue()
