import jax
import numpy as np
import pytest

from helpers import TINY, compose_config, mesh_arg
from tunix_train.parallel import mesh as mesh_lib
from tunix_train.parallel import sharding
from tunix_train.training import state as state_lib
from tunix_train.config import ConfigError
from tunix_train.training.setup import Setup


def _sharded_over(leaf, axis: str) -> bool:
    return any(axis == a or (isinstance(a, tuple) and axis in a) for a in leaf.sharding.spec)


def test_fsdp_tp_mesh_shards_nearly_every_parameter_byte():
    cfg = compose_config(mesh_arg(4, 2), "training.micro_batch_size=2")  # gemma3_tiny itself
    setup = Setup.create(cfg)
    params = setup.fresh_state()["params"]
    leaves = jax.tree.leaves(params)
    total = sum(x.nbytes for x in leaves)
    replicated_over_fsdp = sum(x.nbytes for x in leaves if not _sharded_over(x, "fsdp"))
    assert replicated_over_fsdp / total <= 0.02
    _, per_device = state_lib.param_bytes(params)
    # The single KV head cannot split over tp, so a device holds slightly more than 1/8.
    assert total / 8 <= per_device <= 1.05 * total / 8


def test_zero_stage_below_3_replicates_parameters_but_not_optimizer_state():
    cfg = compose_config(*TINY, mesh_arg(8, 1), "training.micro_batch_size=1",
                         "training.zero_stage=1")
    setup = Setup.create(cfg)
    state = setup.fresh_state()
    assert not any(_sharded_over(x, "fsdp") for x in jax.tree.leaves(state["params"]))
    moments = [x for x in jax.tree.leaves(state["opt_state"]) if x.ndim >= 2]
    sharded = sum(x.nbytes for x in moments if _sharded_over(x, "fsdp"))
    assert sharded / sum(x.nbytes for x in moments) >= 0.98


def test_tp_must_divide_query_heads():
    cfg = compose_config(*TINY, "model.num_heads=6", "model.num_kv_heads=1")
    mesh = mesh_lib.create_mesh(mesh_lib.parse([[2, 4], ["fsdp", "tp"]], 8))
    with pytest.raises(ConfigError, match=r"model.num_heads=6 is not divisible by tp=4"):
        sharding.zero_rules(cfg.model, mesh, 3)


def test_single_kv_head_is_replicated_over_tp_not_an_error():
    cfg = compose_config(*TINY)
    mesh = mesh_lib.create_mesh(mesh_lib.parse([[2, 4], ["fsdp", "tp"]], 8))
    rules = sharding.resolve_rules(cfg.model, mesh)
    assert rules["kv_heads"] is None and rules["q_heads"] == "tp"


def test_rules_table_is_overridable_and_checked():
    mesh = mesh_lib.create_mesh(mesh_lib.parse([[8, 1], ["fsdp", "tp"]], 8))
    cfg = compose_config(*TINY, "model.sharding_rules.embed=null")
    assert sharding.resolve_rules(cfg.model, mesh)["embed"] is None
    cfg = compose_config(*TINY, "+model.sharding_rules.bogus=fsdp")
    with pytest.raises(ConfigError, match="unknown logical axes"):
        sharding.resolve_rules(cfg.model, mesh)
    cfg = compose_config(*TINY, "model.sharding_rules.mlp=data")
    with pytest.raises(ConfigError, match="not a mesh axis"):
        sharding.resolve_rules(cfg.model, mesh)


@pytest.mark.parametrize("mesh,overrides,experts,expert_embed", [
    ([[4, 2], ["fsdp", "tp"]], [], "fsdp", None),  # fsdp divides the 8 experts: it splits them
    ([[4, 2], ["fsdp", "tp"]], ["model.num_experts=6"], None, "fsdp"),  # it does not: their d
    ([[2, 4, 1], ["fsdp", "ep", "tp"]], [], "ep", "fsdp"),  # ep splits them, fsdp their d
    ([[4, 2], ["fsdp", "tp"]], ["+model.sharding_rules.experts=null"], None, "fsdp"),
    ([[4, 2], ["fsdp", "tp"]], ["model.sharding_rules.embed=null"], None, None),
])
def test_fsdp_splits_a_mixtures_experts_where_nothing_else_does(mesh, overrides, experts,
                                                                 expert_embed):
    """Under ZeRO 3 without ep, fsdp splits the experts themselves where it divides them (each
    layer's all-gather then lays out whole experts), else their embed dimension; a rule the
    user set for either is kept, and `expert_embed` follows `embed`."""
    cfg = compose_config("model=qwen3_moe_tiny", *overrides)
    rules = sharding.resolve_rules(cfg.model, mesh_lib.create_mesh(mesh_lib.parse(mesh, 8)))
    assert (rules["experts"], rules["expert_embed"]) == (experts, expert_embed)


def test_batch_is_split_over_fsdp_and_replicated_over_tp():
    cfg = compose_config(*TINY, mesh_arg(4, 2), "training.micro_batch_size=2")
    setup = Setup.create(cfg)
    batch = setup.batch_sharding
    x = jax.device_put(np.zeros((1, 8, 32), np.int32), batch)
    assert {s.data.shape for s in x.addressable_shards} == {(1, 2, 32)}
