"""The Pallas flash attention kernels (models/flash.py) against XLA's dense attention, run by
Pallas's interpreter on CPU; their loop bounds against brute force; what they lower to for a
GPU (Triton kernels, no [L, L] array, each device's own heads on a mesh), lowered here without
one; and the real train step with them on a sharded mesh."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType

from helpers import TINY, compose_config, family_tiny, mesh_arg
from test_blockwise import (assert_bf16_as_close_as_dense, assert_equals_dense,
                            assert_train_step_equals_dense)
from tunix_train.config import ConfigError, ModelConfig
from tunix_train.validation import validate
from tunix_train.models import attention as attention_lib
from tunix_train.models import flash, gemma3
from tunix_train.parallel import sharding


# 96 tokens: blocks of 16 divide them; a block of 64 pads them to 128.
@pytest.mark.parametrize("block,window,packed", [
    (16, None, True), (16, 18, True), (16, 7, True), (16, None, False),
    (64, None, True), (64, 7, True)])
def test_outputs_and_gradients_equal_dense_attention(block, window, packed):
    """4 query heads reading 2 KV heads; fp32, 1e-5 relative."""
    assert_equals_dense(lambda q, k, v, segments: flash.attention(
        q, k, v, segments, scale=0.3, window=window, block=block), window, packed, head_dim=16)


@pytest.mark.parametrize("window", [None, 1, 2, 20, 33, 34, 64, 100])
def test_each_program_visits_exactly_the_blocks_with_a_visible_pair(window):
    """Loop bounds against brute force over positions: a bound too wide would cost work the
    numerics cannot see, one too narrow would drop keys."""
    L, b = 512, 32
    tiles = flash._Tiles(b, window, 1.0, 1, True, 4)
    position = np.arange(L)
    sees = position[None, :] <= position[:, None]  # [query, key]
    if window:
        sees &= position[:, None] - position[None, :] < window
    blocks = sees.reshape(L // b, b, L // b, b).any(axis=(1, 3))  # [query block, key block]
    for i in range(L // b):
        first, end = tiles.key_blocks(i)
        assert list(range(int(first), int(end))) == list(np.flatnonzero(blocks[i]))
        first, end = tiles.query_blocks(i, L // b)
        assert list(range(int(first), int(end))) == list(np.flatnonzero(blocks[:, i]))


def test_in_bf16_it_is_as_close_to_fp32_attention_as_dense_bf16_is():
    """Scores, sums and accumulators in fp32, operands in bf16, as on a GPU: the error against
    fp32 attention stays within twice dense bf16's."""
    assert_bf16_as_close_as_dense(
        lambda q, k, v, segments: flash.attention(q, k, v, segments, scale=0.125, window=48,
                                                  block=32),
        length=128, head_dim=32, scale=0.125, window=48)


def h100s(shape=(1,), axes=("gpu",)) -> jax.sharding.AbstractMesh:
    """A mesh of H100s with no GPU attached: what the kernels are lowered for (jax 0.11's Pallas
    reads the target's compute capability from the abstract mesh in context; jax 0.10's needed
    none)."""
    return jax.sharding.AbstractMesh(shape, axes, (AxisType.Auto,) * len(axes),
                                     abstract_device=jax.sharding.AbstractDevice(
                                         device_kind="NVIDIA H100 80GB HBM3", num_cores=132,
                                         platform="gpu"))


def triton_calls(fn, *shapes, mesh: jax.sharding.AbstractMesh | None = None
                 ) -> list[tuple[str, str]]:
    """(kernel name, operand types) of each Triton kernel in `fn`'s program lowered for CUDA on
    `mesh` (one H100 by default; no GPU needed); also asserts that nothing in it is
    [L, L]-sized."""
    with jax.sharding.use_abstract_mesh(mesh or h100s()):
        text = jax.jit(fn).trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()
    length = shapes[0].shape[1]
    assert not re.search(rf"tensor<([0-9]+x)*{length}x([0-9]+x)*{length}x", text)
    return re.findall(r'custom_call @__gpu\$xla\.gpu\.triton\(.*?name = "(\w+)".*?: \((.*?)\) ->',
                      text)


@pytest.mark.parametrize("heads,kv_heads,head_dim,window", [(4, 1, 256, 512), (8, 4, 256, None),
                                                            (4, 1, 64, 128)])
def test_for_a_gpu_it_lowers_to_three_triton_kernels_and_no_square_array(heads, kv_heads,
                                                                          head_dim, window):
    """Gemma 3's heads at 8,192 tokens: the forward pass and the backward pass's dQ and dK/dV
    kernels, with no [L, L] scores, mask or bias anywhere in the program."""
    L = 8192
    q = jax.ShapeDtypeStruct((1, L, heads, head_dim), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, L, kv_heads, head_dim), jnp.bfloat16)
    segments = jax.ShapeDtypeStruct((1, L), jnp.int32)

    def loss(q, k, v, s):
        out = flash.attention(q, k, v, s, scale=0.06, window=window, interpret=False)
        return out.astype(jnp.float32).sum()

    calls = triton_calls(jax.grad(loss, argnums=(0, 1, 2)), q, kv, kv, segments)
    assert [name for name, _ in calls] == ["flash_forward", "flash_dq", "flash_dkv"]


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_on_a_mesh_each_device_runs_the_kernels_on_its_own_rows_and_heads(monkeypatch,
                                                                          kv_heads):
    """fsdp 2 × tp 4 outside the train step's shard_map (the evaluation step's case): each
    kernel gets a quarter of the 8 query heads and half the rows. KV heads split with them
    where tp divides them (4), else each device gets copies of its own heads' (2)."""
    monkeypatch.setattr(attention_lib.jax, "default_backend", lambda: "gpu")
    mesh = h100s((2, 4), ("fsdp", "tp"))
    attention = attention_lib.Attention(ModelConfig(embed_dim=32, num_heads=8,
                                                    num_kv_heads=kv_heads, head_dim=64),
                                        nnx.Rngs(0), gemma3.FAMILY.architecture)

    def loss(q, k, v, s):
        with sharding.activate(mesh, tuple(sharding.RULES.items())):
            return attention._pallas(q, k, v, s, 16).astype(jnp.float32).sum()

    q = jax.ShapeDtypeStruct((4, 128, 8, 64), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((4, 128, kv_heads, 64), jnp.bfloat16)
    segments = jax.ShapeDtypeStruct((4, 128), jnp.int32)
    calls = triton_calls(jax.grad(loss, argnums=(0, 1, 2)), q, kv, kv, segments, mesh=mesh)
    local_kv = kv_heads // 4 if kv_heads % 4 == 0 else 2
    assert len(calls) == 3
    for _, operands in calls:
        assert operands.startswith(f"tensor<2x128x2x64xbf16>, tensor<2x128x{local_kv}x64xbf16>")


def test_the_train_step_with_the_kernels_equals_dense_on_a_sharded_mesh():
    """Inside the pipeline's stages, one KV head copied to each tp device's query heads."""
    assert_train_step_equals_dense("pallas")


def test_auto_picks_the_kernels_only_for_long_packed_rows_on_a_gpu_and_never_on_cpu(monkeypatch):
    """Where they were measured faster (docs/performance.md): packed rows above the length at
    which cuDNN's document bias grows large; cuDNN everywhere else on a GPU."""
    long = attention_lib.CUDNN_BIAS_MAX_TOKENS + 1
    for backend in ("gpu", "cpu"):
        monkeypatch.setattr(attention_lib.jax, "default_backend", lambda backend=backend: backend)
        for masked in (False, True):
            for length in (256, 2048, attention_lib.CUDNN_BIAS_MAX_TOKENS, long, 65536):
                path, _ = attention_lib.attention_path("auto", jnp.bfloat16, masked, length, 64)
                picked = backend == "gpu" and masked and length >= long
                assert (path == "pallas") == picked, (backend, masked, length, path)
    monkeypatch.setattr(attention_lib.jax, "default_backend", lambda: "gpu")
    assert attention_lib.attention_path("pallas", jnp.bfloat16, True, 2048, 64) == (
        "pallas", "model.attention_impl=pallas")
    monkeypatch.setattr(attention_lib.jax, "default_backend", lambda: "cpu")
    path, why = attention_lib.attention_path("pallas", jnp.float32, True, 2048, 64)
    assert path == "pallas" and "interpreter" in why


@pytest.mark.parametrize("head_dim", [8, 24, 96])
def test_a_head_dim_the_kernels_cannot_tile_is_refused_by_name(head_dim):
    cfg = compose_config("model.attention_impl=pallas", f"model.head_dim={head_dim}")
    with pytest.raises(ConfigError, match=rf"model.head_dim of at least 16, not {head_dim}; "
                                          "use model.attention_impl=blockwise"):
        validate(cfg)
    assert not flash.supported_head_dim(head_dim) and flash.supported_head_dim(256)


def test_the_planner_plans_the_kernels_as_the_blockwise_attention(tmp_path, caplog):
    """A CPU cannot compile the kernels (it would interpret them): the planner compiles the
    blockwise attention instead, which saves the same residuals, and says so."""
    from tunix_train import plan

    common = [*TINY, "data.seq_len=128", mesh_arg(4, 2), "training.micro_batch_size=1"]
    records = {}
    for impl in ("pallas", "blockwise"):
        (tmp_path / impl).mkdir()
        with caplog.at_level("INFO", logger="tunix_train"):
            records[impl] = plan.plan(compose_config(*common, f"model.attention_impl={impl}"),
                                      tmp_path / impl)
    assert records["pallas"]["per_device_bytes"] == records["blockwise"]["per_device_bytes"]
    assert "model.attention_impl=pallas planned as blockwise" in caplog.text


@pytest.mark.parametrize("family,head_dim", [("llama3", 64), ("qwen3", 128)])
def test_each_familys_loss_and_gradients_with_the_kernels_equal_dense(family, head_dim):
    """Llama 3 and Qwen 3 at their published head dims (64 for Llama 3.2 1B, 128 otherwise):
    the whole model's loss and gradients through the kernels equal dense attention's."""
    from flax import nnx

    from tunix_train.models import families
    from tunix_train.training.train_step import loss_sums

    tokens = jax.random.randint(jax.random.key(0), (2, 65), 3, 500)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "weights": jnp.ones((2, 64))}
    results = []
    for impl in ("xla", "pallas"):
        cfg = compose_config(*family_tiny(family, f"model.head_dim={head_dim}",
                                          f"model.attention_impl={impl}")).model
        graphdef, params = nnx.split(families.build(cfg, nnx.Rngs(0)))
        results.append(jax.jit(jax.value_and_grad(  # one program, not op by op
            lambda p: loss_sums(graphdef, p, batch)[0]))(params))
    (dense_loss, dense_grads), (loss, grads) = results
    np.testing.assert_allclose(loss, dense_loss, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(dense_grads)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * float(np.abs(b).max()))
