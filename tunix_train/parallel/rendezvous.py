"""Start-up handshake between the launchers of a multi-node job, over MASTER_PORT + 1.

Node 0's launcher (RANK=0) listens; every other node's launcher connects and announces its
ranks. When all WORLD_SIZE ranks are accounted for, node 0 answers each with its run dir, so
every process of the job writes to one directory. A node that never starts becomes a clear
timeout error after `distributed.init_timeout_s`, not a hang.
"""

from __future__ import annotations

import json
import logging
import socket
import time

log = logging.getLogger("tunix_train.launch")

_POLL_S = 0.5
_GREETING_S = 10  # a connected launcher sends its line at once; longer is not one of ours


def exchange_run_dir(addr: str, port: int, first_rank: int, nprocs: int, world_size: int,
                     run_dir: str, timeout_s: int) -> str:
    if first_rank == 0:
        return _serve(port, nprocs, world_size, run_dir, timeout_s)
    return _fetch(addr, port, first_rank, nprocs, timeout_s)


def _serve(port: int, nprocs: int, world_size: int, run_dir: str, timeout_s: int) -> str:
    deadline = time.monotonic() + timeout_s
    peers, joined = [], nprocs
    with socket.create_server(("", port), reuse_port=True) as server:
        server.settimeout(_POLL_S)
        while joined < world_size:
            if time.monotonic() > deadline:
                raise SystemExit(
                    f"error: distributed.init_timeout_s={timeout_s} passed with the launchers of "
                    f"{joined} of WORLD_SIZE={world_size} processes joined on port {port}; start "
                    f"the launcher on every node with the same MASTER_ADDR, MASTER_PORT and "
                    f"WORLD_SIZE.")
            try:
                conn, peer = server.accept()
            except TimeoutError:
                continue
            hello = _read_hello(conn, deadline)
            if hello is None:  # silent, or not one of our launchers: the others may still come
                log.warning("launcher: ignored a connection from %s that sent no greeting", peer)
                conn.close()
                continue
            log.info("launcher: ranks %d-%d joined", hello["first_rank"],
                     hello["first_rank"] + hello["nprocs"] - 1)
            peers.append(conn)
            joined += hello["nprocs"]
    for conn in peers:
        with conn:
            conn.settimeout(_GREETING_S)
            conn.sendall((json.dumps({"run_dir": run_dir}) + "\n").encode())
    return run_dir


def _read_hello(conn: socket.socket, deadline: float) -> dict | None:
    """A joining launcher's one-line greeting, or None if none comes in time or it is garbled."""
    conn.settimeout(max(min(deadline - time.monotonic(), _GREETING_S), _POLL_S))
    try:
        hello = json.loads(conn.makefile().readline())
        return hello if {"first_rank", "nprocs"} <= set(hello) else None
    except (TimeoutError, OSError, ValueError, TypeError):
        return None


def _fetch(addr: str, port: int, first_rank: int, nprocs: int, timeout_s: int) -> str:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            conn = socket.create_connection((addr, port), timeout=_POLL_S)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise SystemExit(
                    f"error: distributed.init_timeout_s={timeout_s} passed without reaching the "
                    f"RANK=0 launcher at {addr}:{port}; check MASTER_ADDR and MASTER_PORT.")
            time.sleep(_POLL_S)
    with conn:
        conn.sendall((json.dumps({"first_rank": first_rank, "nprocs": nprocs}) + "\n").encode())
        conn.settimeout(max(deadline - time.monotonic(), _POLL_S))
        try:
            return json.loads(conn.makefile().readline())["run_dir"]
        except (TimeoutError, json.JSONDecodeError):
            raise SystemExit(f"error: distributed.init_timeout_s={timeout_s} passed waiting for "
                             f"the other nodes' launchers to join.") from None
