"""The errors a collective ends in when a peer does not take part. Apart from the hang watch
(``hang.py``) that raises most of them, so that the waits under an alarm (``watched.py``) raise
them too without sitting on the hang watch's imports."""

from __future__ import annotations


class CollectiveTimeout(RuntimeError):
    """A collective did not complete within ``comm.timeout_s``; the message is the report."""


class PeerLost(RuntimeError):
    """A peer's connection closed during a collective (it died); the message is the report."""
