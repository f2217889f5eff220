"""Typed configuration: the dataclasses behind the Hydra YAML tree (validated in validation.py).

The dataclasses are registered in Hydra's ConfigStore (``register_configs``) as the schema of
``configs/config.yaml``, so a misspelt key or a wrong type fails with Hydra's own error before
anything runs. Library code receives these objects (``Config`` or one sub-config), never a
``DictConfig``, and never imports Hydra.

Every default is on this screen with its unit.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

CONFIG_DIR = Path(__file__).resolve().parent / "configs"  # the Hydra tree (links to ../configs)


class ConfigError(ValueError):
    """A mistake in the user's configuration; its message is one sentence naming key and fix."""


@dataclass
class ModelConfig:
    name: str = "gemma3_tiny"
    family: str = "gemma3"  # gemma3 | llama3 | qwen3 | qwen3_moe | mixtral (docs/models.md)
    num_layers: int = 6
    embed_dim: int = 128  # d_model
    hidden_dim: int = 512  # gated MLP width
    num_heads: int = 4  # query heads
    num_kv_heads: int = 1  # 1 = multi-query attention
    head_dim: int = 32
    vocab_size: int = 512  # >= the tokenizer's vocabulary; extra rows are never produced by data
    tie_embeddings: bool = True  # the output head is the embedding table; false: its own weight
    sliding_window: int = 64  # Gemma 3: tokens a local layer attends to, itself included
    global_every: int = 6  # Gemma 3: every 6th layer is global (5 local : 1 global)
    local_rope_base: float = 10_000.0  # Gemma 3's local layers
    global_rope_base: float = 1_000_000.0  # full-attention layers (every Llama and Qwen layer)
    global_rope_scale: float = 1.0  # RoPE scaling factor of those (Gemma 3 4B: 8; Llama 3.1: 8)
    rope_type: str = "linear"  # how the factor scales: linear | llama3 (by wavelength)
    rope_low_freq_factor: float = 1.0  # llama3 scaling only
    rope_high_freq_factor: float = 4.0  # llama3 scaling only
    rope_original_context: int = 8192  # llama3 scaling only: the pre-training context
    query_pre_attn_scalar: Optional[float] = None  # softmax scale is its -1/2 power; None = head_dim
    rms_norm_eps: float = 1e-6
    # Mixture of experts (qwen3_moe, mixtral): a routed layer's MLP is num_experts gated MLPs of
    # expert_hidden_dim, each token through its experts_per_token best (docs/models.md).
    num_experts: int = 0  # 0 = every layer's MLP is dense (hidden_dim)
    experts_per_token: int = 2  # top-k
    expert_hidden_dim: int = 0  # each expert's MLP width (HF moe_intermediate_size)
    normalize_top_k: bool = True  # the k routing weights rescaled to sum to 1 (norm_topk_prob)
    moe_every: int = 1  # layers n-1, 2n-1, … are routed, the others dense (decoder_sparse_step)
    router_aux_loss_coef: float = 0.001  # the load-balancing loss's weight (HF config's)
    moe_matmul: str = "auto"  # auto (pallas on a GPU without tp, else blocks) | blocks | tiles
    # | ragged_dot | tokamax | pallas (tiles through models/grouped_matmul.py's kernels: GPUs;
    # interpreted elsewhere)
    # (jax.lax.ragged_dot: XLA's CPU and GPU compilers multiply every row by every expert)
    moe_capacity_factor: Optional[float] = None  # None = dropless; else each expert takes at
    # most factor x its mean share of a micro-batch's rows, the rest dropped (logged)
    moe_ep_buffer_factor: Optional[float] = None  # None = dropless over ep (blocks sized for the
    # worst case); else each device sends each ep shard at most factor x its mean share of rows,
    # the rest dropped (logged in moe_dropped_fraction)
    moe_force_load_balance: bool = False  # benchmarks only: pseudo-random router logits in the
    # forward pass (gradients straight through to the router's): each expert its mean share
    attention_impl: str = "auto"  # auto (cudnn on GPUs where it applies, else blockwise) | blockwise | cudnn | pallas | xla
    cp_exchange: str = "all_gather"  # how keys and values cross the cp axis: all_gather | ring
    unroll_layers: bool = False  # unroll the scans over layers: faster steps on CPU (1.4x on
    # bench/peer_step.py), compile time grows with depth; docs/performance.md
    init_from: Optional[str] = None  # hf:<dir> = dimensions and weights of a Hugging Face checkpoint
    mesh_shape: Optional[List[Any]] = None  # [[sizes], [axis names]]; None = every device on fsdp
    sharding_rules: Dict[str, Optional[str]] = field(default_factory=dict)  # overrides of the
    # logical → mesh axis table (tunix_train/parallel/sharding.py), e.g. {"embed": None}


LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")  # projections by logical name


@dataclass
class LoraConfig:
    """Low-rank adapters (LoRA, Hu et al. 2021; QLoRA, Dettmers et al. 2023). Off at rank 0."""

    rank: int = 0  # r; 0 = off: every parameter trains
    alpha: float = 16.0  # an adapter's output is scaled by alpha / rank
    targets: List[str] = field(default_factory=lambda: ["all"])  # q k v o gate up down | all
    dropout: float = 0.0  # on an adapter's input, in training steps only
    base_quantization: str = "none"  # none | nf4 | int8: how the frozen base is stored (QLoRA)

    @property
    def on(self) -> bool:
        return self.rank > 0

    def target_names(self) -> tuple[str, ...]:
        return LORA_TARGETS if "all" in self.targets else tuple(self.targets)


@dataclass
class DataConfig:
    name: str = "builtin"  # builtin | text | jsonl | parquet | tokens | prompts | preferences
    path: Optional[str] = None  # local file, directory or glob; the builtin corpus needs none
    eval_path: Optional[str] = None  # held-out files; None = hold out validation_fraction of path
    tokenizer: str = "byte"  # byte | sentencepiece:<model file> | hf:<tokenizer.json or dir> | none
    seq_len: int = 256  # tokens per training sequence
    packing: str = "concat"  # concat (no padding, long documents continue) | first_fit (padding)
    text_field: str = "text"  # jsonl/parquet: the field holding a document
    prompt_field: Optional[str] = None  # jsonl/parquet SFT: with response_field, loss on the
    response_field: Optional[str] = None  # response tokens only
    dtype: str = "uint16"  # tokens: uint16 | uint32 ids in the flat binary file
    chat_template: bool = False  # prompts, preferences: wrap each in the model family's user turn
    chosen_field: str = "chosen"  # preferences: the preferred response (text or messages)
    rejected_field: str = "rejected"  # preferences: the dispreferred response
    max_corpus_bytes: int = 8_000_000  # cap on the builtin corpus read from disk
    validation_fraction: float = 0.05  # held-out share of documents (or of each tokens file)
    eval_batches: int = 4  # validation batches per evaluation
    prefetch: int = 2  # batches a background thread prepares ahead; 0 = none


@dataclass
class OptimizerConfig:
    name: str = "adamw"
    lr: float = 3e-3  # peak learning rate; 0 = no update (a control run)
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio at training.steps
    weight_decay: float = 0.1  # decoupled; not applied to norm scales
    grad_clip: float = 1.0  # global L2 norm; 0 disables
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8


@dataclass
class TrainingConfig:
    steps: int = 200  # optimizer steps
    seed: int = 0
    micro_batch_size: Optional[int] = None  # sequences per fsdp shard per micro-step; None: 8,
    global_batch_size: Optional[int] = None  # or derived from this (= micro × fsdp × accumulation)
    gradient_accumulation_steps: int = 1
    sync_gradients_every: int = 1  # micro-steps summed locally between gradient reductions
    grad_reduce_dtype: str = "auto"  # auto (= compute dtype) | fp32: dtype gradients reduce in
    mixed_precision: str = "auto"  # bf16 | fp32 | auto (bf16 on accelerators, fp32 on CPU)
    zero_stage: int = 3  # 0 DDP, 1 +optimizer state sharded, 2 +gradients, 3 +parameters (FSDP)
    remat: str = "save_dots"  # save_dots | none | full: activation recomputation per layer
    loss_vocab_chunk: int = 16384  # vocabulary entries per chunk of the fused output head + loss
    eval_every_steps: int = 0  # 0 = evaluate only at the end
    profile_communication: bool = False
    nan_policy: str = "halt"  # halt | skip
    offload_optimizer: bool = False  # Adam's moments in pinned host memory, streamed to the update
    offload_params: bool = False  # fp32 master weights (and LoRA's base) in pinned host memory:
    # each layer copied to the device when reached, the update streamed layer by layer
    pipeline_microbatches: Optional[int] = None  # per micro-step, with a pp axis; None: bubble <= 25%
    pipeline_repeats: int = 1  # layer chunks per pp stage, visited in turn (circular); 1 = GPipe
    moe_aux_loss_weight: Optional[float] = None  # load-balancing loss; None = the model's
    # router_aux_loss_coef (its Hugging Face config's); 0 = off
    router_z_loss_weight: float = 0.0  # ST-MoE's router z-loss (mean squared logsumexp)


DEFAULT_MICRO_BATCH_SIZE = 8  # training.micro_batch_size when neither batch key is set


@dataclass
class CheckpointConfig:
    every_steps: int = 0  # steps between saves; 0 = only at the end (and on SIGTERM/SIGINT)
    keep: int = 3  # newest complete steps kept; older ones are deleted after a newer one commits
    resume_from: Optional[str] = None  # run dir or step dir: continue another run's full state
    init_params_from: Optional[str] = None  # run dir or step dir: its parameters only (fine-tune)
    async_save: bool = True  # write in a background thread while training continues


@dataclass
class WandbConfig:
    """Weights & Biases beside TensorBoard (training/trackers.py; the `[wandb]` extra)."""
    enabled: bool = False
    project: str = "tunix_train"
    entity: Optional[str] = None  # team or user; None = the logged-in user's default
    mode: str = "online"  # online | offline (files in <run dir>/wandb, `wandb sync` them later)
    tags: List[str] = field(default_factory=list)
    name: Optional[str] = None  # None = the run dir (a sweep point: its overrides)


@dataclass
class MlflowConfig:
    """MLflow beside TensorBoard (training/trackers.py; the `[mlflow]` extra)."""
    enabled: bool = False
    tracking_uri: Optional[str] = None  # http://host:5000, a path; None = MLFLOW_TRACKING_URI
    experiment: str = "tunix_train"
    run_name: Optional[str] = None  # None = the run dir (a sweep point: its overrides)


@dataclass
class LoggingConfig:
    every_steps: int = 10
    progress: str = "auto"  # auto (when stdout is a terminal) | always | never
    peak_tflops: Optional[float] = None  # per device, for MFU; None = look up the device kind
    wandb: WandbConfig = field(default_factory=WandbConfig)
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)


@dataclass
class GenerateConfig:
    prompt: Optional[str] = None  # text, encoded with data.tokenizer
    prompt_ids: Optional[List[int]] = None  # token ids instead of text (no tokenizer needed)
    max_new_tokens: int = 32
    temperature: float = 0.0  # 0 = greedy (argmax)
    top_k: int = 0  # sample among the k most likely tokens; 0 = all
    seed: int = 0  # sampling randomness
    eos_id: Optional[int] = None  # a row stops at this token; None = the tokenizer's EOS; -1 = never


@dataclass
class ExportConfig:
    path: Optional[str] = None  # output folder: config.json + *.safetensors, loadable by transformers
    dtype: str = "bfloat16"  # bfloat16 (as Gemma 3 is released) | float32
    max_shard_gb: float = 5.0  # safetensors files are split at this size (GB), with an index
    lora: str = "merged"  # a LoRA run: merged (a whole model, adapters folded in) | adapter (PEFT)


@dataclass
class TrainerConfig:
    name: str = "default"  # default (next-token loss) | grpo (docs/grpo.md) | dpo (docs/dpo.md)


@dataclass
class GrpoConfig:
    """`trainer=grpo` only. A step = rollouts for `training.global_batch_size` completions
    (num_generations per prompt), then num_iterations optimizer updates on them."""

    num_generations: int = 4  # G: completions per prompt, compared with each other
    max_new_tokens: int = 32  # completion tokens; the prompt gets data.seq_len minus these
    temperature: float = 1.0  # sampling temperature; log-probs are of the tempered policy
    top_k: int = 0  # sample among the k most likely tokens; 0 = all
    top_p: float = 1.0  # nucleus sampling: the smallest set with this much probability
    num_iterations: int = 1  # mu: policy updates per batch of rollouts
    epsilon: float = 0.2  # PPO clip: ratio kept within [1 - epsilon, 1 + epsilon_high]
    epsilon_high: Optional[float] = None  # None = epsilon
    beta: float = 0.04  # KL penalty to the frozen reference model; 0 = no reference at all
    kl_estimator: str = "k3"  # k3 (exp(d) - d - 1, d = log ref - log policy) | k1 (-d)
    advantage: str = "grpo"  # grpo: (r - mean) / (std + 1e-6) | dr_grpo: r - mean | rloo
    loss_aggregation: str = "sequence-mean-token-mean"  # | token-mean
    rewards: List[str] = field(default_factory=lambda: ["answer"])  # answer | format | length
    # | module:function (called with prompts, completions and the records' other fields)
    reward_weights: Optional[List[float]] = None  # one per reward; None = all 1
    answer_field: str = "answer"  # the record field the `answer` reward compares with
    answer_pattern: str = r"(-?\d+(?:\.\d+)?)"  # first match's group 1 is the answer
    answer_compare: str = "numeric"  # numeric (as numbers, else as text) | exact (as text)
    format_pattern: Optional[str] = None  # `format` reward: 1 if the completion fully matches
    length_buffer: Optional[int] = None  # `length`: penalty ramps to -1 over the last this many
    # tokens before max_new_tokens (DAPO's soft overlong penalty); None = max_new_tokens // 4
    sample_every_steps: int = 10  # a few completions as TensorBoard text every this many steps


@dataclass
class DpoConfig:
    """`trainer=dpo` only (docs/dpo.md): preference pairs, a frozen reference."""

    beta: float = 0.1  # strength of the pull toward the reference (the implicit reward's scale)
    loss: str = "sigmoid"  # sigmoid (DPO) | ipo (IPO) | hinge (SLiC)
    label_smoothing: float = 0.0  # sigmoid only: conservative DPO, labels flipped w.p. this
    precompute_reference: bool = False  # score every pair with the reference once, then hold
    # no reference model while training


@dataclass
class ExperimentConfig:
    name: str = "default"


@dataclass
class DistributedConfig:
    init_timeout_s: int = 300  # waiting for every process to join
    heartbeat_timeout_s: int = 100  # a silent process is declared dead after this
    step_timeout_s: int = 900  # a step (after the first) slower than this is a hang


@dataclass
class PlannerConfig:
    """`python -m tunix_train.plan` only."""

    device_memory_gb: float = 80.0  # per device, available to JAX (1e9 bytes): the verdict's limit
    host_memory_gb: float = 128.0  # pinned host memory per device (a machine's, over its devices)
    num_devices: Optional[int] = None  # devices to simulate; None = product of model.mesh_shape


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    grpo: GrpoConfig = field(default_factory=GrpoConfig)
    dpo: DpoConfig = field(default_factory=DpoConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    experiment: ExperimentConfig = field(default_factory=ExperimentConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    generate: GenerateConfig = field(default_factory=GenerateConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    plan: PlannerConfig = field(default_factory=PlannerConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)


@functools.cache  # once a process: ConfigStore is global, and building the schema takes 50 ms
def register_configs() -> None:
    """Registers the schema so `configs/config.yaml` can list `base_config` first in its defaults.

    `model.sharding_rules` is left open (not struct): it holds only the user's overrides of the
    table in parallel/sharding.py, so `model.sharding_rules.embed=null` adds a key; unknown
    logical axes are refused there, with one sentence.
    """
    from hydra.core.config_store import ConfigStore  # the one Hydra import, kept local
    from omegaconf import OmegaConf

    schema = OmegaConf.structured(Config)
    OmegaConf.set_struct(schema.model.sharding_rules, False)
    ConfigStore.instance().store(name="base_config", node=schema)


def to_dict(cfg: Config) -> dict[str, Any]:
    return dataclasses.asdict(cfg)

