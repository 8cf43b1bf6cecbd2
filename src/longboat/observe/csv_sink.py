"""The CSV monitor: one file, ``output_path/job_name/metrics.csv``, a header and one row per
event.

One file with a column per value (DeepSpeed writes one CSV per metric) because a single table
loads in one call (``pandas.read_csv``) and keeps the values of a step on one row. The columns
are fixed when the file is opened; a value an event lacks is an empty cell. A file left by an
earlier run with the same columns is appended to, so a resumed run continues its history.
"""

from __future__ import annotations

import csv
from pathlib import Path

from longboat.observe.events import StepEvent


class CsvSink:
    """Writes events as rows of ``columns`` (``step`` first)."""

    def __init__(self, directory: str | Path, columns: list[str]) -> None:
        self.path = Path(directory) / "metrics.csv"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.columns = ["step", *columns]
        header = ",".join(self.columns)
        fresh = not self.path.exists() or self.path.stat().st_size == 0
        if not fresh:
            with self.path.open() as f:
                old = f.readline().strip()
            if old != header:
                raise ValueError(
                    f"monitor.csv: {self.path} holds other columns ({old}); this run writes "
                    f"({header}); set monitor.csv.job_name to a new name or move the file"
                )
        self._file = self.path.open("a", newline="")
        self._writer = csv.writer(self._file)
        if fresh:
            self._writer.writerow(self.columns)

    def write(self, event: StepEvent) -> None:
        values = event.scalars()
        self._writer.writerow([event.step, *(values.get(c, "") for c in self.columns[1:])])
        self._file.flush()  # a crashed run keeps its rows

    def close(self) -> None:
        self._file.close()
