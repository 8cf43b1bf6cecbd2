"""The workers' output onto the launcher's, without losing a worker's last lines.

[Note: tail race] The elastic agent writes each worker's stdout and stderr to files and, with
``tee``, a thread per file copies new lines onto the launcher's own streams until the agent sets
that worker's ``finished`` event. torch's loop (``tail_logfile`` in
``torch.distributed.elastic.multiprocessing.tail_log``) reads to the end of the file first and
looks at the event after: a worker that writes its last lines and exits between the two, and an
agent that notices and sets the event in that window, end the loop with those lines unread. The
same happens to a file that appears in the window before the loop first sees it; torch 2.13's
loop still reads in this order. On a loaded machine it happens: a one-line script run by
``longboat run`` once came back with its exit status 0 and no line at all
(``tests/test_launcher.py``, in a full run of the suite).

The loop below reads the event *before* each look at the file: if the worker had finished by
then, everything it wrote is on disk, so the end of the file (or no file) is final; if not, it
looks again. Otherwise it is torch's loop, installed in its place in the launcher's process
(:func:`install`), where torch's own tailer pool calls it by its module-level name; a torch whose
function takes other arguments keeps its own. Written here rather than taken from a library: the
fix is a change of order inside torch's own tailer, which has no hook for it.
"""

from __future__ import annotations

import inspect
import os
import time
from collections.abc import Callable
from threading import Event
from typing import TextIO

_PARAMETERS = ("header", "file", "dst", "finished", "interval_sec", "log_line_filter")


def tail_logfile(
    header: str,
    file: str,
    dst: TextIO,
    finished: Event,
    interval_sec: float,
    log_line_filter: Callable[[str], bool] | None = None,
) -> None:
    """Copy the lines of ``file`` onto ``dst``, each after ``header``, as they are written and
    until ``finished`` is set and every line written before it was copied ([Note: tail race])."""
    while True:
        done = finished.is_set()  # before the look: a file not there after it never will be
        if os.path.exists(file):
            break
        if done:
            return
        time.sleep(interval_sec)
    with open(file, errors="replace") as fp:
        while True:
            done = finished.is_set()  # before reading: the end of the file is then final
            line = fp.readline()
            if line:
                if log_line_filter is None or log_line_filter(line):
                    dst.write(f"{header}{line}")
            elif done:
                return
            else:
                time.sleep(interval_sec)


def install() -> bool:
    """Put :func:`tail_logfile` in the place of torch's, where it takes the same arguments;
    whether it did."""
    from torch.distributed.elastic.multiprocessing import tail_log

    theirs = getattr(tail_log, "tail_logfile", None)
    if theirs is None or theirs is tail_logfile:
        return theirs is tail_logfile
    if not set(inspect.signature(theirs).parameters) <= set(_PARAMETERS):
        return False
    tail_log.tail_logfile = tail_logfile
    return True
