"""The per-host half of interface discovery, started on every host by the launcher.

``python -m longboat.launch.probe --port P --token T`` speaks JSON lines on stdin/stdout:

1. it listens on ``P`` at each IPv4 address of each interface but loopback (a listener answers
   every connection with ``T``, this host's token), and prints
   ``{"token": T, "interfaces": {name: [addr, ...]}, "listening": {addr: port}, "errors": {...}}``;
2. it reads one line, ``[[peer, interface, addr, port, token], ...]``: the peers' listeners;
3. it dials each (2 s each, all at once) and prints ``{"reached": [[peer, interface], ...],
   "failed": {"peer interface addr": "why"}}``: reached means the peer's token came back, so an
   address that exists on several hosts (a docker bridge's 172.17.0.1) counts only where it
   really leads to that peer;
4. it keeps listening until stdin closes (other hosts may still be dialling), then exits.

Standard library only, so it starts fast and needs nothing but the Python of the job.
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import json
import socket
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

DIAL_TIMEOUT_S = 2.0


def interfaces() -> dict[str, list[str]]:
    """Interface name -> its IPv4 addresses (loopback and address-less interfaces left out)."""
    out: dict[str, list[str]] = {}
    for _, name in socket.if_nameindex():
        addrs = [a for a in _ipv4_addresses(name) if not ipaddress.ip_address(a).is_loopback]
        if addrs:
            out[name] = addrs
    return out


def _ipv4_addresses(name: str) -> list[str]:
    import psutil

    return [a.address for a in psutil.net_if_addrs().get(name, []) if a.family == socket.AF_INET]


def _serve(sock: socket.socket, token: bytes) -> None:
    while True:
        try:
            conn, _ = sock.accept()
        except OSError:
            return
        with conn, contextlib.suppress(OSError):
            conn.sendall(token + b"\n")


def _dial(addr: str, port: int, token: str) -> str | None:
    """None when ``addr:port`` answers with ``token``; else why not."""
    try:
        with socket.create_connection((addr, port), timeout=DIAL_TIMEOUT_S) as s:
            s.settimeout(DIAL_TIMEOUT_S)
            got = s.makefile("rb").readline().decode(errors="replace").strip()
    except OSError as e:
        return e.strerror or type(e).__name__
    return None if got == token else f"answered by another host ({got or 'nothing'})"


def main(argv: list[str] | None = None) -> int:
    """Run the probe (see the module docstring)."""
    ap = argparse.ArgumentParser(description="longboat interface discovery probe")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--token", required=True)
    args = ap.parse_args(argv)

    found = interfaces()
    listening: dict[str, int] = {}
    errors: dict[str, str] = {}
    sockets = []
    for addrs in found.values():
        for addr in addrs:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind((addr, args.port))
                sock.listen(64)
            except OSError as e:
                sock.close()
                errors[addr] = e.strerror or str(e)
                continue
            sockets.append(sock)
            listening[addr] = args.port
            threading.Thread(target=_serve, args=(sock, args.token.encode()), daemon=True).start()
    print(
        json.dumps(
            {"token": args.token, "interfaces": found, "listening": listening, "errors": errors}
        ),
        flush=True,
    )

    line = sys.stdin.readline()
    targets = json.loads(line) if line.strip() else []
    with ThreadPoolExecutor(max_workers=max(1, min(32, len(targets)))) as pool:
        outcomes = list(pool.map(lambda t: _dial(t[2], t[3], t[4]), targets))
    reached = [[t[0], t[1]] for t, why in zip(targets, outcomes, strict=True) if why is None]
    failed = {f"{t[0]} {t[1]} {t[2]}": why for t, why in zip(targets, outcomes, strict=True) if why}
    print(json.dumps({"reached": reached, "failed": failed}), flush=True)

    sys.stdin.read()  # until the launcher closes our stdin: every host has finished dialling
    for sock in sockets:
        sock.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
