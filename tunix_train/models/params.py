"""How model code reads its parameters: as they are, or through a hook that a trainer installs.

Model code reads parameters in two ways, both right before use:

    materialize(state)   a module's parameters (the scanned layers: one layer's slice, inside
                         the layer loop; the output head: one vocabulary chunk at a time)
    materialize_stack(s) a stack of layers at once (a pipeline stage, parallel/pipeline.py)
    stage_rows(s, ...)   a pipeline stage's rows of a stack stored whole over the stages
    take(table, ids)     rows of an embedding table (the token lookup)

and a mixture of experts split over devices (expert parallelism) sends its tokens' rows to the
devices of their experts and the results back through `exchange` (models/moe.py).

Outside `hooked(...)` both are what they say. A trainer installs a `ParamHook` to fetch
parameters just in time: FSDP all-gathers a layer's shards in `materialize`, and its custom VJP
reduces the layer's gradient where the backward pass produces it (parallel/collectives.py).

What a hook materializes is never saved for the backward pass (`never_saving_materialized`):
like FSDP, a layer is gathered again when the backward pass reaches it, instead of every
gathered layer staying alive from the forward pass to the backward.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Callable, Iterator, Protocol

import jax
import jax.numpy as jnp

from tunix_train.models import quantization

MATERIALIZED = "materialized_parameter"


class ParamHook(Protocol):
    def materialize(self, state: Any) -> Any: ...

    def materialize_stack(self, state: Any) -> Any: ...

    def stage_rows(self, state: Any, stages: int, rows: int) -> tuple[Any, Any]: ...

    def take(self, table: Any, ids: jax.Array) -> jax.Array: ...

    def exchange(self, rows: jax.Array) -> jax.Array: ...


_hook: contextvars.ContextVar[ParamHook | None] = contextvars.ContextVar(
    "tunix_train_param_hook", default=None)


def materialize(state: Any) -> Any:
    """A module's parameters ready for compute: fetched by the hook if one is installed, and
    dequantized where a QLoRA base stores them quantized (models/quantization.py)."""
    hook = _hook.get()
    return quantization.dequantized(state if hook is None else hook.materialize(state))


def materialize_stack(state: Any) -> Any:
    """A whole stack of layers' parameters ready for compute at once (a pipeline stage's,
    used by many pipeline iterations); `materialize` then passes them through."""
    hook = _hook.get()
    return state if hook is None else hook.materialize_stack(state)


def stage_rows(state: Any, stages: int, rows: int) -> tuple[Any, Any]:
    """A pipeline stage's `rows` rows of a layer stack that is not split over the stages by
    rows, materialized at once, and the rows after all `stages` stages' rows, to `materialize`
    one by one. Only a hook knows which stage this is (parallel/collectives.py)."""
    hook = _hook.get()
    if hook is None:
        raise RuntimeError("pipeline stages exist only inside the train step's shard_map")
    return hook.stage_rows(state, stages, rows)


def take(table: Any, ids: jax.Array) -> jax.Array:
    """`table[ids]`: rows of an embedding table ([V, D] → ids.shape + [D])."""
    hook = _hook.get()
    return jnp.take(table, ids, axis=0) if hook is None else hook.take(table, ids)


def exchange(rows_SxCx: jax.Array) -> jax.Array:
    """Rows [S, C, ...] for S devices holding a routed layer's experts in S shards: row block s
    goes to shard s's device, and block s of the result came from device s (an all-to-all).
    Only a hook that splits the experts knows those devices (parallel/collectives.py)."""
    hook = _hook.get()
    if hook is None:
        raise RuntimeError("experts split over devices exist only inside the train step")
    return hook.exchange(rows_SxCx)


@contextlib.contextmanager
def hooked(hook: ParamHook) -> Iterator[None]:
    """`hook` serves `materialize` and `take` while tracing inside this block."""
    token = _hook.set(hook)
    try:
        yield
    finally:
        _hook.reset(token)


def materializer(fn: Callable) -> Callable:
    """Marks the function a hook applies to each parameter, before `jax.custom_vjp` wraps it.

    JAX's recomputation policies see a custom VJP as one equation and know it only by its
    function's name, so the mark is the name.
    """
    fn.__name__ = fn.__qualname__ = MATERIALIZED
    return fn


def never_saving_materialized(policy: Callable) -> Callable:
    """A `jax.checkpoint` policy that saves what `policy` saves, except materialized parameters:
    the backward pass materializes them again (for FSDP: gathers them again)."""

    def saveable(prim, *avals, **params) -> bool:
        if custom_vjp_name(prim, params) == MATERIALIZED:
            return False
        return policy(prim, *avals, **params)

    return saveable


def custom_vjp_name(prim: Any, params: dict) -> str | None:
    """The function name of a `jax.custom_vjp` equation as a recomputation policy sees it (the
    primitive's name and parameters are JAX internals: tests/test_internals.py pins them)."""
    call = params.get("call_jaxpr")
    if str(prim) != "custom_vjp_call" or call is None:
        return None
    return getattr(call.jaxpr.debug_info, "func_name", None)
