"""Numerics against references: the 1-device run and the full-batch run."""

import jax
import numpy as np
import pytest

from helpers import TINY, compose_config, mesh_arg, train_losses

STEPS = 5
GLOBAL_BATCH = 8


@pytest.fixture(scope="module")
def single_device_losses():
    cfg = compose_config(*TINY, mesh_arg(1, 1), f"training.micro_batch_size={GLOBAL_BATCH}")
    losses, _ = train_losses(cfg, STEPS, jax.devices()[:1])
    return losses


@pytest.mark.parametrize("fsdp,tp", [(8, 1), (1, 4), (2, 4)])
def test_every_mesh_gives_the_single_device_losses(single_device_losses, fsdp, tp):
    micro = GLOBAL_BATCH // fsdp
    cfg = compose_config(*TINY, mesh_arg(fsdp, tp), f"training.micro_batch_size={micro}")
    losses, _ = train_losses(cfg, STEPS, jax.devices()[: fsdp * tp])
    np.testing.assert_allclose(losses, single_device_losses, rtol=1e-5)
    assert losses[-1] < losses[0]  # and it is actually training


def test_accumulation_equals_the_full_batch():
    full = compose_config(*TINY, mesh_arg(1, 1), "training.micro_batch_size=8")
    accumulated = compose_config(*TINY, mesh_arg(1, 1), "training.micro_batch_size=2",
                                 "training.gradient_accumulation_steps=4")
    devices = jax.devices()[:1]
    reference, ref_state = train_losses(full, STEPS, devices)
    losses, state = train_losses(accumulated, STEPS, devices)
    np.testing.assert_allclose(losses, reference, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(state["params"]), jax.tree.leaves(ref_state["params"])):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_bf16_compute_tracks_fp32_with_fp32_master_weights():
    fp32 = compose_config(*TINY, mesh_arg(2, 2), "training.micro_batch_size=4")
    bf16 = compose_config(*TINY, mesh_arg(2, 2), "training.micro_batch_size=4",
                          "training.mixed_precision=bf16")
    devices = jax.devices()[:4]
    reference, _ = train_losses(fp32, STEPS, devices)
    losses, state = train_losses(bf16, STEPS, devices)
    assert all(x.dtype == np.float32 for x in jax.tree.leaves(state["params"]))
    np.testing.assert_allclose(losses, reference, rtol=3e-2)
    assert not np.array_equal(losses, reference)  # the compute really ran in bf16
