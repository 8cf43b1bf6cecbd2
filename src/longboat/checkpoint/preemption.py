"""Stopping cleanly when asked: SIGTERM or SIGINT become a request that every rank honours at the
same step, so the run can write a final checkpoint and exit instead of dying mid-step.

``longboat run`` (torch elastic's agent) forwards a SIGTERM or SIGINT it receives to every worker
and waits ``--grace-period`` seconds before killing them; a cluster scheduler preempting a job
does much the same. Ranks receive the signal at slightly different moments, so a rank never acts
on its own flag: :meth:`StopSignals.agreed` all-reduces it (MAX), and every rank sees the same
answer at the same step. A second signal while a stop is pending falls back to the handler that
was there before (usually: terminate now).
"""

from __future__ import annotations

import logging
import signal
import threading
from types import FrameType
from typing import Any

import torch

from longboat.comm.protocol import Comm

log = logging.getLogger("longboat")
_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopSignals:
    """SIGTERM/SIGINT recorded as a stop request (handlers installed on first use)."""

    def __init__(self) -> None:
        self.received: str | None = None  # the signal's name, once one arrived
        self._saved: dict[int, Any] = {}

    def _install(self) -> None:
        if self._saved or threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread
        for sig in _SIGNALS:
            self._saved[sig] = signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self.received is not None:  # asked twice: do what would have happened without us
            previous = self._saved.get(signum, signal.SIG_DFL)
            self.uninstall()
            if callable(previous):
                previous(signum, frame)
            else:
                signal.raise_signal(signum)
            return
        self.received = signal.Signals(signum).name
        log.warning("%s received: stopping at the next step boundary", self.received)

    def agreed(self, comm: Comm) -> bool:
        """True on every rank once any rank received a stop signal. Every rank must call it at
        the same point (one small all-reduce on ``comm``, the world's control plane)."""
        self._install()
        flag = torch.tensor([1.0 if self.received else 0.0])
        comm.all_reduce(flag, op="max")
        return bool(flag.item())

    def uninstall(self) -> None:
        """Put back the handlers that were there before."""
        for sig, handler in self._saved.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        self._saved.clear()
