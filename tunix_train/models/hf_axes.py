"""How a Hugging Face tensor maps onto ours: torch's `[out, in]` matrices with heads flattened
into one axis, against our `[in, out]` with heads as axes of their own. Read a box of ours
straight from a lazily opened safetensors slice, or turn ours back into HF's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class AxisMap:
    """ours = hf.reshape(view).transpose(perm); `groups` are the view axes of each HF axis."""

    perm: tuple[int, ...]
    groups: tuple[tuple[int, ...], ...]


VECTOR = AxisMap((0,), ((0,),))
MATRIX = AxisMap((0, 1), ((0,), (1,)))
TRANSPOSE = AxisMap((1, 0), ((0,), (1,)))
HEADS_OUT = AxisMap((2, 0, 1), ((0, 1), (2,)))  # HF [N*H, D] → ours [D, N, H]
HEADS_IN = AxisMap((1, 2, 0), ((0,), (1, 2)))  # HF [D, N*H] → ours [N, H, D]
EXPERTS_TRANSPOSE = AxisMap((0, 2, 1), ((0,), (1,), (2,)))  # HF [E, out, in] → ours [E, in, out]


def _view(axes: AxisMap, shape: tuple[int, ...]) -> list[int]:
    view = [0] * len(shape)
    for ours, axis in enumerate(axes.perm):
        view[axis] = shape[ours]
    return view


def hf_shape(axes: AxisMap, shape: tuple[int, ...]) -> tuple[int, ...]:
    view = _view(axes, shape)
    return tuple(math.prod(view[a] for a in group) for group in axes.groups)


def read_box(tensor, axes: AxisMap, shape: tuple[int, ...], box: tuple[slice, ...]) -> np.ndarray:
    """`ours[box]` read from an HF tensor (a safetensors slice), touching only the rows needed.

    A merged HF axis (heads × head_dim) is read over whole inner blocks, then cut to the box.
    """
    view = _view(axes, shape)
    view_box = [slice(0)] * len(shape)
    for ours, axis in enumerate(axes.perm):
        view_box[axis] = slice(*box[ours].indices(shape[ours])[:2])
    hf_index, block_shape, inner = [], [], []
    for group in axes.groups:
        outer, size = view_box[group[0]], math.prod(view[a] for a in group[1:])
        hf_index.append(slice(outer.start * size, outer.stop * size))
        block_shape.append(outer.stop - outer.start)
        inner.append(slice(None))
        for axis in group[1:]:
            block_shape.append(view[axis])
            inner.append(view_box[axis])
    block = np.asarray(tensor[tuple(hf_index)]).reshape(block_shape)[tuple(inner)]
    return block.transpose(axes.perm)


def to_hf(axes: AxisMap, ours: np.ndarray) -> np.ndarray:
    return ours.transpose(np.argsort(axes.perm)).reshape(hf_shape(axes, ours.shape))


def factors_to_hf(axes: AxisMap, a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A low-rank update A [in..., r] · B [r, out...] of a weight of ours, as PEFT's factors of
    the HF matrix: lora_A [r, in] and lora_B [out, r], with lora_B · lora_A = to_hf(A · B).

    Where each of HF's axes gathers ours by a permutation (these maps do), the factors are A
    and B with their axes in HF's order: found by sending our flat indices through `to_hf`.
    """
    r = a.shape[-1]
    in_shape, out_shape = a.shape[:-1], b.shape[1:]
    n_in, n_out = math.prod(in_shape), math.prod(out_shape)
    index = to_hf(axes, np.arange(n_in * n_out, dtype=np.int64).reshape(*in_shape, *out_shape))
    rows, cols = index[0] // n_out, index[:, 0] % n_out  # our input of each HF column, output of each row
    if not np.array_equal(index, cols[:, None] + rows[None, :] * n_out):
        raise ValueError("these axes do not send inputs to HF's columns and outputs to its rows")
    return a.reshape(n_in, r)[rows].T, b.reshape(r, n_out)[:, cols].T
