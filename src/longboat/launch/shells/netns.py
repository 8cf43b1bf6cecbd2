"""``netns``: a "host" is a Linux network namespace of this machine (``ip netns exec``).

The namespaces share this machine's files and processes but each has its own interfaces,
addresses and ports, so they stand in for machines joined by a network. Needs root.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Netns:
    """``ip netns exec NAME sh -c COMMAND``."""

    name: str = "netns"

    def argv(self, host: str, command: str) -> list[str]:
        """Run ``command`` with ``sh`` inside namespace ``host``."""
        return ["ip", "netns", "exec", host, "sh", "-c", command]

    def check_argv(self, host: str, timeout_s: int) -> list[str]:
        """``true`` inside the namespace: fails when it does not exist (or we are not root)."""
        return ["ip", "netns", "exec", host, "true"]
