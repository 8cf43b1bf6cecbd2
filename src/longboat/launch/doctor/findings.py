"""One result of a preflight check, and the exit status a list of them earns."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Status = Literal["ok", "warn", "fail"]


@dataclass(frozen=True)
class Finding:
    """What one check found: ``detail`` says what is, ``fix`` what to do when it is not ok."""

    name: str
    status: Status
    detail: str
    fix: str = ""


def exit_code(findings: list[Finding]) -> int:
    """0 when nothing failed (warnings allowed), 1 otherwise."""
    return 1 if any(f.status == "fail" for f in findings) else 0
