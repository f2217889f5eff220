"""Hugging Face safetensors ↔ our parameter tree (`nnx.to_pure_dict` of a `Decoder`), for every
family: the family names the tensors (models/<family>.py), the stacking says which HF layer is
which row of which stack.

Import never materialises a whole tensor on one device: every parameter is built with
`jax.make_array_from_callback`, and each device's shard is read straight from the files with
safetensors' lazy `get_slice`, so a process reads only the bytes its own devices hold.

Axes: HF stores each layer's linear maps as torch `[out, in]` matrices with heads flattened
into one axis; we keep `[in, out]` with heads as their own axes (models/hf_axes.py), and the
layers of each stack stacked on a leading axis (`Stacking.placement()` says which HF layer
is which entry).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import math
from pathlib import Path
from typing import Any, Iterator, NamedTuple

import jax
import numpy as np

from tunix_train.config import ConfigError, LoraConfig, ModelConfig
from tunix_train.models import families
from tunix_train.models.hf_axes import AxisMap, hf_shape, read_box, to_hf

log = logging.getLogger("tunix_train")


class Entry(NamedTuple):
    """One HF tensor and where it goes in our tree."""

    name: str
    leaf: tuple  # our leaf path
    axes: AxisMap
    index: tuple[int, ...]  # which slice of our leaf's leading axes: () all of it, (row,) a
    # layer of a stack, (row, expert) one expert of a routed layer
    half: int | None = None  # of a fused HF tensor: which half of its axis 1 (HfTensor.half)


def hf_tensors(model: ModelConfig, prefix: str = "model.", fused: bool = False
               ) -> Iterator[Entry]:
    """Every HF tensor of `model`, in HF's order; `fused`: experts as transformers 5 saves them
    (one tensor per projection), else as the Hub's files hold them (one per expert)."""
    family = families.of(model)
    for path, tensor in family.hf_top_level(model).items():
        yield Entry(("" if tensor.top else prefix) + tensor.name, path, tensor.axes, ())
    for layer, (stack, row) in enumerate(families.stacking(model).placement()):
        for path, tensor in family.hf_layer(model, stack, fused).items():
            name = f"{prefix}layers.{layer}.{tensor.name}"
            if "{j}" in tensor.name:
                for j in range(model.num_experts):
                    yield Entry(name.format(j=j), (stack, *path), tensor.axes, (row, j))
            else:
                yield Entry(name, (stack, *path), tensor.axes, (row,), tensor.half)


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
        # "model." (…ForCausalLM) or "language_model.model." (multimodal Gemma 3 from 4B).
        self.prefix = embed[0][: -len("embed_tokens.weight")]

    @property
    def names(self):
        return self._where.keys()

    def tensor(self, name: str, expected_shape: tuple[int, ...], half: int | None = None):
        """A lazy slice of tensor `name`; with `half`, of that half of its axis 1 (which is
        twice `expected_shape`'s)."""
        if name not in self._where:
            raise ConfigError(f"model.init_from: the checkpoint has no tensor {name!r}.")
        tensor = self._where[name].get_slice(name)
        stored = list(expected_shape)
        if half is not None:
            stored[1] *= 2
        if tuple(tensor.get_shape()) != tuple(stored):
            raise ConfigError(
                f"model.init_from: tensor {name} has shape {tuple(tensor.get_shape())}, expected "
                f"{tuple(stored)} from config.json."
            )
        return tensor if half is None else _Half(tensor, half * expected_shape[1])


class _Half:
    """Rows [offset, offset + n) of a lazily read tensor's axis 1, read like the tensor."""

    def __init__(self, tensor, offset: int):
        self.tensor, self.offset = tensor, offset

    def __getitem__(self, index: tuple[slice, ...]):
        rows = index[1]
        return self.tensor[(index[0], slice(rows.start + self.offset, rows.stop + self.offset),
                            *index[2:])]


def load_init_from(model: ModelConfig, abstract_params: Any, shardings: Any) -> Any:
    """The weights of `model.init_from=hf:<dir>` (`model` already carries its dimensions)."""
    from tunix_train.models.hf_config import checkpoint_dir

    path = checkpoint_dir(model.init_from)
    log.info("loading Hugging Face weights from %s", path)
    return read_params(path, model, abstract_params, shardings)


def read_params(path: Path, model: ModelConfig, abstract_params: Any, shardings: Any) -> Any:
    """Parameters read from the checkpoint at `path`, each created directly in its sharding."""
    with contextlib.ExitStack() as stack:
        files = CheckpointFiles(path, stack)
        fused = families.of(model).hf_fused(files.names)
        sources: dict[tuple, list[Entry]] = {}
        for entry in hf_tensors(model, prefix=files.prefix, fused=fused):
            sources.setdefault(entry.leaf, []).append(entry)
        flat = {}
        for leaf_path, abstract in _flatten(abstract_params).items():
            sharding = _get(shardings, leaf_path)
            flat[leaf_path] = _load_leaf(files, sources[leaf_path], abstract, sharding)
    return _unflatten(flat)


def _load_leaf(files: CheckpointFiles, sources: list[Entry], abstract, sharding) -> jax.Array:
    lead = len(sources[0].index)  # our leading axes that pick HF tensors (layers, experts)
    by_index = {entry.index: entry for entry in sources}
    shape = tuple(abstract.shape[lead:])
    dtype = abstract.dtype

    def read(entry: Entry, box: tuple[slice, ...]) -> np.ndarray:
        tensor = files.tensor(entry.name, hf_shape(entry.axes, shape), entry.half)
        return read_box(tensor, entry.axes, shape, box).astype(dtype)

    def callback(index: tuple[slice, ...]) -> np.ndarray:
        picked = [range(*index[a].indices(abstract.shape[a])) for a in range(lead)]
        blocks = [read(by_index[i], index[lead:]) for i in itertools.product(*picked)]
        return np.stack(blocks).reshape(*map(len, picked), *blocks[0].shape)

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
        for name, leaf, axes, index, _ in tensors:
            value = np.asarray(_get(params, leaf))[index]
            shard[name] = np.ascontiguousarray(to_hf(axes, value).astype(dtype))
            weight_map[name] = file_name
        save_file(shard, str(out / file_name), metadata={"format": "pt"})
    if len(plan) > 1:
        total = sum(_nbytes(params, entry, np.dtype(dtype).itemsize) for entry in hf_tensors(model))
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return [out / n for n in names]


def _nbytes(params: Any, entry: Entry, itemsize: int) -> int:
    return math.prod(_get(params, entry.leaf).shape[len(entry.index):]) * itemsize


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


ADAPTER_PREFIX = "base_model.model."  # where PEFT's LoraModel puts the wrapped model's names


def save_adapter(adapters: Any, model: ModelConfig, lora: LoraConfig, out: Path,
                 dtype: np.dtype, base_model: str | None) -> Path:
    """Writes a PEFT LoRA adapter folder: adapter_config.json and adapter_model.safetensors,
    `…layers.{i}.self_attn.q_proj.lora_A.weight` [r, in] and `….lora_B.weight` [out, r], which
    `peft.PeftModel.from_pretrained` loads onto the family's transformers model. `adapters`:
    host arrays, the adapters' part of our tree."""
    from safetensors.numpy import save_file

    from tunix_train.models.hf_axes import factors_to_hf
    from tunix_train.models.layers import LORA_SUFFIX

    tensors, modules = {}, set()
    for name, leaf, axes, index, _ in hf_tensors(model):
        try:
            adapter = _get(adapters, (*leaf[:-1], leaf[-1] + LORA_SUFFIX))
        except (KeyError, TypeError):
            continue
        a, b = (np.asarray(adapter[k])[index] for k in "ab")
        lora_a, lora_b = factors_to_hf(axes, a, b)
        module = name.removesuffix(".weight")
        tensors[f"{ADAPTER_PREFIX}{module}.lora_A.weight"] = np.ascontiguousarray(
            lora_a.astype(dtype))
        tensors[f"{ADAPTER_PREFIX}{module}.lora_B.weight"] = np.ascontiguousarray(
            lora_b.astype(dtype))
        modules.add(module.rsplit(".", 1)[-1])
    out.mkdir(parents=True, exist_ok=True)
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora.rank,
        "lora_alpha": lora.alpha, "lora_dropout": lora.dropout, "target_modules": sorted(modules),
        "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "init_lora_weights": True,
        "inference_mode": True, "modules_to_save": None, "base_model_name_or_path": base_model,
    }
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2))
    path = out / "adapter_model.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt"})
    return path
