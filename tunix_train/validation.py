"""Validation of a composed `Config` that needs no devices: ranges, choices and the keys that
must agree. Checks that need the mesh live in parallel/mesh.py and parallel/sharding.py.

`validate` raises `ConfigError` with one sentence naming the key, the value and the fix.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import math
import re
from dataclasses import dataclass
from typing import Callable

from tunix_train.config import (LORA_TARGETS, CheckpointConfig, Config, ConfigError, DataConfig,
                                LoggingConfig, LoraConfig, ModelConfig)
from tunix_train.trainers import TRAINERS

@dataclass(frozen=True)
class _Range:
    """Allowed values of a numeric key; `None` values pass (they mean "not set")."""

    low: float = -math.inf
    high: float = math.inf
    low_open: bool = False  # low itself excluded
    high_open: bool = False

    def __contains__(self, value: float) -> bool:
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        return above and below

    def __str__(self) -> str:
        if self.high == math.inf:
            return f"{'above' if self.low_open else 'at least'} {self.low:g}"
        return (f"in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}"
                f"{')' if self.high_open else ']'}")


_POSITIVE = _Range(0, low_open=True)
_NATURAL = _Range(0)  # 0 allowed
_COUNT = _Range(1)  # a count of at least one
_FRACTION = _Range(0, 1)
_BETA = _Range(0, 1, high_open=True)

# model.family's names; models/families.py holds each family's description
# (tests/test_architecture.py keeps the two the same).
FAMILY_NAMES = ("gemma3", "llama3", "qwen3", "qwen3_moe", "mixtral")

_CHOICES = {
    ("training", "mixed_precision"): ("auto", "bf16", "fp32"),
    ("training", "remat"): ("none", "full", "save_dots"),
    ("training", "nan_policy"): ("halt", "skip"),
    ("training", "grad_reduce_dtype"): ("auto", "fp32"),
    ("model", "attention_impl"): ("auto", "blockwise", "cudnn", "pallas", "xla"),
    ("model", "cp_exchange"): ("all_gather", "ring"),
    ("model", "family"): FAMILY_NAMES,
    ("model", "rope_type"): ("linear", "llama3"),
    ("model", "moe_matmul"): ("auto", "blocks", "tiles", "ragged_dot", "tokamax",
                                 "pallas"),
    ("logging", "progress"): ("auto", "always", "never"),
    ("data", "packing"): ("concat", "first_fit"),
    ("data", "dtype"): ("uint16", "uint32"),
    ("export", "dtype"): ("bfloat16", "float32"),
    ("export", "lora"): ("merged", "adapter"),
    ("lora", "base_quantization"): ("none", "nf4", "int8"),
    ("trainer", "name"): tuple(TRAINERS),  # tunix_train/trainers.py
    ("dpo", "loss"): ("sigmoid", "ipo", "hinge"),
    ("grpo", "kl_estimator"): ("k3", "k1"),
    ("grpo", "advantage"): ("grpo", "dr_grpo", "rloo"),
    ("grpo", "loss_aggregation"): ("sequence-mean-token-mean", "token-mean"),
    ("grpo", "answer_compare"): ("numeric", "exact"),
}

_RANGES = {
    ("model", "num_layers"): _COUNT, ("model", "embed_dim"): _COUNT,
    ("model", "hidden_dim"): _COUNT, ("model", "num_heads"): _COUNT,
    ("model", "num_kv_heads"): _COUNT, ("model", "head_dim"): _COUNT,
    ("model", "vocab_size"): _COUNT, ("model", "sliding_window"): _COUNT,
    ("model", "global_every"): _COUNT, ("model", "local_rope_base"): _POSITIVE,
    ("model", "global_rope_base"): _POSITIVE, ("model", "global_rope_scale"): _POSITIVE,
    ("model", "query_pre_attn_scalar"): _POSITIVE, ("model", "rms_norm_eps"): _POSITIVE,
    ("model", "rope_low_freq_factor"): _POSITIVE, ("model", "rope_high_freq_factor"): _POSITIVE,
    ("model", "rope_original_context"): _COUNT,
    ("model", "num_experts"): _NATURAL, ("model", "experts_per_token"): _COUNT,
    ("model", "expert_hidden_dim"): _NATURAL, ("model", "moe_every"): _COUNT,
    ("model", "router_aux_loss_coef"): _NATURAL, ("model", "moe_capacity_factor"): _POSITIVE,
    ("model", "moe_ep_buffer_factor"): _POSITIVE,
    ("training", "moe_aux_loss_weight"): _NATURAL, ("training", "router_z_loss_weight"): _NATURAL,
    ("data", "seq_len"): _COUNT, ("data", "max_corpus_bytes"): _COUNT,
    ("data", "validation_fraction"): _Range(0, 1, low_open=True, high_open=True),
    ("data", "eval_batches"): _COUNT, ("data", "prefetch"): _NATURAL,
    ("optimizer", "lr"): _NATURAL, ("optimizer", "warmup_steps"): _NATURAL,
    ("optimizer", "min_lr_ratio"): _FRACTION, ("optimizer", "weight_decay"): _NATURAL,
    ("optimizer", "grad_clip"): _NATURAL, ("optimizer", "b1"): _BETA,
    ("optimizer", "b2"): _BETA, ("optimizer", "eps"): _POSITIVE,
    ("training", "steps"): _COUNT, ("training", "seed"): _NATURAL,
    ("training", "micro_batch_size"): _COUNT, ("training", "global_batch_size"): _COUNT,
    ("training", "gradient_accumulation_steps"): _COUNT,
    ("training", "sync_gradients_every"): _COUNT, ("training", "zero_stage"): _Range(0, 3),
    ("training", "loss_vocab_chunk"): _COUNT, ("training", "pipeline_microbatches"): _COUNT,
    ("training", "pipeline_repeats"): _COUNT, ("training", "eval_every_steps"): _NATURAL,
    ("checkpoint", "every_steps"): _NATURAL, ("checkpoint", "keep"): _COUNT,
    ("logging", "every_steps"): _COUNT, ("logging", "peak_tflops"): _POSITIVE,
    ("generate", "max_new_tokens"): _COUNT, ("generate", "temperature"): _NATURAL,
    ("generate", "top_k"): _NATURAL, ("generate", "seed"): _NATURAL,
    ("generate", "eos_id"): _Range(-1),
    ("export", "max_shard_gb"): _POSITIVE,
    ("lora", "rank"): _NATURAL, ("lora", "alpha"): _POSITIVE,
    ("lora", "dropout"): _Range(0, 1, high_open=True),
    ("distributed", "init_timeout_s"): _COUNT, ("distributed", "heartbeat_timeout_s"): _COUNT,
    ("distributed", "step_timeout_s"): _COUNT,
    ("plan", "device_memory_gb"): _POSITIVE, ("plan", "host_memory_gb"): _POSITIVE,
    ("plan", "num_devices"): _COUNT,
    ("grpo", "num_generations"): _Range(2), ("grpo", "max_new_tokens"): _COUNT,
    ("grpo", "temperature"): _POSITIVE, ("grpo", "top_k"): _NATURAL,
    ("grpo", "top_p"): _Range(0, 1, low_open=True), ("grpo", "num_iterations"): _COUNT,
    ("grpo", "epsilon"): _Range(0, 1, low_open=True, high_open=True),
    ("grpo", "epsilon_high"): _POSITIVE, ("grpo", "beta"): _NATURAL,
    ("grpo", "length_buffer"): _COUNT, ("grpo", "sample_every_steps"): _COUNT,
    ("dpo", "beta"): _Range(0, low_open=True), ("dpo", "label_smoothing"): _Range(0, 0.5,
                                                                               high_open=True),
}


def check_installed(version: Callable[[str], str] | None = None) -> None:
    """Installed packages that cannot work together, said before either is imported: jax 0.11
    removed what flax 0.12.9 and older import (`jax.experimental.hijax.HiPrimitive`), and pip
    cannot refuse that pairing (those flax releases set no upper bound on jax), so such a
    command would otherwise end in flax's AttributeError. `version`: the installed version of a
    distribution (importlib.metadata's by default; jax imports that module anyway)."""
    version = version or importlib.metadata.version
    jax_version, flax_version = version("jax"), version("flax")
    if release(jax_version) >= (0, 11) and release(flax_version) < (0, 12, 10):
        raise ConfigError(f"flax {flax_version} is installed with jax {jax_version}, and flax "
                          f"older than 0.12.10 does not import on jax 0.11 or newer: pip install "
                          f"'flax>=0.12.10', or go back to the pinned versions with pip install "
                          f"-c constraints.txt -e .")


def release(version: str) -> tuple[int, ...]:
    """"0.12.10" → (0, 12, 10); a pre-release or local suffix is ignored."""
    return tuple(int(part) for part in re.findall(r"\d+", version.split("+")[0])[:3])


def check_values(cfg: Config) -> None:
    """The ranges and choices of single keys: ConfigError for the first value outside them.
    First, whether the installed packages can run at all (`check_installed`)."""
    check_installed()
    for (section, key), allowed in _RANGES.items():
        value = getattr(getattr(cfg, section), key)
        if value is not None and value not in allowed:
            raise ConfigError(f"{section}.{key}={value} is out of range: it must be {allowed}.")
    for (section, key), allowed in _CHOICES.items():
        value = getattr(getattr(cfg, section), key)
        if value not in allowed:
            raise ConfigError(f"{section}.{key}={value!r} is not one of {', '.join(allowed)}.")


def validate(cfg: Config) -> None:
    """Raises ConfigError for the first mistake found, before any device work."""
    check_values(cfg)
    m = cfg.model
    if m.num_heads % m.num_kv_heads:
        raise ConfigError(
            f"model.num_heads={m.num_heads} must be a multiple of model.num_kv_heads="
            f"{m.num_kv_heads} (grouped-query attention); change one of them."
        )
    if m.attention_impl == "pallas" and (m.head_dim < 16 or m.head_dim & (m.head_dim - 1)):
        raise ConfigError(f"model.attention_impl=pallas needs a power-of-two model.head_dim of at "
                          f"least 16, not {m.head_dim}; use model.attention_impl=blockwise.")
    if m.num_experts and m.moe_matmul == "tokamax":
        _validate_tokamax(cfg)
    _validate_data(cfg.data)
    accum, sync = cfg.training.gradient_accumulation_steps, cfg.training.sync_gradients_every
    if accum % sync:
        raise ConfigError(
            f"training.sync_gradients_every={sync} must divide "
            f"training.gradient_accumulation_steps={accum}."
        )
    _validate_checkpoint(cfg.checkpoint)
    _validate_context(cfg)
    _validate_trainer(cfg)
    _validate_lora(cfg.lora, cfg.model)
    _validate_trackers(cfg.logging)


def _validate_trackers(logging_cfg: LoggingConfig) -> None:
    """A tracker that is on needs its package: said before anything compiles (a tracker that
    fails later only warns, training/trackers.py)."""
    if logging_cfg.wandb.mode not in ("online", "offline"):
        raise ConfigError(f"logging.wandb.mode={logging_cfg.wandb.mode!r} is not one of online, "
                          f"offline.")
    for key in ("wandb", "mlflow"):
        if getattr(logging_cfg, key).enabled and importlib.util.find_spec(key) is None:
            raise ConfigError(f"logging.{key}.enabled=true needs the {key} package, which is not "
                              f"installed: pip install -c constraints.txt -e '.[{key}]', or set "
                              f"logging.{key}.enabled=false.")


def _validate_trainer(cfg: Config) -> None:
    trainer, data = cfg.trainer.name, cfg.data.name
    for name, own in TRAINERS.items():
        if own.data is not None and data == own.data and trainer != name:
            raise ConfigError(f"data={own.data} is for trainer={name}; add trainer={name}, or "
                              f"use data=sft for prompt/response pairs.")
    if TRAINERS[trainer].data not in (None, data):
        raise ConfigError(f"trainer={trainer} needs data={TRAINERS[trainer].data} data.path="
                          f"<jsonl or parquet records>, not data={data}.")
    mesh = cfg.model.mesh_shape
    if not TRAINERS[trainer].pipeline and _mesh_size(cfg, "pp") != 1:
        raise ConfigError(f"model.mesh_shape={mesh} has pipeline stages, which trainer={trainer} "
                          f"does not support yet (the pipeline computes the next-token loss only); "
                          f"put those devices on fsdp or tp instead.")
    if trainer == "dpo" and cfg.dpo.label_smoothing and cfg.dpo.loss != "sigmoid":
        raise ConfigError(f"dpo.label_smoothing={cfg.dpo.label_smoothing} applies to "
                          f"dpo.loss=sigmoid only, not {cfg.dpo.loss}; set it to 0.")
    _validate_grpo(cfg)


def _validate_tokamax(cfg: Config) -> None:
    if importlib.util.find_spec("tokamax") is None:
        raise ConfigError("model.moe_matmul=tokamax needs the tokamax package, which is not "
                          "installed: pip install -c constraints.txt -e '.[cuda]' (or tokamax), "
                          "or set model.moe_matmul=blocks.")


def _mesh_size(cfg: Config, axis: str) -> int:
    """The size `model.mesh_shape` gives `axis` (1 where it has no such axis; -1 unfilled)."""
    mesh = cfg.model.mesh_shape
    if mesh is None or axis not in list(mesh[1]):
        return 1
    return int(mesh[0][list(mesh[1]).index(axis)])


def _validate_context(cfg: Config) -> None:
    cp = _mesh_size(cfg, "cp")
    if cp > 1 and cfg.data.seq_len % (2 * cp):
        raise ConfigError(f"data.seq_len={cfg.data.seq_len} does not split into {2 * cp} "
                          f"(2 × cp={cp}) equal chunks (model.mesh_shape: each cp device holds "
                          f"an early and a late one); choose a data.seq_len divisible by "
                          f"{2 * cp}.")


def _validate_grpo(cfg: Config) -> None:
    if cfg.trainer.name != "grpo":
        return
    g = cfg.grpo
    if g.max_new_tokens >= cfg.data.seq_len:
        raise ConfigError(f"grpo.max_new_tokens={g.max_new_tokens} leaves no room for the prompt "
                          f"in data.seq_len={cfg.data.seq_len}; raise data.seq_len above it.")
    if g.reward_weights is not None and len(g.reward_weights) != len(g.rewards):
        raise ConfigError(f"grpo.reward_weights has {len(g.reward_weights)} values for "
                          f"{len(g.rewards)} grpo.rewards; give one weight per reward.")
    if not g.rewards:
        raise ConfigError("grpo.rewards is empty; name at least one, e.g. 'grpo.rewards=[answer]'.")
    if cfg.training.eval_every_steps:
        raise ConfigError(f"training.eval_every_steps={cfg.training.eval_every_steps} has no "
                          f"meaning with trainer=grpo (rewards are logged every step); set it to 0.")


def _validate_lora(lora: LoraConfig, model: ModelConfig) -> None:
    unknown = [t for t in lora.targets if t not in (*LORA_TARGETS, "all")]
    if unknown or not lora.targets:
        raise ConfigError(f"lora.targets={list(lora.targets)} names {unknown or 'nothing'}; use "
                          f"projections of {', '.join(LORA_TARGETS)}, or all.")
    mlp = [t for t in lora.targets if t in ("gate", "up", "down")]
    if lora.on and model.num_experts and mlp:
        raise ConfigError(f"lora.targets={list(lora.targets)}: {model.name} is a mixture of "
                          f"experts, whose MLPs take no LoRA adapters yet; use "
                          f"lora.targets=[q,k,v,o] (what lora.targets=[all] adapts on it).")
    if lora.base_quantization != "none" and not lora.on:
        raise ConfigError(f"lora.base_quantization={lora.base_quantization} quantizes the frozen "
                          f"base of LoRA, which is off (lora.rank=0); set lora.rank, e.g. 16.")


def _validate_checkpoint(c: CheckpointConfig) -> None:
    if c.resume_from and c.init_params_from:
        raise ConfigError("checkpoint.resume_from and checkpoint.init_params_from are both set; "
                          "keep resume_from to continue a run or init_params_from to fine-tune.")


def _validate_data(data: DataConfig) -> None:
    if data.name in ("prompts", "preferences"):
        if not data.prompt_field:
            raise ConfigError(f"data={data.name} needs data.prompt_field, the field holding each "
                              f"prompt; set data.prompt_field=<field>.")
        return
    if (data.prompt_field is None) != (data.response_field is None):
        raise ConfigError("data.prompt_field and data.response_field go together (SFT); set both "
                          "or neither.")
