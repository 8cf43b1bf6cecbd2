"""Real DeepSpeed configs (``tests/fixtures/deepspeed_configs``, each file's source in its
``SOURCES.json``) judged by longboat as DeepSpeed judges them at world size 2
(``verdicts.json``, recorded by ``record_verdicts.py`` with DeepSpeed itself): a config DeepSpeed
accepts is accepted with the same batch triple and ZeRO stage, one it refuses is refused with a
message that names a key of the file. ``DIFFERENT`` lists, with the reason, the configs where
longboat's verdict cannot be DeepSpeed's; nothing else may differ."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from longboat.config import ConfigError, load_config
from longboat.config.batch import resolve_batch

CORPUS = Path(__file__).parent / "fixtures" / "deepspeed_configs"
RECORD = json.loads((CORPUS / "verdicts.json").read_text())
VERDICTS: dict[str, dict[str, Any]] = RECORD["verdicts"]
SOURCES: dict[str, dict[str, str]] = json.loads((CORPUS / "SOURCES.json").read_text())

# file -> why longboat refuses a config DeepSpeed accepts (a feature it does not have, asked for)
DIFFERENT: dict[str, str] = {}
# A refusal may name a key the file lacks: the batch size DeepSpeed requires.
REQUIRED = {"train_batch_size", "train_micro_batch_size_per_gpu"}


def _keys(data: Mapping[str, Any], prefix: str = "") -> set[str]:
    out = set()
    for k, v in data.items():
        out |= {k, f"{prefix}{k}"}
        if isinstance(v, Mapping):
            out |= _keys(v, f"{prefix}{k}.")
    return out


def _longboat(data: dict[str, Any]) -> dict[str, Any]:
    try:
        cfg = load_config(data)
        batch = resolve_batch(cfg.batch, RECORD["world_size"])
    except ConfigError as e:
        return {"accepted": False, "error": str(e)}
    return {
        "accepted": True,
        "train_batch_size": batch.train_batch_size,
        "micro_batch_size": batch.micro_batch_size,
        "gradient_accumulation_steps": batch.gradient_accumulation_steps,
        "zero_stage": cfg.zero.stage if cfg.strategy == "zero" else 0,
    }


def test_every_file_has_its_source_and_deepspeeds_verdict():
    files = {f.name for f in CORPUS.glob("*.json")} - {"SOURCES.json", "verdicts.json"}
    assert files == set(VERDICTS) == set(SOURCES)
    assert len(files) >= 23
    for name, src in SOURCES.items():
        assert src["repo"] and src["path"] and len(src["commit"]) == 40, name


@pytest.mark.parametrize("name", sorted(VERDICTS))
def test_longboat_judges_each_config_as_deepspeed_does(name):
    data = json.loads((CORPUS / name).read_text())
    want, got = VERDICTS[name], _longboat(data)
    if name in DIFFERENT:
        assert want["accepted"] and not got["accepted"], (name, got)
        return
    if want["accepted"]:
        assert got == want, (name, got.get("error"), want)
    else:
        assert not got["accepted"], (name, want["error"])
        named = [k for k in _keys(data) | REQUIRED if f"'{k}'" in got["error"]]
        assert named, (name, got["error"])


def test_the_counts_accepted_are_deepspeeds():
    accepted = sum(v["accepted"] for v in VERDICTS.values())
    ours = sum(_longboat(json.loads((CORPUS / n).read_text()))["accepted"] for n in VERDICTS)
    assert ours == accepted - len(DIFFERENT)
