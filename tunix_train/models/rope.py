"""Rotary position embeddings (rotate-half form, as Hugging Face writes all three families).

Each stack's `family.Rope` gives its inverse frequencies 1 / base^(2i/H), scaled:

    linear   every frequency / factor (positions / factor: Gemma 3's global layers from 4B)
    llama3   by wavelength λ = 2π / f against the original context C (Llama 3.1 and later):
             λ > C / low_freq_factor: f / factor;  λ < C / high_freq_factor: f;  between:
             (1 - s)·f / factor + s·f with s = (C / λ - low) / (high - low)

computed in fp32 like transformers' `ROPE_INIT_FUNCTIONS`, so imported checkpoints see the
angles they were trained with.
"""

from __future__ import annotations

import math
from typing import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from tunix_train.models.family import Rope

CosSin = tuple[jax.Array, jax.Array]


def inverse_frequencies(rope: Rope, head_dim: int) -> np.ndarray:
    """[H/2] fp32."""
    exponent = np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)
    inv = (np.float32(1.0) / np.power(np.float32(rope.base), exponent)).astype(np.float32)
    if rope.factor == 1.0:
        return inv
    if rope.kind == "linear":
        return (inv / np.float32(rope.factor)).astype(np.float32)
    low_wavelen = rope.original_context / rope.low_freq_factor
    high_wavelen = rope.original_context / rope.high_freq_factor
    wavelen = np.float32(2 * math.pi) / inv
    scaled = np.where(wavelen > low_wavelen, inv / np.float32(rope.factor), inv)
    smooth = (rope.original_context / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def tables(positions_BxL: jax.Array, ropes: Mapping[str, Rope],
           head_dim: int) -> dict[str, CosSin]:
    """Per stack, the cos/sin tables [B, L, 1, H] of these positions.

    All distinct RoPEs' tables come out of one loop over their frequencies rather than one
    expression each: XLA's CPU backend fuses a cos/sin expression into each consumer, which
    recomputes it per layer, per head and per pipeline iteration (180 sine fusions in one
    pipelined step of bench/pipeline_bubble.py, 40 in an 8-layer unrolled step); a loop's
    outputs are computed once and read by all."""
    distinct = list(dict.fromkeys(ropes.values()))
    inv_RxH2 = jnp.asarray(np.stack([inverse_frequencies(r, head_dim) for r in distinct]))
    _, (cos, sin) = jax.lax.scan(lambda _, inv: (None, _cos_sin(positions_BxL, inv)), None,
                                 inv_RxH2)
    return {stack: (cos[distinct.index(r)], sin[distinct.index(r)])
            for stack, r in ropes.items()}


def _cos_sin(positions_BxL: jax.Array, inv_freq_H2: jax.Array) -> CosSin:
    angles_BxLxH2 = positions_BxL[..., None].astype(jnp.float32) * inv_freq_H2
    angles_BxLxH = jnp.concatenate([angles_BxLxH2, angles_BxLxH2], axis=-1)[:, :, None, :]
    return jnp.cos(angles_BxLxH), jnp.sin(angles_BxLxH)


def apply(x_BxLxNxH: jax.Array, cos_sin: CosSin) -> jax.Array:
    cos, sin = cos_sin
    half = x_BxLxNxH.shape[-1] // 2
    x1, x2 = x_BxLxNxH[..., :half], x_BxLxNxH[..., half:]
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    out = x_BxLxNxH.astype(jnp.float32) * cos + rotated.astype(jnp.float32) * sin
    return out.astype(x_BxLxNxH.dtype)
