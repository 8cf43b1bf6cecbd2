"""Which server holds which part of each key: pure arithmetic, the same on every rank.

A key is a list of tensors laid end to end (a parameter group's parameters of one dtype, or one
tensor a user put into a :class:`~longboat.ps.client.KVStore`). A key of at least
``servers x min_split`` elements is cut into one contiguous range per server, equal to within an
element, so the servers share its bytes and its bandwidth; a smaller key goes whole to the
server holding the fewest elements so far (keys taken in order), so small keys do not cost a
message per server. Each server's range is cut again at the tensors' boundaries into
*segments*: the server's optimizer sees each segment as a parameter of its own, which keeps a
parameter that no worker used out of the step (its gradient is None, as in plain PyTorch).
"""

from __future__ import annotations

from dataclasses import dataclass

MIN_SPLIT = 4096


@dataclass(frozen=True)
class Segment:
    """Elements ``[start, end)`` of the key's flat range, inside tensor ``index`` of the key."""

    index: int
    start: int
    end: int

    @property
    def numel(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class KeyLayout:
    """One key: its tensors' sizes and each server's range of the flat key."""

    key: int
    sizes: tuple[int, ...]
    ranges: tuple[tuple[int, int], ...]  # per server: [lo, hi), empty where it holds none

    def holders(self) -> list[int]:
        """The servers holding some of the key, in order."""
        return [s for s, (lo, hi) in enumerate(self.ranges) if hi > lo]

    def segments(self, server: int) -> list[Segment]:
        """``server``'s range cut at the tensors' boundaries."""
        lo, hi = self.ranges[server]
        out: list[Segment] = []
        offset = 0
        for i, n in enumerate(self.sizes):
            a, b = max(lo, offset), min(hi, offset + n)
            if a < b:
                out.append(Segment(i, a, b))
            offset += n
        return out

    def span(self, server: int) -> int:
        lo, hi = self.ranges[server]
        return hi - lo


class Planner:
    """Lays keys out one after another, as they are declared (every rank declares the same keys
    in the same order, so every rank computes the same layouts)."""

    def __init__(self, servers: int, min_split: int = MIN_SPLIT) -> None:
        if servers < 1:
            raise ValueError(f"parameter_server.servers = {servers}: at least one server is needed")
        self.servers = servers
        self.min_split = min_split
        self.load = [0] * servers
        self.layouts: list[KeyLayout] = []

    def add(self, sizes: tuple[int, ...]) -> KeyLayout:
        """The layout of the next key, made of tensors of ``sizes`` elements."""
        n, servers = sum(sizes), self.servers
        if n >= servers * self.min_split:
            bounds = [n * s // servers for s in range(servers + 1)]
            ranges = tuple((bounds[s], bounds[s + 1]) for s in range(servers))
        else:
            home = min(range(servers), key=lambda s: (self.load[s], s))
            ranges = tuple((0, n) if s == home else (0, 0) for s in range(servers))
        for s, (lo, hi) in enumerate(ranges):
            self.load[s] += hi - lo
        lay = KeyLayout(len(self.layouts), tuple(sizes), ranges)
        self.layouts.append(lay)
        return lay
