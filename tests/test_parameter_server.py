"""The parameter server against the plain PyTorch loop of ``reference.py``, and its modes,
faults and state."""

from __future__ import annotations

import signal
import socket
import threading
from pathlib import Path

import harness
import pytest
import reference

from longboat.ps import service

SCRIPTS = Path(__file__).parent / "launch_scripts"

STEPS = 6
GLOBAL_BATCH = 16


def _ps(servers: int = 1, mode: str = "sync", **more) -> dict:
    return {
        "strategy": "parameter_server",
        "parameter_server": {"servers": servers, "mode": mode, **more},
    }


@pytest.mark.parametrize(
    ("workers", "servers", "accum", "model", "optimizer", "update_on_server", "clip"),
    [
        # BatchNorm buffers, routed (conditionally used), never-used and frozen parameters:
        # a parameter no worker used must not move under AdamW (weight decay) on the servers
        # (and a weight tied across two modules: one entry of its key)
        (1, 1, 1, "zoo", "sgd", True, 0.0),
        (2, 1, 1, "zoo", "adamw", True, 0.0),
        (4, 2, 2, "zoo", "adamw", True, 0.0),
        # servers only average; the workers step, clip by the mean gradient's norm
        (2, 1, 1, "zoo", "adamw", False, 0.5),
    ],
)
def test_sync_equals_plain_pytorch(
    ranks, workers, servers, accum, model, optimizer, update_on_server, clip
):
    recipe = reference.Recipe(model=model, optimizer=optimizer, clip=clip)
    harness.run_and_compare(
        ranks,
        workers + servers,
        _ps(servers, update_on_server=update_on_server),
        recipe,
        STEPS,
        accum,
        GLOBAL_BATCH,
        tol=1e-5,
    )


def test_ssp_with_staleness_0_equals_plain_pytorch(ranks):
    # a worker may run no clock ahead: every pull waits for every worker's push, as in sync
    # (but without collectives between workers, each keeps its own BatchNorm statistics)
    recipe = reference.Recipe(model="zoo", optimizer="adamw")
    harness.run_and_compare(
        ranks,
        3,
        _ps(1, "ssp", staleness=0),
        recipe,
        STEPS,
        1,
        GLOBAL_BATCH,
        tol=1e-5,
        own_buffers=True,
    )


def _digits(cfg: dict, epochs: int) -> dict:
    import torch
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    from torch.utils.data import TensorDataset

    import longboat
    from longboat.models import DigitsCNN

    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x, dtype=torch.float32).view(-1, 1, 8, 8) / 16.0
    y = torch.tensor(y)
    # the default example's split (examples/digits.py)
    xtr, xte, ytr, yte = train_test_split(x, y, test_size=0.2, random_state=0, stratify=y)
    train, test = TensorDataset(xtr, ytr), (xte, yte)
    longboat.seed_everything(0)
    model = DigitsCNN()
    try:
        engine = longboat.initialize(model, torch.optim.AdamW(model.parameters(), lr=3e-3), cfg)
    except longboat.ps.ServerExit as served:
        return {"served": served.summary}
    for _ in range(epochs):
        for xb, yb in engine.loader(train):
            engine.backward(torch.nn.functional.cross_entropy(engine(xb), yb))
            engine.step()
    engine.eval()
    with torch.no_grad():
        accuracy = (engine(test[0]).argmax(1) == test[1]).float().mean().item()
    staleness = getattr(engine.strategy, "staleness", {})
    steps = engine.global_step
    engine.close()
    return {"accuracy": accuracy, "steps": steps, **staleness}


@pytest.mark.parametrize(("mode", "staleness"), [("async", 0), ("ssp", 2)])
def test_async_and_ssp_converge_on_digits(ranks, mode, staleness):
    cfg = {
        **harness.QUIET,
        **_ps(1, mode, staleness=staleness),
        "batch": {"train_batch_size": 64},
        "data": {"remainder": "drop"},
    }
    results = ranks(3, _digits, cfg, 10, timeout=300)
    workers, (server,) = results[:2], [r["served"] for r in results[2:]]
    for w in workers:
        # Chance is 0.1; a plain run reaches about 0.97. How stale each read is depends on the
        # machine's load, and on a loaded machine ssp-2 ended at 0.93 (once in four runs).
        assert w["accuracy"] >= 0.9, w
        assert w["max_staleness"] <= (staleness if mode == "ssp" else 10**9)
    # every push of every worker was applied: 2 workers x 22 steps x 10 epochs
    assert sum(w["pushes"] for w in server["workers"]) == 2 * workers[0]["steps"]
    assert not any(w["dead"] for w in server["workers"])


@pytest.mark.parametrize("writer", ["sync", "async"])
def test_checkpoint_reshards_to_replicate_and_back(ranks, tmp_path, writer):
    base = {**harness.QUIET, "batch": {"train_batch_size": 8}}
    ps = {**base, **_ps(1, writer)}
    saved = [r for r in ranks(3, harness.save_or_load, ps, str(tmp_path), 3) if "served" not in r]
    # the servers' AdamW state went into the checkpoint: replicate at 2 ranks reads it whole
    replicated = ranks(2, harness.save_or_load, {**base, "strategy": "replicate"}, str(tmp_path), 0)
    # and a parameter-server job (the other mode) takes it back onto its servers
    other = "async" if writer == "sync" else "sync"
    back = [
        r
        for r in ranks(3, harness.save_or_load, {**base, **_ps(1, other)}, str(tmp_path), 0)
        if "served" not in r
    ]
    # What the file holds, as replicate reads it whole. In sync mode it is what the workers
    # held at the save; in async mode the other worker's last pushes may land between the
    # save's fetch of the servers' state and the one taken to report it, so only the
    # parameters (fetched once, at the save) are compared with the writer's.
    want = harness.assemble(replicated[:1])
    assert any(k != "step" for v in want.values() for k in v), "no optimizer tensors saved"
    compared = [*replicated, *back, *(saved[:1] if writer == "sync" else [])]
    for res in compared:
        assert reference.max_rel_diff(res["state"], saved[0]["state"]) == 0.0
        got = harness.assemble([res])
        assert got.keys() == want.keys()
        for name, keys in want.items():
            for k, v in keys.items():
                if hasattr(v, "dim") and v.dim() > 0:
                    assert reference.max_rel_diff({k: got[name][k]}, {k: v}) == 0.0, (name, k)
                else:
                    assert got[name][k] == v, (name, k)


def test_async_worker_killed_mid_run_is_dropped_and_the_others_finish():
    # 3 workers and a server under longboat run: the launcher keeps the survivors running
    script = SCRIPTS / "ps_worker_dies.py"
    res = harness.longboat_run("-n", "4", str(script), "--die-rank", "1", "--die-at", "20")
    out = res.stdout
    assert res.returncode == 0, out
    assert (
        "longboat: rank 1 (parameter-server worker 1 (async)) was killed by SIGKILL; the job "
        "goes on without it" in out
    ), out
    assert "longboat: the job finished without rank(s) 1, dropped when they died" in out, out
    for r in (0, 2):
        line = [ln for ln in out.splitlines() if ln.startswith(f"[rank{r}]: rank {r} steps=")]
        assert line, out
        # it learned (chance is 0.1) while losing a worker; convergence is the digits test's
        assert float(line[0].split("accuracy=")[1]) >= 0.8, line
    assert "worker 1 (rank 1) sent nothing" in out, out
    # what the dead worker lost: it stopped at clock 20 of the others' 56 (4 epochs x 14)
    assert "worker 1 (rank 1) died at clock 20 and lost 36 updates" in out, out


@pytest.mark.parametrize("how", ["kill", "raise"])
def test_async_job_whose_workers_all_die_fails_naming_them(how):
    # Each dead worker is dropped and the server goes on, but with none left the job trained
    # nothing to its end: it must exit non-zero naming every worker. Killed, the workers leave
    # the server waiting for a message no one sends (its watch ends it); raising, they still
    # say goodbye from the engine's exit handler with their host and error, and the server
    # names them and exits 1 ([Note: workers that fail]); the launcher may see the server's
    # failure before the last worker's exit, so only the server's line is certain then.
    script = SCRIPTS / "ps_worker_dies.py"
    args = ("--die-rank", "-1", "--die-at", "3", "--die-how", how)
    res = harness.longboat_run("-n", "3", str(script), *args, timeout=120)
    out = res.stdout
    assert res.returncode != 0, out
    if how == "kill":
        for r in (0, 1):
            assert f"longboat: rank {r} (parameter-server worker {r} (async)) " in out, out
        assert (
            "parameter server 0: every worker died (worker 0 (rank 0), worker 1 (rank 1)), "
            "none finished its training: the job failed" in out
        ), out
    else:  # the server, the rank that survives, names each worker, its host and its error
        host = socket.gethostname()
        assert (
            f"[rank2]: longboat ERROR [rank 2] parameter server 0: no worker finished its "
            f"training (worker 0 (rank 0 on {host}) failed: RuntimeError: rank 0 fails at step "
            f"3; worker 1 (rank 1 on {host}) failed: RuntimeError: rank 1 fails at step 3): "
            "the job failed" in out
        ), out
    assert "the job finished without" not in out, out


def test_a_server_that_dies_stops_the_job_naming_it_and_a_restart_resumes(tmp_path):
    # 2 workers and a server in sync mode, checkpointing every 10 steps; the server's
    # optimizer kills its process at its 25th step in the first attempt only.
    script = SCRIPTS / "ps_server_dies.py"
    res = harness.longboat_run("-n", "3", str(script), str(tmp_path / "ckpt"))
    out = res.stdout
    assert res.returncode == 128 + signal.SIGKILL, out
    assert "longboat: rank 2 was killed by SIGKILL" in out, out
    assert "longboat: rank 2 was parameter server 0" in out, out
    # the workers say which server they lost and what to do
    for r in (0, 1):
        assert f"[rank{r}]: longboat.ps.client.ServerLost: parameter server 0 (rank 2) is gone" in (
            out
        ), out
    assert "restart it from the last checkpoint" in out
    # with a restart, the job resumes from the step-20 checkpoint and finishes
    res = harness.longboat_run(
        "-n", "3", "--max-restarts", "1", str(script), str(tmp_path / "again")
    )
    out = res.stdout
    assert res.returncode == 0, out
    for r in (0, 1):
        assert f"[rank{r}]: resumed at step 20" in out, out
        assert f"[rank{r}]: finished at step 40" in out, out


def _kvstore(kind: str) -> dict:
    import torch

    import longboat.ps

    try:
        kv = longboat.ps.connect(kind, servers=1, optimizer=lambda ts: torch.optim.SGD(ts, lr=0.5))
    except longboat.ps.ServerExit as served:
        return {"served": served.summary}
    big, small = torch.arange(10000, dtype=torch.float32), torch.ones(3)
    kv.init("big", big)
    kv.init(7, small)
    kv.barrier()
    out = torch.empty(10000)
    kv.pushpull("big", torch.full((10000,), float(kv.rank + 1)), out)  # grads 1 and 2
    kv.push(7, torch.ones(3))
    small_out = torch.empty(3)
    kv.pull(7, small_out)
    kv.barrier()
    kv.pull("big", out)
    result = {
        "big": out.clone(),
        "small": small_out.clone(),
        "type": kv.type,
        "clocks": kv.clocks(),
    }
    kv.close()
    return result


def test_kvstore_dist_sync_averages_pushes_and_applies_the_servers_optimizer(ranks):
    import torch

    got = ranks(3, _kvstore, "dist_sync")
    for r in got[:2]:
        # the mean of the two workers' pushes (1.5) times lr 0.5, taken from worker 0's init
        assert torch.equal(r["big"], torch.arange(10000, dtype=torch.float32) - 0.75)
        assert torch.equal(r["small"], torch.full((3,), 0.5))
        assert r["type"] == "dist_sync"
        assert r["clocks"] == [1, 1]  # one push of each key by each worker
    assert got[2]["served"]["traffic"]["push"]["messages"] == 4


def _kv_failing(failing: list[int]) -> dict:
    """Async workers that push once; those in ``failing`` then raise, leaving from a
    ``finally`` as a script's cleanup does; no launcher watches (the ranks of a pool)."""
    import torch

    import longboat.ps

    try:
        kv = longboat.ps.connect(
            "dist_async", servers=1, optimizer=lambda ts: torch.optim.SGD(ts, lr=1.0)
        )
    except longboat.ps.ServerExit as served:
        return {"served": served.summary, "code": served.code}
    try:
        try:
            kv.init("w", torch.zeros(4))
            kv.barrier()
            kv.push("w", torch.ones(4))
            if kv.rank in failing:
                raise RuntimeError(f"worker {kv.rank} gives up")
        finally:
            kv.close()
    except RuntimeError as e:
        return {"raised": str(e)}
    return {"finished": True}


def test_async_job_none_of_whose_workers_finish_fails_on_the_server(ranks):
    host = socket.gethostname()
    server = ranks(3, _kv_failing, [0, 1])[2]
    assert server["code"] == 1, server
    fates = [service.worker_fate(i, w) for i, w in enumerate(server["served"]["workers"])]
    assert fates == [
        f"worker 0 (rank 0 on {host}) failed: RuntimeError: worker 0 gives up",
        f"worker 1 (rank 1 on {host}) failed: RuntimeError: worker 1 gives up",
    ]
    # one worker that finishes is enough: the job did its training
    server = ranks(3, _kv_failing, [1])[2]
    assert server["code"] == 0, server
    fates = [service.worker_fate(i, w) for i, w in enumerate(server["served"]["workers"])]
    assert fates == [
        f"worker 0 (rank 0 on {host}) finished",
        f"worker 1 (rank 1 on {host}) failed: RuntimeError: worker 1 gives up",
    ]


def test_the_servers_report_names_every_worker_that_did_not_finish(caplog):
    summary = {
        "server": 0,
        "aborted": None,
        "workers": [
            {"rank": 0, "clock": 3, "dead": True, "lost_updates": 0, "host": ""},
            {"rank": 1, "clock": 3, "dead": False, "host": "h1", "error": "ValueError: bad"},
        ],
    }
    with caplog.at_level("WARNING", logger="longboat"):
        service.report(summary)
    assert service.ServerExit(summary).code == 1
    assert (
        "parameter server 0: no worker finished its training (worker 0 (rank 0) died at clock "
        "3; worker 1 (rank 1 on h1) failed: ValueError: bad): the job failed" in caplog.text
    )


def _ssp_leaver(steps_by_worker: list[int]) -> dict:
    import torch

    import longboat.ps

    try:
        kv = longboat.ps.connect(
            "ssp", servers=1, staleness=1, optimizer=lambda ts: torch.optim.SGD(ts, lr=1.0)
        )
    except longboat.ps.ServerExit as served:
        return {"served": served.summary}
    kv.init("w", torch.zeros(4))
    out = torch.empty(4)
    for _ in range(steps_by_worker[kv.rank]):
        kv.pushpull("w", torch.ones(4), out)
    kv.close()
    return {"w": out.clone()}


def test_ssp_goes_on_when_a_worker_leaves_first(ranks):
    # worker 1 leaves after one clock; worker 0 must not wait for it at clock 3 (a bound of 1)
    got = ranks(3, _ssp_leaver, [5, 1])
    server = got[2]["served"]
    assert [w["clock"] for w in server["workers"]] == [5, 1]
    # every clock applied as the mean of the pushes it got: -1 each, 5 clocks
    assert got[0]["w"].tolist() == [-5.0] * 4


def _monitored(cfg: dict) -> dict:
    import longboat

    recipe = reference.Recipe(model="tiny", optimizer="adamw")
    model, opt, _ = recipe.build()
    try:
        engine = longboat.initialize(model, opt, cfg)
    except longboat.ps.ServerExit as served:
        return {"served": served.summary}
    data = harness.data_for(recipe, engine.batch.train_batch_size * 4)
    for batch in engine.loader(data):
        _, *rest = batch
        engine.backward(reference.forward_loss(engine, rest))
        engine.step()
    log = engine.strategy.conn.commlog
    engine.close()
    return {"steps": engine.global_step, "log": {r["op"]: r["count"] for r in log.summary()}}


def test_monitor_shows_each_workers_staleness_and_the_comm_log_counts_pushes(ranks, tmp_path):
    import csv

    cfg = {
        **harness.QUIET,
        **_ps(1, "ssp", staleness=1),
        "batch": {"train_batch_size": 8},
        "monitor": {"every": 1, "csv": {"enabled": True, "output_path": str(tmp_path)}},
        "comm": {"log": True},
    }
    got = ranks(3, _monitored, cfg)
    rows = list(csv.DictReader((tmp_path / "longboat" / "metrics.csv").open()))
    assert len(rows) == got[0]["steps"] == 4
    # Pushes behind the furthest worker: at most staleness + 1, as the furthest may have
    # pushed the clock whose pull then waits for the slowest (what it reads is at most
    # staleness clocks old; the pulls' bound is test_async_and_ssp_converge_on_digits's).
    for row in rows:
        assert 0 <= float(row["staleness_w0"]) <= 2 and 0 <= float(row["staleness_w1"]) <= 2
    pushes = got[2]["served"]["traffic"]["push"]["messages"]
    assert pushes == 2 * 4  # two workers, one key, four steps
    # each worker's comm log: a pull at the start, then a push and a pull per step
    assert got[0]["log"] == got[1]["log"] == {"push": 4, "pull": 5}


class _LinkThatFailsAtGoodbye:
    """A stand-in for the worker's link: heartbeats go through, the goodbye fails with an error
    that is not a lost server (say, the group torn down under the worker)."""

    peer_error = None

    def __init__(self) -> None:
        self.beats = 0

    def request(self, header, dst: int) -> None:
        from longboat.ps.wire import Op

        if header.op == Op.BEAT:
            self.beats += 1
            return
        raise ValueError("the process group is gone")


def test_a_worker_whose_goodbye_fails_stops_its_heartbeats():
    # A heartbeat thread left beating lives on in its process: in the test pool it outlived its
    # test and held the interpreter's thread lock when a later test's DataLoader forked, and the
    # child deadlocked in os.fork.
    from longboat.ps.client import Connection

    link = _LinkThatFailsAtGoodbye()
    connection = Connection(link, worker=0, servers=[1], heartbeat_s=0.01)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="group is gone"):
        connection.close()
    beats = [t for t in threading.enumerate() if t.name == "longboat-ps-heartbeat"]
    assert not beats, "the heartbeat thread is still running after close()"
