"""AdamW with linear warm-up, cosine decay, decoupled weight decay and global-norm clipping,
skipping any update whose gradients are not finite."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from tunix_train.config import OptimizerConfig


def schedule(cfg: OptimizerConfig, total_steps: int) -> optax.Schedule:
    warmup = min(cfg.warmup_steps, max(total_steps - 1, 0))
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=cfg.lr, warmup_steps=warmup,
        decay_steps=max(total_steps, warmup + 1), end_value=cfg.lr * cfg.min_lr_ratio,
    )


def _decay_mask(params):
    # Norm scales multiply (1 + scale): decaying them would pull every norm toward identity
    # for no regularisation benefit.
    return jax.tree_util.tree_map_with_path(
        lambda path, _: getattr(path[-1], "key", None) != "scale", params
    )


def adamw(cfg: OptimizerConfig, total_steps: int, clipped_outside: bool = False
          ) -> optax.GradientTransformation:
    """`clipped_outside`: the caller clips the gradients by their global norm (`clip`) and the
    optimizer holds an identity in the clip's place, so that it can update the parameters a
    layer at a time (training/offload.py); its state is the same either way."""
    adamw = optax.adamw(
        schedule(cfg, total_steps), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
        weight_decay=cfg.weight_decay, mask=_decay_mask,
    )
    clip = optax.identity() if clipped_outside else optax.clip_by_global_norm(cfg.grad_clip)
    inner = optax.chain(clip, adamw) if cfg.grad_clip > 0 else adamw
    # A non-finite gradient leaves parameters and moments untouched, on device, with no host
    # round trip; the loop then halts or carries on (training.nan_policy). Never give up
    # skipping: a run that keeps producing NaNs is halted by the policy, not by optax.
    return optax.apply_if_finite(inner, max_consecutive_errors=int(jnp.iinfo(jnp.int32).max))


def clip(update: jax.Array, norm: jax.Array, max_norm: float) -> jax.Array:
    """One leaf (or slice of one) of the gradients clipped as optax.clip_by_global_norm clips
    it, given the global norm of all of them."""
    if max_norm <= 0:
        return update
    return jax.lax.select(norm < max_norm, update, (update / norm.astype(update.dtype)) * max_norm)


def skipped_updates(opt_state: optax.ApplyIfFiniteState) -> jax.Array:
    """Updates skipped so far because their gradients were not finite (int32, on device)."""
    return opt_state.total_notfinite
