"""Canaries for the JAX, Flax, Orbax and Hydra internals the package relies on.

Each internal sits behind one small named function; each test here fails loudly, naming the
function, when a release moves what it reads. (Two more are pinned elsewhere on real inputs:
the HLO text forms by tests/test_comm_report.py on compiled programs, tensorstore's damage
codes by tests/test_checkpoint.py on truncated files.)
"""

import inspect
import json
import logging

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
import pytest
from flax import nnx

from helpers import ONE_STACK, compose_config
from tunix_train import checkpoint, overrides
from tunix_train.models import layers, params, partitioning
from tunix_train.parallel import mesh as mesh_lib
from tunix_train.parallel import sharding


def test_remat_policies_see_a_custom_vjp_by_its_function_name():
    """params.custom_vjp_name: FSDP's gathered layers are recomputed, never saved, only if a
    checkpoint policy can tell the materializing custom VJP from other equations."""
    def fetch(w):
        return w * 1.0

    gather = jax.custom_vjp(params.materializer(fetch))  # as parallel/collectives.py marks it
    gather.defvjp(lambda w: (gather(w), None), lambda _, g: (g,))  # its fwd calls it again
    seen = []

    def spy(prim, *avals, **kw):
        seen.append(params.custom_vjp_name(prim, kw))
        return True

    f = jax.checkpoint(lambda w, x: jnp.sin(gather(w) * x), policy=spy)
    jax.grad(lambda w, x: f(w, x).sum())(jnp.ones(3), jnp.ones(3))
    assert params.MATERIALIZED in seen, seen


def test_logical_rules_in_effect_are_readable_while_tracing():
    """partitioning.active_rules reads Flax's rules stack (flax.core.spmd)."""
    mesh = mesh_lib.create_mesh(mesh_lib.parse([[8, 1], ["fsdp", "tp"]], 8))
    rules = (("act_batch", "fsdp"), ("embed", None))
    assert partitioning.active_rules() == {}
    with sharding.activate(mesh, rules):
        assert partitioning.active_rules() == dict(rules)


def test_parameters_keep_their_logical_axes_as_nnx_metadata():
    """layers.logical_axes reads the NNX metadata key that holds a parameter's axis names."""
    param = layers.param(jnp.zeros((2, 3)), "embed", "mlp")
    assert layers.logical_axes(param) == ("embed", "mlp")
    abstract = nnx.eval_shape(lambda: layers.param(jnp.zeros(2), "embed"))
    assert layers.logical_axes(abstract) == ("embed",)


def test_orbax_asks_the_manager_before_saving_at_a_preemption_step():
    """checkpoint._Manager overrides CheckpointManager.reached_preemption so that the loop
    alone owns JAX's preemption sync point; the override only matters if Orbax calls it."""
    assert "reached_preemption" in inspect.getsource(ocp.CheckpointManager)
    assert checkpoint._Manager.reached_preemption is not ocp.CheckpointManager.reached_preemption
    assert not checkpoint._Manager.reached_preemption(None, 3)


def test_a_failed_write_is_kept_where_orbaxs_finalize_thread_meets_it(monkeypatch):
    """checkpoint._Manager overrides CheckpointManager._wait_for_checkpointers, where Orbax's
    finalize thread meets a failure of this process's writes before it waits at a barrier."""
    assert "self._wait_for_checkpointers()" in inspect.getsource(ocp.CheckpointManager._finalize)
    error = OSError(28, "No space left on device")

    def fails(self):
        raise error

    monkeypatch.setattr(ocp.CheckpointManager, "_wait_for_checkpointers", fails)
    manager = object.__new__(checkpoint._Manager)
    with pytest.raises(OSError):
        manager._wait_for_checkpointers()
    assert manager.write_error is error


def test_jax_arrays_are_saved_by_their_first_replica_with_orbaxs_metadata_store():
    """checkpoint.py replaces Orbax's jax.Array handler: replica-parallel saving off (as Orbax
    has it on GPUs), the array metadata store of Orbax's own default kept (a private module)."""
    handler = ocp.type_handlers.get_type_handler(jax.Array)
    assert isinstance(handler, ocp.type_handlers.ArrayHandler)
    assert handler._use_replica_parallel is False
    assert type(handler._array_metadata_store).__name__ == "Store"


def test_hydra_command_line_and_override_grammar():
    """overrides.hydra_arguments and overrides.parse use Hydra's own parsers."""
    args = overrides.hydra_arguments(["-m", "--cfg", "job", "a.b=1", "c=2,3"])
    assert (args.multirun, args.cfg, args.overrides) == (True, "job", ["a.b=1", "c=2,3"])
    first, sweep, added = overrides.parse(["a.b=1", "c=2,3", "+d.e=x"])
    assert (first.key_or_group, first.value(), first.is_sweep_override()) == ("a.b", 1, False)
    assert sweep.is_sweep_override() and list(sweep.sweep_string_iterator()) == ["2", "3"]
    assert added.is_add() and added.key_or_group == "d.e"


def test_a_failing_startup_analysis_is_a_warning_and_the_run_trains(tmp_path, monkeypatch,
                                                                    caplog):
    """An HLO form the reader does not know (here: every line of the text replaced) must not
    stop a run: the cost report is the run's commentary, not its work."""
    from tunix_train.analysis import hlo
    from tunix_train.training import run as run_lib

    real_parse = hlo.parse

    def unknown_forms(text):
        module = real_parse("\n".join("%x = mystery[1,2]{0} frob(%y), " + line
                                      for line in text.splitlines()))
        raise ValueError(f"unknown HLO form in {len(module.computations)} computations")

    monkeypatch.setattr(hlo, "parse", unknown_forms)
    cfg = compose_config(*ONE_STACK, "training.steps=2", "training.micro_batch_size=1",
                         "logging.every_steps=1")
    with caplog.at_level(logging.WARNING, logger="tunix_train"):
        summary = run_lib.run(cfg, tmp_path)
    assert summary["final_step"] == 2
    assert "start-up cost report failed (ValueError: unknown HLO form" in caplog.text
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2]



def test_the_suites_compilation_cache_holds_a_file_lock_for_every_read_and_write():
    """tests/conftest.py shares one persistent cache between the suite's processes. JAX's cache
    (jax._src.lru_cache.LRUCache) writes an entry in place; only with a size limit does every
    get and put hold its file lock, so no process reads an entry another is still writing."""
    import os

    from jax._src import compilation_cache, lru_cache

    jax.jit(lambda x: x * 3.0 + 1.0).lower(1.0).compile()  # the cache opens at the first compile
    cache = compilation_cache._get_cache(jax.devices()[0].client)
    assert isinstance(cache, lru_cache.LRUCache) and cache.eviction_enabled
    assert str(cache.path) == os.environ["JAX_COMPILATION_CACHE_DIR"]
    held = []
    real = cache.lock
    cache.lock = type("Spy", (), {"acquire": lambda _, **kw: held.append("acquire"),
                                  "release": lambda _: held.append("release")})()
    try:
        cache.put("tunix-train-canary", b"x")
        assert cache.get("tunix-train-canary") == b"x"
    finally:
        cache.lock = real
    assert held == ["acquire", "release"] * 2
