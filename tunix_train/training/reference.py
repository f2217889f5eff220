"""The frozen reference model of post-training (GRPO's KL penalty, DPO's implicit reward).

The reference is the run's starting weights: re-derived from the run's own source
(checkpoint.init_params_from, model.init_from or the random initialisation of training.seed),
never saved, sharded like the policy. With LoRA it is the frozen base with the adapters off:
no second copy of the model.
"""

from __future__ import annotations

import logging
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from tunix_train.starting_weights import initial_params, run_params
from tunix_train.config import Config
from tunix_train.models import quantization
from tunix_train.parallel import distributed
from tunix_train.parallel import sharding as sharding_lib
from tunix_train.trainers import NO_REFERENCE, TRAINERS
from tunix_train.training import train_step

Setup = Any  # training/setup.py's Setup, which imports this module (for `memory`)

log = logging.getLogger("tunix_train")

ADAPTERS_OFF = "adapters off"  # LoRA's reference: the frozen base (`params_of`)


def none_held(cfg: Config) -> str | None:
    """Why this run holds no reference model beside the policy; None when it holds one."""
    reason = TRAINERS[cfg.trainer.name].no_reference(cfg)
    if reason is None and cfg.lora.on:
        return "reference model: none held (LoRA: the frozen base with the adapters off)"
    return reason


def memory(setup: Setup) -> tuple[int, str]:
    """(bytes per device, a line saying what they are) of the reference model that lives beside
    the train step: the starting weights in the compute dtype, sharded like the policy."""
    from tunix_train.analysis import costs

    reason = none_held(setup.cfg)
    if reason is not None:
        return 0, "" if reason == NO_REFERENCE else reason
    layout = setup.params
    held = costs.sharded_bytes(layout.abstract, layout.shardings, layout.compute_dtype)
    return held, (f"reference model ({setup.cfg.trainer.name}): {held / 1e6:,.1f} MB per device, "
                  f"the starting weights in {jnp.dtype(layout.compute_dtype).name} sharded like "
                  f"the policy; in the total")


def starting_weights(setup: Setup, purpose: str) -> Any:
    """The reference: the run's starting parameters in the compute dtype, sharded like the
    policy's, or ADAPTERS_OFF with LoRA. `purpose` names it in the start-up line."""
    cfg = setup.cfg
    if cfg.lora.on:
        log.info("reference model for %s: the LoRA base, adapters off", purpose)
        return ADAPTERS_OFF
    if cfg.checkpoint.init_params_from:
        params = run_params(setup.params, cfg.checkpoint.init_params_from)
        source = cfg.checkpoint.init_params_from
    else:
        params = initial_params(setup.params, cfg.training.seed)
        source = cfg.model.init_from or f"the random initialisation of seed {cfg.training.seed}"
    log.info("reference model for %s: %s", purpose, source)
    dtype = setup.params.compute_dtype
    return jax.jit(lambda p: quantization.cast(p, dtype), out_shardings=setup.params.shardings,
                   donate_argnums=0)(params)


def params_of(reference: Any, setup: Setup, state) -> Any:
    """The reference's whole parameter tree. With LoRA: the base itself, the adapters switched
    off (zeros in their place)."""
    if reference is not ADAPTERS_OFF:
        return reference
    off = jax.tree.map(jnp.zeros_like, state["params"])
    return setup.state.model_params({**state, "params": off})


def scorer(setup: Setup, temperature: float = 1.0):
    """(model params, batch) → log π of every target [accum, rows, seq_len], one micro-batch
    at a time; no gradient."""
    layout, options = setup.params, setup.options
    dtype = layout.compute_dtype

    def score(params, batch):
        # With cp, attention wants each sequence in its devices' order (train_step.in_cp_order);
        # the log-probs go back to the batch's own order.
        batch = train_step.in_cp_order(batch, options.mesh)
        with sharding_lib.activate(options.mesh, options.rules):
            model = nnx.merge(layout.graphdef, quantization.cast(params, dtype))

            def one(micro):
                return -model.token_losses(micro["inputs"], micro["targets"], micro["positions"],
                                           micro["segment_ids"], options.vocab_chunks,
                                           temperature)

            keys = ("inputs", "targets", "positions", "segment_ids")
            return train_step.out_of_cp_order(jax.lax.map(one, {k: batch[k] for k in keys}),
                                              options.mesh)

    batch_sharding = setup.batch_sharding
    return distributed.first_run_together(
        jax.jit(score, in_shardings=(layout.merged_shardings(), batch_sharding),
                out_shardings=batch_sharding),
        "the reference model's scoring", setup.cfg.distributed.init_timeout_s)
