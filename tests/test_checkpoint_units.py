"""Pieces of the checkpoint format tested alone, without processes: the tensor file writer
against the safetensors reader, the manifest's checks, who writes replicated tensors, and the
loader resuming mid-epoch at another world size."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from torch.utils.data import TensorDataset

from longboat.checkpoint.errors import CheckpointError
from longboat.checkpoint.fingerprint import ModelSpec
from longboat.checkpoint.manifest import Manifest, Shard, TensorEntry, read_manifest
from longboat.checkpoint.save import _where, assign_replicated
from longboat.checkpoint.tensorfile import checksum, write_tensors
from longboat.data import make_loader
from longboat.pieces import MODEL, Piece


def test_tensor_files_are_safetensors_with_per_tensor_checksums(tmp_path):
    tensors = [
        ("a", torch.randn(7)),
        ("b", torch.arange(5)),
        ("c", torch.randn(3).bfloat16()),
        ("d", torch.tensor([True, False])),
        ("e", torch.empty(0)),
        ("f", torch.randn(4, 3)[:, 1]),
    ]  # not contiguous: written from a copy
    rec = write_tensors(tmp_path / "x.safetensors", tensors)
    back = load_file(tmp_path / "x.safetensors")
    assert all(torch.equal(back[k], t) for k, t in tensors)
    assert checksum(tmp_path / "x.safetensors", per_tensor=True) == rec  # streaming agrees


def _manifest(tmp_path, shards) -> Manifest:
    spec = ModelSpec.of(torch.nn.Linear(2, 3, bias=False))
    entry = TensorEntry((3, 2), "float32", tuple(shards))
    return Manifest(
        "t",
        1,
        "zero-3",
        2,
        spec,
        spec.fingerprint,
        {"weight": {MODEL: entry}},
        {
            "rank-00000.safetensors": {"sha256": "0", "bytes": 1},
            "rank-00001.safetensors": {"sha256": "0", "bytes": 1},
        },
        0.0,
    )


def _write(tmp_path, m: Manifest, edit=None):
    data = m.to_json()
    if edit:
        edit(data)
        from longboat.checkpoint.manifest import _digest

        data["checksum"] = _digest({k: v for k, v in data.items() if k != "checksum"})
    (tmp_path / "manifest.json").write_text(json.dumps(data))
    return tmp_path / "manifest.json"


def test_manifest_round_trip_and_its_checks(tmp_path):
    halves = [
        Shard("rank-00000.safetensors", "k", 0, 3, "s"),
        Shard("rank-00001.safetensors", "k", 3, 6, "s"),
    ]
    m = _manifest(tmp_path, halves)
    assert read_manifest(_write(tmp_path, m)).tensors == m.tensors
    with pytest.raises(CheckpointError, match=r"elements \[3, 6\) of model of 'weight'"):
        read_manifest(_write(tmp_path, _manifest(tmp_path, halves[:1])))
    evil = [Shard("../../etc/passwd", "k", 0, 6, "s")]

    def escape(d):
        d["files"]["../../etc/passwd"] = {"sha256": "0", "bytes": 1}

    with pytest.raises(CheckpointError, match="not a plain file name"):
        read_manifest(_write(tmp_path, _manifest(tmp_path, evil), escape))
    path = _write(tmp_path, m)
    path.write_text(path.read_text().replace('"step": 1,', '"step": 2,'))
    with pytest.raises(CheckpointError, match="does not match its own checksum"):
        read_manifest(path)


def test_replicated_tensors_are_written_once_spread_over_ranks():
    pieces = [
        Piece(f"p{i}", MODEL, (n,), 0, n, torch.zeros(n), replicas=(0, 1))
        for i, n in enumerate([60, 100, 40])
    ]
    # Shards held alike by ranks 2 and 3 only (hybrid sharding's replicas): one of them.
    pieces += [
        Piece("q", MODEL, (100,), 50 * i, 50 * (i + 1), torch.zeros(50), replicas=(2, 3))
        for i in range(2)
    ]
    pieces.append(Piece("mine", MODEL, (5,), 0, 5, torch.zeros(5)))  # this rank's alone
    owner = assign_replicated(pieces)
    assert len(owner) == 5 and _where(pieces[-1]) not in owner
    load = [sum(p.tensor.numel() for p in pieces if owner.get(_where(p)) == r) for r in range(4)]
    assert load == [100, 100, 50, 50]  # largest first, each to the least loaded holder


def test_fingerprint_ignores_registration_order_but_not_tying():
    a, b = torch.nn.Sequential(), torch.nn.Sequential()
    a.add_module("x", torch.nn.Linear(3, 3))
    a.add_module("y", torch.nn.Linear(3, 3))
    b.add_module("y", torch.nn.Linear(3, 3))
    b.add_module("x", torch.nn.Linear(3, 3))
    assert ModelSpec.of(a).fingerprint == ModelSpec.of(b).fingerprint
    b.y.weight = b.x.weight
    assert ModelSpec.of(a).fingerprint != ModelSpec.of(b).fingerprint


def _epoch(world: int, state=None, skip_batches: int = 0) -> list[list[int]]:
    """Each rank's remaining micro-batches of epoch 1 (after ``state``, or after taking
    ``skip_batches`` of it)."""
    ds = TensorDataset(torch.arange(48))
    out = []
    for r in range(world):
        lo = make_loader(
            ds,
            rank=r,
            world_size=world,
            micro_batch_size=12 // world,
            train_batch_size=12,
            shuffle=True,
            seed=5,
            remainder="drop",
            announce=False,
        )
        lo.epoch = 1
        if state is not None:
            lo.load_state_dict(state)
        it = iter(lo)
        batches = [b[0].tolist() for b in it]
        out.append(batches[skip_batches:])
    return out


def test_loader_resumes_mid_epoch_at_another_world_size():
    ds = TensorDataset(torch.arange(48))
    lo = make_loader(
        ds,
        rank=0,
        world_size=2,
        micro_batch_size=6,
        train_batch_size=12,
        shuffle=True,
        seed=5,
        remainder="drop",
        announce=False,
    )
    lo.epoch = 1
    it = iter(lo)
    next(it), next(it)  # two steps of epoch 1 done
    state = lo.state_dict()
    assert state["epoch"] == 1 and state["samples"] == 24
    single_rest = _epoch(1, skip_batches=2)[0]
    for world in (1, 3, 4):
        shards = _epoch(world, state)
        assert all(len(s) == 2 for s in shards)  # the two steps left
        for t, batch in enumerate(single_rest):
            assert sorted(x for s in shards for x in s[t]) == sorted(batch)
