"""Expert parallelism (`ep` in model.mesh_shape): a mixture's experts split over devices, each
routed layer's rows sent to their experts' devices and back by all-to-all (models/moe.py's
`exchanged`), every other weight data-parallel over fsdp × ep. Against one device: the same
losses (fp32, 1e-5) with the router's losses on, which are each device's micro-batch's, so the
reference groups its rows alike (one row per micro-batch); the experts really split over ep,
the all-to-alls in the communication report, ep beside cp and pp, a checkpoint restored across
a change of ep, the exchange itself against NumPy, and what ep cannot split refused by name."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import assert_restores_onto, compiled_run, compose_config, family_tiny, mesh_arg, \
    mesh_of, train_losses
from tunix_train.config import ConfigError
from tunix_train.training.setup import Setup

ROUTER_LOSSES = ["model.num_layers=7", "training.moe_aux_loss_weight=0.5",
                 "training.router_z_loss_weight=0.1", "training.global_batch_size=8"]
STEPS = 3

# (fsdp, ep, tp), the overrides the one-device reference shares, the mesh's own: each case one
# row per device per micro-batch.
ACCUMULATE = "training.gradient_accumulation_steps=2"
CASES = {
    "fsdp2-ep2-tp2-zero3-accum2": ((2, 2, 2), [], [ACCUMULATE]),
    "ep4-tp2-zero1-accum2": ((1, 4, 2), [], [ACCUMULATE, "training.zero_stage=1"]),
    "fsdp2-ep4-ragged_dot": ((2, 4, 1), [], ["model.moe_matmul=ragged_dot"]),
    "ep4-tp2-capacity-accum2": ((1, 4, 2), ["model.moe_capacity_factor=1.0"], [ACCUMULATE]),
    "fsdp2-ep2-tp2-lora-offload-zero2": ((2, 2, 2), ["lora.rank=4"], [
        ACCUMULATE, "training.zero_stage=2", "training.offload_params=true",
        "training.offload_optimizer=true"]),
}


def ep_mesh(fsdp: int, ep: int, tp: int) -> str:
    return mesh_of([[fsdp, ep, tp], ["fsdp", "ep", "tp"]])


@pytest.fixture(scope="module")
def references():
    """One device, one row per micro-batch (8 accumulated), per set of shared overrides."""
    return {}


def reference(shared: list[str], cache: dict) -> np.ndarray:
    key = tuple(shared)
    if key not in cache:
        cfg = compose_config(*family_tiny("qwen3_moe", mesh_arg(1, 1), *ROUTER_LOSSES, *shared,
                                          "training.gradient_accumulation_steps=8"))
        cache[key] = train_losses(cfg, STEPS, jax.devices()[:1])[0]
    return cache[key]


@pytest.mark.parametrize("case", CASES)
def test_expert_parallel_meshes_give_one_devices_losses_with_the_experts_split(case, references):
    (fsdp, ep, tp), shared, own = CASES[case]
    cfg = compose_config(*family_tiny("qwen3_moe", ep_mesh(fsdp, ep, tp), *ROUTER_LOSSES,
                                      *shared, *own))
    _, costs, losses, state = compiled_run(cfg, STEPS)
    np.testing.assert_allclose(losses, reference(shared, references), rtol=1e-5)
    # Each device holds E / ep of every routed layer's experts, split over ep (LoRA: the frozen
    # base's, in the compute dtype), ...
    weights = state["frozen"] if cfg.lora.on else state["params"]
    experts = weights["layers"]["mlp"]["gate"]  # [layers, experts, D, F]
    assert tuple(experts.sharding.spec)[1] == "ep"
    shard = experts.addressable_shards[0].data.shape
    zero3 = cfg.training.zero_stage == 3
    assert shard == (experts.shape[0], experts.shape[1] // ep,
                     experts.shape[2] // (fsdp if zero3 else 1), experts.shape[3] // tp)
    # ... and the other weights are split over fsdp × ep under ZeRO 3 (data-parallel ranks).
    embedding = weights["embedder"]["embedding"]
    assert embedding.addressable_shards[0].data.size == embedding.size // (
        fsdp * ep * tp if zero3 else tp)
    exchanges = {c.phase for c in costs.comm.collectives if c.kind == "all-to-all" and
                 c.axis == "ep"}
    assert {"forward", "backward"} <= exchanges


def test_the_eval_step_on_fsdp_ep_tp_gives_one_devices_validation_loss():
    """The eval step (its own program: the CLI's validation loss, not the train step's) on
    fsdp 2 × ep 2 × tp 2, the experts' blocks inside ep's exchange with their width split over
    tp, as the parallelism guide's command runs it: one device's validation loss of the same
    fresh state, on the same 8 held-out rows (1e-5). XLA 0.10's partitioner once aborted
    compiling it."""
    def validation(mesh: str, devices: int) -> float:
        cfg = compose_config(*family_tiny("qwen3_moe", mesh, "data.eval_batches=1",
                                          "training.global_batch_size=8",
                                          "training.gradient_accumulation_steps=1"))
        setup = Setup.create(cfg, jax.devices()[:devices])
        data = setup.open_data()
        loss = setup.evaluator(data.eval_batches)(setup.fresh_state())
        data.close()
        return loss

    reference = validation(mesh_arg(1, 1), 1)
    assert validation(ep_mesh(2, 2, 2), 8) == pytest.approx(reference, rel=1e-5)


def test_ep_composes_with_cp_and_pp():
    """ep 2 × cp 2 × tp 2 (each device routes its chunk of its rows' tokens) and pp 2 × fsdp 2
    × ep 2 (each stage's routed layers exchange over its own ep group, inside the pipeline's
    loop): one device's losses (1e-5; the router's losses off, as they group tokens by
    device)."""
    def losses(mesh: str, devices: int, *extra: str) -> np.ndarray:
        cfg = compose_config(*family_tiny("qwen3_moe", mesh, "model.num_layers=4",
                                          "training.moe_aux_loss_weight=0",
                                          "training.router_z_loss_weight=0",
                                          "training.global_batch_size=8", "data.seq_len=64",
                                          *extra))
        return train_losses(cfg, STEPS, jax.devices()[:devices])[0]

    reference = losses(mesh_arg(1, 1), 1)
    np.testing.assert_allclose(losses(mesh_of([[1, 2, 2, 2], ["fsdp", "ep", "cp", "tp"]]), 8),
                               reference, rtol=1e-5)
    np.testing.assert_allclose(losses(mesh_of([[2, 2, 2, 1], ["pp", "fsdp", "ep", "tp"]]), 8,
                                      "training.pipeline_microbatches=2"), reference, rtol=1e-5)


def test_a_checkpoint_restores_across_a_change_of_ep(tmp_path):
    """Trained on fsdp 2 × ep 2 × tp 2, restored onto ep 4 × tp 2: every array equal."""
    run = compiled_run(compose_config(*family_tiny("qwen3_moe", ep_mesh(2, 2, 2))), 2)
    other = Setup.create(compose_config(*family_tiny("qwen3_moe", ep_mesh(1, 4, 2))))
    assert_restores_onto(run, other, tmp_path)


@pytest.mark.parametrize("overrides,message", [
    (["model=llama3_tiny", ep_mesh(4, 2, 1)],
     r"model.mesh_shape has ep=2, but llama3_tiny has no experts to split "
     r"\(model.num_experts=0\); put those devices on fsdp"),
    (["model=qwen3_moe_tiny", ep_mesh(1, 8, 1), "model.num_experts=12"],
     r"model.num_experts=12 is not divisible by ep=8 from model.mesh_shape"),
])
def test_what_ep_cannot_split_is_refused_by_name(overrides, message):
    with pytest.raises(ConfigError, match=message):
        Setup.create(compose_config(*overrides))


@pytest.mark.parametrize("factor", [None, 0.5])
def test_the_exchange_keeps_every_row_or_the_first_of_each_block_as_numpy_says(factor):
    """models/moe.py's exchange on 2 devices simulated by `jax.vmap` over the ep axis (its
    all-to-all is the train step's): each device's tokens routed over all 8 experts, 4 held by
    each. Dropless (the default), the output and its gradients equal computing every expert of
    the whole set for every token; with model.moe_ep_buffer_factor=0.5, each device sends each
    shard its first ceil(0.5 · T·k / 2) assignments in token order (then top-k order) and drops
    the rest: NumPy running that rule, and the dropped count `statistics` logs."""
    from tunix_train.models import moe, params as model_params, router_losses
    from tunix_train.models.layers import GATED
    from tunix_train.parallel.collectives import FsdpHook

    S, T, D, F, E, K = 2, 24, 16, 8, 8, 2
    rng = np.random.default_rng(0)
    x = rng.normal(size=(S, T, D)).astype(np.float32)
    router = rng.normal(size=(D, E)).astype(np.float32)
    gate, up = (rng.normal(size=(E, D, F)).astype(np.float32) * 0.3 for _ in range(2))
    down = rng.normal(size=(E, F, D)).astype(np.float32) * 0.3
    shard = lambda w: w.reshape(S, E // S, *w.shape[1:])  # noqa: E731  device s: experts 4s..

    def device(x_TxD, gate, up, down):
        routing = moe.route(x_TxD, jnp.asarray(router), K, True)
        with model_params.hooked(FsdpHook()):
            y = moe.experts_mlp(x_TxD, routing, gate, up, down, GATED["silu"],
                                buffer_factor=factor)
        blocks = moe.plan_blocks(T, K, E // S, S, buffer_factor=factor)
        dropped = router_losses.statistics(routing, blocks=blocks)["dropped"]
        return y, dropped, routing.experts_TxK, routing.weights_TxK

    run = jax.jit(jax.vmap(device, axis_name="ep"))  # one program, not an op at a time
    y, dropped, experts, weights = run(x, *(shard(w) for w in (gate, up, down)))
    C = moe.plan_blocks(T, K, E // S, S, buffer_factor=factor).rows
    expected, dropped_np = np.zeros((S, T, D)), 0
    for s in range(S):
        taken = np.zeros(S, int)
        for t in range(T):
            for j in range(K):
                e = int(experts[s, t, j])
                if taken[e // (E // S)] == C:
                    dropped_np += 1
                    continue
                taken[e // (E // S)] += 1
                h = x[s, t] @ gate[e]
                expected[s, t] += float(weights[s, t, j]) * (
                    (h / (1 + np.exp(-h))) * (x[s, t] @ up[e])) @ down[e]
    np.testing.assert_allclose(np.asarray(y), expected, rtol=1e-4, atol=1e-5)
    assert int(np.sum(dropped)) == dropped_np and (dropped_np > 0) == (factor is not None)
    if factor is None:  # gradients through the all-to-all and its transpose
        probe = rng.normal(size=(S, T, D)).astype(np.float32)
        ours = jax.jit(jax.grad(lambda g: jnp.sum(run(x, g, *(shard(w) for w in (up, down)))[0]
                                                  * probe)))(shard(gate))

        def dense(g):
            routing = moe.route(jnp.asarray(x.reshape(S * T, D)), jnp.asarray(router), K, True)
            w_TxE = jnp.zeros((S * T, E)).at[jnp.arange(S * T)[:, None],
                                             routing.experts_TxK].set(routing.weights_TxK)
            x_ = jnp.asarray(x.reshape(S * T, D))
            h = GATED["silu"](jnp.einsum("td,edf->etf", x_, g), jnp.einsum("td,edf->etf", x_, up))
            return jnp.sum(jnp.einsum("etf,efd,te->td", h, down, w_TxE) * probe.reshape(S * T, D))

        np.testing.assert_allclose(np.asarray(ours).reshape(gate.shape),
                                   np.asarray(jax.jit(jax.grad(dense))(jnp.asarray(gate))),
                                   rtol=1e-4, atol=1e-5)
