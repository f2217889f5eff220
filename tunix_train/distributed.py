"""Joining a multi-process job: environment discovery and `jax.distributed.initialize`."""

from __future__ import annotations

import logging
import os

import jax

from tunix_train.config import DistributedConfig

log = logging.getLogger(__name__)


def initialize(cfg: DistributedConfig) -> None:
    """Initialises jax.distributed when the environment describes a job of several processes."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return
    address = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    jax.distributed.initialize(
        coordinator_address=address, num_processes=world,
        process_id=int(os.environ["RANK"]), initialization_timeout=cfg.init_timeout_s,
        heartbeat_timeout_seconds=cfg.heartbeat_timeout_s,
    )
