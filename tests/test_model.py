import contextlib
import io

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.ad_checkpoint import print_saved_residuals

from helpers import TINY, compose_config, jitted_forward, mesh_arg, train_losses
from tunix_train.models import families
from tunix_train.models.decoder import REMAT_POLICIES
from tunix_train.models.layers import geglu, project, rms_norm, swiglu
from tunix_train.training.train_step import loss_sums


def _model(*overrides, remat="none"):
    cfg = compose_config(*TINY, *overrides).model
    return cfg, families.build(cfg, nnx.Rngs(0), remat)


def _forward(model):
    return jitted_forward(*nnx.split(model))


def _tokens(length=48, seed=0):
    return jax.random.randint(jax.random.key(seed), (2, length), 3, 259)


def test_five_local_then_one_global_like_gemma3():
    cfg = compose_config("model=gemma3_1b").model
    placement = families.stacking(cfg).placement()
    stacks = [stack for stack, _ in placement]
    assert len(stacks) == 26
    assert [i for i, k in enumerate(stacks) if k == "global_layers"] == [5, 11, 17, 23]
    # Each stack is indexed in layer order; the two locals after the last block have their own.
    assert [i for k, i in placement if k == "local_layers"] == list(range(20))
    assert placement[24:] == [("trailing_layers", 0), ("trailing_layers", 1)]


@pytest.mark.parametrize("name,expected", [
    ("gemma3_270m", 268e6), ("gemma3_1b", 1.0e9), ("gemma3_4b", 3.88e9), ("gemma3_12b", 11.77e9),
    ("gemma3_27b", 27.01e9), ("llama3_2_1b", 1.24e9), ("llama3_2_3b", 3.21e9),
    ("llama3_1_8b", 8.03e9), ("qwen3_0_6b", 0.6e9), ("qwen3_1_7b", 1.7e9), ("qwen3_4b", 4.0e9),
    ("qwen3_8b", 8.2e9)])
def test_published_sizes_have_their_parameter_counts(name, expected):
    # Text decoder only, embeddings included (Gemma's published 4.3B, 12.2B and 27.4B include
    # a 0.42B vision tower); an untied output head counted as well (Llama 3.1 8B, Qwen 3 8B).
    count = families.count_params(compose_config(f"model={name}").model)
    assert abs(count - expected) / expected < 0.03


def test_causal_future_tokens_do_not_change_past_logits():
    model = _forward(_model()[1])
    tokens = _tokens()
    changed = tokens.at[:, 30:].set(5)
    np.testing.assert_allclose(model(tokens)[:, :30], model(changed)[:, :30], atol=1e-6)


def test_local_layers_see_only_their_window_global_layers_see_everything():
    # One local layer: position p sees tokens p-15..p (window 16, itself included).
    cfg, local_only = _model("model.num_layers=1")
    local_only = _forward(local_only)
    tokens = _tokens()
    changed = tokens.at[:, 0].set(7)
    diff = np.abs(np.asarray(local_only(tokens) - local_only(changed))).max(axis=(0, 2))
    assert diff[cfg.sliding_window - 1] > 0 and np.all(diff[cfg.sliding_window:] == 0)
    # One global layer (global_every=1) sees the changed first token from every position.
    global_only = _forward(_model("model.num_layers=1", "model.global_every=1")[1])
    diff = np.abs(np.asarray(global_only(tokens) - global_only(changed))).max(axis=(0, 2))
    assert np.all(diff > 0)


def test_trailing_local_layers_run_after_the_blocks():
    cfg, model = _model("model.num_layers=8")
    stacking = families.stacking(cfg)
    assert (stacking.num_blocks, stacking.trailing_layers) == (1, 2)
    assert stacking.count("local_layers") + stacking.count("trailing_layers") == 7
    assert _forward(model)(_tokens()).shape == (2, 48, cfg.vocab_size)


def test_untrained_model_predicts_near_uniform_and_trains_from_scratch():
    cfg, model = _model()
    graphdef, params = nnx.split(model)
    tokens = _tokens(33)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
             "weights": jnp.ones((2, 32), jnp.float32)}
    loss_fn = lambda p: loss_sums(graphdef, p, batch)[0] / 64  # noqa: E731
    loss, grads = jax.jit(jax.value_and_grad(loss_fn))(params)  # one program, not op by op
    assert abs(float(loss) - np.log(cfg.vocab_size)) < 1.0
    # Every weight matrix gets a gradient: no layer starts dead (zero-initialised kernels would).
    norms = {jax.tree_util.keystr(k): float(jnp.abs(g).max())
             for k, g in jax.tree_util.tree_leaves_with_path(grads)}
    dead = [k for k, v in norms.items() if v == 0]
    assert not dead, dead


def test_remat_changes_memory_not_numbers():
    tokens = _tokens()
    outs = []
    for remat in ("none", "full", "save_dots"):
        _, model = _model(remat=remat)
        graphdef, params = nnx.split(model)
        batch = {"inputs": tokens, "targets": tokens, "weights": jnp.ones(tokens.shape)}
        grads = jax.jit(jax.grad(lambda p: loss_sums(graphdef, p, batch)[0]))(params)
        outs.append(jax.tree.leaves(grads))
    for other in outs[1:]:
        for a, b in zip(outs[0], other):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4 * float(np.abs(a).max()))


def test_unrolled_layers_give_the_scanned_losses():
    # 5 layers: two blocks of [local, global] and a trailing local, all three scans.
    cfg = compose_config(*TINY, mesh_arg(1, 1), "training.micro_batch_size=2",
                         "model.num_layers=5", "model.global_every=2")
    scanned, _ = train_losses(cfg, 2, jax.devices()[:1])
    cfg.model.unroll_layers = True
    unrolled, _ = train_losses(cfg, 2, jax.devices()[:1])
    np.testing.assert_allclose(unrolled, scanned, rtol=1e-5)


@pytest.mark.parametrize("unroll", [False, True])
def test_unroll_layers_decides_whether_the_forward_pass_loops(unroll):
    # 2 blocks of [2 locals, global], 2 trailing locals: every scan runs at least twice (JAX
    # keeps a one-trip loop even when unrolling).
    cfg, model = _model("model.num_layers=8", "model.global_every=3",
                        f"model.unroll_layers={unroll}")
    graphdef, state = nnx.split(model)
    text = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t)).lower(state, _tokens()).as_text()
    # One loop is always there: the one that builds both kinds' RoPE tables (models/rope.py).
    loops = text.count("stablehlo.while")
    assert loops == 1 if unroll else loops > 1


@pytest.mark.parametrize("x_shape,w_shape,contract", [
    ((2, 6, 8), (8, 24), 1),      # widening (gate, up): x transposed by hand
    ((2, 6, 24), (24, 8), 1),     # narrowing (down): dy transposed by hand
    ((2, 6, 8), (8, 3, 4), 1),    # into heads (q, k, v)
    ((2, 6, 3, 4), (3, 4, 8), 2),  # out of heads (o)
])
@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-6), (jnp.bfloat16, 2e-2)])
def test_project_and_its_gradients_equal_the_plain_contraction(x_shape, w_shape, contract,
                                                               dtype, tol):
    kx, kw, kd = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, x_shape, dtype)
    w = jax.random.normal(kw, w_shape, dtype)
    out_shape = x_shape[:len(x_shape) - contract] + w_shape[contract:]
    dy = jax.random.normal(kd, out_shape, dtype)

    def vjp(f):
        y, pullback = jax.vjp(f, x, w)
        return (y, *pullback(dy))

    ours = jax.jit(lambda: vjp(lambda x, w: project(x, w, contract)))()
    plain = jax.jit(lambda: vjp(lambda x, w: jnp.tensordot(x, w, axes=contract)))()
    for a, b in zip(ours, plain):
        assert a.dtype == b.dtype and a.shape == b.shape
        # Within `tol` of the array's largest entry: a sum that cancels to near zero keeps the
        # rounding of its terms (bf16: 0.0055 against -0.0156 among entries up to 5, jax 0.11).
        b = np.asarray(b, np.float32)
        np.testing.assert_allclose(np.asarray(a, np.float32), b, rtol=tol,
                                   atol=tol * float(np.abs(b).max()))


def test_project_keeps_cpu_from_transposing_the_wide_gradient():
    # XLA's CPU backend lays one operand of a weight-gradient GEMM out transposed. In an MLP
    # (x [T, D] widened to [T, F], narrowed back) the plain contraction transposes the wide
    # dy [T, F] (fused into its elementwise producer: strided writes); `project` transposes
    # the narrow operand of each GEMM instead, so no [F, T] array exists.
    B, L, D, F = 4, 128, 32, 128
    x, w = jnp.ones((B, L, D)), jnp.ones((D, F))

    def has_wide_transpose(f):
        loss = lambda x, w: jnp.sum(f(jnp.tanh(f(x, w)), w.T) ** 2)  # noqa: E731
        hlo = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(x, w).compile().as_text()
        return f"f32[{F},{B * L}]" in hlo

    assert has_wide_transpose(lambda x, w: jnp.tensordot(x, w, axes=1))
    assert not has_wide_transpose(project)


def _plain_rms_norm(x, scale, eps, offset):
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y * (offset + scale.astype(jnp.float32))).astype(x.dtype)


@pytest.mark.parametrize("ours,plain,shapes", [
    (geglu, lambda g, u: jax.nn.gelu(g, approximate=True) * u, [(2, 6, 16), (2, 6, 16)]),
    (swiglu, lambda g, u: jax.nn.silu(g) * u, [(2, 6, 16), (2, 6, 16)]),
    (rms_norm, _plain_rms_norm, [(2, 6, 16), (16,), (), ()]),
], ids=["geglu", "swiglu", "rms_norm"])
def test_elementwise_gradients_equal_autodiff_and_keep_only_inputs(ours, plain, shapes):
    keys = jax.random.split(jax.random.key(1), len(shapes) + 1)
    inputs = [jax.random.normal(k, s) * 3 for k, s in zip(keys, shapes)]
    inputs[2:] = [jnp.float32(1e-6), jnp.float32(1.0)][:len(inputs[2:])]  # eps, offset
    d_out = jax.random.normal(keys[-1], (2, 6, 16))
    backward = lambda f: jax.jit(lambda *a: jax.vjp(f, *a)[1](d_out))  # noqa: E731 - one program
    for a, b in zip(backward(ours)(*inputs), backward(plain)(*inputs)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)

    # What the backward pass keeps of [2, 6, 16] arrays (a scanned layer stacks each one).
    def kept(f):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            print_saved_residuals(f, *inputs)
        return [line for line in out.getvalue().splitlines() if line.startswith("f32[2,6,16]")]

    assert len(kept(ours)) == sum(s == (2, 6, 16) for s in shapes) < len(kept(plain))


def test_save_dots_keeps_projections_and_full_keeps_none():
    # On CPU a projection is a custom VJP (no dot for the policy to see): its name keeps it.
    x, w = jnp.ones((2, 6, 8)), jnp.ones((8, 16))

    def kept(remat):
        f = jax.checkpoint(lambda x, w: jnp.tanh(project(x, w)), policy=REMAT_POLICIES[remat])
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            print_saved_residuals(f, x, w)
        return out.getvalue()

    assert "named 'projection'" in kept("save_dots")
    assert "named 'projection'" not in kept("full")
