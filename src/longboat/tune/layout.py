"""A candidate's layout on the mesh: pipeline stages and tensor-parallel ranks ([Note: layouts]
in ``space.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Layout:
    """Pipeline stages and tensor-parallel ranks of a candidate ([Note: layouts]); the
    data-parallel ranks are what they leave of the world."""

    pp: int = 1
    tp: int = 1
    schedule: str = "1f1b"  # the pipeline schedule, with pp > 1

    @property
    def label(self) -> str:
        """``pp2 zb-h1 tp2``; empty for one stage and no tensor parallelism."""
        parts = [f"pp{self.pp} {self.schedule}"] if self.pp > 1 else []
        parts += [f"tp{self.tp}"] if self.tp > 1 else []
        return " ".join(parts)

    def sections(self) -> dict[str, Any]:
        """The config tables that say this layout (none for the plain one)."""
        out: dict[str, Any] = {}
        if self.pp > 1 or self.tp > 1:
            out["mesh"] = {k: v for k, v in (("pp", self.pp), ("tp", self.tp)) if v > 1}
        if self.pp > 1:
            out["pipeline"] = {"schedule": self.schedule}
        return out


PLAIN = Layout()
