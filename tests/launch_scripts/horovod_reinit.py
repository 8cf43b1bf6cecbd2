"""Horovod's init/shutdown cycle twice in one process: the first cycle ends with a collective
the ranks disagree on (caught), and the second must work as a fresh job. Each rank prints one
JSON line: what each cycle's allreduce gave and the error of the first."""

from __future__ import annotations

import json

import torch

import longboat.horovod.torch as hvd

results = []
for cycle in range(2):
    hvd.init()
    r = hvd.rank()
    error = ""
    if cycle == 0:
        try:
            hvd.allreduce(torch.ones(2 + r))
        except hvd.HorovodInternalError as e:
            error = str(e)
    total = hvd.allreduce(torch.tensor([float(r + 1)]), op=hvd.Sum).item()
    results.append({"size": hvd.size(), "sum": total, "error": error})
    hvd.shutdown()
    assert not hvd.is_initialized() or hvd.size() == 1
print(json.dumps({"rank": r, "cycles": results}))
