"""Two ZeRO-3 engines that the script never closes, of which rank 1 drops the second before the
end and rank 0 keeps both: at exit the ranks hold different engines. Closing them at exit as
close() does (ZeRO-3 gathers each parameter to hand the model back) would have each rank wait
in a different engine's collective until ``comm.timeout_s``. Prints ``DROPPED <rank> <bool>``
(whether the engine dropped is gone) and ``END <rank>``."""

import gc
import os
import weakref

import torch

import longboat


def trained_engine() -> longboat.Engine:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = {
        "strategy": "zero",
        "zero": {"stage": 3},
        "batch": {"micro_batch_size": 2},
        "comm": {"timeout_s": 20},
        "log": {"level": "WARNING", "progress": False},
    }
    engine = longboat.initialize(model, opt, cfg)
    engine.backward(engine(torch.randn(2, 8)).square().mean())
    engine.step()
    return engine


if __name__ == "__main__":
    rank = int(os.environ["RANK"])
    kept = trained_engine()
    other = trained_engine()
    gone = weakref.ref(other)
    if rank == 1:
        del other
        gc.collect()
    print(f"DROPPED {rank} {gone() is None}", flush=True)
    print(f"END {rank}", flush=True)
