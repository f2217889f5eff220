"""Gemma 3 building blocks in Flax NNX. Parameters carry logical axis names only.

Shapes are written into names: B batch, L sequence, D embed, N query heads, K KV heads,
H head dim, F MLP width, V vocabulary.
"""

from __future__ import annotations

import functools
import logging
import math
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from tunix_train.config import ModelConfig
from tunix_train.models import blockwise, flash, head, kv_cache, partitioning
from tunix_train.models.params import materialize, take
from tunix_train.models.partitioning import constrain

log = logging.getLogger("tunix_train")

PROJECTION = "projection"  # name of a projection's output, for recomputation policies


def _normal(rngs: nnx.Rngs, shape: tuple[int, ...], fan_in: int) -> jax.Array:
    # Scaled normal init for every matrix. Never zeros: Gemma's reference zero-initialises MLP
    # kernels because it expects a checkpoint, which from scratch never trains.
    return jax.random.normal(rngs.params(), shape, jnp.float32) * fan_in**-0.5


_AXES_METADATA = "out_sharding"  # where Flax NNX keeps a Variable's logical axis names


def _param(value: jax.Array, *logical_axes: str) -> nnx.Param:
    # Shardings are applied by jit's out_shardings (see state.py), so a model can also be built
    # with no mesh at all (tests, the planner's eval_shape).
    return nnx.Param(value, **{_AXES_METADATA: logical_axes}, eager_sharding=False)


def logical_axes(variable: nnx.Variable) -> tuple[str | None, ...]:
    """The logical axis names a parameter was created with (tests/test_internals.py pins
    where NNX keeps them)."""
    return tuple(variable.get_metadata()[_AXES_METADATA])


def project(x: jax.Array, w: jax.Array, contract: int = 1) -> jax.Array:
    """x [..., *K] · w [*K, *N] → [..., *N], contracting x's last `contract` axes with w's first.

    On CPU the weight gradient xᵀ · dy contracts the token axis, the major axis of both, and
    XLA's CPU backend lays one operand out transposed for its GEMM: left to itself it picks dy,
    and fuses that transpose into dy's elementwise producer (GeGLU's backward), whose strided
    writes cost more than the matmuls (221 of 760 ms of bench/peer_step.py's 4-layer step).
    `_project_cpu` transposes the smaller of x and dy itself, behind a barrier XLA cannot fold.
    Elsewhere the plain contraction: cuBLAS takes transposed operands as they are.
    """
    if jax.default_backend() == "cpu":
        y = _project_cpu(x, w, contract)
    else:
        y = jnp.tensordot(x, w, axes=contract)
    return checkpoint_name(y, PROJECTION)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _project_cpu(x, w, contract):
    return jnp.tensordot(x, w, axes=contract)


def _project_cpu_fwd(x, w, contract):
    return _project_cpu(x, w, contract), (x, w)


def _project_cpu_bwd(contract, residuals, dy):
    x, w = residuals
    k = math.prod(w.shape[:contract])
    x_TxK, w_KxN = x.reshape(-1, k), w.reshape(k, -1)
    dy_TxN = dy.reshape(x_TxK.shape[0], -1)
    dx = (dy_TxN @ w_KxN.T.astype(dy.dtype)).reshape(x.shape).astype(x.dtype)
    if k <= dy_TxN.shape[1]:
        dw_KxN = jax.lax.optimization_barrier(x_TxK.T) @ dy_TxN.astype(x.dtype)
    else:
        dw_KxN = (jax.lax.optimization_barrier(dy_TxN.T) @ x_TxK.astype(dy.dtype)).T
    return dx, dw_KxN.reshape(w.shape).astype(w.dtype)


_project_cpu.defvjp(_project_cpu_fwd, _project_cpu_bwd)


def keeping_inputs(fn: Callable) -> Callable:
    """`fn` (elementwise or a norm) whose backward pass keeps only its inputs and recomputes the
    rest (fused into the gradient's own elementwise pass).

    Differentiated as written, a chain of elementwise operations leaves each intermediate for
    the backward pass, and a scanned layer stacks every one of them per layer: the tanh GELU
    alone leaves six [B, L, F] arrays (x³, tanh, 1 − tanh², products), an RMSNorm four.
    """
    kept = jax.custom_vjp(fn)
    kept.defvjp(lambda *inputs: (fn(*inputs), inputs),
                lambda inputs, grad: jax.vjp(fn, *inputs)[1](grad))
    return functools.wraps(fn)(kept)


@keeping_inputs
def geglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    """gelu_tanh(gate) · up."""
    return jax.nn.gelu(gate, approximate=True) * up


@keeping_inputs
def rms_norm(x: jax.Array, scale: jax.Array, eps: jax.Array) -> jax.Array:
    """x / rms(x) · (1 + scale) in fp32 whatever x's dtype, back in x's dtype."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y * (1.0 + scale.astype(jnp.float32))).astype(x.dtype)


class RMSNorm(nnx.Module):
    """RMSNorm with Gemma's (1 + scale), computed in fp32 whatever the input dtype."""

    def __init__(self, dim: int, eps: float):
        self.scale = _param(jnp.zeros((dim,), jnp.float32), "norm")
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.scale[...], jnp.float32(self.eps))


class Embedder(nnx.Module):
    """Token embedding scaled by sqrt(D) on the way in, tied to the output projection."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        shape = (cfg.vocab_size, cfg.embed_dim)
        self.embedding = _param(_normal(rngs, shape, cfg.embed_dim), "vocab", "embed")
        self.embed_dim = cfg.embed_dim

    def encode(self, tokens_BxL: jax.Array) -> jax.Array:
        x_BxLxD = take(self.embedding.get_value(), tokens_BxL)
        return x_BxLxD * jnp.asarray(self.embed_dim**0.5, x_BxLxD.dtype)

    def decode(self, x_BxLxD: jax.Array) -> jax.Array:
        """Logits over the whole vocabulary (generation, evaluation of a few tokens)."""
        table_VxD = materialize(self.embedding.get_value())
        logits_BxLxV = jnp.einsum("bld,vd->blv", x_BxLxD, table_VxD)
        return constrain(logits_BxLxV, ("act_batch", "act_seq", "act_vocab"))

    def token_losses(self, x_BxLxD: jax.Array, targets_BxL: jax.Array,
                     chunks: head.VocabChunks) -> jax.Array:
        """Cross-entropy [B, L] (fp32) of the logits, never formed whole (models/head.py)."""
        batch, length, dim = x_BxLxD.shape
        losses_T = head.token_losses(x_BxLxD.reshape(batch * length, dim),
                                     self.embedding.get_value(), targets_BxL.reshape(-1), chunks)
        return losses_T.reshape(batch, length)


def rope_tables(positions_BxL: jax.Array, head_dim: int, base: float, scale: float):
    """cos/sin of shape [B, L, 1, H] for rotate-half RoPE (linear scaling divides positions)."""
    fraction = jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim
    inv_freq = 1.0 / (base**fraction) / scale
    angles_BxLxH2 = positions_BxL[..., None].astype(jnp.float32) * inv_freq
    angles_BxLxH = jnp.concatenate([angles_BxLxH2, angles_BxLxH2], axis=-1)[:, :, None, :]
    return jnp.cos(angles_BxLxH), jnp.sin(angles_BxLxH)


def apply_rope(x_BxLxNxH: jax.Array, cos_sin: tuple[jax.Array, jax.Array]) -> jax.Array:
    cos, sin = cos_sin
    half = x_BxLxNxH.shape[-1] // 2
    x1, x2 = x_BxLxNxH[..., :half], x_BxLxNxH[..., half:]
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    out = x_BxLxNxH.astype(jnp.float32) * cos + rotated.astype(jnp.float32) * sin
    return out.astype(x_BxLxNxH.dtype)


class Attention(nnx.Module):
    """Grouped-query attention with per-head RMSNorm of queries and keys."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        D, N, K, H = cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q = _param(_normal(rngs, (D, N, H), D), "embed", "q_heads", "head_dim")
        self.k = _param(_normal(rngs, (D, K, H), D), "embed", "kv_heads", "head_dim")
        self.v = _param(_normal(rngs, (D, K, H), D), "embed", "kv_heads", "head_dim")
        self.o = _param(_normal(rngs, (N, H, D), N * H), "q_heads", "head_dim", "embed")
        self.q_norm = RMSNorm(H, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(H, cfg.rms_norm_eps)
        self.scale = (cfg.query_pre_attn_scalar or H) ** -0.5
        self.implementation = cfg.attention_impl

    def __call__(self, x_BxLxD, cos_sin, segment_ids_BxL, window: int | None) -> jax.Array:
        q_BxLxNxH, k_BxLxKxH, v_BxLxKxH = self._project(x_BxLxD, cos_sin)
        out_BxLxNxH = self._attention(q_BxLxNxH, k_BxLxKxH, v_BxLxKxH, segment_ids_BxL, window)
        return self._output(out_BxLxNxH)

    def decode(self, x_BxTxD, cos_sin, positions_BxT, cache: kv_cache.LayerView,
               window: int | None) -> tuple[jax.Array, dict]:
        """Attention of T new tokens to the cache and to each other; also the written cache."""
        q_BxTxNxH, k_BxTxKxH, v_BxTxKxH = self._project(x_BxTxD, cos_sin)
        k_BxSxKxH, v_BxSxKxH, k_positions_BxS = cache.keys_values(
            k_BxTxKxH.astype(cache.kv["k"].dtype), v_BxTxKxH.astype(cache.kv["v"].dtype),
            positions_BxT)
        mask = kv_cache.mask(positions_BxT, k_positions_BxS, window)
        out_BxTxNxH = jax.nn.dot_product_attention(
            q_BxTxNxH.astype(k_BxSxKxH.dtype), k_BxSxKxH, v_BxSxKxH, mask=mask, scale=self.scale)
        written = cache.write(k_BxTxKxH.astype(cache.kv["k"].dtype),
                              v_BxTxKxH.astype(cache.kv["v"].dtype))
        return self._output(out_BxTxNxH.astype(x_BxTxD.dtype)), written

    def _project(self, x_BxLxD, cos_sin):
        """Queries, keys and values, normalised per head and rotated."""
        q_BxLxNxH = project(x_BxLxD, self.q[...])
        k_BxLxKxH = project(x_BxLxD, self.k[...])
        v_BxLxKxH = project(x_BxLxD, self.v[...])
        q_BxLxNxH = constrain(q_BxLxNxH, ("act_batch", "act_seq", "act_q_heads", None))
        k_BxLxKxH = constrain(k_BxLxKxH, ("act_batch", "act_seq", "act_kv_heads", None))
        v_BxLxKxH = constrain(v_BxLxKxH, ("act_batch", "act_seq", "act_kv_heads", None))
        q_BxLxNxH = apply_rope(self.q_norm(q_BxLxNxH), cos_sin)
        k_BxLxKxH = apply_rope(self.k_norm(k_BxLxKxH), cos_sin)
        return q_BxLxNxH, k_BxLxKxH, v_BxLxKxH

    def _attention(self, q, k, v, segment_ids_BxL, window: int | None) -> jax.Array:
        """Causal attention by the path `attention_path` picks; the path taken is logged once
        per process, and a cuDNN refusal under `auto` is a warning saying why."""
        path, why = attention_path(self.implementation, q.dtype, segment_ids_BxL is not None,
                                    q.shape[1])
        if path == "cudnn":
            out, path = self._cudnn(q, k, v, segment_ids_BxL, window)
            if out is not None:
                return out
        else:
            _report_once(logging.INFO, f"attention: {_PATHS[path]} ({why})")
        if path == "blockwise":
            return blockwise.attention(q, k, v, segment_ids_BxL, scale=self.scale, window=window)
        if path == "pallas":
            return self._pallas(q, k, v, segment_ids_BxL, window)
        return self._library(q, k, v, segment_ids_BxL, window, cudnn=False)

    def _cudnn(self, q, k, v, segment_ids_BxL, window) -> tuple[jax.Array | None, str]:
        """(cuDNN's output, "cudnn"), or (None, the path to take instead) when `auto` meets a
        refusal. cuDNN's own checks run while tracing, so falling back is free."""
        chosen = "cuDNN fused flash attention" + (
            "" if segment_ids_BxL is None else
            ", document masks as an additive [B, N, L, L] bias")
        if self.implementation == "cudnn":  # asked for by name: a refusal is the user's error
            out = self._library(q, k, v, segment_ids_BxL, window, cudnn=True)
        else:
            try:
                out = self._library(q, k, v, segment_ids_BxL, window, cudnn=True)
            except (ValueError, NotImplementedError, RuntimeError, TypeError) as refusal:
                reason = str(refusal).strip().splitlines()[0][:200] if str(refusal) else \
                    type(refusal).__name__
                path, _ = without_cudnn(q.shape[1], "")
                _report_once(logging.WARNING, f"attention: cuDNN refused this call ({reason}); "
                                              f"using the {path} attention")
                return None, path
        _report_once(logging.INFO, f"attention: {chosen}")
        return out, "cudnn"

    def _library(self, q, k, v, segment_ids_BxL, window, cudnn: bool) -> jax.Array:
        """`jax.nn.dot_product_attention`: XLA's with the document mask, or cuDNN's with it as
        an additive bias per head (the only form cuDNN's batching rule accepts)."""
        mask = None if segment_ids_BxL is None else \
            segment_ids_BxL[:, None, :, None] == segment_ids_BxL[:, None, None, :]
        bias = None
        if cudnn and mask is not None:
            bias, mask = _mask_as_bias(mask, q.shape[2], q.dtype), None
        return jax.nn.dot_product_attention(
            q, k, v, bias=bias, mask=mask, scale=self.scale, is_causal=True,
            local_window_size=(window - 1, 0) if window else None,
            implementation="cudnn" if cudnn else "xla")

    def _pallas(self, q_BxLxNxH, k_BxLxKxH, v_BxLxKxH, segment_ids_BxL, window) -> jax.Array:
        """models/flash.py's kernels on each device's rows and heads (XLA cannot partition a
        Pallas call: it would gather all of them onto every device)."""
        N, K = q_BxLxNxH.shape[2], k_BxLxKxH.shape[2]
        if K % partitioning.ways("act_q_heads"):
            # The query heads split over devices, their KV heads cannot (one KV head): each
            # device's kernel gets its own heads' copies.
            k_BxLxKxH, v_BxLxKxH = (jnp.repeat(a, N // K, axis=2) for a in (k_BxLxKxH, v_BxLxKxH))
        if segment_ids_BxL is None:
            segment_ids_BxL = jnp.zeros(q_BxLxNxH.shape[:2], jnp.int32)
        heads = ("act_batch", None, "act_q_heads", None)
        return partitioning.per_device(
            functools.partial(flash.attention, scale=self.scale, window=window),
            (q_BxLxNxH, k_BxLxKxH, v_BxLxKxH, segment_ids_BxL),
            (heads, heads, heads, ("act_batch", None)), heads)

    def _output(self, out_BxLxNxH: jax.Array) -> jax.Array:
        out_BxLxNxH = constrain(out_BxLxNxH, ("act_batch", "act_seq", "act_q_heads", None))
        return project(out_BxLxNxH, self.o[...], contract=2)


_PATHS = {"blockwise": "blockwise", "xla": "XLA, [B, N, L, L] scores",
          "pallas": "Pallas flash attention kernels"}

# Above this many tokens packed documents take the blockwise attention: cuDNN would get their
# mask as a [B, N, L, L] bias, per sequence 0.54 GB at 8,192 tokens and 8.6 GB at 32,768
# (bf16, 4 heads), and as much again for its gradient.
CUDNN_BIAS_MAX_TOKENS = 8192
# Without cuDNN: from this many tokens blockwise is faster than dense on CPU for head dims 64
# and 256 (bench/attention.py); below it dense wins at head dim 256 and its scores are small.
BLOCKWISE_MIN_TOKENS = 512


def attention_path(implementation: str, dtype, masked: bool, length: int) -> tuple[str, str]:
    """(path, why): "cudnn", "blockwise" (models/blockwise.py), "pallas" (models/flash.py) or
    "xla" (dense scores), for `model.attention_impl`, the compute dtype, whether documents are
    masked and the length. `auto` never picks pallas: its speed on a GPU is not measured yet."""
    if implementation == "pallas" and jax.default_backend() != "gpu":
        return "pallas", f"model.attention_impl=pallas on {jax.default_backend()}: through " \
                         f"Pallas's interpreter, exact but slow; the kernels are for GPUs"
    if implementation in ("xla", "blockwise", "cudnn", "pallas"):
        return implementation, f"model.attention_impl={implementation}"
    if jax.default_backend() != "gpu":
        why = f"model.attention_impl=auto on {jax.default_backend()}: cuDNN needs a GPU"
    elif jnp.dtype(dtype) not in (jnp.bfloat16, jnp.float16):
        why = f"cuDNN's fused attention takes bf16 or fp16, and compute is " \
              f"{jnp.dtype(dtype).name}"
    elif masked and length > CUDNN_BIAS_MAX_TOKENS:
        return "blockwise", f"document masks at {length} tokens would reach cuDNN as a " \
                            f"[B, N, L, L] bias (above {CUDNN_BIAS_MAX_TOKENS} tokens)"
    else:
        return "cudnn", "model.attention_impl=auto on a GPU"
    return without_cudnn(length, why)


def without_cudnn(length: int, why: str) -> tuple[str, str]:
    """The path where cuDNN is not used: blockwise from BLOCKWISE_MIN_TOKENS, dense below."""
    if length >= BLOCKWISE_MIN_TOKENS:
        return "blockwise", f"{why}; {length} tokens >= {BLOCKWISE_MIN_TOKENS}"
    return "xla", f"{why}; {length} tokens < {BLOCKWISE_MIN_TOKENS}"


_REPORTED: set[str] = set()


def _report_once(level: int, message: str) -> None:
    """Each attention layer is traced several times (train and eval steps, both layer kinds):
    one line per process is enough."""
    if message not in _REPORTED:
        _REPORTED.add(message)
        log.log(level, message)


def _mask_as_bias(mask_Bx1xLxS: jax.Array, heads: int, dtype) -> jax.Array:
    big_negative = jnp.asarray(jnp.finfo(dtype).min / 2, dtype)
    bias = jnp.where(mask_Bx1xLxS, jnp.asarray(0, dtype), big_negative)
    return jnp.broadcast_to(bias, (bias.shape[0], heads, *bias.shape[2:]))


class MLP(nnx.Module):
    """GeGLU: down(gelu_tanh(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        D, F = cfg.embed_dim, cfg.hidden_dim
        self.gate = _param(_normal(rngs, (D, F), D), "embed", "mlp")
        self.up = _param(_normal(rngs, (D, F), D), "embed", "mlp")
        self.down = _param(_normal(rngs, (F, D), F), "mlp", "embed")

    def __call__(self, x_BxLxD: jax.Array) -> jax.Array:
        gate_BxLxF = project(x_BxLxD, self.gate[...])
        up_BxLxF = project(x_BxLxD, self.up[...])
        h_BxLxF = geglu(gate_BxLxF, up_BxLxF)
        h_BxLxF = constrain(h_BxLxF, ("act_batch", "act_seq", "act_mlp"))
        return project(h_BxLxF, self.down[...])


class DecoderLayer(nnx.Module):
    """Norms before and after both attention and MLP, as in Gemma 2 and 3."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        eps = cfg.rms_norm_eps
        self.pre_attention_norm = RMSNorm(cfg.embed_dim, eps)
        self.attention = Attention(cfg, rngs)
        self.post_attention_norm = RMSNorm(cfg.embed_dim, eps)
        self.pre_mlp_norm = RMSNorm(cfg.embed_dim, eps)
        self.mlp = MLP(cfg, rngs)
        self.post_mlp_norm = RMSNorm(cfg.embed_dim, eps)

    def __call__(self, x_BxLxD, cos_sin, segment_ids_BxL, window: int | None) -> jax.Array:
        attn = self.attention(self.pre_attention_norm(x_BxLxD), cos_sin, segment_ids_BxL, window)
        x_BxLxD = x_BxLxD + self.post_attention_norm(attn)
        return self._mlp_block(x_BxLxD)

    def decode(self, x_BxTxD, cos_sin, positions_BxT, cache: kv_cache.LayerView,
               window: int | None) -> tuple[jax.Array, dict]:
        attn, written = self.attention.decode(self.pre_attention_norm(x_BxTxD), cos_sin,
                                              positions_BxT, cache, window)
        return self._mlp_block(x_BxTxD + self.post_attention_norm(attn)), written

    def _mlp_block(self, x_BxLxD: jax.Array) -> jax.Array:
        x_BxLxD = x_BxLxD + self.post_mlp_norm(self.mlp(self.pre_mlp_norm(x_BxLxD)))
        return constrain(x_BxLxD, ("act_batch", "act_seq", "act_embed"))
