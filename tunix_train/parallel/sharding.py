"""The logical → mesh axis table, checked once, and every sharding derived from it.

Model code names logical axes only (`("embed", "mlp")`, `("act_batch", "act_seq", ...)`); this
module holds the one table that maps them to mesh axes (`RULES`; `model.sharding_rules` holds a
user's overrides, merged here) and turns them into `PartitionSpec`s. `training.zero_stage`
picks what is sharded over `fsdp`:

    stage   parameters   gradients   optimizer state
      0     replicated   replicated  replicated        (DDP: gradients all-reduced)
      1     replicated   replicated  sharded
      2     replicated   sharded     sharded           (gradients reduce-scattered)
      3     sharded      sharded     sharded           (FSDP: parameters all-gathered before use)
"""

from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

import jax
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from tunix_train.config import ConfigError, ModelConfig
from tunix_train.models import families
from tunix_train.parallel.mesh import CP, DATA_AXES, EP, FSDP, PP, TP

log = logging.getLogger(__name__)

LogicalRules = tuple[tuple[str, str | None], ...]

RULES: dict[str, str | None] = {
    # Parameters. `embed` is the dimension FSDP (ZeRO-3) shards; the rest is tensor parallelism.
    "vocab": TP,
    "embed": FSDP,
    "mlp": TP,
    "experts": EP,  # a routed layer's experts: split over ep (expert parallelism), if the mesh
    # has it; otherwise over fsdp under ZeRO 3 where fsdp divides them (`_experts_over_fsdp`)
    "expert_embed": FSDP,  # the experts' `embed` dimension: as `embed`, where fsdp does not
    # split the experts themselves
    "expert_scores": None,  # the router's output: a score per expert, for every expert
    "expert_mlp": TP,  # each expert's MLP width, as `mlp`
    "q_heads": TP,
    "kv_heads": TP,  # dropped automatically when tp does not divide num_kv_heads (MQA)
    "head_dim": None,
    "layers": PP,  # the blocks' layer stacks: each pipeline stage holds its own (pp meshes)
    "trailing_layers": None,
    "norm": None,
    "lora_rank": None,  # a LoRA adapter's rank r: small, kept whole
    # Activations.
    "act_batch": FSDP,
    "act_seq": CP,  # context parallelism: each device holds a chunk of every sequence
    "act_tokens": CP,  # [B·L] flattened tokens of the output head: chunks of them under cp
    "act_embed": None,
    "act_mlp": TP,
    "act_q_heads": TP,
    "act_kv_heads": TP,
    "act_vocab": TP,
}

# Logical axes whose size must be divisible by the mesh axis they map to, or the run cannot shard
# them; the others fall back to replication (e.g. a single KV head under tp).
_MUST_DIVIDE = ("vocab", "embed", "mlp", "experts", "expert_embed", "expert_mlp", "q_heads")


@dataclass(frozen=True)
class ZeroRules:
    """The rules each kind of state follows at a ZeRO stage; `params` also drives the model's
    activation constraints."""

    params: LogicalRules
    grads: LogicalRules
    optimizer: LogicalRules


def logical_dims(model: ModelConfig) -> dict[str, int]:
    """Size of each logical axis for this model (activations share their parameter's size)."""
    dims = {
        "vocab": model.vocab_size, "embed": model.embed_dim, "mlp": model.hidden_dim,
        "q_heads": model.num_heads, "kv_heads": model.num_kv_heads, "head_dim": model.head_dim,
    }
    if model.num_experts:
        dims.update(experts=model.num_experts, expert_scores=model.num_experts,
                    expert_embed=model.embed_dim, expert_mlp=model.expert_hidden_dim)
    dims.update({f"act_{k}": v for k, v in dims.items()})
    return dims


def resolve_rules(model: ModelConfig, mesh: Mesh,
                  pipeline_repeats: int = 1) -> dict[str, str | None]:
    """`RULES` with `model.sharding_rules` merged in, checked against the mesh and the model's
    dimensions (`pipeline_repeats`: `training.pipeline_repeats`)."""
    unknown = sorted(set(model.sharding_rules) - set(RULES))
    if unknown:
        raise ConfigError(
            f"model.sharding_rules has unknown logical axes {unknown}; "
            f"known ones are {sorted(RULES)}."
        )
    rules = {**RULES, **model.sharding_rules}
    if "expert_embed" not in model.sharding_rules:
        rules["expert_embed"] = rules["embed"]
    for optional in (PP, CP, EP):
        if optional not in mesh.shape:
            rules = {name: None if axis == optional else axis for name, axis in rules.items()}
    rules = _experts_over_fsdp(rules, model, mesh)
    if PP in mesh.shape and rules["layers"] == PP and (
            families.stacking(model).num_blocks % mesh.shape[PP] or pipeline_repeats > 1):
        # Blocks that do not divide into the stages, or a circular schedule's stages of chunks
        # apart: the stacks are stored whole over pp and ZeRO splits them over fsdp × pp
        # instead (spread_over_ranks, parallel/pipeline.py).
        rules["layers"] = None
    dims = logical_dims(model)
    for name, axis in rules.items():
        if axis is not None and axis not in mesh.shape:
            raise ConfigError(
                f"model.sharding_rules.{name}={axis!r} is not a mesh axis; use one of "
                f"{list(mesh.shape)} or null."
            )
        if axis is None or name not in dims or dims[name] % mesh.shape[axis] == 0:
            continue
        if name.removeprefix("act_") in _MUST_DIVIDE:
            key = _DIM_KEYS[name.removeprefix("act_")]
            raise ConfigError(
                f"model.{key}={dims[name]} is not divisible by {axis}={mesh.shape[axis]} from "
                f"model.mesh_shape; choose a {axis} size that divides {dims[name]}."
            )
        log.info("%s=%d does not divide over %s=%d: replicated instead.",
                 name, dims[name], axis, mesh.shape[axis])
        rules[name] = None
    return rules


_DIM_KEYS = {"vocab": "vocab_size", "embed": "embed_dim", "mlp": "hidden_dim",
             "experts": "num_experts", "expert_embed": "embed_dim",
             "expert_mlp": "expert_hidden_dim", "q_heads": "num_heads"}


def _experts_over_fsdp(rules: dict[str, str | None], model: ModelConfig,
                       mesh: Mesh) -> dict[str, str | None]:
    """Where nothing else splits a mixture's experts (no ep) and ZeRO 3 would split their
    `embed` dimension over fsdp, fsdp splits the experts instead, if it divides them: the same
    bytes a device, but each layer's all-gather then lays out whole experts one after another
    (the outermost dimension), as the tiles' per-expert weights are read. Gathered along
    `embed`, XLA's CPU compiler kept `embed` outermost and every tile read its weight through a
    transposed view, 15% of bench/moe.py's MoE step on fsdp 4 x tp 2 (docs/performance.md). A
    rule the user set for either axis is kept."""
    fsdp = mesh.shape.get(FSDP, 1)
    if (not model.num_experts or fsdp == 1 or model.num_experts % fsdp
            or rules["experts"] is not None or rules["expert_embed"] != FSDP
            or {"experts", "expert_embed"} & set(model.sharding_rules)):
        return rules
    return {**rules, "experts": FSDP, "expert_embed": None}


def zero_rules(model: ModelConfig, mesh: Mesh, zero_stage: int,
               pipeline_repeats: int = 1) -> ZeroRules:
    rules = resolve_rules(model, mesh, pipeline_repeats)
    if FSDP in (rules["vocab"], rules["act_vocab"]):
        raise ConfigError(
            "model.sharding_rules maps the vocabulary to fsdp, which the embedding lookup and "
            "the chunked output head do not support; map vocab and act_vocab to tp or null.")
    sharded = tuple(rules.items())
    unsharded = tuple(
        (name, None if axis == FSDP and not name.startswith("act_") else axis)
        for name, axis in rules.items()
    )
    return ZeroRules(
        params=sharded if zero_stage >= 3 else unsharded,
        grads=sharded if zero_stage >= 2 else unsharded,
        optimizer=sharded if zero_stage >= 1 else unsharded,
    )


def vocab_chunks(vocab_size: int, shards: int, chunk_size: int) -> int:
    """Chunks the output head takes each of the vocabulary's `shards` blocks in (models/head.py):
    the fewest that divide a block evenly into chunks of at most `chunk_size` entries overall."""
    block = vocab_size // shards
    return next(k for k in range(1, block + 1) if block % k == 0 and vocab_size // k <= chunk_size
                or k == block)


def vocab_shards(rules: LogicalRules, mesh: Mesh) -> int:
    """Contiguous blocks the vocabulary is split in: its tp shards, if it is sharded."""
    axis = dict(rules).get("vocab")
    return mesh.shape[axis] if axis else 1


def per_shard_rules(rules: LogicalRules) -> LogicalRules:
    """Rules for code that runs on one fsdp shard's rows (see fsdp.py): activations no
    longer split over fsdp, since the shard axis itself is."""
    return _activations_not_over(rules, FSDP)


def whole_sequences(rules: LogicalRules) -> LogicalRules:
    """Rules for code that keeps each sequence on one device (the sampler's prefill and
    decoding): activations no longer split over cp; cp devices then share a data shard's rows."""
    return _activations_not_over(rules, CP)


def _activations_not_over(rules: LogicalRules, mesh_axis: str) -> LogicalRules:
    return tuple((name, None if axis == mesh_axis and name.startswith("act_") else axis)
                 for name, axis in rules)


@contextlib.contextmanager
def activate(mesh: Mesh, rules: LogicalRules) -> Iterator[None]:
    """Mesh and logical rules in effect for the model's activation constraints while tracing.

    Usable inside a jitted function (where only the abstract mesh may be set) and outside.
    """
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh), nnx.logical_axis_rules(rules):
        yield


def state_shardings(abstract_state: Any, mesh: Mesh, rules: LogicalRules) -> Any:
    """NamedShardings for an `nnx.State` of Variables carrying logical `out_sharding` metadata."""
    with nnx.logical_axis_rules(rules):
        return nnx.get_named_sharding(abstract_state, mesh)


def optimizer_shardings(
    optimizer: optax.GradientTransformation, abstract_opt_state: Any, param_shardings: Any,
    mesh: Mesh,
) -> Any:
    """Optimizer moments share their parameter's sharding; scalars (counts) are replicated."""
    replicated = NamedSharding(mesh, P())
    return optax.tree_utils.tree_map_params(
        optimizer, lambda _, s: s, abstract_opt_state, param_shardings,
        transform_non_params=lambda _: replicated,
    )


def batch_sharding(mesh: Mesh, rules: Mapping[str, str | None], leading: int = 0) -> NamedSharding:
    """[leading..., batch, seq] arrays: batch over the data axes, each sequence over cp."""
    return NamedSharding(mesh, P(*([None] * leading), batch_axes(mesh, rules),
                                 rules.get("act_seq")))


def batch_axes(mesh: Mesh, rules: Mapping[str, str | None]) -> str | tuple[str, ...] | None:
    """What splits the batch rows: the data axis (fsdp), and ep where the mesh has it (an ep
    device is a data-parallel rank for every weight but its experts)."""
    rows = rules.get("act_batch")
    return DATA_AXES if rows == FSDP and mesh.shape.get(EP, 1) > 1 else rows


def to_device(x: jax.Array) -> jax.Array:
    """`x` in device memory: inside a traced step, a value in pinned host memory
    (`training.offload_params`) is copied to the device where it is used; others pass."""
    if jax.typeof(x).memory_space == jax.memory.Space.Host:
        return jax.device_put(x, jax.memory.Space.Device)
    return x


def to_host(x: jax.Array) -> jax.Array:
    """`x` copied to pinned host memory (inside a traced step)."""
    return jax.device_put(x, jax.memory.Space.Host)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def spread_over_ranks(shardings: Any, abstract: Any, mesh: Mesh) -> Any:
    """What ZeRO splits over fsdp, split over every data-parallel device that holds it:

    - over cp too (context parallelism): a cp device computes gradients of its own tokens, so
      it is a data-parallel rank for the weights (parallel/fsdp.py reduces over fsdp × cp),
      and adding cp never adds parameter, gradient or optimizer bytes per device;
    - over pp too, on a pipeline mesh, for what every stage holds (embedding, final norm,
      trailing layers, stacks whose blocks do not divide into the stages): its gradient is
      summed over pp as over fsdp. Per-device parameter (ZeRO-3), gradient (2) and optimizer
      (1) bytes then halve from pp=1 to pp=2 like the pipelined blocks'.

    - over ep too (expert parallelism), for every weight but the experts split over ep: an ep
      device computes gradients of its own batch rows, like an fsdp device.

    The group is (fsdp, ep, cp, pp) in that order (collectives.py's `_fetch_stage` gathers over
    pp first); a dimension the whole group does not divide drops pp, then ep and cp, and stays
    split over fsdp alone if nothing else divides it (the reduction then sums over the rest)."""
    pp = mesh.shape.get(PP, 1)

    def spread(s: NamedSharding, leaf: Any) -> NamedSharding:
        spec = tuple(s.spec)
        if FSDP not in spec:
            return s
        dim = spec.index(FSDP)
        over_pp = pp > 1 and PP not in spec
        ranks = tuple(a for a in (EP, CP) if mesh.shape.get(a, 1) > 1 and a not in spec)
        groups = [(FSDP, *ranks, PP), (FSDP, *ranks), (FSDP, PP)]
        groups = [g for g in groups if len(g) > 1 and (PP not in g or over_pp)]
        for group in groups:
            if leaf.shape[dim] % math.prod(mesh.shape[a] for a in group) == 0:
                return NamedSharding(mesh, P(*spec[:dim], group, *spec[dim + 1:]),
                                     memory_kind=s.memory_kind)
        return s

    return jax.tree.map(spread, shardings, abstract)


def gathered_over_fsdp(shardings: Any) -> Any:
    """The same shardings with fsdp (and cp) removed: a whole copy on every fsdp shard, split
    over tp only (what decoding wants: no gather per generated token)."""
    def without(axis):
        if isinstance(axis, tuple):
            kept = tuple(a for a in axis if a not in (FSDP, CP))
            return kept if len(kept) > 1 else (kept[0] if kept else None)
        return None if axis in (FSDP, CP) else axis

    def gathered(s: NamedSharding) -> NamedSharding:
        return NamedSharding(s.mesh, P(*(without(axis) for axis in s.spec)))

    return jax.tree.map(gathered, shardings)


def global_array(array: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """A global array from a host array every process holds whole."""
    return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index])


def on_devices(batch: dict[str, np.ndarray], sharding: NamedSharding) -> dict[str, jax.Array]:
    """A host batch (every process holds all of it) as global arrays in `sharding`."""
    return {k: global_array(v, sharding) for k, v in batch.items()}
