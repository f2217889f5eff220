"""Grouped-query attention, and which implementation computes it: XLA's dense scores, the
blockwise (flash) algorithm in XLA ops (models/blockwise.py), cuDNN's fused kernel, or our
Pallas kernels (models/flash.py).

Shapes are written into names: B batch, L sequence, D embed, N query heads, K KV heads,
H head dim.
"""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
from flax import nnx

from tunix_train import backend
from tunix_train.config import LoraConfig, ModelConfig
from tunix_train.models import blockwise, context, kv_cache, lora, partitioning, rope
# models/flash.py is imported where its kernels are used: importing Pallas and its Triton
# dialect takes 0.2 s of every start, CPU runs included, which never call them.
from tunix_train.models.family import Architecture
from tunix_train.models.layers import RMSNorm, adapted, param, scaled_normal
from tunix_train.models.partitioning import constrain

log = logging.getLogger("tunix_train")


class Attention(nnx.Module):
    """Grouped-query attention, with per-head RMSNorm of queries and keys where the family has
    it."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, arch: Architecture,
                 lora_cfg: LoraConfig = LoraConfig()):
        D, N, K, H = cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q = param(scaled_normal(rngs, (D, N, H), D), "embed", "q_heads", "head_dim")
        self.k = param(scaled_normal(rngs, (D, K, H), D), "embed", "kv_heads", "head_dim")
        self.v = param(scaled_normal(rngs, (D, K, H), D), "embed", "kv_heads", "head_dim")
        self.o = param(scaled_normal(rngs, (N, H, D), N * H), "q_heads", "head_dim", "embed")
        heads = ("head_dim",)
        shapes = {"q": ((D,), ("embed",), (N, H), ("q_heads", *heads)),
                  "k": ((D,), ("embed",), (K, H), ("kv_heads", *heads)),
                  "v": ((D,), ("embed",), (K, H), ("kv_heads", *heads)),
                  "o": ((N, H), ("q_heads", *heads), (D,), ("embed",))}
        for name, adapter in lora.adapters(lora_cfg, rngs, shapes).items():
            setattr(self, name, adapter)
        if arch.qk_norm:
            self.q_norm = RMSNorm(H, cfg.rms_norm_eps, arch.norm_offset)
            self.k_norm = RMSNorm(H, cfg.rms_norm_eps, arch.norm_offset)
        self.qk_norm = arch.qk_norm
        self.scale = (cfg.query_pre_attn_scalar or H) ** -0.5
        self.implementation = cfg.attention_impl
        self.cp_exchange = cfg.cp_exchange

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
        q_BxLxNxH = adapted(self, "q", x_BxLxD)
        k_BxLxKxH = adapted(self, "k", x_BxLxD)
        v_BxLxKxH = adapted(self, "v", x_BxLxD)
        q_BxLxNxH = constrain(q_BxLxNxH, ("act_batch", "act_seq", "act_q_heads", None))
        k_BxLxKxH = constrain(k_BxLxKxH, ("act_batch", "act_seq", "act_kv_heads", None))
        v_BxLxKxH = constrain(v_BxLxKxH, ("act_batch", "act_seq", "act_kv_heads", None))
        if self.qk_norm:
            q_BxLxNxH, k_BxLxKxH = self.q_norm(q_BxLxNxH), self.k_norm(k_BxLxKxH)
        return rope.apply(q_BxLxNxH, cos_sin), rope.apply(k_BxLxKxH, cos_sin), v_BxLxKxH

    def _attention(self, q, k, v, segment_ids_BxL, window: int | None) -> jax.Array:
        """Causal attention by the path `attention_path` picks; the path taken is logged once
        per process, and a cuDNN refusal under `auto` is a warning saying why. With the
        sequence split over devices (cp) every path is models/context.py's."""
        if partitioning.split_over("act_seq")[1] > 1:
            return self._context(q, k, v, segment_ids_BxL, window)
        path, why = attention_path(self.implementation, q.dtype, segment_ids_BxL is not None,
                                    q.shape[1], q.shape[-1])
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
                path, _ = without_cudnn(q.shape[1], q.shape[-1], "")
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
        k_BxLxKxH, v_BxLxKxH, segment_ids_BxL = _per_device_inputs(
            q_BxLxNxH, k_BxLxKxH, v_BxLxKxH, segment_ids_BxL)
        from tunix_train.models import flash  # only where used: see the imports above

        heads = ("act_batch", None, "act_q_heads", None)
        return partitioning.per_device(
            functools.partial(flash.attention, scale=self.scale, window=window),
            (q_BxLxNxH, k_BxLxKxH, v_BxLxKxH, segment_ids_BxL),
            (heads, heads, heads, ("act_batch", None)), heads)

    def _context(self, q_BxLxNxH, k_BxLxKxH, v_BxLxKxH, segment_ids_BxL, window) -> jax.Array:
        """models/context.py on each device's chunk of the sequence (and its heads, rows)."""
        axis, ways = partitioning.split_over("act_seq")
        ring = self.cp_exchange == "ring"
        _report_once(logging.INFO, f"attention: context parallel over {axis}={ways} (keys and "
                                   f"values {'passed around a ring' if ring else 'all-gathered'}, "
                                   f"model.cp_exchange={self.cp_exchange}, models/context.py)")
        k_BxLxKxH, v_BxLxKxH, segment_ids_BxL = _per_device_inputs(
            q_BxLxNxH, k_BxLxKxH, v_BxLxKxH, segment_ids_BxL)
        heads = ("act_batch", "act_seq", "act_q_heads", None)
        return partitioning.per_device(
            functools.partial(context.ring_attention if ring else context.gathered_attention,
                              axis=axis, scale=self.scale, window=window),
            (q_BxLxNxH, k_BxLxKxH, v_BxLxKxH, segment_ids_BxL),
            (heads, heads, heads, ("act_batch", "act_seq")), heads)

    def _output(self, out_BxLxNxH: jax.Array) -> jax.Array:
        out_BxLxNxH = constrain(out_BxLxNxH, ("act_batch", "act_seq", "act_q_heads", None))
        return adapted(self, "o", out_BxLxNxH, contract=2)


def _per_device_inputs(q_BxLxNxH, k_BxLxKxH, v_BxLxKxH, segment_ids_BxL):
    """Keys, values and segment ids for a `partitioning.per_device` call: where the query heads
    split over devices and their KV heads cannot (one KV head), each device gets its own heads'
    copies; no documents become one segment."""
    N, K = q_BxLxNxH.shape[2], k_BxLxKxH.shape[2]
    if K % partitioning.ways("act_q_heads"):
        k_BxLxKxH, v_BxLxKxH = (jnp.repeat(a, N // K, axis=2) for a in (k_BxLxKxH, v_BxLxKxH))
    if segment_ids_BxL is None:
        segment_ids_BxL = jnp.zeros(q_BxLxNxH.shape[:2], jnp.int32)
    return k_BxLxKxH, v_BxLxKxH, segment_ids_BxL


_PATHS = {"blockwise": "blockwise", "xla": "XLA, [B, N, L, L] scores",
          "pallas": "Pallas flash attention kernels"}

# Above this many tokens packed documents take the Pallas kernels on a GPU: cuDNN would get their
# mask as a [B, N, L, L] bias, per sequence 0.54 GB at 8,192 tokens and 8.6 GB at 32,768
# (bf16, 4 heads), and as much again for its gradient. Measured on an H200 (2026-11-26,
# docs/performance.md): gemma3_1b at 32,768 tokens steps in 1.07 s with the kernels against
# 1.81 s blockwise; at 8,192 the kernels beat cuDNN on Gemma's local layers (0.9 against 2.7 ms)
# but not on a global one (6.3 against 3.3 ms), so families without windows keep cuDNN there.
CUDNN_BIAS_MAX_TOKENS = 8192
# Without cuDNN: from this many tokens blockwise is faster than dense on CPU at head dim 256
# (bench/attention.py: 0.96 at 512 tokens, 1.33 at 256); below it dense wins and its scores are
# small. Heads of at most SMALL_HEAD_DIM gain from SMALL_HEAD_MIN_TOKENS (0.90-0.93 at 256,
# 1.05 at 128, head dim 64).
BLOCKWISE_MIN_TOKENS = 512
SMALL_HEAD_DIM, SMALL_HEAD_MIN_TOKENS = 64, 256


def attention_path(implementation: str, dtype, masked: bool, length: int,
                   head_dim: int) -> tuple[str, str]:
    """(path, why): "cudnn", "blockwise" (models/blockwise.py), "pallas" (models/flash.py) or
    "xla" (dense scores), for `model.attention_impl`, the compute dtype, whether documents are
    masked, the length and the head dim. `auto` on a GPU takes pallas only for packed documents
    above CUDNN_BIAS_MAX_TOKENS, where it was measured against blockwise (blockwise for a head
    dim the kernels cannot tile)."""
    if implementation == "pallas" and not backend.is_gpu():
        return "pallas", f"model.attention_impl=pallas on {backend.name()}: through " \
                         f"Pallas's interpreter, exact but slow; the kernels are for GPUs"
    if implementation in ("xla", "blockwise", "cudnn", "pallas"):
        return implementation, f"model.attention_impl={implementation}"
    if _CUDNN_FAILED:
        why = f"cuDNN's attention failed to compile in this process ({_CUDNN_FAILED[0]})"
    elif not backend.is_gpu():
        why = f"model.attention_impl=auto on {backend.name()}: cuDNN needs a GPU"
    elif jnp.dtype(dtype) not in (jnp.bfloat16, jnp.float16):
        why = f"cuDNN's fused attention takes bf16 or fp16, and compute is " \
              f"{jnp.dtype(dtype).name}"
    elif masked and length > CUDNN_BIAS_MAX_TOKENS:
        from tunix_train.models import flash  # only where used: see the imports above

        path = "pallas" if flash.supported_head_dim(head_dim) else "blockwise"
        return path, f"document masks at {length} tokens would reach cuDNN as a " \
                     f"[B, N, L, L] bias (above {CUDNN_BIAS_MAX_TOKENS} tokens)"
    else:
        return "cudnn", "model.attention_impl=auto on a GPU"
    return without_cudnn(length, head_dim, why)


_CUDNN_FAILED: list[str] = []  # why cuDNN's attention failed to compile here, once it has


def fall_back_from_cudnn(error: BaseException, implementation: str) -> bool:
    """Whether a step whose compilation raised `error` should be traced and compiled again
    without cuDNN's attention: under `auto`, when the error is cuDNN's (its own checks pass
    while tracing, and some failures only come when XLA compiles the fused kernel). Says so
    once; from then on `auto` takes the path it takes without cuDNN, in every step this
    process traces (train, eval, generate)."""
    if implementation != "auto" or _CUDNN_FAILED or "cudnn" not in str(error).lower():
        return False
    first = next((line.strip() for line in str(error).splitlines() if line.strip()), "")
    _CUDNN_FAILED.append(first[:200])
    log.warning("attention: cuDNN's fused attention failed to compile (%s); compiling again "
                "without it (model.attention_impl=auto)", _CUDNN_FAILED[0])
    return True


def without_cudnn(length: int, head_dim: int, why: str) -> tuple[str, str]:
    """The path where cuDNN is not used: blockwise from BLOCKWISE_MIN_TOKENS (from
    SMALL_HEAD_MIN_TOKENS for heads of at most SMALL_HEAD_DIM), dense below."""
    least = SMALL_HEAD_MIN_TOKENS if head_dim <= SMALL_HEAD_DIM else BLOCKWISE_MIN_TOKENS
    if length >= least:
        return "blockwise", f"{why}; {length} tokens >= {least} at head dim {head_dim}"
    return "xla", f"{why}; {length} tokens < {least} at head dim {head_dim}"


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
