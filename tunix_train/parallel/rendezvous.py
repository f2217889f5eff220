"""Start-up handshake that gives every process of a job one run dir, over MASTER_PORT + 1.

Node 0's launcher (RANK=0) listens; every other node's launcher connects and announces its
ranks. When all WORLD_SIZE ranks are accounted for, node 0 answers each with its run dir, so
every process of the job writes to one directory. Processes started by hand with MASTER_ADDR,
MASTER_PORT, RANK and WORLD_SIZE (no launcher) do the same before Hydra starts, one rank each
(cli.py). While waiting, a line every 15 s says for whom; a node that never starts becomes a
`PeersError` after `distributed.init_timeout_s`, not a hang; SIGTERM/SIGINT end the wait.
"""

from __future__ import annotations

import json
import logging
import socket
import time

from tunix_train.parallel.waiting import Waiting

log = logging.getLogger("tunix_train.launch")

_POLL_S = 0.5
_GREETING_S = 10  # a connected launcher sends its line at once; longer is not one of ours
PEERS_EXIT_CODE = 5  # processes did not join (the exit code table is in docs/monitoring.md)


class PeersError(RuntimeError):
    """Other processes of the job did not join within `distributed.init_timeout_s`."""


def exchange_run_dir(addr: str, port: int, first_rank: int, nprocs: int, world_size: int,
                     run_dir: str, timeout_s: int) -> str:
    if first_rank == 0:
        return _serve(port, nprocs, world_size, run_dir, timeout_s)
    return _fetch(addr, port, first_rank, nprocs, timeout_s)


def _serve(port: int, nprocs: int, world_size: int, run_dir: str, timeout_s: int) -> str:
    deadline = time.monotonic() + timeout_s
    peers, joined = [], nprocs
    what = lambda: f"{world_size - joined} of {world_size} processes to join at port {port}"  # noqa: E731
    with socket.create_server(("", port), reuse_port=True) as server, \
            Waiting(what, None, PEERS_EXIT_CODE):
        server.settimeout(_POLL_S)
        while joined < world_size:
            if time.monotonic() > deadline:
                raise PeersError(
                    f"distributed.init_timeout_s={timeout_s} passed with {joined} of "
                    f"WORLD_SIZE={world_size} processes joined on port {port}; start every "
                    f"process (or every node's launcher) with the same MASTER_ADDR, MASTER_PORT "
                    f"and WORLD_SIZE, or raise distributed.init_timeout_s.")
            try:
                conn, peer = server.accept()
            except TimeoutError:
                continue
            hello = _read_hello(conn, deadline)
            if hello is None:  # silent, or not one of our launchers: the others may still come
                log.warning("ignored a connection from %s that sent no greeting", peer)
                conn.close()
                continue
            peers.append(conn)
            joined += hello["nprocs"]
            log.info("ranks %d-%d joined (%d of %d processes)", hello["first_rank"],
                     hello["first_rank"] + hello["nprocs"] - 1, joined, world_size)
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
    with Waiting(f"process 0 (RANK=0) at {addr}:{port}", None, PEERS_EXIT_CODE):
        conn = _connect(addr, port, deadline, timeout_s)
    with conn, Waiting(f"the other processes to join at {addr}:{port}", None, PEERS_EXIT_CODE):
        conn.sendall((json.dumps({"first_rank": first_rank, "nprocs": nprocs}) + "\n").encode())
        conn.settimeout(max(deadline - time.monotonic(), _POLL_S))
        try:
            return json.loads(conn.makefile().readline())["run_dir"]
        except TimeoutError:
            raise PeersError(f"distributed.init_timeout_s={timeout_s} passed waiting for the "
                             f"other processes of the job to join.") from None
        except (json.JSONDecodeError, KeyError):
            raise PeersError(f"process 0 at {addr}:{port} answered without a run dir; is "
                             f"another program using MASTER_PORT + 1?") from None


def _connect(addr: str, port: int, deadline: float, timeout_s: int) -> socket.socket:
    while True:
        try:
            return socket.create_connection((addr, port), timeout=_POLL_S)
        except OSError:
            if time.monotonic() > deadline:
                raise PeersError(
                    f"distributed.init_timeout_s={timeout_s} passed without reaching process 0 "
                    f"(RANK=0) at {addr}:{port}; check MASTER_ADDR and MASTER_PORT, and start "
                    f"RANK=0 too.") from None
            time.sleep(_POLL_S)
