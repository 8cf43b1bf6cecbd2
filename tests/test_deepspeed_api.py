"""``longboat.deepspeed``: a DeepSpeed-style script under ``longboat run -n 2`` trains exactly
as the same run through ``longboat.initialize`` ([Note: DeepSpeed call sites])."""

from __future__ import annotations

import json
from pathlib import Path

import harness

SCRIPTS = Path(__file__).parent / "launch_scripts"
DS_CONFIG = {
    "train_batch_size": 16,
    "gradient_accumulation_steps": 2,
    "steps_per_print": 10,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
    "gradient_clipping": 1.0,
    "zero_optimization": {"stage": 2, "overlap_comm": True, "contiguous_gradients": True},
}


def _run(tmp_path: Path, *flags: str) -> dict:
    tmp_path.mkdir()
    cfg = tmp_path / "ds_config.json"
    cfg.write_text(json.dumps(DS_CONFIG))
    script = str(SCRIPTS / "deepspeed_style.py")
    res = harness.longboat_run(
        "-n", "2", script, "--deepspeed", "--deepspeed_config", str(cfg),
        "--checkpoints", str(tmp_path / "ckpt"), *flags,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout
    line = next(ln for ln in res.stdout.splitlines() if '"losses"' in ln)
    return json.loads(line.split("]: ", 1)[-1])


def test_a_deepspeed_style_script_trains_as_longboat_initialize_does(tmp_path):
    ds = _run(tmp_path / "ds")
    plain = _run(tmp_path / "plain", "--plain-longboat")
    # 128 samples / (2 ranks x micro-batch 4) = 16 micro-steps, 8 optimizer steps
    assert len(ds["losses"]) == len(plain["losses"]) == 16
    assert ds["losses"] == plain["losses"] and ds["digest"] == plain["digest"]
    # DeepSpeed's answers: its tag, the client state back, the batch triple, the stage
    assert ds["loaded"] == {
        "tag": "global_step8",
        "client": {"epoch": 1},
        "steps": 8,
        "lr": [1e-2],
        "batch": [16, 4, 2],
        "stage": 2,
    }


def _train_batch_against_backward_step(cfg: dict, directory: str) -> dict:
    import torch
    import torch.nn.functional as F
    from torch.utils.data import TensorDataset

    import longboat.deepspeed as deepspeed

    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(64, 20, generator=g), torch.randint(0, 5, (64,), generator=g))

    def build() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(20, 16), torch.nn.ReLU(), torch.nn.Linear(16, 5))

    a, _, loader_a, _ = deepspeed.initialize(model=build(), config=cfg, training_data=data)
    for x, y in loader_a:
        a.backward(F.cross_entropy(a(x), y))
        a.step()
    b, _, loader_b, _ = deepspeed.initialize(model=build(), config=cfg, training_data=data)
    it = iter(loader_b)
    means = [b.train_batch(it, F.cross_entropy).item() for _ in range(b.global_steps, 4)]
    missing = b.load_checkpoint(directory)
    same = all(
        torch.equal(p, q) for p, q in zip(a.module.parameters(), b.module.parameters(), strict=True)
    )
    out = {"steps": [a.global_steps, b.global_steps], "same": same, "means": len(means)}
    out["missing"] = list(missing)
    a.destroy()
    b.destroy()
    return out


def test_train_batch_is_a_whole_step_and_a_missing_checkpoint_is_none_none(ranks, tmp_path):
    cfg = {**DS_CONFIG, "zero_optimization": {"stage": 1}}
    for r in ranks(2, _train_batch_against_backward_step, cfg, str(tmp_path / "none")):
        # 64 samples / 16 per step: 4 steps, whether micro-batch by micro-batch or by train_batch
        assert r == {"steps": [4, 4], "same": True, "means": 4, "missing": [None, None]}
