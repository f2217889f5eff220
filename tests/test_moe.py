"""models/moe.py against transformers' sparse MoE blocks (Qwen3-MoE with and without
`norm_topk_prob`, Mixtral) on the same random weights, and its gradients against the dense
computation (every expert on every token, weighted by the routing); the qwen3_moe family against
transformers' Qwen3MoeForCausalLM (logits from fused-expert files, the auxiliary loss and the
training loss it is added to), and the router's losses on a mesh against one device. The family
also runs the shared matrices: test_hf.py (import, export, generation), test_train_step.py
(meshes, pipeline, ZeRO, resume) and test_lora.py."""

import contextlib
import io
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.ad_checkpoint import print_saved_residuals

from helpers import (compose_config, family_tiny, jitted_forward, mesh_arg, mesh_of,
                     train_losses)
from tunix_train import cli
from tunix_train.config import ConfigError
from tunix_train.models import hf_weights, moe, router_losses
from tunix_train.models.decoder import REMAT_POLICIES, Experts
from tunix_train.models.layers import GATED
from tunix_train.training.setup import Setup
from tunix_train.training.train_step import loss_sums

D, F, E, K, T = 32, 16, 8, 2, 24


def hf_block(kind: str):
    """(transformers' block, ours as a function of x) on the same weights."""
    import torch
    from transformers import MixtralConfig, Qwen3MoeConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    torch.manual_seed(0)
    if kind == "mixtral":
        config = MixtralConfig(hidden_size=D, intermediate_size=F, num_local_experts=E,
                               num_experts_per_tok=K)
        block, normalize = MixtralSparseMoeBlock(config), True
    else:
        normalize = kind == "qwen3_moe_norm"
        config = Qwen3MoeConfig(hidden_size=D, moe_intermediate_size=F, num_experts=E,
                                num_experts_per_tok=K, norm_topk_prob=normalize)
        block = Qwen3MoeSparseMoeBlock(config)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.2)
    block = block.float().eval()
    router_DxE = block.gate.weight.detach().numpy().T  # transformers' 5.x layout: experts fused
    gate_up = block.experts.gate_up_proj.detach().numpy()  # [E, 2F, D]
    gate, up = gate_up[:, :F].transpose(0, 2, 1), gate_up[:, F:].transpose(0, 2, 1)
    down = block.experts.down_proj.detach().numpy().transpose(0, 2, 1)  # [E, D, F] → [E, F, D]
    weights = tuple(jnp.asarray(w) for w in (router_DxE, gate, up, down))

    def ours(x_TxD, weights=weights):
        router, gate, up, down = weights
        routing = moe.route(x_TxD, router, K, normalize)
        return moe.experts_mlp(x_TxD, routing, gate, up, down, GATED["silu"]), routing

    return block, ours, weights, normalize


@pytest.mark.parametrize("kind", ["qwen3_moe", "qwen3_moe_norm", "mixtral"])
def test_the_experts_give_transformers_output_and_auxiliary_loss(kind):
    import torch
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    block, ours, _, _ = hf_block(kind)
    x = np.random.default_rng(1).normal(size=(1, T, D)).astype(np.float32)
    with torch.no_grad():
        theirs = block(torch.from_numpy(x)).numpy()
        logits = torch.from_numpy(x[0]) @ block.gate.weight.T

    @jax.jit  # one program, not op by op
    def forward(x_TxD):
        y, routing = ours(x_TxD)
        stats = router_losses.statistics(routing)
        aux = router_losses.losses(stats)["moe_aux_loss"]  # what training adds
        return y, routing.experts_TxK, aux

    y, experts, ours_aux = forward(jnp.asarray(x[0]))
    np.testing.assert_allclose(np.asarray(y), theirs[0], rtol=1e-5, atol=1e-6)
    assert len(np.unique(np.asarray(experts))) > K  # tokens went to several experts
    aux = load_balancing_loss_func((logits,), E, K).item()
    np.testing.assert_allclose(float(ours_aux), aux, rtol=1e-6)


@pytest.mark.parametrize("matmul", sorted(moe.MATMULS))
def test_gradients_equal_the_dense_computation_of_every_expert(matmul):
    """Gradients through the sort, the grouped matmuls and the scatter (as a train step takes
    them, routing weights included) equal those of computing every expert for every token and
    weighting by the routing (zero for the experts not picked)."""
    _, _, weights, normalize = hf_block("qwen3_moe_norm")
    x = jnp.asarray(np.random.default_rng(2).normal(size=(T, D)).astype(np.float32))

    def sparse(x, weights):
        router, gate, up, down = weights
        routing = moe.route(x, router, K, normalize)
        return moe.experts_mlp(x, routing, gate, up, down, GATED["silu"], matmul)

    def dense(x, weights):
        router, gate, up, down = weights
        routing = moe.route(x, router, K, normalize)
        weight_TxE = jnp.zeros((T, E)).at[jnp.arange(T)[:, None], routing.experts_TxK].set(
            routing.weights_TxK)
        h_ExTxF = GATED["silu"](jnp.einsum("td,edf->etf", x, gate),
                                jnp.einsum("td,edf->etf", x, up))
        return jnp.einsum("etf,efd,te->td", h_ExTxF, down, weight_TxE)

    probe = jnp.asarray(np.random.default_rng(3).normal(size=(T, D)).astype(np.float32))
    loss = lambda f: lambda x, w: jnp.sum(f(x, w) * probe)  # noqa: E731
    ours = jax.jit(jax.grad(loss(sparse), argnums=(0, 1)))(x, weights)
    reference = jax.jit(jax.grad(loss(dense), argnums=(0, 1)))(x, weights)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(reference)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)
    assert float(jnp.abs(ours[1][1]).sum()) > 0  # the experts' weights got gradients


@pytest.mark.parametrize("matmul", sorted(moe.MATMULS))
def test_save_dots_keeps_the_experts_three_projections_as_it_keeps_a_dense_layers(matmul):
    """Recomputing them in the backward pass was a third of the expert matmuls' time."""
    _, _, weights, normalize = hf_block("qwen3_moe_norm")
    x = jnp.ones((T, D))

    def saved(remat: str) -> str:
        def layer(x, weights):
            router, gate, up, down = weights
            return moe.experts_mlp(x, moe.route(x, router, K, normalize), gate, up, down,
                                   GATED["silu"], matmul)
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            print_saved_residuals(jax.checkpoint(layer, policy=REMAT_POLICIES[remat]), x,
                                  weights)
        return out.getvalue()

    assert saved("save_dots").count("named 'projection'") == 3
    assert "named 'projection'" not in saved("full")


@pytest.mark.parametrize("way", [*sorted(moe.MATMULS), "capacity", "ep"])
def test_save_dots_keeps_the_routing_plan_so_the_backward_pass_sorts_no_more(way):
    """Each grouped matmul's plan (where each row goes: a sort, scatters, the tiles' or the
    overflow's map; with a capacity, the capped blocks'; over ep, where rows travel) is kept,
    not made again in the backward pass: the gradient under save_dots runs as many sorts as
    the forward pass alone, under full twice as many. `ep`: 2 devices simulated by `jax.vmap`
    over the ep axis, 4 of the 8 experts each."""
    from tunix_train.models import params as model_params
    from tunix_train.parallel.collectives import FsdpHook

    _, _, weights, normalize = hf_block("qwen3_moe_norm")
    x = jnp.asarray(np.random.default_rng(5).normal(size=(T, D)).astype(np.float32))
    matmul = way if way in moe.MATMULS else "blocks"

    def layer(x, weights):
        router, gate, up, down = weights
        return moe.experts_mlp(x, moe.route(x, router, K, normalize), gate, up, down,
                               GATED["silu"], matmul, 1.0 if way == "capacity" else None)

    if way == "ep":
        x = jnp.stack([x, x[::-1]])
        router, *experts = weights
        weights = (jnp.stack([router] * 2), *(w.reshape(2, E // 2, *w.shape[1:])
                                              for w in experts))

        def on_devices(x, weights):
            with model_params.hooked(FsdpHook()):
                return jax.vmap(layer, axis_name="ep")(x, weights)
        run = on_devices
    else:
        run = layer

    def sorts(f) -> int:
        return str(jax.make_jaxpr(f)(x, weights)).count(" sort[")

    def gradient(remat: str):
        return jax.grad(lambda x, w: jnp.sum(jax.checkpoint(run, policy=REMAT_POLICIES[remat])(
            x, w) ** 2), argnums=(0, 1))

    forward = sorts(run)
    assert forward > 0
    assert sorts(gradient("save_dots")) == forward
    assert sorts(gradient("full")) == 2 * forward
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        print_saved_residuals(jax.checkpoint(run, policy=REMAT_POLICIES["save_dots"]), x,
                              weights)
    assert "named 'routing_plan'" in out.getvalue()


def test_the_tiled_matmul_does_the_rows_work_not_every_experts():
    """As XLA compiles it: at most 1.5x the multiply-adds of each row by its own expert alone
    (tiles of at most half an expert's mean share), forward and backward, on rows spread
    unevenly (one expert gets none, one a third)."""
    rows, experts, dim, width = 3072, 24, 64, 48
    sizes = np.full(experts, rows // experts)
    sizes[0], sizes[1] = 0, sizes[0] + rows // 3
    sizes[2:] = (rows - sizes[1]) // (experts - 2)
    sizes[-1] += rows - sizes.sum()
    lhs = jnp.ones((rows, dim))
    rhs = jnp.arange(experts, dtype=jnp.float32)[:, None, None] * jnp.ones((experts, dim, width))
    ideal = 2 * rows * dim * width

    def flops(f, *args):
        cost = jax.jit(f).lower(*args).compile().cost_analysis()
        return (cost[0] if isinstance(cost, list) else cost)["flops"]

    def grouped(lhs, rhs, expert_of_row):  # into the tiles, multiplied, back: rows in order
        tiles = moe.tiled(expert_of_row, 1, experts)
        return tiles.to_tokens(tiles.matmul(tiles.from_tokens(lhs), rhs), rows)[:, 0]

    expert_of_row = jnp.asarray(np.repeat(np.arange(experts), sizes), jnp.int32)
    assert ideal <= flops(grouped, lhs, rhs, expert_of_row) <= 1.55 * ideal  # + the selects
    backward = jax.grad(lambda a, b, s: jnp.sum(grouped(a, b, s)), argnums=(0, 1))
    assert flops(backward, lhs, rhs, expert_of_row) <= 3 * 1.55 * ideal
    expected = np.concatenate([np.full((n, width), dim * e) for e, n in enumerate(
        sizes)])  # each row multiplied by its own expert's weight
    np.testing.assert_array_equal(np.asarray(jax.jit(grouped)(lhs, rhs, expert_of_row)),
                                  expected)


def _every_expert(x, experts_TxK, weights_TxK, gate, up, down):
    """Each token through every expert, weighted by its routing (zero for those not picked)."""
    weight_TxE = jnp.zeros((x.shape[0], gate.shape[0])).at[
        jnp.arange(x.shape[0])[:, None], experts_TxK].set(weights_TxK)
    h_ExTxF = GATED["silu"](jnp.einsum("td,edf->etf", x, gate), jnp.einsum("td,edf->etf", x, up))
    return jnp.einsum("etf,efd,te->td", h_ExTxF, down, weight_TxE)


@pytest.mark.parametrize("spread", ["every_token_to_two_experts", "even", "uneven"])
def test_blocks_overflow_loop_gives_the_dense_values_and_gradients(spread):
    """`blocks`: each expert's first ⌈T·k / E⌉ rows in place, the rest through the loop over
    the tiles they fill. Values and gradients (rows, weights, routing weights) equal every
    expert on every token, weighted, in the worst case (every token to the same two experts:
    the loop holds nearly all rows), with no overflow at all (each expert exactly its share:
    the loop runs no tile) and with an uneven spread (both parts)."""
    tokens = 64
    rng = np.random.default_rng(7)
    if spread == "every_token_to_two_experts":
        experts = np.tile([3, 5], (tokens, 1))
    elif spread == "even":
        experts = np.stack([np.arange(tokens) % E, (np.arange(tokens) + 1) % E], axis=1)
    else:
        experts = np.stack([rng.choice(E, 2, replace=False, p=np.linspace(1, 3, E) / 16)
                            for _ in range(tokens)])
    experts = jnp.asarray(experts, jnp.int32)
    _, _, (_, gate, up, down), _ = hf_block("qwen3_moe")
    x = jnp.asarray(rng.normal(size=(tokens, D)).astype(np.float32))
    gates = jnp.asarray(rng.uniform(0.2, 1, size=(tokens, K)).astype(np.float32))
    probe = jnp.asarray(rng.normal(size=(tokens, D)).astype(np.float32))

    def blocks(x, gates, gate, up, down):
        routing = moe.Routing(gates, experts, jnp.zeros((tokens, E)), jnp.zeros(tokens))
        return moe.experts_mlp(x, routing, gate, up, down, GATED["silu"], "blocks")

    def dense(x, gates, gate, up, down):
        return _every_expert(x, experts, gates, gate, up, down)

    share = moe.capacity(tokens * K, E, 1.0)  # 16 rows; the overflow in tiles of 8
    used = int(moe.overflow_plan(experts.reshape(-1), K, E, share).used)
    assert used == {"every_token_to_two_experts": 2 * (tokens - share) // 8, "even": 0}.get(
        spread, used) and (used > 0) == (spread != "even")
    args = (x, gates, gate, up, down)
    loss = lambda f: lambda *a: jnp.sum(f(*a) * probe)  # noqa: E731
    for ours, reference in zip(jax.jit(jax.value_and_grad(loss(blocks), argnums=range(5)))(*args),
                               jax.value_and_grad(loss(dense), argnums=range(5))(*args)):
        for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(reference)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


def test_an_ep_devices_received_rows_through_blocks_equal_the_tiles():
    """On an ep device the received rows (padding among them, expert -1) go through the blocks
    sized by the rows that arrive on average, not by the exchange's worst-case buffer; most of
    them past their expert's share here, so the loop holds them: values and gradients equal
    the tiles'."""
    import functools

    _, _, (_, gate, up, down), _ = hf_block("qwen3_moe")
    held, received, share = 4, 96, 8
    rng = np.random.default_rng(9)
    expert_Q = jnp.asarray(np.where(rng.uniform(size=received) < 0.4, -1,
                                     rng.choice(held, received, p=[0.55, 0.3, 0.1, 0.05])),
                           jnp.int32)
    x = jnp.asarray(rng.normal(size=(received, D)).astype(np.float32))
    x = jnp.where((expert_Q >= 0)[:, None], x, 0)  # padding rows arrive as zeros
    probe = jnp.asarray(rng.normal(size=(received, D)).astype(np.float32))
    weights = (gate[:held], up[:held], down[:held])

    def through(kind, x, weights):
        mlp = functools.partial(moe._mlp, gate_ExDxF=weights[0], up_ExDxF=weights[1],
                                down_ExFxD=weights[2], gated=GATED["silu"])
        if kind == "blocks":
            y = moe._received_in_blocks(x, expert_Q, share, weights, GATED["silu"])
        else:
            y = moe._received_as(x, expert_Q, moe.tiled, held, mlp)
        return jnp.sum(y * probe)

    plan = moe.overflow_plan(expert_Q, 1, held, share)
    assert int(plan.used) > 3  # the first expert's rows are several tiles past its block
    ours = jax.jit(jax.value_and_grad(functools.partial(through, "blocks"), argnums=(0, 1)))(
        x, weights)
    tiles = jax.jit(jax.value_and_grad(functools.partial(through, "tiles"), argnums=(0, 1)))(
        x, weights)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(tiles)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


def _collectives_in_loops(program: str) -> list[str]:
    """The collectives a while loop's body runs (or anything it calls), in compiled HLO text."""
    from tunix_train.analysis import hlo

    module = hlo.parse(program)
    bodies = [re.search(r"body=%([\w.\-]+)", i.attrs).group(1)
              for instructions in module.computations.values() for i in instructions
              if i.opcode == "while"]
    seen, found = set(), []
    while bodies:
        name = bodies.pop()
        if name in seen:
            continue
        seen.add(name)
        for inst in module.computations.get(name, ()):
            if inst.opcode.removesuffix("-start") in ("all-reduce", "all-gather",
                                                       "reduce-scatter", "all-to-all"):
                found.append(inst.name)
            bodies += re.findall(r"(?:calls|body|condition|to_apply)=%([\w.\-]+)", inst.attrs)
    return found


def test_blocks_on_tp_sum_the_tokens_once_and_give_one_devices_gradients():
    """With the experts' width split over tp (XLA's partitioner, as in the train step), each
    device runs the blocks and the overflow loop on its share of every expert and the tokens'
    partial sums [T, D] are added once at the end: no collective inside a loop of the compiled
    program (left to XLA, every tile's down projection was all-reduced inside the loop), and the
    same values and gradients as on one device."""
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

    from tunix_train.parallel import sharding

    _, _, (router, gate, up, down), normalize = hf_block("qwen3_moe_norm")
    x = jnp.asarray(np.random.default_rng(8).normal(size=(96, D)).astype(np.float32))

    def loss(x, gate, up, down):
        routing = moe.route(x, router, K, normalize)
        return jnp.sum(jnp.sin(moe.experts_mlp(x, routing, gate, up, down, GATED["silu"],
                                               "blocks")))

    step = jax.jit(jax.value_and_grad(loss, argnums=range(4)))
    reference = step(x, gate, up, down)
    mesh = jax.make_mesh((4, 2), ("fsdp", "tp"), axis_types=(AxisType.Auto,) * 2,
                         devices=jax.devices()[:8])
    with sharding.activate(mesh, tuple(sharding.RULES.items())):
        put = lambda a, *spec: jax.device_put(a, NamedSharding(mesh, P(*spec)))  # noqa: E731
        args = (put(x), put(gate, None, None, "tp"), put(up, None, None, "tp"),
                put(down, None, "tp", None))
        step = jax.jit(jax.value_and_grad(loss, argnums=range(4)))
        ours = step(*args)
        program = step.lower(*args).compile().as_text()
    assert _collectives_in_loops(program) == [] and " all-reduce(" in program
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(reference)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("factor", [0.5, 1.0, 4.0])
def test_a_capacity_drops_the_rows_numpy_says_and_a_large_one_none(factor):
    """With a capacity factor each expert takes its first ceil(factor · T·k / E) assignments in
    token order (then top-k order) and drops the rest: one layer against NumPy running that
    rule expert by expert; the logged dropped count too; and E/k x (every row fits) equals the
    dropless output."""
    block, ours, weights, normalize = hf_block("qwen3_moe")
    router, gate, up, down = (np.asarray(w, np.float64) for w in weights)
    x = np.random.default_rng(4).normal(size=(T, D)).astype(np.float32)

    @jax.jit  # one program, as in a train step, not op by op
    def layer(x_TxD):
        routing = moe.route(x_TxD, weights[0], K, normalize)
        y = moe.experts_mlp(x_TxD, routing, *weights[1:], GATED["silu"], capacity_factor=factor)
        dropped = router_losses.statistics(routing, factor)["dropped"]
        return routing.experts_TxK, routing.weights_TxK, y, dropped, ours(x_TxD)[0]

    experts, gates, y, logged_dropped, dropless = layer(jnp.asarray(x))
    experts, gates = np.asarray(experts), np.asarray(gates, np.float64)
    per_expert = moe.capacity(T * K, E, factor)
    expected, taken, dropped = np.zeros((T, D)), np.zeros(E, int), 0
    for t in range(T):
        for j in range(K):
            e = experts[t, j]
            if taken[e] == per_expert:
                dropped += 1
                continue
            taken[e] += 1
            h = x[t] @ gate[e]
            expected[t] += gates[t, j] * ((h / (1 + np.exp(-h))) * (x[t] @ up[e])) @ down[e]
    np.testing.assert_allclose(np.asarray(y), expected, rtol=1e-5, atol=1e-5)
    assert float(logged_dropped) == dropped and (dropped > 0) == (factor < 1.5)
    if factor == 4.0:
        np.testing.assert_allclose(np.asarray(y), np.asarray(dropless), rtol=1e-5, atol=1e-6)


def _fused_checkpoint(path, family, **changes):
    """A tiny mixture of experts saved from its in-memory state dict, experts fused as
    transformers 5 holds them (its save_pretrained splits them per expert, as the Hub's files
    are)."""
    import hf_reference
    from safetensors.torch import save_file

    model = hf_reference.build(path / "split", family=family, **changes)
    path.mkdir(exist_ok=True)
    model.config.save_pretrained(path)
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"
             or not model.config.tie_word_embeddings}
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    return model


def _imported(path):
    cfg = cli.compose([f"model.init_from=hf:{path}", mesh_arg(1, 1),
                       "training.mixed_precision=fp32"])
    setup = Setup.create(cfg, jax.devices()[:1])
    params = hf_weights.load_init_from(cfg.model, setup.params.abstract, setup.params.shardings)
    return cfg, nnx.merge(setup.params.graphdef, params)


@pytest.mark.parametrize("family,changes", [
    ("qwen3_moe", {"norm_topk_prob": True, "decoder_sparse_step": 1}), ("mixtral", {})])
def test_fused_experts_with_renormalised_weights_give_transformers_logits_and_losses(
        tmp_path, family, changes):
    """Every layer routed, top-k weights renormalised, experts read from fused tensors: logits
    within 1e-5, the load-balancing loss transformers returns with output_router_logits=True,
    and the training loss it adds to the mean token loss (router_aux_loss_coef x that loss)."""
    import torch

    import hf_reference

    theirs_model = _fused_checkpoint(tmp_path, family, **changes)
    cfg, ours = _imported(tmp_path)
    assert (cfg.model.normalize_top_k, cfg.model.moe_every, cfg.model.num_experts) == (True, 1, 5)
    tokens = np.random.default_rng(0).integers(0, 320, (2, 40))
    theirs = hf_reference.logits(theirs_model, tokens)
    graphdef, state = nnx.split(ours)
    logits = jitted_forward(graphdef, state)(jnp.asarray(tokens))
    np.testing.assert_allclose(np.asarray(logits), theirs,
                               atol=1e-5 * np.abs(theirs).max(), rtol=1e-5)
    with torch.no_grad():
        out = theirs_model(torch.as_tensor(tokens), labels=torch.as_tensor(tokens),
                           output_router_logits=True)
    # Ours on the same batch: targets shifted by one, the last position not counted.
    batch = {"inputs": jnp.asarray(tokens),
             "targets": jnp.asarray(np.concatenate([tokens[:, 1:], tokens[:, :1]], axis=1)),
             "weights": jnp.asarray(np.arange(40) < 39, jnp.float32)[None].repeat(2, 0)}
    weights = router_losses.LossWeights(aux=cfg.model.router_aux_loss_coef)
    loss_sum, sums = jax.jit(lambda state, batch: loss_sums(graphdef, state, batch,
                                                            router=weights))(state, batch)
    tokens_counted = float(sums["tokens"])
    np.testing.assert_allclose(float(sums["moe_aux_loss"]) / tokens_counted,
                               out.aux_loss.item(), rtol=1e-5)
    assert out.aux_loss.item() > 1  # k = 2 at perfect balance: far from a missing term's 0
    np.testing.assert_allclose(float(loss_sum) / tokens_counted, out.loss.item(), rtol=1e-5)


ROUTER_LOSSES = ["model.num_layers=7", "training.moe_aux_loss_weight=0.5",
                 "training.router_z_loss_weight=0.1", "training.global_batch_size=8"]


def test_the_router_losses_on_a_mesh_and_a_pipeline_equal_one_device_grouped_alike():
    """The router's losses are a batch's: each device's micro-batch's (as transformers computes
    them per forward pass). One device with 2 rows and 4 accumulation steps groups the rows as
    fsdp 4 x tp 2 with 2 rows per device does, and as pp 2 x fsdp 2 x tp 2 with 2 rows and 2
    steps, where each stage's statistics (its layers, over the M = 2 pipeline micro-batches it
    ran, idle iterations left out) are summed over pp; Qwen 3 MoE's 7 layers make 3 blocks of
    a dense and a routed layer, so a routed block is left over after the 2 stages. The same
    losses (1e-5), which the router's losses change (against them off)."""
    def losses(mesh: str, accumulation: int, *extra: str) -> np.ndarray:
        cfg = compose_config(*family_tiny("qwen3_moe", mesh, *ROUTER_LOSSES,
                                          f"training.gradient_accumulation_steps={accumulation}",
                                          *extra))
        devices = math.prod(cfg.model.mesh_shape[0])
        return train_losses(cfg, 3, jax.devices()[:devices])[0]

    reference = losses(mesh_arg(1, 1), 4)
    np.testing.assert_allclose(losses(mesh_arg(4, 2), 1), reference, rtol=1e-5)
    np.testing.assert_allclose(losses(mesh_of([[2, 2, 2], ["pp", "fsdp", "tp"]]), 2,
                                      "training.pipeline_microbatches=2"), reference, rtol=1e-5)
    without = losses(mesh_arg(1, 1), 4, "training.moe_aux_loss_weight=0",
                     "training.router_z_loss_weight=0")
    assert np.all(reference - without > 0.5)  # the weighted aux loss alone is about 0.5 x 2


def test_router_losses_on_a_pipeline_whose_stages_do_not_divide_its_microbatches_are_refused():
    cfg = compose_config(*family_tiny("qwen3_moe", mesh_of([[2, 2, 2], ["pp", "fsdp", "tp"]]),
                                      "training.moe_aux_loss_weight=0.01",
                                      "training.global_batch_size=12",
                                      "training.pipeline_microbatches=3"))
    with pytest.raises(ConfigError, match=r"training.pipeline_microbatches=3 on pp=2 with the "
                                          r"router's losses on \(training.moe_aux_loss_weight="
                                          r"0.01, training.router_z_loss_weight=0.0\): set"):
        Setup.create(cfg, jax.devices()[:8])


def test_tokamax_trains_with_the_tiles_losses_and_is_refused_where_it_cannot_run(monkeypatch):
    """model.moe_matmul=tokamax on fsdp 4 (on a CPU tokamax runs XLA's ragged_dot; its Pallas
    kernels run in bench/gpu_check.sh): the losses of tiles (1e-5); so does
    model.moe_matmul=pallas (models/grouped_matmul.py's kernels in Pallas's interpreter).
    Refused by name on a tp mesh (XLA cannot split a kernel), where the package is missing,
    and on a GPU where tokamax's kernels call what this jax removed (the GPU asked for here
    as models/moe.py asks it)."""
    from tunix_train import backend, validation

    def losses(matmul: str) -> np.ndarray:
        cfg = compose_config(*family_tiny("qwen3_moe", mesh_arg(4, 1),
                                          f"model.moe_matmul={matmul}"))
        return train_losses(cfg, 3, jax.devices()[:4])[0]

    tiles = losses("tiles")
    np.testing.assert_allclose(losses("tokamax"), tiles, rtol=1e-5)
    np.testing.assert_allclose(losses("pallas"), tiles, rtol=1e-5)  # our kernels, interpreted
    cfg = cli.compose(["model=qwen3_moe_tiny", "model.moe_matmul=tokamax", mesh_arg(4, 2)])
    with pytest.raises(ConfigError, match=r"model.moe_matmul=tokamax with tp=2 in "
                                          r"model.mesh_shape: XLA cannot split"):
        Setup.create(cfg, jax.devices()[:8])
    cfg = cli.compose(["model=qwen3_moe_tiny", "model.moe_matmul=tokamax", mesh_arg(4, 1)])
    monkeypatch.setattr(backend, "is_gpu", lambda: True)
    monkeypatch.setattr(moe.jax, "__version__", "0.11.2")
    monkeypatch.setattr(moe.importlib.metadata, "version", lambda name: "0.0.12")
    with pytest.raises(ConfigError, match=r"model.moe_matmul=tokamax on a GPU: tokamax 0.0.12's "
                                          r"GPU kernels do not run on jax 0.11.2 .* set "
                                          r"model.moe_matmul=pallas"):
        Setup.create(cfg, jax.devices()[:4])
    monkeypatch.setattr(moe.importlib.metadata, "version", lambda name: "0.0.13")
    assert moe.chosen_matmul(cfg.model, 1) == "tokamax"  # a later release: tried
    monkeypatch.setattr(validation.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConfigError, match=r"model.moe_matmul=tokamax needs the tokamax package"):
        validation.validate(cli.compose(["model=qwen3_moe_tiny", "model.moe_matmul=tokamax"]))


def test_expert_lora_targets_are_refused_by_name():
    from tunix_train import validation

    cfg = cli.compose(["model=qwen3_moe_tiny", "lora.rank=4", "lora.targets=[q,gate]"])
    with pytest.raises(ConfigError, match=r"lora.targets=\['q', 'gate'\]: qwen3_moe_tiny is a "
                                          r"mixture of experts"):
        validation.validate(cfg)


def test_forced_balance_routes_by_noise_and_passes_the_routers_gradient_straight_through():
    """model.moe_force_load_balance (benchmarks): a router that sends every token to the same
    two experts routes, forced, each expert within 5 σ of its mean share (binomial), whatever
    the router; the router's gradient is x^T times the loss's gradient at the logits it routed
    by (a reference of the routing's formulas on those logits); and the layer takes the key."""
    tokens = 2048
    x_TxD = jax.random.normal(jax.random.key(1), (tokens, D)) + 3.0
    router_DxE = jnp.zeros((D, E)).at[:, :2].set(1.0)
    real = moe.route(x_TxD, router_DxE, K, True)
    assert np.bincount(np.asarray(real.experts_TxK).ravel(), minlength=E)[2:].sum() == 0
    forced = moe.route(x_TxD, router_DxE, K, True, force_balance=True)
    loads = np.bincount(np.asarray(forced.experts_TxK).ravel(), minlength=E)
    mean = tokens * K / E
    assert np.all(np.abs(loads - mean) < 5 * math.sqrt(mean * (1 - 1 / E))), loads
    other = moe.route(x_TxD, -router_DxE, K, True, force_balance=True)
    np.testing.assert_array_equal(other.experts_TxK, forced.experts_TxK)
    np.testing.assert_array_equal(other.weights_TxK, forced.weights_TxK)

    c = [jax.random.normal(jax.random.key(i), shape) for i, shape in
         enumerate([(tokens, K), (tokens, E), (tokens,)], start=2)]

    def loss(weights_TxK, probs_TxE, logsumexp_T):
        return (jnp.sum(weights_TxK * c[0]) + jnp.sum(probs_TxE * c[1])
                + jnp.sum(logsumexp_T * c[2]))

    def reference(logits_TxE):  # route's formulas from the logits on
        probs_TxE = jax.nn.softmax(logits_TxE, axis=-1)
        weights_TxK = jax.lax.top_k(probs_TxE, K)[0]
        weights_TxK = weights_TxK / jnp.sum(weights_TxK, axis=-1, keepdims=True)
        return loss(weights_TxK, probs_TxE, jax.nn.logsumexp(logits_TxE, axis=-1))

    def forced_loss(router):
        routing = moe.route(x_TxD, router, K, True, force_balance=True)
        return loss(routing.weights_TxK, routing.probs_TxE, routing.logsumexp_T)

    routed_by_TxE = jnp.log(forced.probs_TxE) + forced.logsumexp_T[:, None]
    expected = x_TxD.T @ jax.grad(reference)(routed_by_TxE)
    np.testing.assert_allclose(jax.grad(forced_loss)(router_DxE), expected, rtol=1e-4,
                               atol=1e-4 * float(jnp.abs(expected).max()))

    cfg = compose_config(*family_tiny("qwen3_moe", "model.moe_force_load_balance=true",
                                      "model.moe_matmul=blocks"))
    layer = Experts(cfg.model, nnx.Rngs(0), "silu")
    x_BxLxD = jax.random.normal(jax.random.key(5), (2, 16, cfg.model.embed_dim))
    y_before = layer(x_BxLxD)[0]
    layer.router[...] = -layer.router[...]
    np.testing.assert_array_equal(layer(x_BxLxD)[0], y_before)


def test_a_step_logs_the_fraction_its_capacity_dropped():
    """The train step's metrics: the dropped fraction with a capacity factor of 0.5 (at least
    half the assignments past their expert's capacity), none when dropless."""
    dropped = {}
    for factor in ("0.5", "null"):
        cfg = compose_config(*family_tiny("qwen3_moe", mesh_arg(1, 1),
                                          f"model.moe_capacity_factor={factor}"))
        setup = Setup.create(cfg, jax.devices()[:1])
        data = setup.open_data()
        _, metrics = setup.train_step()(setup.fresh_state(), next(data.train))
        data.close()
        dropped[factor] = float(metrics["moe_dropped_fraction"])
    assert dropped["null"] == 0 and 0.5 <= dropped["0.5"] < 1, dropped


def test_the_grouped_matmul_kernel_equals_ragged_dot_in_values_and_gradients():
    """models/grouped_matmul.py's Pallas kernels (in Pallas's interpreter on this CPU) against
    `jax.lax.ragged_dot` on the same rows: 5 experts of 16-row tiles, one expert with no rows,
    one with a partial tile, unused tiles at the end (their rows zero); the output, and the
    gradients of the rows and of every expert's weight."""
    from tunix_train.models import grouped_matmul

    tile, D, F, E = 16, 48, 64, 5
    sizes_E = np.array([20, 0, 16, 35, 3])
    tiles_E = -(-sizes_E // tile)
    n_tiles = int(tiles_E.sum()) + 2  # two unused
    first_tile_E = np.cumsum(tiles_E) - tiles_E
    rng = np.random.default_rng(5)
    x_PxD = np.zeros((n_tiles * tile, D), np.float32)
    rows = np.concatenate([first_tile_E[e] * tile + np.arange(sizes_E[e]) for e in range(E)])
    x_PxD[rows] = rng.normal(size=(len(rows), D))
    w = jnp.asarray(rng.normal(size=(E, D, F)).astype(np.float32))
    expert_N = np.minimum(np.searchsorted(np.cumsum(tiles_E), np.arange(n_tiles), "right"),
                          E - 1)
    probe = jnp.asarray(rng.normal(size=(len(rows), F)).astype(np.float32))
    args = [jnp.asarray(a, jnp.int32) for a in (expert_N, first_tile_E, tiles_E)]

    def kernel(x, w):
        return grouped_matmul.grouped_matmul(x, w, *args, tile)[rows]

    def reference(x, w):  # the used rows, packed, through ragged_dot
        return jax.lax.ragged_dot(x[rows], w, jnp.asarray(sizes_E, jnp.int32))

    loss = lambda f: lambda x, w: jnp.sum(f(x, w) * probe)  # noqa: E731
    x = jnp.asarray(x_PxD)
    # Each one program, as in a train step, not op by op.
    np.testing.assert_allclose(jax.jit(kernel)(x, w), jax.jit(reference)(x, w), rtol=1e-5,
                               atol=1e-5)
    ours, theirs = (jax.jit(jax.grad(loss(f), argnums=(0, 1)))(x, w) for f in (kernel, reference))
    for a, b in zip(ours, theirs):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
    assert float(jnp.abs(ours[1][1]).max()) == 0 and float(jnp.abs(ours[1][3]).min()) > 0


def test_auto_takes_our_kernels_on_a_gpu_without_tp_and_blocks_elsewhere(monkeypatch):
    """model.moe_matmul=auto (the default): blocks on this CPU, as the layout the step is built
    from records and the start-up experts line says; on a GPU (faked), our Pallas kernels on
    fsdp 4, blocks on tp 2 (XLA would gather the kernels' experts whole) and where a width is no
    multiple of 16 (Triton's least dot); a named matmul is kept."""
    from dataclasses import replace

    from tunix_train import backend
    from tunix_train.models import families
    from tunix_train.parallel import mesh as mesh_lib
    from tunix_train.parallel.layout import ParamLayout

    cfg = compose_config(*family_tiny("qwen3_moe", mesh_arg(4, 1)))
    assert cfg.model.moe_matmul == "auto"
    mesh = mesh_lib.create_mesh(mesh_lib.parse(cfg.model.mesh_shape, 4), jax.devices()[:4])
    layout = ParamLayout.create(cfg.model, mesh, 3)
    assert families.experts_line(layout.model, 1).endswith("; grouped matmul blocks")
    monkeypatch.setattr(backend, "is_gpu", lambda: True)
    assert ParamLayout.create(cfg.model, mesh, 3).model.moe_matmul == "pallas"
    assert moe.chosen_matmul(cfg.model, tp=2) == "blocks"
    assert moe.chosen_matmul(replace(cfg.model, expert_hidden_dim=40), tp=1) == "blocks"
    assert moe.chosen_matmul(replace(cfg.model, moe_matmul="ragged_dot"), tp=1) == "ragged_dot"


def test_for_a_gpu_the_kernels_lower_to_triton_reading_each_weight_as_it_lies():
    """Qwen3-30B-A3B's experts (d 2,048, width 768: not a power of two, so the contraction is
    walked in chunks) through an up and a down projection, lowered for CUDA (no GPU needed):
    each matmul forward, its rows' gradient and its weight's gradient are one Triton kernel
    each, and every kernel reads the weights [E, D, F] and [E, F, D] as stored (no transposed
    copy for the rows' gradient)."""
    from test_flash import triton_calls
    from tunix_train import backend

    T, k, experts, d, width = 512, 8, 16, 2048, 768

    def loss(x, up, down, expert_of_A):
        rows = moe.tiled(expert_of_A, k, experts, kernel=True)
        h = rows.matmul(rows.from_tokens(x), up)
        return rows.matmul(h, down).astype(jnp.float32).sum()

    shapes = (jax.ShapeDtypeStruct((T, d), jnp.bfloat16),
              jax.ShapeDtypeStruct((experts, d, width), jnp.bfloat16),
              jax.ShapeDtypeStruct((experts, width, d), jnp.bfloat16),
              jax.ShapeDtypeStruct((T * k,), jnp.int32))
    with pytest.MonkeyPatch.context() as patch:  # the kernels for a GPU, not interpreted
        patch.setattr(backend, "is_gpu", lambda: True)
        calls = triton_calls(jax.grad(loss, argnums=(0, 1, 2)), *shapes)
    names = [name for name, _ in calls]
    assert sorted(names) == ["grouped_matmul"] * 4 + ["grouped_matmul_weight_gradient"] * 2
    weights = {f"{experts}x{d}x{width}xbf16", f"{experts}x{width}x{d}xbf16"}
    read = [re.findall(r"tensor<(\d+x\d+x\d+xbf16)>", operands) for name, operands in calls
            if name == "grouped_matmul"]
    assert all(len(w) == 1 and w[0] in weights for w in read) and {w[0] for w in read} == weights
