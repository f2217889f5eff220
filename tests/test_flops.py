"""Model FLOPs for MFU, against independent counts: the attention mask itself, XLA's own count
of a layer's forward pass, and the published device peaks."""

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers import compose_config
from tunix_train.analysis import flops
from tunix_train.config import LoggingConfig
from tunix_train.models import families, rope
from tunix_train.models.decoder import DecoderLayer
from tunix_train.models.family import Rope


def attended_pairs(seq_len, window):
    """(query, key) pairs a causal layer computes, counted on the mask."""
    allowed = np.tril(np.ones((seq_len, seq_len), bool))
    if window is not None:
        allowed &= ~np.tril(np.ones((seq_len, seq_len), bool), -window)
    return allowed.sum()


@pytest.mark.parametrize("seq_len,window", [(2048, 512), (2048, None), (100, 512), (33, 8)])
def test_mean_context_counts_the_causal_half_and_the_window(seq_len, window):
    assert flops.mean_context(seq_len, window) * seq_len == pytest.approx(
        attended_pairs(seq_len, window))


def test_gemma3_1b_flops_per_token_is_6n_plus_masked_attention():
    model = compose_config("model=gemma3_1b").model
    local = 22  # 26 layers: 4 blocks of 5 locals and a global, 2 trailing locals
    pairs = local * attended_pairs(2048, 512) + (26 - local) * attended_pairs(2048, None)
    # QKᵀ and AV: 2 matmuls × 2 FLOPs × heads × head_dim per pair, × 3 for forward + backward.
    count = families.count_params(model)
    expected = 6 * count + 12 * model.num_heads * model.head_dim * pairs / 2048
    assert flops.training_flops_per_token(model, 2048) == pytest.approx(expected)
    # The windows halve attention: counted as full causal layers it would be ~1.9× larger.
    full = 12 * model.num_heads * model.head_dim * model.num_layers * (2048 + 1) / 2
    assert expected - 6 * count < full / 1.8


def test_an_untied_head_counts_as_a_matmul_and_the_embedding_lookup_not_at_all():
    model = compose_config("model=llama3_1_8b").model
    lookup = model.vocab_size * model.embed_dim
    attention = 12 * model.num_heads * model.head_dim * model.num_layers * (4096 + 1) / 2
    assert families.count_params(model) == pytest.approx(8.03e9, rel=0.01)  # published 8.03B
    assert flops.training_flops_per_token(model, 4096) == pytest.approx(
        6 * (families.count_params(model) - lookup) + attention)


@pytest.mark.parametrize("family", sorted(families.FAMILIES))
def test_a_layer_forward_costs_what_xla_counts(family):
    # Forward = 2 FLOPs per parameter per token + 4·heads·head_dim per attended pair. XLA's
    # attention computes every (query, key) pair and masks afterwards: compare at full context.
    cfg = compose_config("model.embed_dim=256", "model.hidden_dim=1024", "model.head_dim=64",
                         "model.num_kv_heads=2", "model.attention_impl=xla").model
    layer = DecoderLayer(cfg, nnx.Rngs(0), families.FAMILIES[family].architecture)
    graphdef, state = nnx.split(layer)
    length = 256
    x = jnp.zeros((1, length, cfg.embed_dim))
    tables = rope.tables(jnp.arange(length)[None], {"layers": Rope(10_000.0)}, cfg.head_dim)
    forward = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x, tables["layers"], None, None))
    analysis = forward.lower(state, x).compile().cost_analysis()
    counted = (analysis[0] if isinstance(analysis, list) else analysis)["flops"]
    params = sum(v.size for v in jax.tree.leaves(state))
    modelled = length * (2 * params + 4 * cfg.num_heads * cfg.head_dim * length)
    assert counted == pytest.approx(modelled, rel=0.05)


def test_peak_flops_by_device_kind_and_override():
    kind = lambda name: SimpleNamespace(device_kind=name)  # noqa: E731
    assert flops.peak_flops_per_device(LoggingConfig(), kind("NVIDIA H100 80GB HBM3")) == 989.4e12
    assert flops.peak_flops_per_device(LoggingConfig(), kind("NVIDIA H100 PCIe")) == 756e12
    assert flops.peak_flops_per_device(LoggingConfig(), kind("NVIDIA A100-SXM4-80GB")) == 312e12
    assert flops.peak_flops_per_device(LoggingConfig(), kind("cpu")) is None
    assert flops.peak_flops_per_device(LoggingConfig(peak_tflops=2.5), kind("cpu")) == 2.5e12
