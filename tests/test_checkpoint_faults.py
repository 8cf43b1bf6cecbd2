"""Fault tests 6, 7, 9 and 13 of RELIABILITY.md for checkpoints, plus the save-side errors.

6: a crash in each phase of a save leaves the previous checkpoint loadable, exactly, and the
   partial one ignored. 7: truncated, bit-flipped or missing files are refused, naming the file
   and its checksum, before anything is loaded. 9: another model's checkpoint, and one whose two
   same-shaped layers were swapped, are refused. 13: crafted pickles wherever longboat reads are
   never executed.
"""

from __future__ import annotations

import json
import os
import pickle
import struct
from pathlib import Path

import ckpt_helpers as h
import pytest
import reference
import torch

from longboat import checkpoint
from longboat.checkpoint import CheckpointError, CheckpointNotFoundError


class Crash(BaseException):
    """Stands for the process dying: not an Exception, so no cleanup code runs for it."""


def _snapshot(engine) -> dict:
    return {k: v.detach().clone() for k, v in engine.state_dict().items()}


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# -- 6: a crash in each phase of a save --------------------------------------------------------


def _crash_in_phase(ckpt: str, layout: str, world: int, phase: str) -> dict:
    engine = h.build(h.config(layout, world))
    h.train(engine, 2, ckpt, save_at=(2,), noise=False)  # the previous, complete checkpoint
    at_2 = _snapshot(engine)
    h.train(engine, 4, noise=False)
    at_4 = _snapshot(engine)

    def die(name: str) -> None:
        if name == phase:
            raise Crash(name)

    with pytest.raises(Crash):
        checkpoint.save(engine, ckpt, on_phase=die)
    engine.close()
    restarted = h.build(h.config(layout, world))  # a fresh process would do just this
    entries = sorted(os.listdir(ckpt))  # after build: its broadcast waits for rank 0's crash
    loaded = restarted.load_checkpoint(ckpt)
    state = _snapshot(restarted)
    restarted.close()
    return {
        "step": loaded.step,
        "entries": entries,
        "equal_2": _equal(state, at_2),
        "equal_4": _equal(state, at_4),
    }


@pytest.mark.parametrize("phase", checkpoint.PHASES)
@pytest.mark.parametrize(("layout", "world"), [("single", 1), ("zero2", 2)])
def test_crash_in_each_save_phase_leaves_previous_checkpoint(ranks, tmp_path, phase, layout, world):
    results = ranks(world, _crash_in_phase, str(tmp_path), layout, world, phase)
    for res in results:
        if phase == "latest_moved":  # the new checkpoint was complete and published
            assert res["step"] == 4 and res["equal_4"], res
            continue
        assert res["step"] == 2 and res["equal_2"], res  # exactly the previous one
        partial = [e for e in res["entries"] if e not in ("latest", "step-00000002")]
        # Before the rename the new one is a .tmp- directory; after it, a complete directory
        # that 'latest' does not name yet. Either way it is not what loads.
        assert len(partial) == 1, res["entries"]
        assert partial[0].startswith(".tmp-") == (phase != "renamed"), res["entries"]
    # The next save succeeds and clears what the crash left behind.
    engine = h.build(h.config("single", 1))
    engine.save_checkpoint(tmp_path, tag="after")
    engine.close()
    assert not [e for e in os.listdir(tmp_path) if e.startswith(".")]


# -- 7: damaged files ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def good(ranks, tmp_path_factory) -> Path:
    """A zero-2 checkpoint written at 2 ranks (tag step-00000003)."""
    d = tmp_path_factory.mktemp("good")
    ranks(2, h.run, "zero2", 2, 3, str(d), (3,), noise=False)
    return d / "step-00000003"


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def _try_load(ckpt: str, world: int) -> str:
    """Load at ``world`` ranks; the error message (or '' if it loaded), and whether the model
    was left untouched."""
    engine = h.build(h.config("zero1", world))
    before = _snapshot(engine)
    try:
        engine.load_checkpoint(ckpt, "t")
    except CheckpointError as e:
        untouched = _equal(before, _snapshot(engine))
        engine.close()
        return f"{e}" if untouched else f"MODEL TOUCHED: {e}"
    engine.close()
    return ""


def _flip(path: Path, offset_from_end: int) -> None:
    data = bytearray(path.read_bytes())
    data[-offset_from_end] ^= 0x01
    path.write_bytes(bytes(data))


DAMAGE = {
    "bit flip in tensor data": (
        "rank-00001.safetensors",
        lambda p: _flip(p, 5),
        ["rank-00001.safetensors", "SHA-256", "tensors affected"],
    ),
    "truncated tensor file": (
        "rank-00000.safetensors",
        lambda p: p.write_bytes(p.read_bytes()[:-100]),
        ["rank-00000.safetensors", "bytes", "SHA-256"],
    ),
    "missing tensor file": (
        "rank-00001.safetensors",
        lambda p: p.unlink(),
        ["rank-00001.safetensors", "missing"],
    ),
    "missing rank state": ("rank-00000.json", lambda p: p.unlink(), ["rank-00000.json", "missing"]),
    "bit flip in state": ("state.json", lambda p: _flip(p, 3), ["state.json", "SHA-256"]),
    "bit flip in manifest": ("manifest.json", lambda p: _flip(p, 40), ["manifest.json"]),
}


@pytest.mark.parametrize("case", list(DAMAGE))
def test_damaged_files_are_refused_by_name_before_loading(ranks, good, tmp_path, case):
    file, damage, expected = DAMAGE[case]
    ckpt = _copy(good, tmp_path / "t")
    damage(ckpt / file)
    for msg in ranks(2, _try_load, str(tmp_path), 2):  # every rank refuses, none hangs
        assert msg and not msg.startswith("MODEL TOUCHED"), msg
        for word in expected:
            assert word in msg, msg


def test_intact_copy_loads(ranks, good, tmp_path):
    _copy(good, tmp_path / "t")
    assert ranks(2, _try_load, str(tmp_path), 2) == ["", ""]


# -- 9: another model, swapped layers -----------------------------------------------------------


def _load_into(ckpt: str, model: torch.nn.Module) -> str:
    import longboat

    engine = longboat.initialize(
        model, torch.optim.AdamW(model.parameters()), {**h.QUIET, "batch": {"micro_batch_size": 4}}
    )
    try:
        engine.load_checkpoint(ckpt, "t")
    except CheckpointError as e:
        return str(e)
    finally:
        engine.close()
    return ""


def test_another_models_checkpoint_is_refused_by_fingerprint(good, tmp_path):
    _copy(good, tmp_path / "t")
    msg = _load_into(str(tmp_path), reference.TiedNet())
    assert (
        "another model" in msg and "'inp.weight' is in the checkpoint but not in the model" in msg
    ), msg
    msg = _load_into(str(tmp_path), reference.TinyNet(d_hidden=16))
    assert "'mid.weight': checkpoint float32[24, 24], model float32[16, 16]" in msg, msg


def test_a_different_tying_is_refused_by_fingerprint(good, tmp_path):
    _copy(good, tmp_path / "t")
    model = reference.TinyNet()
    model.frozen.weight = model.mid.weight  # same names and shapes, one tensor shared
    msg = _load_into(str(tmp_path), model)
    assert "'frozen.weight': tied to None in the checkpoint, to 'mid.weight'" in msg, msg


def _swap_tensors(path: Path, a: str, b: str) -> None:
    """Swap two same-sized tensors of a safetensors file by exchanging their header entries:
    the file stays valid safetensors, each name now points at the other's bytes."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    header[a]["data_offsets"], header[b]["data_offsets"] = (
        header[b]["data_offsets"],
        header[a]["data_offsets"],
    )
    text = json.dumps(header, separators=(",", ":")).encode().ljust(n)
    path.write_bytes(raw[:8] + text + raw[8 + n :])


def test_swapped_same_shaped_layers_are_refused(tmp_path):
    """mid.weight and frozen.weight are both 24x24: swapping them inside the checkpoint keeps
    every name, shape and dtype (so the fingerprint cannot see it); the file's SHA-256 and the
    two tensors' own SHA-256 in the manifest refuse it, naming both."""
    engine = h.build(h.config("single", 1))
    engine.save_checkpoint(tmp_path, tag="t")
    engine.close()
    tfile = tmp_path / "t" / "rank-00000.safetensors"
    _swap_tensors(tfile, "model:mid.weight", "model:frozen.weight")
    from safetensors.torch import load_file

    assert load_file(tfile)["model:mid.weight"].shape == (24 * 24,)  # still a valid file
    msg = _load_into(str(tmp_path), reference.TinyNet())
    assert "rank-00000.safetensors" in msg and "SHA-256" in msg, msg
    assert "model of 'mid.weight'" in msg and "model of 'frozen.weight'" in msg, msg


# -- 13: crafted pickles ------------------------------------------------------------------------


class _Payload:
    def __init__(self, sentinel: Path) -> None:
        self.sentinel = sentinel

    def __reduce__(self):  # unpickling this runs: open(sentinel, "w")
        return (open, (str(self.sentinel), "w"))


def test_crafted_pickles_are_never_executed(tmp_path, good):
    sentinel = tmp_path / "PWNED"
    evil = pickle.dumps(_Payload(sentinel))
    torch_evil = tmp_path / "evil.pt"
    torch.save({"x": _Payload(sentinel)}, torch_evil)
    assert not sentinel.exists()

    cases = {}
    # A pickle as the manifest, the pointer, the tensor file, the state.
    for name in ("manifest.json", "rank-00000.safetensors", "state.json", "rank-00000.json"):
        d = tmp_path / name.replace(".", "_")
        _copy(good, d / "t")
        (d / "t" / name).write_bytes(evil)
        cases[name] = d
    latest = tmp_path / "latest_case"
    latest.mkdir()
    (latest / "latest").write_bytes(evil)
    # torch's own formats dropped into an intact checkpoint: longboat never opens them.
    planted = tmp_path / "planted"
    _copy(good, planted / "t")
    for name in ("model.pt", "mp_rank_00_model_states.pt", ".metadata", "__0_0.distcp"):
        (planted / "t" / name).write_bytes(torch_evil.read_bytes() if name.endswith("pt") else evil)
    # A pickle as state.json with the manifest rewritten to match it (checksums and all).
    forged = tmp_path / "forged"
    _copy(good, forged / "t")
    (forged / "t" / "state.json").write_bytes(evil)
    _rewrite_manifest(forged / "t")

    for name, d in cases.items():
        assert "MODEL TOUCHED" not in _try_load(str(d), 1) != "", name
    engine = h.build(h.config("single", 1))
    with pytest.raises(CheckpointNotFoundError):
        engine.load_checkpoint(latest)
    with pytest.raises(CheckpointError, match="not valid JSON"):
        engine.load_checkpoint(forged, "t")
    assert engine.load_checkpoint(planted, "t").step == 3
    engine.close()
    from longboat.checkpoint.inspect import consolidate, describe

    for d in cases.values():
        with pytest.raises(CheckpointError):
            consolidate(d / "t", tmp_path / "out.safetensors")
        assert not describe(d / "t").verified  # reports what is wrong, never unpickles
    consolidate(forged / "t", tmp_path / "out.safetensors")  # needs no state.json
    assert describe(forged / "t").verified  # the forgery is consistent, yet only JSON-parsed
    assert not sentinel.exists(), "a pickle was executed"


def _rewrite_manifest(path: Path) -> None:
    import hashlib

    from longboat.checkpoint.manifest import _digest

    m = json.loads((path / "manifest.json").read_bytes())
    for f, rec in m["files"].items():
        data = (path / f).read_bytes()
        rec["sha256"], rec["bytes"] = hashlib.sha256(data).hexdigest(), len(data)
    body = {k: v for k, v in m.items() if k != "checksum"}
    m["checksum"] = _digest(body)
    (path / "manifest.json").write_text(json.dumps(m))


# -- errors of saving and finding ----------------------------------------------------------------


def _save_with_tag(ckpt: str, bad_rank: int | None) -> str:
    engine = h.build(h.config("replicate", 2))
    rank = torch.distributed.get_rank()
    tag = f"t{rank}" if bad_rank is not None else "same"
    directory = ckpt
    if bad_rank is None:  # rank 1 cannot write where it is asked to
        directory = os.path.join(ckpt, "a-file") if rank == 1 else ckpt
        Path(ckpt, "a-file").touch()
    try:
        engine.save_checkpoint(directory, tag=tag)
    except CheckpointError as e:
        return str(e)
    finally:
        engine.close()
    return ""


def test_ranks_disagreeing_on_the_tag_are_named(ranks, tmp_path):
    for msg in ranks(2, _save_with_tag, str(tmp_path), 1):
        assert "ranks disagree on the checkpoint tag (rank 0: 't0', rank 1: 't1')" in msg, msg
    assert not os.listdir(tmp_path)


def test_a_rank_failing_to_write_fails_the_save_on_every_rank(ranks, tmp_path):
    for msg in ranks(2, _save_with_tag, str(tmp_path), None):
        assert "was not saved (rank 1: " in msg and "previous checkpoint is untouched" in msg
    assert sorted(os.listdir(tmp_path)) == ["a-file"]  # the temporary directory was removed


def test_missing_checkpoint_is_an_error_unless_allowed(tmp_path):
    engine = h.build(h.config("single", 1))
    with pytest.raises(CheckpointNotFoundError, match="allow_missing=True"):
        engine.load_checkpoint(tmp_path / "nothing")
    assert engine.load_checkpoint(tmp_path / "nothing", allow_missing=True) is None
    engine.save_checkpoint(tmp_path, tag="a")
    with pytest.raises(CheckpointNotFoundError, match="checkpoint 'b'"):
        engine.load_checkpoint(tmp_path, "b")
    with pytest.raises(CheckpointError, match=r"tag '\.\./x' is invalid"):
        engine.save_checkpoint(tmp_path, tag="../x")
    engine.close()


def test_save_between_accumulation_boundaries_is_refused(tmp_path):
    engine = h.build(h.config("single", 1, batch={"train_batch_size": 12, "micro_batch_size": 6}))
    x, y = reference.dataset(6)[:]
    engine.backward(torch.nn.functional.cross_entropy(engine(x), y))
    with pytest.raises(CheckpointError, match="between accumulation boundaries"):
        engine.save_checkpoint(tmp_path)
    engine.close()


def test_client_state_must_be_json(tmp_path):
    engine = h.build(h.config("single", 1))
    with pytest.raises(CheckpointError, match=r"client_state'\]\['t'\] is a Tensor"):
        engine.save_checkpoint(tmp_path, tag="a", client_state={"t": torch.ones(1)})
    assert not os.listdir(tmp_path)
    engine.save_checkpoint(tmp_path, tag="a", client_state={"epoch": 3, "best": [0.5, None]})
    assert engine.load_checkpoint(tmp_path).client_state == {"epoch": 3, "best": [0.5, None]}
    engine.close()


def test_resume_with_an_incompatible_batch_is_refused_before_loading(tmp_path):
    """Fault test 11 (config part) at resume. Inconsistent batch configs themselves are refused
    before training by resolve_batch: tests/test_config.py::test_batch_triple_errors_name_values.
    """
    engine = h.build(h.config("single", 1))
    h.train(engine, 3, str(tmp_path), save_at=(3,), noise=False)  # 36 samples into epoch 0
    engine.close()
    engine = h.build({**h.config("single", 1), "batch": {"train_batch_size": 8}})
    before = _snapshot(engine)
    with pytest.raises(CheckpointError, match="36 samples into epoch 0"):
        engine.load_checkpoint(tmp_path)
    assert _equal(before, _snapshot(engine)) and engine.global_step == 0
    engine.close()


def test_keep_last_prunes_older_checkpoints(tmp_path):
    engine = h.build(h.config("single", 1, checkpoint={"keep_last": 2}))
    h.train(engine, 5, str(tmp_path), save_at=(1, 2, 3, 4, 5), noise=False)
    assert sorted(os.listdir(tmp_path)) == ["latest", "step-00000004", "step-00000005"]
    assert engine.load_checkpoint(tmp_path).step == 5
    engine.close()


def test_latest_pointing_nowhere_falls_back_to_newest_complete(tmp_path):
    engine = h.build(h.config("single", 1))
    h.train(engine, 2, str(tmp_path), save_at=(1, 2), noise=False)
    (tmp_path / "latest").write_text("step-00000099\n")
    assert engine.load_checkpoint(tmp_path).step == 2
    engine.close()
