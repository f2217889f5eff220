"""Context parallelism (`cp`): each sequence split over devices, attention across the chunks
(models/context.py), against dense attention and against the same run without cp."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, PartitionSpec as P

from helpers import TINY, compose_config, family_tiny, train_losses
from tunix_train.models import context
from tunix_train.training.setup import Setup


@pytest.mark.parametrize("exchange", [context.gathered_attention, context.ring_attention],
                         ids=["all_gather", "ring"])
@pytest.mark.parametrize("window,block,cp", [(None, None, 4), (5, None, 4), (20, 4, 4),
                                             (None, 4, 4), (20, 4, 2)])
def test_chunked_attention_equals_dense_attention_and_its_gradients(exchange, window, block, cp,
                                                                     monkeypatch):
    """fp32, 4 devices of two 8-token pieces each (balanced; or 2 of two 16-token pieces),
    packed documents, 4 query heads over 2 KV heads; a window shorter than a piece (5) reaches
    one piece back at most, a longer one (20) three; queries and keys in tiles of a whole piece
    (8 tokens) and of 4. Keys and values all-gathered, or passed around a ring."""
    monkeypatch.setattr(context, "BLOCK", block)
    chunked, outputs_and_grads = _attention_case(exchange, window, cp)

    def dense(q, k, v, segments):
        mask = segments[:, None, :, None] == segments[:, None, None, :]
        return jax.nn.dot_product_attention(
            q, k, v, mask=mask, is_causal=True, scale=0.3,
            local_window_size=(window - 1, 0) if window else None, implementation="xla")

    got, want = jax.jit(lambda: outputs_and_grads(chunked))(), outputs_and_grads(dense)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, w, atol=1e-5, rtol=1e-5)


def _attention_case(exchange, window, cp):
    """(`exchange` on cp devices as a function of the whole sequence's q, k, v and segments;
    fn → fn's outputs and input gradients on one random batch of them)."""
    B, L, N, K, H = 2, 64, 4, 2, 8
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(B, L, N, H)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(B, L, K, H)), jnp.float32) for _ in range(2))
    segments = jnp.asarray(np.sort(rng.integers(0, 4, size=(B, L)), axis=1))
    mesh = jax.make_mesh((cp,), ("cp",), axis_types=(AxisType.Auto,), devices=jax.devices()[:cp])
    split = P(None, "cp")
    on_devices = jax.shard_map(
        functools.partial(exchange, axis="cp", scale=0.3, window=window), mesh=mesh,
        in_specs=(split,) * 4, out_specs=split, check_vma=False)
    order = context.balanced_order(L, cp)

    def chunked(*arrays):  # into the devices' order and back (the train step's batch is)
        out = on_devices(*(jnp.take(a, order, axis=1) for a in arrays))
        return jnp.take(out, np.argsort(order), axis=1)

    cotangent = jnp.asarray(rng.normal(size=(B, L, N, H)), jnp.float32)

    def outputs_and_grads(fn):
        out, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, segments), q, k, v)
        return out, vjp(cotangent)

    return chunked, outputs_and_grads


def test_the_ring_leaves_no_input_of_a_manual_computation_unused():
    """A local window shorter than a piece sees no tile of the far chunks (cp 4: step 2), and
    those steps pass no tile table: an empty one was an input the backward pass's manual
    computation never read, on which jax 0.11.2's Shardy crashed the process compiling
    (ManualComputationUnusedInputsPattern, a segfault; the GPU image's jax). jax 0.10 lowers
    the same program, so it is checked here from the lowering."""
    chunked, outputs_and_grads = _attention_case(context.ring_attention, 5, 4)
    module = jax.jit(lambda: outputs_and_grads(chunked)).lower().compiler_ir("stablehlo")
    manual = []

    def walk(operation):
        for region in operation.regions:
            for block in region.blocks:
                for inner in block.operations:
                    if inner.operation.name == "sdy.manual_computation":
                        arguments = inner.regions[0].blocks[0].arguments
                        manual.append([str(a.type) for a in arguments if not list(a.uses)])
                    walk(inner.operation)

    walk(module.operation)
    assert len(manual) == 2 and manual == [[], []], manual  # forward and backward, all read


COMMON = [*TINY, "model.num_layers=9", "model.global_every=2", "data.seq_len=512",
          "training.global_batch_size=4",
          "model.attention_impl=blockwise"]


@pytest.fixture(scope="module")
def without_cp():
    """fsdp 2 × tp 2 on 4 devices, no cp: the reference losses (3 steps, packed documents,
    local layers of window 16 and global ones, 512 tokens)."""
    cfg = compose_config(*COMMON, 'model.mesh_shape=[[2,1,2],["fsdp","cp","tp"]]')
    losses, _ = train_losses(cfg, 3, jax.devices()[:4])
    assert losses[-1] < losses[0]
    return losses


@pytest.mark.parametrize("mesh,extra", [
    ('[[2,2,2],["fsdp","cp","tp"]]', []),
    # Keys and values passed around a ring instead of all-gathered (model.cp_exchange).
    ('[[1,4,2],["fsdp","cp","tp"]]', ["model.cp_exchange=ring"]),
    ('[[2,1,2,2],["pp","fsdp","cp","tp"]]', ["model.cp_exchange=ring"]),
    # DDP's all-reduce over fsdp × cp; ZeRO-2's reduce-scatter after two local micro-batches.
    ('[[2,4,1],["fsdp","cp","tp"]]', ["training.zero_stage=0"]),
    ('[[2,2,2],["fsdp","cp","tp"]]', ["training.zero_stage=2",
                                       "training.gradient_accumulation_steps=2",
                                       "training.sync_gradients_every=2"]),
], ids=["fsdp2_cp2_tp2", "cp4_tp2_ring", "pp2_cp2_tp2_ring", "zero0_fsdp2_cp4",
        "zero2_accum2_cp2"])
def test_cp_trains_with_the_losses_of_the_same_run_without_it(mesh, extra, without_cp):
    losses, _ = train_losses(compose_config(*COMMON, f"model.mesh_shape={mesh}", *extra), 3)
    np.testing.assert_allclose(losses, without_cp, rtol=1e-5)


@pytest.mark.parametrize("family,extra", [("llama3", []),
                                          ("qwen3", ["training.offload_optimizer=true"])])
def test_every_family_trains_and_evaluates_under_cp_as_under_fsdp(family, extra):
    """The other families (no windows; Qwen's QK norms) on cp 2 against fsdp 2: the losses of 2
    steps of 256-token rows, then the validation loss of the trained state (the eval step,
    with cp an axis XLA partitions; Qwen's optimizer state offloaded on the cp run)."""
    def losses(mesh: str, *more: str):
        cfg = compose_config(*family_tiny(family, "data.seq_len=256", "model.num_layers=2",
                                          "training.global_batch_size=2", "data.eval_batches=1",
                                          f"model.mesh_shape={mesh}", *more))
        setup = Setup.create(cfg, jax.devices()[:2])
        data = setup.open_data()
        state, step = setup.fresh_state(), setup.train_step()
        train = []
        for _ in range(2):
            state, metrics = step(state, next(data.train))
            train.append(float(metrics["loss"]))
        validation = setup.evaluator(data.eval_batches)(state)
        data.close()
        return [*train, validation]

    np.testing.assert_allclose(losses('[[1,2,1],["fsdp","cp","tp"]]', *extra),
                               losses('[[2,1,1],["fsdp","cp","tp"]]'), rtol=1e-5)


def test_cp_splits_the_sequence_and_its_activations_and_passes_keys_and_values_on():
    """Not a silently replicated sequence: the batch arrives in chunks, the compiled step
    passes keys and values around a ring over cp (collective-permutes), and its temporaries
    (activations) shrink with cp.
    In bf16: XLA's CPU compiler once aborted on these steps' 16-bit reductions (tp of one
    device; partitioning.per_device's workaround)."""
    def compiled(cp: int):
        cfg = compose_config(*TINY, "data.seq_len=1024", "training.global_batch_size=1",
                             "model.attention_impl=blockwise", "training.mixed_precision=bf16",
                             "model.cp_exchange=ring",
                             f'model.mesh_shape=[[1,{cp},1],["fsdp","cp","tp"]]')
        setup = Setup.create(cfg, jax.devices()[:cp])
        return setup, setup.compile_train_step()

    setup, four = compiled(4)
    assert setup.batch_sharding.shard_shape((1, 1, 1024)) == (1, 1, 256)
    assert "collective-permute" in four.as_text()
    _, one = compiled(1)
    temporaries = [c.memory_analysis().temp_size_in_bytes for c in (one, four)]
    assert temporaries[1] < 0.5 * temporaries[0], temporaries
    # ZeRO over fsdp × cp: cp devices are data-parallel ranks for the weights, each holding a
    # quarter of the parameters and optimizer state.
    state_bytes = [c.memory_analysis().argument_size_in_bytes for c in (one, four)]
    assert state_bytes[1] < 0.3 * state_bytes[0], state_bytes
    assert any(("fsdp", "cp") in s.spec for s in jax.tree.leaves(setup.params.shardings))


def test_cp_devices_compute_their_own_tokens_share_of_every_weight_gradient():
    """cp 4 does the FLOPs of fsdp 4 on the same rows (a model whose attention is a small part
    of them): each weight gradient is a partial sum of the device's own tokens, reduced over
    cp, not a product of activations all-gathered over cp computed whole on every device
    (2.6x the FLOPs before cp was manual in the step's shard_map)."""
    def flops(mesh: str) -> float:
        cfg = compose_config(*TINY, "model.embed_dim=256", "model.hidden_dim=1024",
                             "data.seq_len=128", "training.global_batch_size=4",
                             f"model.mesh_shape={mesh}")
        return Setup.create(cfg, jax.devices()[:4]).compile_train_step().cost_analysis()["flops"]

    fsdp, cp = flops('[[4,1,1],["fsdp","cp","tp"]]'), flops('[[1,4,1],["fsdp","cp","tp"]]')
    assert cp < 1.2 * fsdp, (cp, fsdp)


def test_every_cp_device_gets_the_same_causal_work():
    """Device c holds pieces c and 2·cp − 1 − c of 2·cp: the attention tiles it visits (an
    early piece's few, a late one's many) add up to the same count on every device, so no
    device's tile list is padded, where contiguous chunks would give device c c + 1 chunks'
    worth."""
    cp = 4
    tables = np.asarray(context._tile_tables(cp, 1, 64, None))
    assert tables.shape == (cp, 2 * cp + 1, 4)
    assert (tables[..., 2] >= 0).all()  # no padding tile
    assert sorted(map(tuple, tables.reshape(-1, 4)[:, [3, 2]].tolist())) == sorted(
        (j, q) for q in range(2 * cp) for j in range(q + 1))  # each causal tile once


def test_the_ring_visits_each_causal_tile_once_and_a_window_only_the_neighbours():
    """The ring's tables (step s: device c's queries against device c − s's chunk) in the
    sequence's blocks: causal, every step after the first gives every device two tiles, none
    padding, and together they cover each causal tile once; a window shorter than a piece only
    reaches the chunks of the devices either side (steps 1 and cp − 1): the steps between have
    no tiles at all."""
    cp = 4
    first, rest = context._ring_tables(cp, 1, 64, None)
    assert [t.shape for t in rest] == [(cp, 2, 4)] * (cp - 1)
    seen = []
    for s, table in enumerate((first, *rest)):
        table = np.asarray(table)
        assert (table[..., 2] >= 0).all()  # no padding tile
        for c in range(cp):
            held = context._piece_blocks((c - s) % cp, cp, 1)
            assert (held[table[c, :, 1]] == table[c, :, 3]).all()  # local key block → global
            seen += map(tuple, table[c][:, [3, 2]].tolist())
    assert sorted(seen) == sorted((j, q) for q in range(2 * cp) for j in range(q + 1))
    _, local = context._ring_tables(cp, 1, 64, window=32)
    assert [t.shape[1] for t in local] == [1, 0, 1]


def test_each_gradient_is_summed_over_the_data_axes_that_hold_copies_of_its_parameter():
    """Per parameter, not per mesh: cp devices compute on other tokens, so every weight (split
    over fsdp × cp by ZeRO-3, or whole) is summed over fsdp and cp; a data axis that splits a
    weight by itself (as an expert-parallel axis splits experts) holds no copies to sum."""
    cfg = compose_config(*family_tiny("qwen3_moe"), "model.mesh_shape=[[2,2,2],[fsdp,cp,tp]]")
    sync = Setup.create(cfg, jax.devices()).options.sync
    specs = jax.tree.leaves(sync.grad_specs, is_leaf=lambda x: isinstance(x, P))
    assert any("cp" in str(spec) for spec in specs)  # ZeRO's split over fsdp × cp is there
    assert {sync.reduction_group(spec) for spec in specs} == {("fsdp", "cp")}
    assert sync.reduction_group(P("cp", ("fsdp",), "tp")) == ("fsdp",)
    assert sync.reduction_group(P(None, ("fsdp", "cp"), "tp")) == ("fsdp", "cp")
