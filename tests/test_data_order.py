"""The global batch order is the same for 1 and 2 real processes, each process reads only its
share, and an iterator state saved on one process count restores exactly on another."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from compile_flags import with_fast_compile
from helpers import REPO, TINY, compose_config, free_port
from tunix_train.data import demo
from tunix_train.training.setup import Setup

pytestmark = pytest.mark.slow
BATCHES = 3  # batches before the state is taken


def _overrides(corpus):
    # 8 rows in every run: micro-batch 2 × fsdp 4 (4 devices, in one or in two processes).
    return [*TINY, "data=text", f"data.path={corpus}", "data.seq_len=16",
            "training.micro_batch_size=2", 'model.mesh_shape=[[-1,1],["fsdp","tp"]]']


def _one_process(overrides, restore=None):
    """(BATCHES + 1 batches, state after BATCHES, next batch after restoring `restore`)."""
    cfg = compose_config(*overrides)
    data = Setup.create(cfg, jax.devices()[:4]).open_data()
    host = lambda b: {k: np.asarray(v) for k, v in b.items()}  # noqa: E731
    batches = [host(next(data.train)) for _ in range(BATCHES)]
    state = json.loads(json.dumps(data.train.get_state()))
    batches.append(host(next(data.train)))
    restored = None
    if restore is not None:
        data.train.set_state(restore)
        restored = host(next(data.train))
    data.close()
    return batches, state, restored


def _two_processes(out, overrides, restore_file):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2")
    with_fast_compile(env)
    worker = REPO / "tests" / "data_order_worker.py"
    procs = [subprocess.Popen([sys.executable, str(worker), str(out), str(BATCHES),
                               str(restore_file), *overrides], env={**env, "RANK": str(rank)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for rank in range(2)]
    logs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(logs)[-5000:]
    return ([np.load(out / f"rank{r}.npz") for r in range(2)],
            [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)])


def test_one_and_two_processes_read_the_same_global_batches(tmp_path):
    corpus = tmp_path / "corpus"
    demo.write_text(corpus, demo.documents())
    overrides = _overrides(corpus)
    reference, state, _ = _one_process(overrides)
    (tmp_path / "state.json").write_text(json.dumps(state))
    arrays, reports = _two_processes(tmp_path, overrides, tmp_path / "state.json")

    assert [r["streams"] for r in reports] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    for rank in range(2):
        for i, batch in enumerate(reference):
            for name, value in batch.items():
                np.testing.assert_array_equal(arrays[rank][f"{i}/{name}"], value,
                                              err_msg=f"rank {rank} batch {i} {name}")
        # The state saved by one process, restored on two: batch BATCHES + 1 again.
        for name, value in reference[BATCHES].items():
            np.testing.assert_array_equal(arrays[rank][f"restored/{name}"], value)
    # Each process read only the documents of its own rows.
    read = [set(r["read"]) for r in reports]
    assert read[0] and read[1] and not read[0] & read[1]
    # The state two processes saved (gathered, in global rows) restores on one.
    assert reports[0]["state"] == reports[1]["state"] == state
    _, _, restored = _one_process(overrides, restore=reports[0]["state"])
    for name, value in reference[BATCHES].items():
        np.testing.assert_array_equal(restored[name], value)
