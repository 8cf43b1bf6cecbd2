"""``longboat.horovod.torch``: Adasum against the published rule on known vectors, the
collectives at 2 ranks, a Horovod-style script under ``longboat run -n 2`` against the same
training under ``replicate`` ([Note: Horovod API], [Note: Adasum]), and ``hvd.join()`` with one
rank 3 batches short against a plain PyTorch loop ([Note: Horovod join])."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import harness
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from longboat.horovod import adasum

SCRIPTS = Path(__file__).parent / "launch_scripts"
sys.path.insert(0, str(SCRIPTS))  # the pool's ranks import the join script's train() too
import horovod_join  # noqa: E402


def test_adasum_follows_the_published_rule_on_known_vectors():
    a, b = torch.tensor([1.0, 0.0]), torch.tensor([1.0, 1.0])
    # a.b = 1, |a|^2 = 1, |b|^2 = 2: (1 - 1/2) a + (1 - 1/4) b
    assert torch.allclose(adasum.pair(a, b), torch.tensor([1.25, 0.75]))
    e1, e2 = torch.tensor([3.0, 0.0, 0.0]), torch.tensor([0.0, -2.0, 0.0])
    assert torch.equal(adasum.pair(e1, e2), e1 + e2)  # orthogonal: summed
    v = torch.tensor([0.5, -1.5, 2.0])
    assert torch.allclose(adasum.pair(v, v), v)  # equal: averaged
    assert torch.allclose(adasum.pair(v, -v), torch.zeros(3))  # opposite: cancelled
    assert torch.equal(adasum.pair(torch.zeros(3), v), v)  # a zero gradient adds nothing
    g = [torch.randn(5, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    want = adasum.pair(adasum.pair(g[0], g[1]), adasum.pair(g[2], g[3]))
    assert torch.equal(adasum.tree(g), want)  # ranks 0+1 and 2+3, then the two
    with pytest.raises(ValueError, match="power-of-two"):
        adasum.tree(g[:3])


def _collectives() -> dict:
    import longboat.horovod.torch as hvd

    hvd.init()
    r = hvd.rank()
    x = torch.tensor([1.0, 2.0]) * (r + 1)
    out = {
        "size": hvd.size(),
        "local": [hvd.local_rank(), hvd.local_size(), hvd.cross_rank(), hvd.cross_size()],
        "average": hvd.allreduce(x).tolist(),
        "sum": hvd.allreduce(x, op=hvd.Sum).tolist(),
        "fp16": hvd.allreduce(x, op=hvd.Sum, compression=hvd.Compression.fp16).tolist(),
        "adasum": hvd.allreduce(x if r == 0 else torch.tensor([0.0, 3.0]), op=hvd.Adasum).tolist(),
        "gather": hvd.allgather(torch.full((r + 1, 2), float(r))).tolist(),
        "broadcast": hvd.broadcast(x, root_rank=1).tolist(),
        # rank 0 sends 1 row to itself and 2 to rank 1; rank 1 sends 2 and 1
        "alltoall": hvd.alltoall(
            torch.arange(3.0) + 10 * r, torch.tensor([1, 2] if r == 0 else [2, 1])
        ).tolist(),
        "object": hvd.broadcast_object({"from": r}, root_rank=0),
    }
    return out


def test_the_collectives_at_two_ranks(ranks):
    got = ranks(2, _collectives)
    for r, out in enumerate(got):
        assert out["size"] == 2 and out["local"] == [r, 2, 0, 1]
        assert out["average"] == [1.5, 3.0] and out["sum"] == [3.0, 6.0] == out["fp16"]
        # [1, 2] and [0, 3]: a.b = 6, |a|^2 = 5, |b|^2 = 9 -> 0.4 a + (2/3) b
        assert out["adasum"] == pytest.approx([0.4, 2.8])
        assert out["gather"] == [[0.0, 0.0], [1.0, 1.0], [1.0, 1.0]]
        assert out["broadcast"] == [2.0, 4.0]
        assert out["object"] == {"from": 0}
    assert got[0]["alltoall"] == [0.0, 10.0, 11.0] and got[1]["alltoall"] == [1.0, 2.0, 12.0]


def _script(*flags: str) -> dict:
    res = harness.longboat_run("-n", "2", str(SCRIPTS / "horovod_style.py"), *flags)
    assert res.returncode == 0, res.stdout
    line = next(ln for ln in res.stdout.splitlines() if '"losses"' in ln)
    return json.loads(line.split("]: ", 1)[-1])


def test_a_horovod_style_script_trains_as_replicate_does():
    hvd, rep = _script(), _script("--replicate")
    assert len(hvd["losses"]) == 6
    for a, b in zip(hvd["losses"], rep["losses"], strict=True):
        assert abs(a - b) <= 1e-5 * abs(b), (hvd["losses"], rep["losses"])
    for k, v in rep["params"].items():
        got, want = torch.tensor(hvd["params"][k]), torch.tensor(v)
        assert (got - want).abs().max() <= 1e-5 * want.abs().max(), k


def _join_reference(size: int, batches: int, short: int, bpps: int) -> dict:
    """Plain PyTorch, one model: in each round (one optimizer step of the Horovod script) the
    gradient is the sum over the ranks that still have batches of their round's gradients,
    divided by all ``size`` ranks (Horovod's Average while ranks have joined: their zeros
    count); the direct allreduce of each rank's round loss is divided by ``size`` too."""
    torch.manual_seed(0)  # rank 0's initialisation, which the script broadcasts
    model = nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1 * size, momentum=0.9)
    counts = [batches - 3 if r == short else batches for r in range(size)]
    losses: list[list[float]] = [[] for _ in range(size)]
    averaged = []
    for k in range(math.ceil(max(counts) / bpps)):
        opt.zero_grad()
        total = 0.0
        for r in range(size):
            for i in range(k * bpps, min((k + 1) * bpps, counts[r])):
                g = torch.Generator().manual_seed(1000 * r + i)
                x, y = torch.randn(5, 6, generator=g), torch.randint(0, 3, (5,), generator=g)
                loss = F.cross_entropy(model(x), y)
                (loss / size).backward()
                losses[r].append(loss.item())
                total += loss.item()
        opt.step()
        averaged.append(total / size)
    params = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"counts": counts, "losses": losses, "averaged": averaged, "params": params}


def _check_join(got: list[dict], size: int, short: int, bpps: int) -> None:
    want = _join_reference(size, 8, short, bpps)
    assert [out["rank"] for out in got] == list(range(size))
    for r, out in enumerate(got):
        assert len(out["losses"]) == want["counts"][r]
        for a, b in zip(out["losses"], want["losses"][r], strict=True):
            assert abs(a - b) <= 1e-5 * abs(b), (r, out["losses"], want["losses"][r])
        rounds = math.ceil(want["counts"][r] / bpps)
        for a, b in zip(out["averaged"], want["averaged"][:rounds], strict=True):
            assert abs(a - b) <= 1e-5 * abs(b), (r, out["averaged"], want["averaged"])
        # the ranks with all their batches join together, after the short one: the highest
        assert out["last"] == max(q for q in range(size) if q != short)
        for k, v in want["params"].items():
            t = torch.tensor(out["params"][k])
            assert (t - v).abs().max() <= 1e-5 * v.abs().max(), (r, k)


def _join_rank(short: int, bpps: int) -> dict:
    return horovod_join.train(8, short, bpps)


@pytest.mark.parametrize(("size", "short", "bpps"), [(2, 1, 2), (4, 2, 1), (4, 0, 2)])
def test_join_with_one_rank_three_batches_short_trains_as_plain_pytorch(ranks, size, short, bpps):
    _check_join(ranks(size, _join_rank, short, bpps), size, short, bpps)


def test_a_horovod_style_script_with_join_under_longboat_run():
    script = str(SCRIPTS / "horovod_join.py")
    res = harness.longboat_run("-n", "2", script, "--short", "0", "--bpps", "1")
    assert res.returncode == 0, res.stdout
    lines = [ln.split("]: ", 1)[-1] for ln in res.stdout.splitlines() if '"losses"' in ln]
    got = sorted((json.loads(ln) for ln in lines), key=lambda out: out["rank"])
    _check_join(got, 2, 0, 1)


def test_a_script_without_shutdown_leaves_the_group_before_the_interpreter_ends():
    """``hvd.init`` registers leaving for the exit, as Horovod does: gloo's threads are gone
    when the interpreter shuts down (left running, they can abort a finished rank)."""
    res = harness.longboat_run("-n", "2", str(SCRIPTS / "horovod_no_shutdown.py"))
    assert res.returncode == 0, res.stdout
    assert res.stdout.count("STEPPED") == 2, res.stdout
    left = re.findall(r"GLOO_THREADS_AT_EXIT (\d+)", res.stdout)
    assert left == ["0", "0"], res.stdout


def _allgather_while_joined() -> str:
    import longboat.horovod.torch as hvd

    hvd.init()
    if hvd.rank() == 1:
        return f"joined, last {hvd.join()}"
    try:
        hvd.allgather(torch.zeros(2, 1))
    except RuntimeError as e:
        return f"{e}; last {hvd.join()}"
    return "no error"


def test_a_collective_a_joined_rank_cannot_take_part_in_fails_on_the_active_ranks(ranks):
    """The active rank gets the error; the joined one goes on serving until rank 0 joins."""
    message, joined = ranks(2, _allgather_while_joined)
    assert "called hvd.join()" in message and "[1]" in message, message
    assert message.endswith("; last 0") and joined == "joined, last 0", (message, joined)


def _elastic(*flags: str, crash_at: int = -1) -> dict:
    script = str(SCRIPTS / "horovod_elastic.py")
    res = harness.longboat_run("-n", "2", *flags, script, "--crash-at", str(crash_at))
    assert res.returncode == 0, res.stdout
    lines = [ln for ln in res.stdout.splitlines() if '"ran"' in ln]
    return json.loads(lines[-1].split("]: ", 1)[-1])


def test_horovod_elastic_resumes_from_the_last_commit_after_a_restart():
    """Rank 1 dies after batch 12 on the first attempt; the restart resumes from the commit at
    batch 10 (model, momentum and the batch counter) and ends where an uninterrupted run ends."""
    # The uninterrupted run through Horovod's own command line: horovodrun -np 2 python ...
    script = str(SCRIPTS / "horovod_elastic.py")
    res = subprocess.run(
        [sys.executable, "-m", "longboat.cli", "horovodrun", "-np", "2", "python", script],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    line = next(ln for ln in res.stdout.splitlines() if '"ran"' in ln)
    whole = json.loads(line.split("]: ", 1)[-1])
    resumed = _elastic("--max-restarts", "1", crash_at=12)
    assert whole["ran"] == list(range(20))
    assert resumed["attempt"] == 1 and resumed["ran"] == list(range(10, 20))
    for k, v in whole["params"].items():
        assert torch.equal(torch.tensor(resumed["params"][k]), torch.tensor(v)), k


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["-np", "5", "-H", "a:2,b:2", "python", "x.py"], "-np 5 is more than the 4 slots"),
        (["-np", "2", "--mpi", "python", "x.py"], "--mpi: longboat runs on gloo"),
        (["-np", "2", "python", "-m", "pkg"], "longboat runs Python scripts"),
        (["-np", "2", "--host-discovery-script", "d.sh", "python", "x.py"], "fixed hosts"),
    ],
)
def test_horovodrun_usage_errors_exit_2(args, named):
    res = subprocess.run(
        [sys.executable, "-m", "longboat.cli", "horovodrun", *args],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert res.returncode == 2 and named in res.stderr, res.stderr


def test_horovodrun_places_ranks_in_slot_order():
    from longboat.cli.horovodrun import _fill
    from longboat.launch.hosts import parse_host_list

    assert _fill(parse_host_list("a:2,b:2,c:4"), 5) == "a:2,b:2,c:1"
    assert _fill(parse_host_list("a:4"), 2) == "a:2"
