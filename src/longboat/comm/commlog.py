"""The comm log: per operation, how many collectives, how many bytes, how long, and the
algorithm and bus bandwidth (as nccl-tests defines them).

Times: synchronous collectives are timed around the call; asynchronous ones from launch to
completion (a callback on the work's future), not to the ``wait()`` that may come much later.

[Note: bytes saved] ``bytes`` is the size of each collective's buffer (all-gather: the gathered
output); ``wire_bytes`` is what each rank moves over the links with ring algorithms, ``bytes``
times the bus factor (all-reduce ``2(n-1)/n``, reduce-scatter, all-gather and all-to-all
``(n-1)/n``), the measure by which collectives of different kinds compare. Gradient compression
(``longboat.comm.compression``) sends its own collectives, logged like any other, and tells the
log which exact all-reduce each stood in for (``Comm.count_replaced``): those appear as rows
marked ``replaced`` (nothing was sent). The compressed collectives carry a tag starting with
:data:`COMPRESSED`, so the log also totals their wire bytes apart: :meth:`CommLog.saved` sets
the two side by side.
"""

from __future__ import annotations

import io
import logging
import threading
from dataclasses import dataclass
from typing import Any

from longboat.comm.trace import CallRecord

#: How the tags of the collectives that carry compressed gradients start ([Note: bytes saved]).
COMPRESSED = "compressed"


def bus_factor(op: str, n: int) -> float:
    """busbw = algbw x this (nccl-tests' PERFORMANCE.md)."""
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
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
        #: exact collectives that compressed ones stood in for ([Note: bytes saved])
        self.replaced: dict[str, OpStats] = {}
        #: wire bytes of the collectives sent for compressed reductions
        self.compressed_wire = 0
        self._lock = threading.Lock()  # async completions arrive on the backend's thread
        self._log = logging.getLogger("longboat.comm")

    def add(self, rec: CallRecord, nbytes: int, seconds: float) -> None:
        with self._lock:
            s = self.stats.setdefault(rec.op, OpStats())
            s.count += 1
            s.bytes += nbytes
            s.seconds += seconds
            if rec.tag.startswith(COMPRESSED):
                self.compressed_wire += self.wire(rec.op, nbytes)
        if self.verbose:
            self._log.info(
                "rank %d: %s %d B %.3f ms", self.rank, rec.describe(), nbytes, seconds * 1e3
            )

    def replace(self, op: str, nbytes: int) -> None:
        """Count an exact ``op`` of ``nbytes`` that compressed collectives stood in for."""
        with self._lock:
            s = self.replaced.setdefault(op, OpStats())
            s.count += 1
            s.bytes += nbytes

    def wire(self, op: str, nbytes: int) -> int:
        """The bytes a rank moves for a collective of ``nbytes`` ([Note: bytes saved])."""
        return round(nbytes * bus_factor(op, self.world_size))

    def saved(self) -> dict[str, int]:
        """Wire bytes of the exact reductions compression replaced, and of the compressed
        collectives sent instead ([Note: bytes saved])."""
        with self._lock:
            exact = sum(self.wire(op, s.bytes) for op, s in self.replaced.items())
            return {"exact_wire_bytes": exact, "compressed_wire_bytes": self.compressed_wire}

    def summary(self) -> list[dict[str, Any]]:
        """One row per operation: count, bytes, wire bytes, total/mean seconds, algbw and busbw
        (GB/s); then the exact collectives compression replaced, marked ``replaced``."""
        rows = []
        with self._lock:
            items = sorted(self.stats.items())
            replaced = sorted(self.replaced.items())
        for op, s in items:
            algbw = s.bytes / s.seconds / 1e9 if s.seconds > 0 else 0.0
            rows.append(
                {
                    "op": op,
                    "count": s.count,
                    "bytes": s.bytes,
                    "wire_bytes": self.wire(op, s.bytes),
                    "total_s": s.seconds,
                    "mean_s": s.seconds / s.count if s.count else 0.0,
                    "algbw_gbps": algbw,
                    "busbw_gbps": algbw * bus_factor(op, self.world_size),
                    "replaced": False,
                }
            )
        for op, s in replaced:
            rows.append(
                {
                    "op": op,
                    "count": s.count,
                    "bytes": s.bytes,
                    "wire_bytes": self.wire(op, s.bytes),
                    "total_s": 0.0,
                    "mean_s": 0.0,
                    "algbw_gbps": 0.0,
                    "busbw_gbps": 0.0,
                    "replaced": True,
                }
            )
        return rows

    def table(self, axis: str = "") -> str:
        """The summary as a text table (rich); ``axis`` names the doorway's axis in the title."""
        from rich.console import Console
        from rich.table import Table

        where = f"{axis}, " if axis else ""
        t = Table(title=f"longboat comm log ({where}rank {self.rank}, {self.world_size} ranks)")
        for col in (
            "op",
            "count",
            "bytes",
            "wire bytes",
            "total ms",
            "mean ms",
            "algbw GB/s",
            "busbw GB/s",
        ):
            t.add_column(col, justify="left" if col == "op" else "right")
        for r in self.summary():
            t.add_row(
                f"{r['op']} (replaced, not sent)" if r["replaced"] else r["op"],
                str(r["count"]),
                f"{r['bytes']:,}",
                f"{r['wire_bytes']:,}",
                f"{r['total_s'] * 1e3:.2f}",
                f"{r['mean_s'] * 1e3:.3f}",
                f"{r['algbw_gbps']:.3f}",
                f"{r['busbw_gbps']:.3f}",
            )
        out = io.StringIO()
        Console(width=120, file=out, color_system=None).print(t)
        return out.getvalue()
