"""What reaches the launcher's console: worker lines once-prefixed, and no duplicate reports."""

from __future__ import annotations

import contextlib
import logging
import re
import sys
from collections.abc import Callable, Iterator
from typing import TextIO

from longboat.launch.failures import WorkerExit, describe
from longboat.launch.last_words import Ended

# torch's init_process_group installs an excepthook in every worker that already prefixes each
# traceback line with "[rankN]: ", the same prefix the agent adds, so tracebacks would show it
# twice. The tail threads write one whole "prefix + line" per call, so collapsing is exact.
_DOUBLE_PREFIX = re.compile(r"^(\[rank\d+\]: )\1")

# torch elastic's log lines about stopping workers, replaced by longboat's own report. The second
# is logged once per failed attempt with (exitcode, local_rank, pid, ...) of the first failure.
_STOPPING_MESSAGE = "Sending process %s closing signal %s"
_FAILED_MESSAGE = "failed (exitcode: %s) local_rank: %s"
_ELASTIC_MP_LOGGER = "torch.distributed.elastic.multiprocessing.api"


_ANY_PREFIX = re.compile(r"^(\[rank\d+\]: )+")


class _OnePrefixStream:
    """A text stream proxy that writes ``[rankN]: [rankN]: x`` as ``[rankN]: x`` (or, without
    prefixes, as ``x``)."""

    def __init__(self, stream: TextIO, prefix: bool = True) -> None:
        self._stream = stream
        self._prefix = prefix

    def write(self, text: str) -> int:
        if self._prefix:
            self._stream.write(_DOUBLE_PREFIX.sub(r"\1", text, count=1))
        else:
            self._stream.write(_ANY_PREFIX.sub("", text, count=1))
        return len(text)

    def flush(self) -> None:
        self._stream.flush()

    def __getattr__(self, name: str) -> object:
        return getattr(self._stream, name)


def report(line: str) -> None:
    """Print one launcher line to stderr, after any worker output already received."""
    # Worker lines reach our stdout through a buffer: flush it so the report comes after them.
    sys.stdout.flush()
    print(line, file=sys.stderr, flush=True)


class _FailureLogFilter(logging.Filter):
    """Drops torch's stop/failure lines; turns the failure of an attempt that will be restarted
    into a longboat line (the final failure gets the full report from the launcher instead)."""

    def __init__(
        self,
        node_rank: int,
        nproc_per_node: int,
        max_restarts: int,
        first_failure: Callable[[], Ended | None] = lambda: None,
    ) -> None:
        super().__init__()
        self._first_rank = node_rank * nproc_per_node
        self._max_restarts = max_restarts
        self._failed_attempts = 0
        self._first_failure = first_failure

    def filter(self, record: logging.LogRecord) -> bool:
        if not isinstance(record.msg, str):
            return True
        if record.msg.startswith(_STOPPING_MESSAGE):
            return False
        if not record.msg.startswith(_FAILED_MESSAGE):
            return True
        self._failed_attempts += 1
        first = self._first_failure()  # this attempt's, before its ranks' moment to end
        if self._failed_attempts > self._max_restarts:
            return False
        if first is not None:  # [Note: last words]: torch names a rank that ended in the moment
            record.args = (first.exitcode, first.local_rank, first.pid)
        # torch's elastic agent logs the exit code, local rank and pid as ints.
        match record.args:
            case (int() as exitcode, int() as local_rank, int() as pid, *_):
                worker = WorkerExit(rank=self._first_rank + local_rank, pid=pid, exitcode=exitcode)
                report(describe(worker))
                report(
                    f"longboat: restarting all workers (attempt {self._failed_attempts + 1} of "
                    f"{self._max_restarts + 1})"
                )
        return False


@contextlib.contextmanager
def worker_console(
    node_rank: int,
    nproc_per_node: int,
    max_restarts: int,
    prefix: bool = True,
    first_failure: Callable[[], Ended | None] = lambda: None,
) -> Iterator[None]:
    """For the duration of a launch: one rank prefix per line (or none), no log lines we report
    better; a restart names ``first_failure()``'s rank where it gives one ([Note: last
    words])."""
    log_filter = _FailureLogFilter(node_rank, nproc_per_node, max_restarts, first_failure)
    logger = logging.getLogger(_ELASTIC_MP_LOGGER)
    logger.addFilter(log_filter)
    try:
        with (
            contextlib.redirect_stdout(_OnePrefixStream(sys.stdout, prefix)),
            contextlib.redirect_stderr(_OnePrefixStream(sys.stderr, prefix)),
        ):
            yield
    finally:
        logger.removeFilter(log_filter)
