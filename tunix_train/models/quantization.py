"""QLoRA's frozen base: projection weights stored 4-bit NormalFloat (`nf4`) or `int8`, with a
scale per block of 64 values along the weight's contracted (input) dimension, per output
channel, as Dettmers et al. (2023) store them; dequantized layer by layer, where the layer's
weights are materialized (models/params.py), in the forward and the backward pass alike.

The arithmetic is Google's `qwix` (`qwix.quantize` / `qwix.dequantize`, the library Tunix's
QLoRA uses); a quantized weight is its `QArray`, whose leaves (codes, scales) are parameters
like any other: sharded by the weight's logical axes, gathered by FSDP, stored in checkpoints.
qwix's model-rewriting interception (`QtProvider`) is not used: our projections read their
weights through one function already, which is the one place a weight is dequantized.
Embeddings, the output head and norms stay in the compute dtype.
"""

from __future__ import annotations

import sys
from typing import Any

import jax
import jax.numpy as jnp

BLOCK = 64  # values per scale along the contracted dimension (QLoRA's block size)
QUANTIZED = ("q", "k", "v", "o", "gate", "up", "down")  # the projections a base stores quantized
# The contracted dimension of each projection's weight (q: [D, N, H] → D; o: [N, H, D] → H).
_CONTRACTED = {"q": 0, "k": 0, "v": 0, "o": 1, "gate": 0, "up": 0, "down": 0}


def is_quantized_weight(path: tuple) -> bool:
    """Whether the parameter at `path` is a projection weight a quantized base stores
    quantized (stacked layers: the path ends in the projection's name)."""
    return bool(path) and path[-1] in QUANTIZED


def tiled_axis(path: tuple, stacked: bool) -> int:
    """The dimension of the weight at `path` whose blocks share a scale."""
    return _CONTRACTED[path[-1]] + (1 if stacked else 0)


def quantize(weight: jax.Array, qtype: str, axis: int, scale_dtype: Any) -> Any:
    """`weight` as a qwix QArray: `BLOCK`-value blocks along `axis` (the whole dimension where
    it does not divide), one scale per block and per every other index."""
    import qwix

    block = BLOCK if weight.shape[axis] % BLOCK == 0 else weight.shape[axis]
    others = tuple(a for a in range(weight.ndim) if a != axis)
    return qwix.quantize(weight, qtype, channelwise_axes=others, tiled_axes={axis: block},
                         scale_dtype=scale_dtype)


def is_qarray(x: Any) -> bool:
    """Whether `x` is a qwix QArray: never before qwix is imported (`quantize` imports it), so
    a run without a quantized base does not pay for the import (0.15 s a process)."""
    qwix = sys.modules.get("qwix")
    return qwix is not None and isinstance(x, qwix.QArray)


def dequantized(tree: Any) -> Any:
    """`tree` with every QArray replaced by its values (in its scales' dtype)."""
    if not any(is_qarray(leaf) for leaf in jax.tree.leaves(tree, is_leaf=is_qarray)):
        return tree
    import qwix

    return jax.tree.map(lambda x: qwix.dequantize(x) if is_qarray(x) else x, tree,
                        is_leaf=is_qarray)


def cast(tree: Any, dtype: Any) -> Any:
    """A parameter tree in the compute `dtype`; a quantized base stays as stored (its codes are
    not numbers to cast)."""
    return jax.tree.map(lambda x: x if is_qarray(x) or x.dtype == dtype else x.astype(dtype),
                        tree, is_leaf=is_qarray)


def itemsize(dtype: Any) -> float:
    """Bytes per element as XLA stores it: 4-bit types (an nf4 base's codes) take half a byte."""
    dtype = jnp.dtype(dtype)
    return 0.5 if dtype.name in ("int4", "uint4") else dtype.itemsize


def qtype(name: str) -> Any:
    """`lora.base_quantization` → qwix's type."""
    return {"nf4": "nf4", "int8": jnp.int8}[name]
