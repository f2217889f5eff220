"""Shared test helpers: composing configs and running a few steps in-process."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
from flax import nnx
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import faults as faults_lib
from compile_flags import with_fast_compile
from typed_docs import SCHEDULER_VARIABLES
from tunix_train import checkpoint
from tunix_train import config as config_lib
from tunix_train.checkpoint import Checkpoints
from tunix_train.config import CheckpointConfig, Config, register_configs
from tunix_train.training.setup import Setup

REPO = Path(__file__).resolve().parent.parent
register_configs()

# Small enough that a step takes milliseconds on CPU, large enough to exercise every layer kind.
TINY = [
    "model.num_layers=7", "model.embed_dim=64", "model.hidden_dim=128", "model.head_dim=16",
    "model.sliding_window=16", "data.seq_len=32", "data.max_corpus_bytes=400000",
    "training.mixed_precision=fp32", "optimizer.warmup_steps=2",
]

# TINY's Gemma 3 in one stack of 4 local layers (fewer than global_every): the same layer code,
# one scanned body instead of TINY's three (blocks of locals, globals, trailing locals), so its
# step compiles in half the time. For the tests whose subject is not Gemma's layer kinds but a
# mesh, a ZeRO stage, accumulation, offload, processes, the planner, the output head or GRPO's
# and DPO's objectives (the family matrix, the pipeline, context-parallel, attention-kernel and
# generation tests run the three kinds).
ONE_STACK = [*TINY, "model.num_layers=4"]

# Every family's tiny model, for the tests' shared family matrix: as small as TINY, with at
# least two blocks (pipeline stages) and, for Gemma 3, a trailing layer after them.
FAMILY_MODELS = {
    "gemma3": ["model.num_layers=5", "model.global_every=2", *TINY[1:5]],
    "llama3": ["model=llama3_tiny", "model.embed_dim=64", "model.hidden_dim=128",
               "model.head_dim=16"],
    "qwen3": ["model=qwen3_tiny", "model.embed_dim=64", "model.hidden_dim=128",
              "model.head_dim=16"],
    # Every second layer routed (1 and 3; 0, 2 and the trailing 4 dense), without the router's
    # losses, which group tokens by device and micro-batch (test_moe.py holds those).
    "qwen3_moe": ["model=qwen3_moe_tiny", "model.embed_dim=64", "model.hidden_dim=128",
                  "model.head_dim=16", "model.expert_hidden_dim=32", "model.num_layers=5",
                  "model.moe_every=2", "training.moe_aux_loss_weight=0"],
    # Every layer routed (one stack), without the router's losses.
    "mixtral": ["model=mixtral_tiny", "model.embed_dim=64", "model.head_dim=16",
                "model.expert_hidden_dim=32", "training.moe_aux_loss_weight=0"],
}
FAMILIES = list(FAMILY_MODELS)


# Linux hands out ports from 32768 up to any process that binds port 0 (gloo's pairs, JAX's
# coordinator clients) or connects: a job's ports are picked below that range, so that none of
# those can take one between the check here and the job's own bind.
PORTS_BELOW = 32768


def free_port(span: int = 3) -> int:
    """A MASTER_PORT whose `span` ports from it are free (a job of ours listens on MASTER_PORT
    to + 2: torchrun's store, the run dir's handshake, JAX's coordinator), below the range
    the kernel hands out itself."""
    while True:
        port = random.randrange(20000, PORTS_BELOW - span)
        if all(_bindable(port + i) for i in range(span)):
            return port


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def family_tiny(family: str, *overrides: str) -> list[str]:
    """TINY for `family`: its tiny model, then TINY's data and training settings."""
    return [*FAMILY_MODELS[family], *TINY[5:], *overrides]


def jitted_forward(graphdef, state):
    """tokens → logits of the model `graphdef` and `state` make, as one program (run eagerly,
    each of its operations would compile as a program of its own)."""
    run = jax.jit(lambda state, tokens: nnx.merge(graphdef, state)(tokens))
    return lambda tokens: run(state, tokens)


def compose_config(*overrides: str) -> Config:
    with initialize_config_dir(str(REPO / "configs"), version_base=None):
        cfg = compose("config", overrides=list(overrides))
    return OmegaConf.to_object(cfg)


def mesh_arg(fsdp: int, tp: int) -> str:
    return f'model.mesh_shape=[[{fsdp},{tp}],["fsdp","tp"]]'


def train_losses(cfg: Config, steps: int, devices=None) -> tuple[np.ndarray, dict]:
    """Per-step losses of `steps` steps of the real jitted step; also returns the final state."""
    setup = Setup.create(cfg, devices)
    data = setup.open_data()
    state, step_fn = setup.fresh_state(), setup.train_step()
    losses = []
    for _ in range(steps):
        state, metrics = step_fn(state, next(data.train))
        losses.append(float(metrics["loss"]))
    data.close()
    return np.array(losses), state


def cli_env(env_extra: dict | None = None) -> dict:
    """The test process's environment without its 8 forced devices, plus `env_extra`, and
    compile_flags.FAST_COMPILE."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS" and not k.startswith(
        SCHEDULER_VARIABLES)}
    env.update(env_extra or {})
    return with_fast_compile(env)


def run_cli(args: list[str], cwd: Path, env_extra: dict | None = None, timeout: int = 600,
            script: str = "run_training.py") -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(REPO / script), *args], cwd=cwd, env=cli_env(env_extra),
        capture_output=True, text=True, timeout=timeout,
    )


def start_cli(args: list[str], cwd: Path, env_extra: dict | None = None,
              script: str = "run_training.py") -> subprocess.Popen:
    """A running CLI whose stdout and stderr are one stream of text lines (to react to them)."""
    return subprocess.Popen(
        [sys.executable, str(REPO / script), *args], cwd=cwd, env=cli_env(env_extra),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
    )


def sigterm_when_paused(args: list[str], cwd: Path, at_step: int, env_extra: dict | None = None,
                        timeout: int = 300) -> str:
    """tests/faulty_training.py paused after step `at_step` (tests/faults.py), then SIGTERMed
    and released: it must stop after exactly that step, saved, and exit 0 (events, not timing,
    decide where the signal lands). Returns its output."""
    go = cwd / f"go-{time.monotonic_ns()}"  # a file of its own: an old one would not pause it
    faults = json.dumps({"pause_at_step": at_step, "resume_file": str(go)})
    process = start_cli(args, cwd, {**(env_extra or {}), faults_lib.ENV: faults},
                        script="tests/faulty_training.py")
    lines = []
    for line in process.stdout:
        lines.append(line)
        if f"paused after step {at_step} " in line:
            process.send_signal(signal.SIGTERM)
            go.touch()
    output = "".join(lines)
    assert process.wait(timeout=timeout) == 0, output[-4000:]
    return output


def compiled_run(cfg: Config, steps: int, devices=None):
    """The step compiled ahead of time as a run compiles it, its costs, and `steps` losses.

    Returns (setup, costs, losses, final state)."""
    setup = Setup.create(cfg, devices)
    compiled = setup.compile_train_step()
    costs = setup.analyse(compiled)
    losses, state, step = [], None, setup.runnable(compiled)
    if steps:
        data = setup.open_data()
        state = setup.fresh_state()
        for _ in range(steps):
            state, metrics = step(state, next(data.train))
            losses.append(float(metrics["loss"]))
        data.close()
    return setup, costs, np.array(losses), state


# Pipeline meshes of 8 devices (tests/test_pipeline*.py).
PP_MESHES = {"2x2x2": [[2, 2, 2], ["pp", "fsdp", "tp"]], "4x1x2": [[4, 1, 2], ["pp", "fsdp", "tp"]],
             "2x4x1": [[2, 4, 1], ["pp", "fsdp", "tp"]]}


def mesh_of(shape) -> str:
    sizes, names = shape
    return f"model.mesh_shape=[{sizes},[{','.join(f'{n!r}' for n in names)}]]".replace("'", '"')


def assert_restores_onto(run, other, tmp_path) -> None:
    """`run`'s (compiled_run's) final state saved, then restored onto `other` (a Setup on
    another mesh): every array equal, in `other`'s shardings."""
    setup, _, _, state = run
    checkpoints = Checkpoints(tmp_path, CheckpointConfig(async_save=False))
    checkpoints.save(int(state["step"]), state, {}, config_lib.to_dict(setup.cfg))
    checkpoints.close()
    restored = checkpoint.restore(tmp_path, other.state.with_shardings(),
                                  config_lib.to_dict(other.cfg)).state
    for got, want, sharding in zip(jax.tree.leaves(restored), jax.tree.leaves(state),
                                   jax.tree.leaves(other.state.shardings)):
        assert got.sharding == sharding
        np.testing.assert_array_equal(jax.device_get(got), jax.device_get(want))
