"""Our train step against two references on one Gemma 3 or Llama 3 shape, in one process, one
run:

- a plain-JAX floor: the same architecture written directly in `jax.numpy` + optax (no
  tunix_train model code), whole fp32 logits, AdamW;
- Tunix's `PeftTrainer` on its own Gemma 3 or Llama 3 (`pip install google-tunix`; optional:
  skipped with a line saying so when it is not installed).

    python bench/peer_step.py                         # 1 device
    python bench/peer_step.py --mesh 4 2              # fsdp 4 x tp 2 on 8 virtual CPU devices
    python bench/peer_step.py --seq 2048              # long rows: blockwise attention
    python bench/peer_step.py --family llama3         # the Llama 3 shape (also with --mesh)
    python bench/peer_step.py --family llama3 --lora 16   # LoRA rank 16 on every projection

Shape: 4 layers, d 256, MLP 1,024, head dim 64, vocab 4,096, 8 x 256 tokens, fp32; Gemma 3 with
4 heads / 1 KV head, Llama 3 with 4 heads / 2 KV heads (Tunix shards KV heads over tp), an
output head of its own and RoPE base 500,000 unscaled (Tunix's Llama has no llama3 scaling).
Ours trains on the bundled corpus with document masks; the floor and Tunix on random tokens. Steps are timed in alternating rounds (machine noise hits all alike);
the last line is JSON with `ours_over_floor` and `ours_over_tunix` (median step times), and
the same for ours with `model.unroll_layers=true`, and ours with the blockwise attention against
ours with XLA's dense one (`model.attention_impl=blockwise` / `xla`; `auto` picks dense below
512 tokens on CPU). `--seq 2048` trains 1 × 2,048-token rows (fsdp rows on a mesh). The
floor's layer loop is a scan, as ours.

`--lora R`: adapters of rank R (alpha 2R) on every attention and MLP projection, the base
frozen: ours with `lora.rank=R`, Tunix's model through qwix's `LoraProvider` /
`apply_lora_to_model` (as Tunix's CLI applies it; its PeftTrainer then trains the adapters
alone). The floor and the variants are left out: the line compares ours with Tunix.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mesh", nargs=2, type=int, default=[1, 1], metavar=("FSDP", "TP"))
    parser.add_argument("--family", choices=["gemma3", "llama3"], default="gemma3")
    parser.add_argument("--seq", type=int, default=256,
                        help="tokens per sequence; 2,048 tokens per step (rows >= fsdp)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3, help="steps per round")
    parser.add_argument("--lora", type=int, default=0, metavar="RANK",
                        help="train LoRA adapters of this rank (ours and Tunix's)")
    return parser.parse_args()


ARGS = parse()
DEVICES = ARGS.mesh[0] * ARGS.mesh[1]
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           f" --xla_force_host_platform_device_count={DEVICES}").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from timing import timed  # noqa: E402

LLAMA = ARGS.family == "llama3"
LAYERS, D, F, N, K, H, V = 4, 256, 1024, 4, 2 if LLAMA else 1, 64, 4096
# 257 tokens in, 256 predicted: Tunix's loss drops the last position, ours and the floor shift.
SEQ, WINDOW = ARGS.seq, None if LLAMA else 128  # Gemma: 3 local layers, then a global one
ROPE_BASE = 500_000.0 if LLAMA else 10_000.0
BATCH = max(2048 // SEQ, ARGS.mesh[0])
FAMILY = (["model=llama3_tiny", "model.tie_embeddings=false", "model.global_rope_scale=1.0",
           "model.rms_norm_eps=1e-6"] if LLAMA else
          [f"model.sliding_window={WINDOW}", "model.global_every=6"])
SHAPE = [*FAMILY, f"model.num_layers={LAYERS}", f"model.embed_dim={D}", f"model.hidden_dim={F}",
         f"model.num_heads={N}", f"model.num_kv_heads={K}", f"model.head_dim={H}",
         f"model.vocab_size={V}", f"data.seq_len={SEQ}", "training.mixed_precision=fp32",
         "optimizer.weight_decay=0.1",
         *([f"lora.rank={ARGS.lora}", f"lora.alpha={2 * ARGS.lora}"] if ARGS.lora else [])]
# Tunix's projections, by qwix's module-path pattern (its Gemma 3: einsums for attention).
TUNIX_LORA_PATHS = (".*q_proj|.*k_proj|.*v_proj|.*o_proj|.*gate_proj|.*up_proj|.*down_proj"
                    if LLAMA else
                    ".*q_einsum|.*kv_einsum|.*attn_vec_einsum|.*gate_proj|.*up_proj|.*down_proj")


# ------------------------------------------------------------------------------------------
# Ours: the step run_training.py compiles.

def ours(*overrides: str):
    from tunix_train import cli
    from tunix_train.training.setup import Setup

    mesh = f'model.mesh_shape=[[{ARGS.mesh[0]},{ARGS.mesh[1]}],["fsdp","tp"]]'
    setup = Setup.create(cli.compose([*SHAPE, mesh, f"training.global_batch_size={BATCH}",
                                      *overrides]))
    data = setup.open_data()
    batch = next(data.train)
    step, state = setup.runnable(setup.compile_train_step()), [setup.fresh_state()]

    def run():
        state[0], metrics = step(state[0], batch)
        return metrics["loss"]
    return run, data.close


# ------------------------------------------------------------------------------------------
# The floor: Gemma 3 or Llama 3 in jax.numpy, nothing of ours.

def _rms(x, scale):
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-6)
    return (normed * (scale if LLAMA else 1 + scale)).astype(x.dtype)


def _post(x, scale):
    """Gemma's norms after attention and MLP; Llama has none."""
    return x if LLAMA else _rms(x, scale)


def _rope(x, positions, base=ROPE_BASE):
    half = x.shape[-1] // 2
    freq = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angle = positions[..., None, None] * freq
    sin, cos = jnp.sin(angle), jnp.cos(angle)
    a, b = x[..., :half], x[..., half:]
    return jnp.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)


def floor_loss(params, tokens, targets):
    positions = jnp.broadcast_to(jnp.arange(SEQ), tokens.shape)
    x = params["embed"][tokens] * (1.0 if LLAMA else jnp.sqrt(float(D)))
    i, j = jnp.arange(SEQ)[:, None], jnp.arange(SEQ)[None, :]
    mask = (j <= i) & (True if WINDOW is None else i - j < WINDOW)
    qk_norm = (lambda x, scale: x) if LLAMA else _rms  # noqa: E731

    def layer(x, p):
        h = _rms(x, p["pre_attn"])
        q = _rope(qk_norm(jnp.einsum("bld,dnh->blnh", h, p["q"]), p["q_norm"]), positions)
        k = _rope(qk_norm(jnp.einsum("bld,dkh->blkh", h, p["k"]), p["k_norm"]), positions)
        v = jnp.einsum("bld,dkh->blkh", h, p["v"])
        q = q.reshape(*q.shape[:2], K, N // K, H)
        scores = jnp.einsum("blkgh,bskh->bkgls", q, k) * H ** -0.5
        scores = jnp.where(mask, scores, -1e30)
        out = jnp.einsum("bkgls,bskh->blkgh", jax.nn.softmax(scores, axis=-1), v)
        attn = jnp.einsum("blnh,nhd->bld", out.reshape(*out.shape[:2], N, H), p["o"])
        x = x + _post(attn, p["post_attn"])
        h = _rms(x, p["pre_mlp"])
        act = jax.nn.silu if LLAMA else lambda g: jax.nn.gelu(g, approximate=True)
        mlp = act(h @ p["gate"]) * (h @ p["up"])
        return x + _post(mlp @ p["down"], p["post_mlp"]), None

    x, _ = jax.lax.scan(layer, x, params["layers"])
    logits = _rms(x, params["final_norm"]) @ params["head" if LLAMA else "embed"].T
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def floor_params(key, mesh):
    ks = iter(jax.random.split(key, 16))
    init = lambda shape, fan_in: jax.random.normal(next(ks), shape) * fan_in ** -0.5  # noqa: E731
    zeros = lambda *shape: jnp.full(shape, 1.0 if LLAMA else 0.0)  # noqa: E731  norm scales
    layers = {
        "q": init((LAYERS, D, N, H), D), "k": init((LAYERS, D, K, H), D),
        "v": init((LAYERS, D, K, H), D), "o": init((LAYERS, N, H, D), N * H),
        "gate": init((LAYERS, D, F), D), "up": init((LAYERS, D, F), D),
        "down": init((LAYERS, F, D), F),
        **{n: zeros(LAYERS, D) for n in ("pre_attn", "post_attn", "pre_mlp", "post_mlp")},
        "q_norm": zeros(LAYERS, H), "k_norm": zeros(LAYERS, H),
    }
    params = {"embed": init((V, D), 1), "final_norm": zeros(D), "layers": layers}
    specs = {"embed": P("tp", "fsdp"), "final_norm": P(), "layers": {
        "q": P(None, "fsdp", "tp"), "k": P(None, "fsdp"), "v": P(None, "fsdp"),
        "o": P(None, "tp", None, "fsdp"), "gate": P(None, "fsdp", "tp"),
        "up": P(None, "fsdp", "tp"), "down": P(None, "tp", "fsdp"),
        **{n: P() for n in ("pre_attn", "post_attn", "pre_mlp", "post_mlp", "q_norm", "k_norm")}}}
    if LLAMA:
        params["head"], specs["head"] = init((V, D), D), P("tp", "fsdp")
    return jax.device_put(params, jax.tree.map(lambda s: NamedSharding(mesh, s), specs))


def floor():
    devices = np.array(jax.devices()).reshape(ARGS.mesh)
    mesh = jax.sharding.Mesh(devices, ("fsdp", "tp"))
    params = floor_params(jax.random.key(0), mesh)
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(3e-3, weight_decay=0.1))
    opt_state = optimizer.init(params)
    rows = NamedSharding(mesh, P("fsdp", None))
    tokens = jax.device_put(jax.random.randint(jax.random.key(1), (BATCH, SEQ + 1), 0, V), rows)

    @jax.jit
    def step(params, opt_state, tokens):
        loss, grads = jax.value_and_grad(floor_loss)(params, tokens[:, :-1], tokens[:, 1:])
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    state = [params, opt_state]

    def run():
        state[0], state[1], loss = step(state[0], state[1], tokens)
        return loss
    return run


# ------------------------------------------------------------------------------------------
# Tunix's PeftTrainer on its Gemma 3 or Llama 3.

def tunix_model(nnx):
    """Tunix's own model of the shape (its configs and classes, as its CLI builds them)."""
    if LLAMA:
        from tunix.models.llama3 import model as tunix_llama3

        config = tunix_llama3.ModelConfig(
            num_layers=LAYERS, vocab_size=V, embed_dim=D, hidden_dim=F, num_heads=N,
            head_dim=H, num_kv_heads=K, rope_theta=int(ROPE_BASE), norm_eps=1e-6,
            weight_tying=False)
        return tunix_llama3.Llama3(config, rngs=nnx.Rngs(0))
    from tunix.models.gemma3 import model as tunix_gemma3

    config = tunix_gemma3.ModelConfig(
        num_layers=LAYERS, num_embed=V, embed_dim=D, hidden_dim=F, num_heads=N, head_dim=H,
        num_kv_heads=K, sliding_window_size=WINDOW, param_dtype=jnp.float32)
    return tunix_gemma3.Gemma3(config, rngs=nnx.Rngs(0))


def tunix():
    try:
        from flax import nnx
        from tunix.sft import peft_trainer
        from tunix.sft import utils as tunix_utils
    except ImportError as e:
        print(f"tunix: not installed ({e}); `pip install google-tunix` to compare")
        return None
    # As Tunix's own CLI (tunix/cli/peft_main.py) sets it up, on a model built from a config.
    mesh = jax.make_mesh(tuple(ARGS.mesh), ("fsdp", "tp"),
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)
    with jax.set_mesh(mesh):
        model = tunix_model(nnx)
        if ARGS.lora:
            import qwix

            provider = qwix.LoraProvider(module_path=TUNIX_LORA_PATHS, rank=ARGS.lora,
                                         alpha=2.0 * ARGS.lora)
            model = qwix.apply_lora_to_model(model, provider, **model.get_model_input())
            adapters = jax.tree.leaves(nnx.state(model, nnx.LoRAParam))
            print(f"tunix: LoRA on {len(adapters) // 2} projection(s) of rank {ARGS.lora}")
        state = nnx.state(model)
        specs = nnx.get_partition_spec(state)
        nnx.update(model, jax.device_put(state, jax.tree.map(
            lambda s: NamedSharding(mesh, s), specs)))
        optimizer = optax.chain(optax.clip_by_global_norm(1.0),
                                optax.adamw(3e-3, weight_decay=0.1))
        trainer = peft_trainer.PeftTrainer(model, optimizer, peft_trainer.TrainingConfig(
            eval_every_n_steps=10**9, max_steps=10**9))

        def model_input(x):
            pad_mask = x.input_tokens != 0
            return {"input_tokens": x.input_tokens, "input_mask": x.input_mask,
                    "positions": tunix_utils.build_positions_from_mask(pad_mask),
                    "attention_mask": tunix_utils.make_causal_attn_mask(pad_mask)}

        trainer = trainer.with_gen_model_input_fn(model_input)
        train_step, _ = trainer.jit_train_and_eval_step()
    rows = NamedSharding(mesh, P("fsdp", None))
    tokens = jax.random.randint(jax.random.key(1), (BATCH, SEQ + 1), 1, V)
    example = peft_trainer.TrainingInput(
        input_tokens=jax.device_put(tokens, rows),
        input_mask=jax.device_put(jnp.ones_like(tokens, dtype=bool), rows))
    embedding = jax.tree.leaves(nnx.state(model, nnx.Param))[0]
    print(f"tunix: {embedding.shape} parameter sharded as {embedding.sharding.spec}")

    def run():
        with jax.set_mesh(mesh):
            loss, _, _ = train_step(example)
        return loss
    return run


def main() -> None:
    runs = {"ours": ours()[0]}
    if not ARGS.lora:
        runs.update({"ours_unrolled": ours("model.unroll_layers=true")[0],
                     "ours_blockwise": ours("model.attention_impl=blockwise")[0],
                     "ours_dense": ours("model.attention_impl=xla")[0], "floor": floor()})
    peer = tunix()
    if peer is not None:
        runs["tunix"] = peer
    for run in runs.values():
        timed(run, 2)  # compile and warm up
    times = {name: [] for name in runs}
    for _ in range(ARGS.rounds):
        for name, run in runs.items():
            times[name].append(timed(run, ARGS.steps))
    median = {name: statistics.median(t) for name, t in times.items()}
    for name, t in median.items():
        print(f"{name:18s} {t * 1e3:8.1f} ms/step")
    result = {"family": ARGS.family, "mesh": ARGS.mesh, "lora_rank": ARGS.lora,
              "devices": jax.device_count(), "device_kind": jax.devices()[0].device_kind,
              "step_s": {k: round(v, 5) for k, v in median.items()}}
    if not ARGS.lora:
        result.update({
            "ours_over_floor": round(median["ours"] / median["floor"], 3),
            "ours_unrolled_over_floor": round(median["ours_unrolled"] / median["floor"], 3),
            "blockwise_over_dense": round(median["ours_blockwise"] / median["ours_dense"], 3)})
    if "tunix" in median:
        result["ours_over_tunix"] = round(median["ours"] / median["tunix"], 3)
        if not ARGS.lora:
            result["ours_unrolled_over_tunix"] = round(median["ours_unrolled"] / median["tunix"],
                                                       3)
    print(json.dumps(result))


if __name__ == "__main__":
    sys.exit(main())
