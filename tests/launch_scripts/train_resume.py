"""A training script that resumes: ``train_resume.py CKPT OUT STEPS [--kill-at S] [--sleep T]``.

It loads the latest checkpoint in CKPT if there is one (auto-resume), trains TinyNet with ZeRO-2
to STEPS, saves a checkpoint every 2 steps, and stops cleanly (final checkpoint, exit 0) when
``engine.should_stop()`` says a stop signal arrived. Rank 0 writes the final weights to OUT.
``--kill-at S``: on the first attempt, rank 1 SIGKILLs itself right after step S.
``--sleep T``: sleep T seconds after each step (so a test can signal mid-run).
START, STEP and KILL lines carry the wall-clock time (for benchmarks/restart_recovery.py).
"""

import argparse
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: reference, ckpt_helpers

import ckpt_helpers as h
import reference
import torch
from safetensors.torch import save_file


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("ckpt")
    ap.add_argument("out")
    ap.add_argument("steps", type=int)
    ap.add_argument("--kill-at", type=int, default=0)
    ap.add_argument("--sleep", type=float, default=0.0)
    args = ap.parse_args()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    engine = h.build(h.config("zero2", world))
    rank = engine.comm.rank
    engine.load_checkpoint(args.ckpt, allow_missing=True)
    print(f"START attempt={attempt} step={engine.global_step} t={time.time():.3f}", flush=True)
    loader = engine.loader(reference.dataset(h.GLOBAL_BATCH * h.EPOCH))
    loss_fn = torch.nn.CrossEntropyLoss()
    while engine.global_step < args.steps:
        for x, y in loader:
            engine.backward(loss_fn(engine(x), y))
            if not engine.step():
                continue
            step = engine.global_step
            if step % 2 == 0:
                engine.save_checkpoint(args.ckpt)
            if attempt == 0 and rank == 1 and step == args.kill_at:
                print(f"KILL step={step} t={time.time():.3f}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            print(f"STEP {step} t={time.time():.3f}", flush=True)
            time.sleep(args.sleep)
            if engine.should_stop():
                t0 = time.monotonic()
                engine.save_checkpoint(args.ckpt, tag=f"final-{step:08d}")
                print(f"FINAL step={step} seconds={time.monotonic() - t0:.3f}", flush=True)
                engine.close()
                return
            if step == args.steps:
                break
    state = {k: v.contiguous() for k, v in engine.state_dict().items()}
    if rank == 0:
        save_file(state, args.out)
    print(f"DONE step={engine.global_step}", flush=True)
    engine.close()


if __name__ == "__main__":
    main()
