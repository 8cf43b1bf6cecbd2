"""What travels between workers and servers: a fixed-size header, then a payload, as messages
through the comm doorway (:class:`~longboat.comm.protocol.Mailbox`) on a gloo group of the
parameter server's own, so that each appears in the comm log and a receive that hangs in the
hang report. A lost peer is the parameter server's to name ([Note: parameter server liveness]
in ``server.py``), not the doorway's.

[Note: parameter server wire] Every request is a header of :data:`HEADER_LEN` float64 numbers
(exact for integers below 2**53) sent on tag :data:`REQUEST`; a server takes them with a
receive-from-any, so it serves whichever worker speaks first. A request that carries tensors
(a push, an init, a state) sends them next, on tag :data:`PAYLOAD`, to the same server: the
server reads it from that worker alone before it takes the next header, so a payload is never
mistaken for another worker's header. A reply goes back on a tag of the key it answers
(:func:`reply_tag`): a worker waiting on key 3 of a server cannot receive key 5's reply, and a
server may answer keys in any order (a pull waits until its condition holds). Names (optimizer
state keys) travel as UTF-8 JSON in a uint8 tensor: no pickle, no torch RPC.

Why gloo, even beside an NCCL data plane: receive-from-any exists only there, and servers keep
their state in CPU memory, as MXNet's and TensorFlow's servers do.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import torch

from longboat.comm.protocol import Mailbox

HEADER_LEN = 8
REQUEST = 0  # headers, worker -> server
PAYLOAD = 1  # tensors after a header, worker -> server
_REPLY_BASE = 16  # server -> worker: header on 16 + 2k, payload on 17 + 2k (key k)
#: Replies that answer no key (barrier, goodbye) come on this key's tag.
CONTROL_KEY = 1 << 20


class Op(IntEnum):
    """What a header asks for (worker -> server) or says (server -> worker)."""

    INIT = 1  # payload: the key's initial values (worker 0); reply when the key is known
    PUSH = 2  # payload: a gradient slice and its usage flags
    PULL = 3  # reply (when the mode allows): values, or the aggregated gradient
    BARRIER = 4  # reply when every live worker has arrived
    BEAT = 5  # a worker's heartbeat: no reply
    BYE = 6  # a worker leaves; a: bytes of a JSON payload (host, error); reply: the counts
    STATE = 7  # reply: values and optimizer state, as JSON names + a flat payload
    SET_STATE = 8  # payload: JSON names + a flat payload, as STATE replies
    STATS = 9  # reply: every worker's clock, as JSON
    REPLY = 20
    ABORT = 21  # the job cannot go on (a worker died in sync mode): reply fields name it


@dataclass(frozen=True)
class Header:
    """One header's fields; ``a``/``b``/``c`` mean what the op says (see the users)."""

    op: Op
    key: int = 0
    clock: int = 0
    worker: int = 0
    a: float = 0.0
    b: float = 0.0
    c: float = 0.0

    def tensor(self) -> torch.Tensor:
        return torch.tensor(
            [float(self.op), self.key, self.clock, self.worker, self.a, self.b, self.c, 0.0],
            dtype=torch.float64,
        )

    @classmethod
    def of(cls, t: torch.Tensor) -> Header:
        v = t.tolist()
        return cls(Op(int(v[0])), int(v[1]), int(v[2]), int(v[3]), v[4], v[5], v[6])


def reply_tag(key: int) -> int:
    return _REPLY_BASE + 2 * key


def describe(tag: int) -> str:
    """What a message on ``tag`` is, as logs and hang reports name it."""
    if tag == REQUEST:
        return "parameter-server request"
    if tag == PAYLOAD:
        return "parameter-server request payload"
    key, payload = divmod(tag - _REPLY_BASE, 2)
    what = "control" if key == CONTROL_KEY else f"key {key}"
    return f"parameter-server reply{' payload' if payload else ''} ({what})"


def empty_header() -> torch.Tensor:
    return torch.zeros(HEADER_LEN, dtype=torch.float64)


@dataclass
class Link:
    """Messages on the parameter server's group, through its doorway ``comm``, between global
    ranks; counts messages and bytes by kind (the servers' summary of pushes and pulls)."""

    group: Any
    comm: Mailbox
    #: Turns a failed send to or receive from a named peer (its global rank) into the error
    #: to raise (a worker's: the server it lost); None keeps the doorway's error.
    peer_error: Callable[[int, RuntimeError], Exception] | None = None

    def __post_init__(self) -> None:
        self.counts: dict[str, list[int]] = {}
        self._ranks = [self.comm.global_rank(r) for r in range(self.comm.world_size)]

    def count(self, kind: str, nbytes: int) -> None:
        c = self.counts.setdefault(kind, [0, 0])
        c[0] += 1
        c[1] += nbytes

    def send(self, t: torch.Tensor, dst: int, tag: int) -> None:
        try:
            self.comm.send_message(
                t, self._ranks.index(dst), tag, describe(tag), loss_reported=False
            )
        except RuntimeError as e:
            self._raise_for(dst, e)
            raise

    def recv(self, t: torch.Tensor, src: int | None, tag: int) -> int:
        """Receive into ``t`` from ``src`` (None: from any); returns the sender's global rank."""
        peer = None if src is None else self._ranks.index(src)
        try:
            got = self.comm.recv_message(t, peer, tag, describe(tag), loss_reported=False)
        except RuntimeError as e:
            if src is not None:
                self._raise_for(src, e)
            raise
        return self._ranks[got]

    def _raise_for(self, peer: int, e: RuntimeError) -> None:
        err = None if self.peer_error is None else self.peer_error(peer, e)
        if err is not None and err is not e:
            raise err from e

    def request(self, h: Header, dst: int) -> None:
        self.send(h.tensor(), dst, REQUEST)

    def reply(self, h: Header, dst: int, payload: torch.Tensor | None = None) -> None:
        self.send(h.tensor(), dst, reply_tag(h.key))
        if payload is not None:
            self.send(payload, dst, reply_tag(h.key) + 1)

    def await_reply(self, key: int, src: int) -> Header:
        t = empty_header()
        self.recv(t, src, reply_tag(key))
        return Header.of(t)

    def reply_payload(self, out: torch.Tensor, key: int, src: int) -> None:
        self.recv(out, src, reply_tag(key) + 1)


def encode_json(obj: Any) -> torch.Tensor:
    return torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8)


def decode_json(t: torch.Tensor) -> Any:
    return json.loads(bytes(t.tolist()).decode())
