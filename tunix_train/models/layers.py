"""The pieces every family's layers are built from, in Flax NNX: parameters by logical axis
names, projections, norms, gated activations, the embedding and the output head. Attention is
in models/attention.py, the MLP, the decoder layer and the model in models/decoder.py.

Shapes are written into names: B batch, L sequence, D embed, N query heads, K KV heads,
H head dim, F MLP width, V vocabulary.
"""

from __future__ import annotations

import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from tunix_train import backend
from tunix_train.config import ModelConfig
from tunix_train.models import head
from tunix_train.models.params import materialize, take
from tunix_train.models.partitioning import constrain

PROJECTION = "projection"  # name of a projection's output, for recomputation policies
ROUTING_PLAN = "routing_plan"  # a mixture's integer routing plan, for recomputation policies
LORA_SUFFIX = "_lora"  # the low-rank adapter of projection `q` is the module `q_lora` (lora.py)


def scaled_normal(rngs: nnx.Rngs, shape: tuple[int, ...], fan_in: int) -> jax.Array:
    # Scaled normal init for every matrix. Never zeros: Gemma's reference zero-initialises MLP
    # kernels because it expects a checkpoint, which from scratch never trains.
    return jax.random.normal(rngs.params(), shape, jnp.float32) * fan_in**-0.5


_AXES_METADATA = "out_sharding"  # where Flax NNX keeps a Variable's logical axis names


def param(value: jax.Array, *logical_axes: str) -> nnx.Param:
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
    if backend.is_cpu():
        y = _project_cpu(x, w, contract)
    else:
        y = jnp.tensordot(x, w, axes=contract)
    return checkpoint_name(y, PROJECTION)


def project_unsaved(x: jax.Array, w: jax.Array, contract: int = 1) -> jax.Array:
    """`project` whose output no recomputation policy keeps for the backward pass: unnamed,
    and a custom VJP (policies see one opaque equation, not a dot), so `save_dots`
    recomputes it from its inputs. For a LoRA adapter's up-projection (models/lora.py)."""
    return _project_cpu(x, w, contract)


def adapted(module: nnx.Module, name: str, x: jax.Array, contract: int = 1) -> jax.Array:
    """x through `module`'s projection `name` (a weight parameter), plus the update of its
    low-rank adapter where LoRA gave it one (models/lora.py)."""
    y = project(x, getattr(module, name)[...], contract)
    adapter = getattr(module, name + LORA_SUFFIX, None)
    return y if adapter is None else y + adapter(x, contract).astype(y.dtype)


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
    """gelu_tanh(gate) · up (Gemma)."""
    return jax.nn.gelu(gate, approximate=True) * up


@keeping_inputs
def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    """silu(gate) · up (Llama, Qwen)."""
    return jax.nn.silu(gate) * up


GATED = {"gelu_tanh": geglu, "silu": swiglu}  # Architecture.activation → the gated product


@keeping_inputs
def rms_norm(x: jax.Array, scale: jax.Array, eps: jax.Array, offset: jax.Array) -> jax.Array:
    """x / rms(x) · (offset + scale) in fp32 whatever x's dtype, back in x's dtype."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y * (offset + scale.astype(jnp.float32))).astype(x.dtype)


class RMSNorm(nnx.Module):
    """RMSNorm scaled by (offset + scale), computed in fp32 whatever the input dtype: Gemma's
    (1 + scale) with the scale starting at 0, or Llama's plain scale starting at 1."""

    def __init__(self, dim: int, eps: float, offset: float):
        self.scale = param(jnp.full((dim,), 1.0 - offset, jnp.float32), "norm")
        self.eps, self.offset = eps, offset

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.scale[...], jnp.float32(self.eps), jnp.float32(self.offset))


class Embedder(nnx.Module):
    """Token embedding (scaled by sqrt(D) on the way in where the family says so); also the
    output head when the family ties them."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, scale: bool):
        shape = (cfg.vocab_size, cfg.embed_dim)
        self.embedding = param(scaled_normal(rngs, shape, cfg.embed_dim), "vocab", "embed")
        self.scale = cfg.embed_dim**0.5 if scale else None

    def encode(self, tokens_BxL: jax.Array) -> jax.Array:
        x_BxLxD = take(self.embedding.get_value(), tokens_BxL)
        if self.scale is None:
            return x_BxLxD
        return x_BxLxD * jnp.asarray(self.scale, x_BxLxD.dtype)

    def table(self) -> nnx.Param:
        return self.embedding


class Unembedding(nnx.Module):
    """An output head of its own ([V, D], like the embedding: the same vocabulary sharding and
    fused loss), for families that do not tie it to the embedding."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        shape = (cfg.vocab_size, cfg.embed_dim)
        self.weight = param(scaled_normal(rngs, shape, cfg.embed_dim), "vocab", "embed")

    def table(self) -> nnx.Param:
        return self.weight


def logits(x_BxLxD: jax.Array, table: nnx.Param) -> jax.Array:
    """Logits over the whole vocabulary (generation, evaluation of a few tokens)."""
    table_VxD = materialize(table.get_value())
    logits_BxLxV = jnp.einsum("bld,vd->blv", x_BxLxD, table_VxD)
    return constrain(logits_BxLxV, ("act_batch", "act_seq", "act_vocab"))


def token_losses(x_BxLxD: jax.Array, table: nnx.Param, targets_BxL: jax.Array,
                 chunks: head.VocabChunks) -> jax.Array:
    """Cross-entropy [B, L] (fp32) of the logits, never formed whole (models/head.py)."""
    batch, length, dim = x_BxLxD.shape
    losses_T = head.token_losses(x_BxLxD.reshape(batch * length, dim), table.get_value(),
                                 targets_BxL.reshape(-1), chunks)
    return losses_T.reshape(batch, length)
