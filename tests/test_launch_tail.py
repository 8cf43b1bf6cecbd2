"""The launcher copies every line a worker wrote, even when the worker writes its last ones and
the agent marks it finished in the moment between the tailer's two looks ([Note: tail race] in
``longboat/launch/tail.py``). The races are driven by a stand-in event, not by timing."""

from __future__ import annotations

import io
from pathlib import Path

from longboat.launch import tail


class _WorkerEndsWhenAsked:
    """The ``finished`` event of a worker that, the first time the tailer asks, writes
    ``last`` to ``path`` and exits, and whose agent sets the event: the worst moment there is.
    """

    def __init__(self, path: Path, last: str) -> None:
        self.path, self.last, self.ended = path, last, False

    def is_set(self) -> bool:
        if not self.ended:
            with self.path.open("a") as f:
                f.write(self.last)
            self.ended = True
        return True


def _tail(path: Path, finished: object) -> str:
    out = io.StringIO()
    tail.tail_logfile("[rank0]: ", str(path), out, finished, 0.001)  # type: ignore[arg-type]
    return out.getvalue()


def test_the_last_line_written_as_the_worker_ends_is_copied(tmp_path: Path) -> None:
    log = tmp_path / "stdout.log"
    log.write_text("step 1\n")
    # torch 2.13's loop reads to the end, then looks at the event: this line was lost so.
    assert _tail(log, _WorkerEndsWhenAsked(log, "IDS run default\n")) == (
        "[rank0]: step 1\n[rank0]: IDS run default\n"
    )


def test_a_file_that_appears_as_the_worker_ends_is_copied(tmp_path: Path) -> None:
    log = tmp_path / "stdout.log"
    # torch 2.13's loop looks for the file, then at the event: this file was never read so.
    assert _tail(log, _WorkerEndsWhenAsked(log, "only line\n")) == "[rank0]: only line\n"


def test_a_worker_that_never_wrote_a_file_ends_the_tail(tmp_path: Path) -> None:
    class Finished:
        def is_set(self) -> bool:
            return True

    assert _tail(tmp_path / "none.log", Finished()) == ""


def test_the_launcher_puts_it_in_the_place_of_torchs() -> None:
    from torch.distributed.elastic.multiprocessing import tail_log

    assert tail.install()
    assert tail_log.tail_logfile is tail.tail_logfile
    assert tail.install()  # twice is harmless
