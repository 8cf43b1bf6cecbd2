"""Running one script under real DeepSpeed and under longboat at once, for the side-by-side
tests (marker ``deepspeed_compare``): tests/test_deepspeed_side_by_side.py and
tests/test_deepspeed_pipe_side_by_side.py.

Real DeepSpeed is looked for in ``.deepspeed/`` at the repository's root, where ``make test``
installs it (``make deepspeed-compare``; DeepSpeed alone, ``--no-deps``, so that it never brings
another torch: its light dependencies are the ``deepspeed-compare`` extra), or in the folder
``LONGBOAT_DEEPSPEED_PATH`` names. Only the DeepSpeed run has it on its ``PYTHONPATH``, by its
resolved path: DeepSpeed's CPU accelerator builds its shared-memory collective (used for
inference only) with the C++ compiler on its first run, where it finds one, cached in
``~/.cache/torch_extensions`` under a build file that names the sources' path, so the same
installation reached by another path (a link to it from another checkout) would build it again.
Without a compiler it goes on without it. Both sides start together; each writes
``OUT/rank<N>.json``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
VERSION = "0.19.8"
TOL = 1e-5  # fp32; the two engines add the same gradients in a different order


def deepspeed_home() -> Path | None:
    """The folder holding DeepSpeed VERSION (not imported here: that takes seconds)."""
    home = Path(os.environ.get("LONGBOAT_DEEPSPEED_PATH", ROOT / ".deepspeed")).resolve()
    found = (home / "deepspeed" / "__init__.py").is_file()
    return home if found and (home / f"deepspeed-{VERSION}.dist-info").is_dir() else None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _start(cmd: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    # A session of its own, so that a hang kills the launcher's ranks too: they hold its
    # output pipe, and a second communicate() would wait for them forever.
    return subprocess.Popen(
        cmd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def _finish(proc: subprocess.Popen[str], name: str, out: Path) -> list[dict]:
    # A guard against a hang, not a time limit: the ZeRO-0..3 script runs a dozen engines one
    # after another (about a minute on an idle 2-core machine, over four when it is shared).
    try:
        log, _ = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # the launcher and every rank it started
        try:
            log, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            log = "(no output: the pipe stayed open after the kill)"
        pytest.fail(f"{name} timed out:\n{log[-4000:]}")
    assert proc.returncode == 0, f"{name} failed:\n{log[-4000:]}"
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def run_both(script: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    """``script OUT`` under torchrun with real DeepSpeed (``DS_IMPL=deepspeed``, CPU) and under
    ``longboat run -n 2``, started together: each side's ranks' records, in rank order. Skips,
    saying how to install it, where DeepSpeed is not installed."""
    home = deepspeed_home()
    if home is None:
        pytest.skip(
            f"real DeepSpeed {VERSION} is not installed: `make deepspeed-compare` puts it in "
            ".deepspeed/ (or set LONGBOAT_DEEPSPEED_PATH to a folder made with `pip install "
            f"--no-deps --target DIR deepspeed=={VERSION}` and `pip install -e "
            "'.[deepspeed-compare]'`)"
        )
    base = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    ours = str(ROOT / "src")
    ds_out, lb_out = tmp_path_factory.mktemp("deepspeed"), tmp_path_factory.mktemp("longboat")
    ds_env = {
        **base,
        "DS_IMPL": "deepspeed",
        "DS_ACCELERATOR": "cpu",
        "PYTHONPATH": os.pathsep.join([str(home), ours]),
    }
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    ds = _start([*torchrun, "--master-port", str(_free_port()), str(script), str(ds_out)], ds_env)
    lb_env = {**base, "PYTHONPATH": ours}
    lb = _start(
        [sys.executable, "-m", "longboat.cli", "run", "-n", "2", str(script), str(lb_out)], lb_env
    )
    return {
        "deepspeed": _finish(ds, "DeepSpeed", ds_out),
        "longboat": _finish(lb, "longboat", lb_out),
    }


def close(a: list[float], b: list[float]) -> None:
    """Equal within fp32's ``TOL``, element by element."""
    assert len(a) == len(b)
    assert a == pytest.approx(b, rel=TOL, abs=TOL)
