"""Bind a listening socket for a store to serve (kept free of torch, so usage errors are fast)."""

from __future__ import annotations

import socket


def bind_listener(addr: str, port: int) -> socket.socket:
    """Bind and listen on ``addr:port`` (port 0: a free one); raise ``OSError`` if impossible.

    Handing the bound socket to ``TCPStore`` (``master_listen_fd``) makes the store listen only
    on ``addr`` (given a host and port it listens on every interface), and leaves no window in
    which another process could take a port found free.
    """
    family, _, _, _, sockaddr = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return sock
