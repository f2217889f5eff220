"""models/moe.py against transformers' sparse MoE blocks (Qwen3-MoE with and without
`norm_topk_prob`, Mixtral) on the same random weights, and its gradients against the dense
computation (every expert on every token, weighted by the routing)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tunix_train.models import moe
from tunix_train.models.layers import GATED

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
    y, routing = ours(jnp.asarray(x[0]))
    np.testing.assert_allclose(np.asarray(y), theirs[0], rtol=1e-5, atol=1e-6)
    assert len(np.unique(np.asarray(routing.experts_TxK))) > K  # tokens went to several experts
    aux = load_balancing_loss_func((logits,), E, K).item()
    np.testing.assert_allclose(float(moe.load_balancing_loss(routing.probs_TxE,
                                                             routing.experts_TxK)), aux, rtol=1e-6)


def test_gradients_equal_the_dense_computation_of_every_expert():
    """Gradients through the sort, the grouped matmuls and the scatter (as a train step takes
    them, routing weights included) equal those of computing every expert for every token and
    weighting by the routing (zero for the experts not picked)."""
    _, _, weights, normalize = hf_block("qwen3_moe_norm")
    x = jnp.asarray(np.random.default_rng(2).normal(size=(T, D)).astype(np.float32))

    def sparse(x, weights):
        router, gate, up, down = weights
        routing = moe.route(x, router, K, normalize)
        return moe.experts_mlp(x, routing, gate, up, down, GATED["silu"])

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
    reference = jax.grad(loss(dense), argnums=(0, 1))(x, weights)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(reference)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)
    assert float(jnp.abs(ours[1][1]).sum()) > 0  # the experts' weights got gradients
