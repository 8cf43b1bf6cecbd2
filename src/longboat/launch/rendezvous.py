"""longboat's rendezvous: torch's static one (fixed node ranks), made safe to restart.

torch's ``static`` rendezvous (what ``torchrun --node-rank`` uses) has node 0's agent create one
``TCPStore`` and hands that same store to the workers of every attempt. Measured here with torch
2.13 and ``--max-restarts 1``: the restarted workers find the previous attempt's gloo keys still
in the store (torch assumes "a new TCPStore for every retry") and either dial the dead workers'
ports ("Gloo connectFullMesh failed ... Connection refused") or hang in the store barrier,
depending on who reads first. Also, the store listens on every interface even when given
127.0.0.1, and a free port found by binding port 0 and closing the socket can be taken by
someone else before the store binds it again.

So this handler keeps torch's static semantics (node ranks from ``--node-rank``, node 0 hosts the
rendezvous store at ``--master-addr:--master-port``, no nodes joining mid-job) and changes two
things:

* node 0 starts a **fresh store for the workers of each attempt** on a new free port, and tells
  the other nodes that port through the rendezvous store (key per attempt);
* every store serves a socket **already bound** to the chosen address (``master_listen_fd``), so
  it listens only there and no other process can take the port in between.

Ports: when the user names ``--master-port P``, attempt ``k``'s worker store listens on
``P + 1 + k`` (so a job with ``--max-restarts R`` uses ports P to P + 1 + R on node 0, a range a
firewall rule can name); without one (a single node), on a free port the OS picks.
"""

from __future__ import annotations

import datetime
import json
import socket
import time

# The stores are defined (and declared in the stubs) in torch._C._distributed_c10d;
# torch.distributed re-exports them without saying so.
from torch._C._distributed_c10d import PrefixStore, Store, TCPStore
from torch.distributed import DistError
from torch.distributed.elastic.rendezvous import (
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
    rendezvous_handler_registry,
)
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

from longboat.network import bind_listener, node_label, route_ip

BACKEND = "longboat-static"
_NODE_KEY = "longboat/node/{node}"


class RendezvousFailed(RuntimeError):
    """The nodes did not all meet; the message names the missing ones and what was tried."""


LISTEN_FD_KEY = "listen_fd"
WORKER_PORT_BASE_KEY = "worker_port_base"
_WORKER_PORT_KEY = "longboat/worker_store_port/{attempt}"


class StaticRendezvous(RendezvousHandler):
    """Fixed node ranks; a rendezvous store on node 0; a fresh worker store per attempt."""

    def __init__(
        self,
        master_addr: str,
        master_port: int,
        node_rank: int,
        nnodes: int,
        run_id: str,
        timeout: datetime.timedelta,
        listen_fd: int | None,
        worker_port_base: int | None = None,
    ) -> None:
        self._addr = master_addr
        self._port = master_port
        self._node_rank = node_rank
        self._nnodes = nnodes
        self._run_id = run_id
        self._timeout = timeout
        self._listen_fd = listen_fd
        self._worker_port_base = worker_port_base
        self._store: Store | None = None
        # Node 0 keeps the current attempt's worker store alive; replacing it shuts the old down.
        self._worker_store: TCPStore | None = None
        self._attempt = -1

    def get_backend(self) -> str:
        """Our registered name (torch checks it against the requested backend)."""
        return BACKEND

    @property
    def use_agent_store(self) -> bool:
        """Workers are TCPStore clients of a store the agent on node 0 hosts."""
        return True

    def next_rendezvous(self) -> RendezvousInfo:
        """Meet the other nodes (first call) and set up the workers' store for a new attempt."""
        if self._store is None:
            self._store = self._meet()
        store = PrefixStore(self._run_id, self._store)
        self._attempt += 1
        key = _WORKER_PORT_KEY.format(attempt=self._attempt)
        if self._node_rank == 0:
            sock = self._worker_listener()
            port = sock.getsockname()[1]
            self._worker_store = TCPStore(
                self._addr,
                port,
                None,
                True,
                self._timeout,
                wait_for_workers=False,
                master_listen_fd=sock.detach(),  # the store owns the socket from here on
            )
            store.set(key, str(port))
        else:
            port = int(store.get(key))
        return RendezvousInfo(
            store, self._node_rank, self._nnodes, RendezvousStoreInfo(self._addr, port)
        )

    def _meet(self) -> Store:
        """Connect to node 0's store and wait for every node, naming those that never came."""
        is_host = self._node_rank == 0
        where = f"{self._addr}:{self._port}"
        seconds = int(self._timeout.total_seconds())
        try:
            store = TCPStore(
                self._addr,
                self._port,
                None,
                is_host,
                self._timeout,
                wait_for_workers=False,
                multi_tenant=True,
                master_listen_fd=self._listen_fd if is_host else None,
            )
        except DistError as e:
            via = route_ip(self._addr)
            raise RendezvousFailed(
                f"{node_label(self._node_rank)} could not reach node 0's rendezvous at {where} "
                f"within {seconds} s (dialled from {via or 'no route'}): "
                f"{str(e).splitlines()[0] if str(e) else type(e).__name__}"
            ) from None
        me = {"host": socket.gethostname(), "via": route_ip(self._addr) or "?"}
        store.set(_NODE_KEY.format(node=self._node_rank), json.dumps(me))
        keys = [_NODE_KEY.format(node=n) for n in range(self._nnodes)]
        deadline = time.monotonic() + self._timeout.total_seconds()
        missing: list[int] = []
        try:
            while not store.check(keys):
                joined = [n for n, k in enumerate(keys) if store.check([k])]
                missing = [n for n in range(self._nnodes) if n not in joined]
                if time.monotonic() > deadline:
                    seen = ", ".join(
                        f"{node_label(n)} from {json.loads(store.get(keys[n]))['via']}"
                        for n in joined
                    )
                    raise RendezvousFailed(
                        f"{', '.join(map(node_label, missing))} never joined the rendezvous at "
                        f"{where} within {seconds} s; joined: {seen}"
                    )
                time.sleep(0.5)
        except DistError:  # node 0 gave up first (its deadline came earlier) and closed it
            raise RendezvousFailed(
                f"{node_label(self._node_rank)}: node 0's rendezvous at {where} closed while "
                f"waiting for {', '.join(map(node_label, missing)) or 'the other nodes'} "
                "(node 0 reports who never joined)"
            ) from None
        return store

    def _worker_listener(self) -> socket.socket:
        if self._worker_port_base is None:
            return bind_listener(self._addr, 0)
        port = self._worker_port_base + self._attempt
        try:
            return bind_listener(self._addr, port)
        except OSError as e:
            raise RuntimeError(
                f"longboat: cannot listen on {self._addr}:{port} for attempt {self._attempt}'s "
                f"worker store (--master-port + {1 + self._attempt}): {e.strerror or e}; "
                "choose a --master-port with the ports after it free"
            ) from e

    def is_closed(self) -> bool:
        """A static job is never closed to new rounds (restarts reuse it)."""
        return False

    def set_closed(self) -> None:
        """Nothing to close: see :meth:`is_closed`."""

    def num_nodes_waiting(self) -> int:
        """No node can join a static job mid-run."""
        return 0

    def get_run_id(self) -> str:
        """The run id every node was started with."""
        return self._run_id

    def shutdown(self) -> bool:
        """Nothing to release beyond what the process exit releases."""
        return True


def _create_handler(params: RendezvousParameters) -> RendezvousHandler:
    addr, port = parse_rendezvous_endpoint(params.endpoint, -1)
    listen_fd = params.config.get(LISTEN_FD_KEY)
    return StaticRendezvous(
        master_addr=addr,
        master_port=port,
        node_rank=int(params.config["rank"]),
        nnodes=params.max_nodes,
        run_id=params.run_id,
        timeout=datetime.timedelta(seconds=int(params.config.get("timeout", 900))),
        listen_fd=None if listen_fd is None else int(listen_fd),
        worker_port_base=(
            None
            if params.config.get(WORKER_PORT_BASE_KEY) is None
            else int(params.config[WORKER_PORT_BASE_KEY])
        ),
    )


def register_backend() -> None:
    """Register :data:`BACKEND` with torch elastic (idempotent: same creator each time)."""
    rendezvous_handler_registry.register(BACKEND, _create_handler)
