"""The parameter server speaks through the comm doorway: every request and reply is in the comm
log, a receive that waits past the timeout is named in the hang report, and a server waiting
for requests from any worker is not reported as hung."""

from __future__ import annotations

import json
from pathlib import Path

import harness
import reference

TIMEOUT_S = 2.0


def _logged(cfg: dict) -> dict:
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
    service = engine.strategy.service
    pushpull = {r["op"]: r for r in engine.strategy.conn.commlog.summary()}
    engine.close()
    return {"messages": {r["op"]: r for r in service.comm.log_summary()}, "pushpull": pushpull}


def test_every_parameter_server_message_is_in_the_comm_log(ranks):
    cfg = {
        **harness.QUIET,
        "strategy": "parameter_server",
        "parameter_server": {"servers": 1, "mode": "sync"},
        "batch": {"train_batch_size": 8},
        "comm": {"log": True},
    }
    *workers, served = ranks(3, _logged, cfg)
    server = served["served"]
    for w in workers:
        sent, got = w["messages"]["send"], w["messages"]["recv"]
        pulls, pushes = w["pushpull"]["pull"], w["pushpull"]["push"]
        # Every pull's answer is a header and a payload from the one server, and the goodbye
        # is answered with a header: nothing else comes back to a worker.
        assert got["count"] == 2 * pulls["count"] + 1, w
        assert got["bytes"] == pulls["bytes"] + (pulls["count"] + 1) * 8 * 8, w
        # Each push is a header and a payload, each pull a header (and heartbeats besides).
        assert sent["count"] >= 2 * pushes["count"] + pulls["count"] + 1, w
        assert sent["bytes"] >= pushes["bytes"], w
    # The server's side: every worker's requests arrived through its doorway (heartbeats
    # besides), and its answers left through it.
    log = {r["op"]: r for r in server["comm_log"]}
    requests = sum(
        2 * w["pushpull"]["push"]["count"] + w["pushpull"]["pull"]["count"] + 1 for w in workers
    )
    assert log["recv"]["count"] >= requests, log
    assert log["recv"]["bytes"] >= server["traffic"]["push"]["bytes"]
    assert log["send"]["count"] == sum(w["messages"]["recv"]["count"] for w in workers)
    assert log["send"]["bytes"] == sum(w["messages"]["recv"]["bytes"] for w in workers)


def _hung_reply(report_dir: str) -> dict:
    import datetime
    import os
    import time

    import torch.distributed as dist

    from longboat.comm.collectives import Collectives, CollectiveTimeout
    from longboat.comm.hang import REPORT_DIR_VAR
    from longboat.ps.wire import Link

    timeout = datetime.timedelta(seconds=TIMEOUT_S)
    group = dist.new_group([0, 1], backend="gloo", timeout=timeout)
    comm = Collectives(group, timeout_s=TIMEOUT_S, name="parameter servers")
    link = Link(group, comm)
    out: dict = {}
    try:
        if dist.get_rank() == 0:  # a worker whose server does not answer its pull
            os.environ[REPORT_DIR_VAR] = report_dir
            try:
                link.await_reply(0, 1)
            except CollectiveTimeout as e:
                out["error"] = str(e)
            finally:
                del os.environ[REPORT_DIR_VAR]
        else:  # the server, busy past the worker's timeout
            time.sleep(TIMEOUT_S + 2.0)
    finally:
        comm.close()
        dist.barrier()
        dist.destroy_process_group(group)
    return out


def test_a_reply_that_never_comes_is_named_in_the_hang_report(ranks, tmp_path: Path):
    worker, _ = ranks(2, _hung_reply, str(tmp_path))
    assert "did not arrive at recv(float64[8])" in worker.get("error", ""), worker
    rep = json.loads((tmp_path / "rank0.json").read_text())
    assert rep["kind"] == "timeout" and rep["not_arrived"] == [1], rep
    assert rep["collective"]["op"] == "recv", rep
    assert rep["collective"]["group"] == "parameter servers", rep
    assert rep["collective"]["tag"] == "parameter-server reply (key 0), from rank 1", rep
    assert rep["collective"]["source"].startswith("test_ps_doorway.py:"), rep


def _idle_server(report_dir: str) -> dict:
    import datetime
    import os
    import time

    import torch.distributed as dist

    from longboat.comm.collectives import Collectives, CollectiveTimeout, PeerLost
    from longboat.comm.hang import REPORT_DIR_VAR
    from longboat.ps.wire import REQUEST, Link, empty_header

    timeout = datetime.timedelta(seconds=TIMEOUT_S)
    group = dist.new_group([0, 1], backend="gloo", timeout=timeout)
    comm = Collectives(group, log=True, timeout_s=TIMEOUT_S, name="parameter servers")
    link = Link(group, comm)
    out: dict = {}
    try:
        if dist.get_rank() == 1:  # a server no worker speaks to for longer than the timeout
            os.environ[REPORT_DIR_VAR] = report_dir
            start = time.monotonic()
            try:
                link.recv(empty_header(), None, REQUEST)
            except (CollectiveTimeout, PeerLost) as e:
                out["reported"] = str(e)
            except RuntimeError as e:
                out["error"] = str(e)
            finally:
                del os.environ[REPORT_DIR_VAR]
            out["waited_s"] = time.monotonic() - start
            out["log"] = comm.log_summary()
        else:
            time.sleep(TIMEOUT_S + 1.0)
    finally:
        comm.close()
        dist.barrier()
        dist.destroy_process_group(group)
    return out


def test_a_server_waiting_for_any_worker_is_not_reported_as_hung(ranks, tmp_path: Path):
    _, server = ranks(2, _idle_server, str(tmp_path))
    # Its wait ends as the group's timeout says, and the error goes to the server's own
    # liveness watch ([Note: parameter server liveness]), with no report from the doorway.
    assert "reported" not in server and "timed out" in server.get("error", "").lower(), server
    assert server["waited_s"] >= TIMEOUT_S - 0.1, server
    assert not list(tmp_path.iterdir())
    assert server["log"] == [], server  # nothing was received
