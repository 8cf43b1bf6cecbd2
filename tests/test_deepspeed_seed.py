"""The DeepSpeed examples of a public tutorial (``shared/seeds/004_*.txt``, beside the repository)
run under ``longboat run -n 2`` with only their imports changed: ``import deepspeed`` becomes
``import longboat.deepspeed as deepspeed`` and ``from deepspeed.pipe import`` becomes ``from
longboat.deepspeed.pipe import`` (Python resolves a ``from`` import by the module's own name,
not by an alias bound in the script). The examples are read from the tutorial at run time, never
copied here; the test skips where the tutorial is not beside the repository.

What each example does is checked by lines appended to it (they print what the script computed);
nothing of the example itself is changed beyond the imports. The tutorial's scheduler example
is a fragment that uses ``torch`` and ``deepspeed`` without importing them: its test puts the two
imports in front of it, and changes nothing else. The tutorial's torchrun and DDP snippets are
not scripts (they call a ``setup`` with the wrong number of arguments, ``MyModel``, ``do_A``), so
there is nothing there to run as it is.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import harness
import pytest

SEED = Path(__file__).resolve().parents[2] / "shared" / "seeds" / "004_662b7d77e65fcd4a.txt"


def _example(start: str, end: str) -> str:
    """The tutorial's text from the line ``start`` (after ``after``) through the line ``end``."""
    if not SEED.is_file():
        pytest.skip(f"the tutorial {SEED} is not beside the repository")
    text = SEED.read_text()
    m = re.search(start + r".*?" + end + r"\n", text, flags=re.S)
    assert m is not None, f"the tutorial no longer holds {start!r} ... {end!r}"
    return m.group(0)


def _only_imports_changed(code: str) -> str:
    code, n = re.subn(
        r"^import deepspeed$", "import longboat.deepspeed as deepspeed", code, flags=re.M
    )
    assert n == 1, "the example imports deepspeed once"
    return re.sub(r"^from deepspeed\.", "from longboat.deepspeed.", code, flags=re.M)


def _run(tmp_path: Path, code: str, report: str) -> dict:
    script = tmp_path / "example.py"
    script.write_text(code + "\n# appended by the test: what the example computed\n" + report)
    res = harness.longboat_run("-n", "2", str(script), timeout=300)
    assert res.returncode == 0, res.stdout
    rows = [ln.split("]: ", 1)[-1] for ln in res.stdout.splitlines() if "REPORT " in ln]
    return {r["rank"]: r for r in (json.loads(ln.split("REPORT ", 1)[1]) for ln in rows)} | {
        "stdout": res.stdout
    }


def test_the_data_parallel_example_runs_with_its_import_changed(tmp_path):
    code = _example(
        r"import torch\nimport deepspeed\n\n# Define a simple", r"model_engine\.step\(\)"
    )
    out = _run(
        tmp_path,
        _only_imports_changed(code),
        "import json\n"
        "print('REPORT ' + json.dumps({'rank': model_engine.global_rank, "
        "'steps': model_engine.global_steps, 'world': model_engine.world_size, "
        "'batch': [model_engine.train_batch_size(), "
        "model_engine.train_micro_batch_size_per_gpu()]}), flush=True)\n",
    )
    # train_batch_size 64 over 2 ranks: micro-batches of 32, one optimizer step taken
    for rank in (0, 1):
        assert out[rank] == {"rank": rank, "steps": 1, "world": 2, "batch": [64, 32]}


def test_the_pipeline_example_runs_with_its_imports_changed(tmp_path):
    code = _example(
        r"import torch\nimport deepspeed\nfrom deepspeed\.pipe",
        r"    loss = model_engine\.train_batch\(\)",
    )
    out = _run(
        tmp_path,
        _only_imports_changed(code),
        "import json, math\n"
        "m = model_engine.module\n"
        "print('REPORT ' + json.dumps({'rank': model_engine.global_rank, "
        "'steps': model_engine.global_steps, 'held': m.held, "
        "'interval': m.activation_checkpoint_interval, "
        "'finite': math.isfinite(float(loss)), "
        "'params': sorted(n for n, _ in m.named_parameters())}), flush=True)\n",
    )
    # two stages of one layer each (uniform), 100 optimizer steps of 4 micro-batches each,
    # every layer recomputed in the backward (the config's activation_checkpoint_interval 1)
    want = {"steps": 100, "interval": 1, "finite": True}
    assert out[0] == {**want, "rank": 0, "held": [0], "params": ["0.fc.bias", "0.fc.weight"]}
    assert out[1] == {**want, "rank": 1, "held": [1], "params": ["1.fc.bias", "1.fc.weight"]}


def test_the_scheduler_example_runs_with_the_imports_it_lacks(tmp_path):
    code = _example(r"```python\nimport torch\.nn as nn", r"lr_scheduler\.step\(\)")
    code = "import torch\nimport longboat.deepspeed as deepspeed\n" + code.split("\n", 1)[1]
    out = _run(
        tmp_path,
        code,
        "import json\n"
        "print('REPORT ' + json.dumps({'rank': model_engine.global_rank, "
        "'steps': model_engine.global_steps, 'type': type(optimizer).__name__, "
        "'warming': 0.001 < optimizer.param_groups[0]['lr'] < 0.01}), flush=True)\n",
    )
    # the script's own torch.optim.Adam (the config's "Adam" would be AdamW, as in DeepSpeed),
    # stepped once, its learning rate on the config's WarmupLR's way up
    for rank in (0, 1):
        assert out[rank] == {"rank": rank, "steps": 1, "type": "Adam", "warming": True}
