"""``-n/--nproc-per-node``: how many workers this node starts, as torchrun reads it, and a range.

A number; ``gpu`` (one per visible CUDA device), ``cpu`` (one per CPU core) or ``auto`` (``gpu``
where CUDA is usable, else ``cpu``), as torchrun's ``--nproc-per-node``; or ``MIN:MAX``, an
elastic node ([Note: elastic node] in ``elastic.py``): MAX workers start, and after a failure the
node restarts without the failed workers' slots, down to MIN.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

_HOW = "give a number (-n 2), gpu, cpu, auto, or MIN:MAX (-n 2:4)"


class NprocError(ValueError):
    """A ``-n`` value that cannot be used; the message names it and the fix."""


@dataclass(frozen=True)
class Nproc:
    """Workers to start (``most``), and the fewest an elastic node restarts with (``least``,
    equal to ``most`` when the node is not elastic)."""

    most: int
    least: int

    @property
    def elastic(self) -> bool:
        return self.least < self.most


def _count(text: str, value: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise NprocError(f"-n/--nproc-per-node {value!r} is not understood: {_HOW}") from None
    if n < 1:
        raise NprocError(
            f"-n/--nproc-per-node {value!r}: a node needs at least one worker process; {_HOW}"
        )
    return n


def _gpus(value: str) -> int:
    import torch  # only for gpu and auto: a number needs no torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0 and value == "gpu":
        raise NprocError(
            "-n/--nproc-per-node gpu: no CUDA device is visible here "
            "(torch.cuda.is_available() is False); give a number of workers, e.g. -n 2"
        )
    return count


def parse(value: str | int) -> Nproc:
    """The workers ``value`` asks for; :class:`NprocError` names what is wrong with it."""
    text = str(value).strip().lower()
    if text == "gpu":
        n = _gpus(text)
        return Nproc(n, n)
    if text in ("cpu", "auto"):
        n = (_gpus(text) if text == "auto" else 0) or os.cpu_count() or 1
        return Nproc(n, n)
    if ":" in text:
        low, _, high = text.partition(":")
        least, most = _count(low, str(value)), _count(high, str(value))
        if least > most:
            raise NprocError(
                f"-n/--nproc-per-node {value!r}: MIN {least} is above MAX {most}; write MIN:MAX, "
                f"e.g. -n {most}:{least}"
            )
        return Nproc(most, least)
    n = _count(text, str(value))
    return Nproc(n, n)
