"""Hugging Face Gemma 3 safetensors ↔ our parameter tree (`nnx.to_pure_dict` of `Gemma3`).

Import never materialises a whole tensor on one device: every parameter is built with
`jax.make_array_from_callback`, and each device's shard is read straight from the files with
safetensors' lazy `get_slice`, so a process reads only the bytes its own devices hold.

Layouts: HF stores each layer's linear maps as torch `[out, in]` matrices with heads flattened
into one axis; we keep `[in, out]` with heads as their own axes, and the layers of each kind
stacked on a leading axis (`LayerLayout.placement()` says which HF layer is which entry).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import jax
import numpy as np

from tunix_train.config import ConfigError, ModelConfig
from tunix_train.models.gemma3 import LayerLayout

log = logging.getLogger("tunix_train")


@dataclass(frozen=True)
class Layout:
    """ours = hf.reshape(view).transpose(perm); `groups` are the view axes of each HF axis."""

    perm: tuple[int, ...]
    groups: tuple[tuple[int, ...], ...]


VECTOR = Layout((0,), ((0,),))
MATRIX = Layout((0, 1), ((0,), (1,)))
TRANSPOSE = Layout((1, 0), ((0,), (1,)))
HEADS_OUT = Layout((2, 0, 1), ((0, 1), (2,)))  # HF [N*H, D] → ours [D, N, H]
HEADS_IN = Layout((1, 2, 0), ((0,), (1, 2)))  # HF [D, N*H] → ours [N, H, D]

TOP_LEVEL = {
    ("embedder", "embedding"): ("embed_tokens.weight", MATRIX),
    ("final_norm", "scale"): ("norm.weight", VECTOR),
}
PER_LAYER = {
    ("attention", "q"): ("self_attn.q_proj.weight", HEADS_OUT),
    ("attention", "k"): ("self_attn.k_proj.weight", HEADS_OUT),
    ("attention", "v"): ("self_attn.v_proj.weight", HEADS_OUT),
    ("attention", "o"): ("self_attn.o_proj.weight", HEADS_IN),
    ("attention", "q_norm", "scale"): ("self_attn.q_norm.weight", VECTOR),
    ("attention", "k_norm", "scale"): ("self_attn.k_norm.weight", VECTOR),
    ("mlp", "gate"): ("mlp.gate_proj.weight", TRANSPOSE),
    ("mlp", "up"): ("mlp.up_proj.weight", TRANSPOSE),
    ("mlp", "down"): ("mlp.down_proj.weight", TRANSPOSE),
    ("pre_attention_norm", "scale"): ("input_layernorm.weight", VECTOR),
    ("post_attention_norm", "scale"): ("post_attention_layernorm.weight", VECTOR),
    ("pre_mlp_norm", "scale"): ("pre_feedforward_layernorm.weight", VECTOR),
    ("post_mlp_norm", "scale"): ("post_feedforward_layernorm.weight", VECTOR),
}


def _view(layout: Layout, shape: tuple[int, ...]) -> list[int]:
    view = [0] * len(shape)
    for ours, axis in enumerate(layout.perm):
        view[axis] = shape[ours]
    return view


def hf_shape(layout: Layout, shape: tuple[int, ...]) -> tuple[int, ...]:
    view = _view(layout, shape)
    return tuple(math.prod(view[a] for a in group) for group in layout.groups)


def read_box(tensor, layout: Layout, shape: tuple[int, ...], box: tuple[slice, ...]) -> np.ndarray:
    """`ours[box]` read from an HF tensor (a safetensors slice), touching only the rows needed.

    A merged HF axis (heads × head_dim) is read over whole inner blocks, then cut to the box.
    """
    view = _view(layout, shape)
    view_box = [slice(0)] * len(shape)
    for ours, axis in enumerate(layout.perm):
        view_box[axis] = slice(*box[ours].indices(shape[ours])[:2])
    hf_index, block_shape, inner = [], [], []
    for group in layout.groups:
        outer, size = view_box[group[0]], math.prod(view[a] for a in group[1:])
        hf_index.append(slice(outer.start * size, outer.stop * size))
        block_shape.append(outer.stop - outer.start)
        inner.append(slice(None))
        for axis in group[1:]:
            block_shape.append(view[axis])
            inner.append(view_box[axis])
    block = np.asarray(tensor[tuple(hf_index)]).reshape(block_shape)[tuple(inner)]
    return block.transpose(layout.perm)


def to_hf(layout: Layout, ours: np.ndarray) -> np.ndarray:
    return ours.transpose(np.argsort(layout.perm)).reshape(hf_shape(layout, ours.shape))


def hf_tensors(model: ModelConfig, prefix: str = "model.") -> Iterator[tuple[str, tuple, Layout, int | None]]:
    """(HF name, our leaf path, layout, index in our layer stack or None), in HF's order."""
    for path, (name, layout) in TOP_LEVEL.items():
        yield prefix + name, path, layout, None
    for layer, (kind, index) in enumerate(LayerLayout.of(model).placement()):
        stack = f"{kind}_layers"
        for path, (name, layout) in PER_LAYER.items():
            yield f"{prefix}layers.{layer}.{name}", (stack, *path), layout, index


# ---------------------------------------------------------------------------------------------
# Import


class CheckpointFiles:
    """Lazy access to the tensors of a folder of *.safetensors (single file or sharded)."""

    def __init__(self, path: Path, stack: contextlib.ExitStack):
        from safetensors import safe_open  # numpy API only: torch is never needed

        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise ConfigError(f"model.init_from: {path} holds no *.safetensors files.")
        self._where: dict[str, Any] = {}
        for file in files:
            handle = stack.enter_context(safe_open(str(file), framework="np"))
            self._where.update({name: handle for name in handle.keys()})
        embed = [n for n in self._where if n.endswith("embed_tokens.weight")]
        if len(embed) != 1:
            raise ConfigError(f"model.init_from: {path} has no single embed_tokens.weight tensor.")
        # "model." (Gemma3ForCausalLM) or "language_model.model." (multimodal 4B and up).
        self.prefix = embed[0][: -len("embed_tokens.weight")]

    def tensor(self, name: str, expected_shape: tuple[int, ...]):
        if name not in self._where:
            raise ConfigError(f"model.init_from: the checkpoint has no tensor {name!r}.")
        tensor = self._where[name].get_slice(name)
        if tuple(tensor.get_shape()) != expected_shape:
            raise ConfigError(
                f"model.init_from: tensor {name} has shape {tuple(tensor.get_shape())}, expected "
                f"{expected_shape} from config.json."
            )
        return tensor


def load_init_from(model: ModelConfig, abstract_params: Any, shardings: Any) -> Any:
    """The weights of `model.init_from=hf:<dir>` (`model` already carries its dimensions)."""
    from tunix_train.models.hf_config import checkpoint_dir

    path = checkpoint_dir(model.init_from)
    log.info("loading Hugging Face weights from %s", path)
    return read_params(path, model, abstract_params, shardings)


def read_params(path: Path, model: ModelConfig, abstract_params: Any, shardings: Any) -> Any:
    """Parameters read from the checkpoint at `path`, each created directly in its sharding."""
    sources: dict[tuple, list] = {}
    for name, leaf, layout, index in hf_tensors(model, prefix=""):
        sources.setdefault(leaf, []).append((name, layout, index))
    with contextlib.ExitStack() as stack:
        files = CheckpointFiles(path, stack)
        flat = {}
        for leaf_path, abstract in _flatten(abstract_params).items():
            sharding = _get(shardings, leaf_path)
            flat[leaf_path] = _load_leaf(files, sources[leaf_path], abstract, sharding)
    return _unflatten(flat)


def _load_leaf(files: CheckpointFiles, sources: list, abstract, sharding) -> jax.Array:
    stacked = sources[0][2] is not None
    by_index = {index: (name, layout) for name, layout, index in sources}
    shape = tuple(abstract.shape[1:] if stacked else abstract.shape)
    dtype = abstract.dtype

    def read(name: str, layout: Layout, box: tuple[slice, ...]) -> np.ndarray:
        tensor = files.tensor(files.prefix + name, hf_shape(layout, shape))
        return read_box(tensor, layout, shape, box).astype(dtype)

    def callback(index: tuple[slice, ...]) -> np.ndarray:
        if not stacked:
            return read(*by_index[None], index)
        layers = range(*index[0].indices(abstract.shape[0]))
        return np.stack([read(*by_index[i], index[1:]) for i in layers])

    return jax.make_array_from_callback(abstract.shape, sharding, callback)


def _flatten(tree: Any, prefix: tuple = ()) -> dict[tuple, Any]:
    if not isinstance(tree, dict):
        return {prefix: tree}
    return {k: v for key, sub in tree.items() for k, v in _flatten(sub, (*prefix, key)).items()}


def _unflatten(flat: dict[tuple, Any]) -> dict:
    tree: dict = {}
    for path, value in flat.items():
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return tree


def _get(tree: Any, path: tuple) -> Any:
    for key in path:
        tree = tree[key]
    return tree


# ---------------------------------------------------------------------------------------------
# Export


def save(params: Any, model: ModelConfig, out: Path, dtype: np.dtype, max_shard_bytes: int,
         token_ids: dict[str, int] | None = None) -> list[Path]:
    """Writes config.json and safetensors (split at `max_shard_bytes`, with an index) to `out`.

    `params` is a tree of host (numpy) arrays; tensors are converted one at a time.
    """
    from safetensors.numpy import save_file

    from tunix_train.models import hf_config

    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(hf_config.to_hf(model, token_ids), indent=2))
    plan = _shard_plan(model, params, np.dtype(dtype).itemsize, max_shard_bytes)
    names = ["model.safetensors"] if len(plan) == 1 else [
        f"model-{i + 1:05d}-of-{len(plan):05d}.safetensors" for i in range(len(plan))]
    weight_map = {}
    for file_name, tensors in zip(names, plan):
        shard = {}
        for name, leaf, layout, index in tensors:
            value = _get(params, leaf)
            value = value if index is None else value[index]
            shard[name] = np.ascontiguousarray(to_hf(layout, np.asarray(value)).astype(dtype))
            weight_map[name] = file_name
        save_file(shard, str(out / file_name), metadata={"format": "pt"})
    if len(plan) > 1:
        total = sum(_nbytes(params, entry, np.dtype(dtype).itemsize) for entry in hf_tensors(model))
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return [out / n for n in names]


def _nbytes(params: Any, entry: tuple, itemsize: int) -> int:
    _, leaf, _, index = entry
    shape = _get(params, leaf).shape
    return math.prod(shape[1:] if index is not None else shape) * itemsize


def _shard_plan(model: ModelConfig, params: Any, itemsize: int, max_bytes: int) -> list[list]:
    """HF tensors grouped, in order, into files of at most `max_bytes` (one if smaller)."""
    plan, current, size = [], [], 0
    for entry in hf_tensors(model):
        nbytes = _nbytes(params, entry, itemsize)
        if current and size + nbytes > max_bytes:
            plan, current, size = plan + [current], [], 0
        current.append(entry)
        size += nbytes
    return plan + [current]
