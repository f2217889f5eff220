"""The blockwise attention (models/blockwise.py) against XLA's dense attention: outputs and
gradients with document masks and sliding windows, through the real train step on a sharded
mesh, its memory against the sequence length, and which attention path `auto` picks."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import TINY, compose_config, mesh_arg, train_losses
from tunix_train.analysis import hlo
from tunix_train.models import attention, blockwise


def dense(q, k, v, segment_ids, window, scale):
    """The reference: every [L, L] score, the document mask as segment_q == segment_k."""
    mask = None if segment_ids is None else \
        segment_ids[:, None, :, None] == segment_ids[:, None, None, :]
    return jax.nn.dot_product_attention(
        q, k, v, mask=mask, scale=scale, is_causal=True, implementation="xla",
        local_window_size=(window - 1, 0) if window else None)


def inputs(length=96, heads=4, kv_heads=2, head_dim=8, batch=2, seed=0):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(batch, length, heads, head_dim)), jnp.float32)
    k, v, weights = (jnp.asarray(rng.normal(size=shape), jnp.float32) for shape in (
        (batch, length, kv_heads, head_dim), (batch, length, kv_heads, head_dim), q.shape))
    # Packed rows: documents of random lengths, ids increasing along the row.
    segments = jnp.asarray(np.sort(rng.integers(0, 5, size=(batch, length)), axis=1))
    return q, k, v, weights, segments


# 16 and 32 divide 96; 40 does not (the sequence is padded); 128 > 96 is one block.
@pytest.mark.parametrize("block", [16, 40, 128])
@pytest.mark.parametrize("window", [None, 20, 7])
@pytest.mark.parametrize("packed", [False, True])
def test_outputs_and_gradients_equal_dense_attention(block, window, packed):
    assert_equals_dense(lambda q, k, v, segments: blockwise.attention(
        q, k, v, segments, scale=0.3, window=window, block=block), window, packed)


def assert_equals_dense(ours, window: int | None, packed: bool, head_dim: int = 8) -> None:
    """`ours(q, k, v, segments)` and its dq, dk, dv equal dense attention's (scale 0.3) to
    1e-5 on 96 tokens, 4 query heads reading 2 KV heads."""
    q, k, v, weights, segments = inputs(head_dim=head_dim)
    segments = segments if packed else None

    def value_and_grads(fn):
        return jax.value_and_grad(lambda q, k, v: jnp.sum(fn(q, k, v, segments) * weights),
                                  argnums=(0, 1, 2))(q, k, v)

    def reference(q, k, v, segments):
        return dense(q, k, v, segments, window, 0.3)

    got, want = value_and_grads(ours), value_and_grads(reference)
    np.testing.assert_allclose(ours(q, k, v, segments), reference(q, k, v, segments),
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    for g, w in zip(got[1], want[1]):  # dq, dk, dv (dk and dv summed over each KV head's group)
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5 * float(jnp.abs(w).max()))


def temporaries(fn, length, batch=1, heads=4, head_dim=32):
    q = jax.ShapeDtypeStruct((batch, length, heads, head_dim), jnp.float32)
    kv = jax.ShapeDtypeStruct((batch, length, 1, head_dim), jnp.float32)
    seg = jax.ShapeDtypeStruct((batch, length), jnp.int32)
    grad = jax.grad(lambda q, k, v, s: jnp.sum(fn(q, k, v, s)), argnums=(0, 1, 2))
    return jax.jit(grad).lower(q, kv, kv, seg).compile().memory_analysis().temp_size_in_bytes


def test_memory_is_linear_in_the_sequence_length():
    """Forward and backward compiled at 1,024 and 4,096 tokens: 4× the tokens, about 4× the
    temporaries (dense attention: about 16×, its [B, N, L, L] scores and mask)."""
    def ours(q, k, v, s):
        return blockwise.attention(q, k, v, s, scale=0.2, window=None, block=256)

    def reference(q, k, v, s):
        return dense(q, k, v, s, None, 0.2)

    short, long = temporaries(ours, 1024), temporaries(ours, 4096)
    assert long <= 4.5 * short
    scores_fp32 = 1 * 4 * 4096 * 4096 * 4  # B · N · L² · 4 bytes: what dense attention holds
    assert long < scores_fp32 / 8
    assert temporaries(reference, 4096) >= scores_fp32 > 10 * long


def test_the_train_step_with_blockwise_attention_equals_dense_on_a_sharded_mesh():
    """Packed documents, 128 tokens in blocks of 64 (local layers' window of 16 reaches one
    block back): blockwise attention inside the pipeline's stages."""
    assert blockwise.block_size(128) == 64
    assert_train_step_equals_dense("blockwise")


def assert_train_step_equals_dense(implementation: str) -> None:
    """3 steps with `implementation` on pp 2 × fsdp 2 × tp 2 give the losses of XLA's dense
    attention on fsdp 2 × tp 2 (packed documents, 128 tokens, local windows of 16)."""
    common = [*TINY, "model.num_layers=9", "model.global_every=2", "data.seq_len=128",
              "training.global_batch_size=8"]
    pipelined = 'model.mesh_shape=[[2,2,2],["pp","fsdp","tp"]]'
    got, _ = train_losses(
        compose_config(*common, pipelined, f"model.attention_impl={implementation}"), 3)
    want, _ = train_losses(compose_config(*common, mesh_arg(2, 2), "model.attention_impl=xla"),
                           3, jax.devices()[:4])
    assert want[-1] < want[0]
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_auto_picks_cudnn_on_a_gpu_unless_a_document_bias_would_be_large_then_the_kernels(monkeypatch):
    path_of = functools.partial(attention.attention_path, head_dim=256)
    monkeypatch.setattr(attention.jax, "default_backend", lambda: "gpu")
    bf16, long = jnp.bfloat16, attention.CUDNN_BIAS_MAX_TOKENS * 2
    assert path_of("auto", bf16, masked=True, length=2048)[0] == "cudnn"
    assert path_of("auto", bf16, masked=False, length=long)[0] == "cudnn"
    path, why = path_of("auto", bf16, masked=True, length=long)
    assert path == "pallas" and f"document masks at {long} tokens" in why
    assert attention.attention_path("auto", bf16, True, long, head_dim=96)[0] == "blockwise"
    assert path_of("auto", jnp.float32, masked=False, length=2048)[0] == "blockwise"
    assert path_of("xla", bf16, masked=True, length=2048)[0] == "xla"
    # Without cuDNN: dense below BLOCKWISE_MIN_TOKENS, blockwise from it; by name, as asked.
    monkeypatch.setattr(attention.jax, "default_backend", lambda: "cpu")
    short = attention.BLOCKWISE_MIN_TOKENS
    assert path_of("auto", bf16, masked=True, length=short)[0] == "blockwise"
    assert path_of("auto", bf16, masked=True, length=short - 1)[0] == "xla"
    assert path_of("blockwise", bf16, masked=False, length=32)[0] == "blockwise"
    # Small heads gain sooner (bench/attention.py --head-dim 64).
    small = attention.SMALL_HEAD_MIN_TOKENS
    for head_dim, length, path in ((64, small, "blockwise"), (64, small - 1, "xla"),
                                   (128, small, "xla"), (32, small, "blockwise")):
        assert attention.attention_path("auto", bf16, True, length, head_dim)[0] == path


@pytest.mark.parametrize("length,block", [(32, 64), (256, 64), (1024, 256), (2048, 512),
                                          (32768, 512), (300, 64)])
def test_block_size_is_a_quarter_of_the_sequence_within_64_and_512(length, block):
    assert blockwise.block_size(length) == block


@pytest.mark.parametrize("window", [None, 100])
def test_the_planners_flop_count_is_the_tiles_visited(window):
    """Every loop has a known trip count, so the planner's HLO count (analysis/hlo.py) is the
    work done: 7 tile matmuls (2 forward, 5 backward) per visited tile, the tiles found here
    by brute force over positions (the backward's Σ dO·O compiles to a reduction, not a dot)."""
    B, L, N, H, block = 2, 512, 2, 16, 64
    q = jax.ShapeDtypeStruct((B, L, N, H), jnp.float32)
    seg = jax.ShapeDtypeStruct((B, L), jnp.int32)
    grad = jax.grad(lambda q, k, v, s: jnp.sum(blockwise.attention(
        q, k, v, s, scale=0.25, window=window, block=block)), argnums=(0, 1, 2))
    module = hlo.parse(jax.jit(grad).lower(q, q, q, seg).compile().as_text())

    position = np.arange(L)
    sees = position[None, :] <= position[:, None]  # [query, key]
    if window:
        sees &= position[:, None] - position[None, :] < window
    tiles = sees.reshape(L // block, block, L // block, block).any(axis=(1, 3)).sum()
    assert module.warnings == []
    assert hlo.flops(module) == 7 * tiles * 2 * B * N * block * block * H



def test_in_bf16_it_is_as_close_to_fp32_attention_as_dense_bf16_is():
    """The GPU path computes in bf16 (scores and sums in fp32, probabilities cast to bf16 for
    their products): its error against fp32 attention stays within twice dense bf16's."""
    assert_bf16_as_close_as_dense(
        lambda q, k, v, segments: blockwise.attention(q, k, v, segments, scale=0.125, window=48,
                                                      block=64),
        length=256, head_dim=64, scale=0.125, window=48)


def assert_bf16_as_close_as_dense(ours, length: int, head_dim: int, scale: float, window: int):
    """Gradients of `ours(q, k, v, segments)` in bf16 are within twice dense bf16's error
    against fp32 dense attention."""
    q, k, v, weights, segments = inputs(length=length, head_dim=head_dim)

    def grads(fn, dtype):  # one program each, as in a train step, not op by op
        cast = [a.astype(dtype) for a in (q, k, v)]
        return jax.jit(jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32) * weights),
                                argnums=(0, 1, 2)))(*cast)

    def reference(q, k, v):
        return dense(q, k, v, segments, window, scale)

    exact = grads(reference, jnp.float32)
    for got, dense_bf16, want in zip(grads(lambda q, k, v: ours(q, k, v, segments), jnp.bfloat16),
                                     grads(reference, jnp.bfloat16), exact):
        error = float(jnp.abs(got.astype(jnp.float32) - want).max())
        dense_error = float(jnp.abs(dense_bf16.astype(jnp.float32) - want).max())
        assert error <= 2 * dense_error
