"""KV-cache generation against full recomputation, transformers, and itself across meshes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers import TINY, compose_config, mesh_arg
from tunix_train.models import families
from tunix_train.inference import sampler as sampler_lib
from tunix_train.inference.sampler import Sampler, SamplingOptions, left_pad, _stop_at_eos
from tunix_train.training.setup import Setup

NEW = 24
# Longer than the window (16), shorter, and a single token: ragged rows of one batch.
PROMPTS = [list(range(40, 61)), [7, 100, 33, 2, 9], [200]]

# One program, as inside generation's loop, not op by op.
sample = jax.jit(sampler_lib.sample, static_argnums=2)


def varied(params, seed=1):
    """Random norm scales: an untrained model with zero (= identity) scales repeats one token,
    which would make any decoder look right."""
    keys = iter(jax.random.split(jax.random.key(seed), 64))
    return jax.tree_util.tree_map_with_path(
        lambda path, x: jax.random.normal(next(keys), x.shape) if path[-1].key == "scale" else x,
        params)


@pytest.fixture(scope="module")
def model():
    cfg = compose_config(*TINY, mesh_arg(2, 4))
    setup = Setup.create(cfg)
    params = jax.jit(lambda: nnx.to_pure_dict(nnx.state(families.build(cfg.model, nnx.Rngs(0)))))()
    return cfg, setup, setup.params.graphdef, varied(params)


def full_recompute_greedy(graphdef, params, prompt, new, length=64):
    """Argmax decoding that re-runs the training forward over the whole sequence each step.

    The sequence sits in a fixed-length buffer (one compilation); causal attention makes the
    zeros after it irrelevant to the logits read at its last token."""
    forward = jax.jit(lambda p, t: nnx.merge(graphdef, p)(t))
    buffer = np.zeros((1, length), np.int32)
    buffer[0, :len(prompt)] = prompt
    for length in range(len(prompt), len(prompt) + new):
        buffer[0, length] = int(jnp.argmax(forward(params, buffer)[0, length - 1]))
    return buffer[0, len(prompt):len(prompt) + new].tolist()


def test_cached_greedy_equals_full_recomputation_on_a_sharded_batch(model):
    cfg, setup, graphdef, params = model
    sharded = jax.device_put(params, setup.params.shardings)
    sampler = Sampler(graphdef, setup.params.shardings, SamplingOptions(NEW),
                      jnp.float32, setup.mesh, setup.params.rules.params)
    got = sampler(sharded, PROMPTS)
    for prompt, row in zip(PROMPTS, got):
        assert row == full_recompute_greedy(graphdef, params, prompt, NEW)
    assert len(set(got[0])) > 4  # the check above is not comparing constant sequences


def test_greedy_on_a_pipeline_mesh_equals_full_recomputation():
    """A pp run's parameters, laid out as its mesh stores them (3 blocks over 2 stages: the
    stacks whole over pp, split over fsdp × pp), generate what the unsharded model does."""
    cfg = compose_config(*TINY, "model.num_layers=7", "model.global_every=2",
                         'model.mesh_shape=[[2,2,2],["pp","fsdp","tp"]]')
    setup = Setup.create(cfg)
    params = varied(jax.jit(lambda: nnx.to_pure_dict(
        nnx.state(families.build(cfg.model, nnx.Rngs(0)))))())
    assert any(("fsdp", "pp") in s.spec for s in jax.tree.leaves(setup.params.shardings))
    sampler = Sampler(setup.params.graphdef, setup.params.shardings, SamplingOptions(8),
                      jnp.float32, setup.mesh, setup.params.rules.params)
    got = sampler(jax.device_put(params, setup.params.shardings), PROMPTS[:2])
    for prompt, row in zip(PROMPTS[:2], got):
        assert row == full_recompute_greedy(setup.params.graphdef, params, prompt, 8)
    assert len(set(got[0])) > 2  # not constant sequences


def test_sampling_keeps_to_the_top_k_and_greedy_is_argmax():
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(2000, 50)), jnp.float32)
    top3 = np.argsort(np.asarray(logits), axis=1)[:, -3:]
    drawn, logps = sample(logits, jax.random.key(0), SamplingOptions(1, 1.0, top_k=3))
    drawn = np.asarray(drawn)
    assert all(d in row for d, row in zip(drawn, top3))
    assert len(set(drawn.tolist())) > 10  # it samples, it does not take the argmax
    # The log-probability is of the whole tempered distribution, not of the top-k renormalised.
    full = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    np.testing.assert_allclose(logps, full[np.arange(2000), drawn], rtol=1e-5)
    greedy, _ = sample(logits, jax.random.key(0), SamplingOptions(1, 0.0))
    np.testing.assert_array_equal(greedy, np.argmax(logits, axis=1))


def test_nucleus_sampling_draws_from_the_smallest_set_reaching_top_p():
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(500, 20)).astype(np.float32) * 2
    temperature, top_p = 0.7, 0.6
    drawn, logps = sample(jnp.asarray(logits), jax.random.key(3),
                          SamplingOptions(1, temperature, top_p=top_p))
    probs = np.asarray(jax.nn.softmax(logits / temperature, axis=-1))
    for row, token in zip(probs, np.asarray(drawn)):
        order = np.argsort(-row)
        before = np.cumsum(row[order]) - row[order]
        assert token in set(order[before < top_p].tolist())
    np.testing.assert_allclose(np.exp(logps), probs[np.arange(500), np.asarray(drawn)],
                               rtol=1e-5)


def test_rows_stop_after_their_eos_and_left_padding_aligns_prompts():
    tokens, counts, logps = _stop_at_eos(jnp.asarray([[5, 2, 7, 2], [5, 6, 7, 8]]),
                                         -jnp.ones((2, 4)), eos_id=2)
    np.testing.assert_array_equal(tokens, [[5, 2, 0, 0], [5, 6, 7, 8]])
    np.testing.assert_array_equal(counts, [2, 4])
    np.testing.assert_array_equal(logps, [[-1, -1, 0, 0], [-1, -1, -1, -1]])
    padded, lengths = left_pad([[1, 2, 3], [4]])
    np.testing.assert_array_equal(padded, [[1, 2, 3], [0, 0, 4]])
    np.testing.assert_array_equal(lengths, [3, 1])
