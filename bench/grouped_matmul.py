"""The experts' grouped matmul alone, each `model.moe_matmul` layout of one projection against
one dense matmul of the same useful FLOPs, in one run (`blocks`, whose overflow loop runs a
tile's whole MLP at once, is timed in the train step: bench/moe.py):

    python bench/grouped_matmul.py                       # Qwen3-30B-A3B's experts, 16,384 tokens
    python bench/grouped_matmul.py --tokens 512 --experts 8 --dim 256 --hidden 128   # a CPU

The rows are a layer's: T tokens routed uniformly at random to k of E experts, laid out by
models/moe.py as the model lays them (tiles for `tiles` and `pallas`, sorted rows for
`tokamax`, `tokamax_triton` (its Triton kernels by name) and `ragged_dot`), then
[rows, D] × [E, D, F]. The baseline is x [T·k, D] @ w [D, F]:
the same multiply-adds with no routing. Each is timed forward, and forward with the gradients of
x and w (what a train step runs), in alternating rounds; TFLOP/s count the useful FLOPs (2·T·k·D·F
forward, three times that with gradients), so padding rows count as waste. `ragged_dot` (XLA's)
multiplies every row by every expert on GPUs (marin#7012), E times the work: timed only with
--ragged. The last line is JSON.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from timing import alternating_medians  # noqa: E402
from tunix_train.models import moe  # noqa: E402

WARMUP, ROUNDS, STEPS = 2, 5, 5


def main(argv: list[str]) -> dict:
    args = _parse(argv)
    T, k, E, D, F = args.tokens, args.k, args.experts, args.dim, args.hidden
    rng = np.random.default_rng(0)
    experts_A = jnp.asarray(np.argsort(rng.random((T, E)), axis=1)[:, :k].reshape(-1), jnp.int32)
    dtype = jnp.dtype(args.dtype)
    x_TxD = jnp.asarray(rng.normal(size=(T, D)), dtype)
    w_ExDxF = jnp.asarray(rng.normal(size=(E, D, F)) / np.sqrt(D), dtype)
    w_DxF = w_ExDxF[0]
    layouts = ["tiles", "pallas"] + (["tokamax", "tokamax_triton"] if _has("tokamax") else []) \
        + (["ragged_dot"] if args.ragged else [])
    runs = {"dense": _dense(jnp.repeat(x_TxD, k, axis=0), w_DxF)}
    for name in layouts:
        try:  # a layout that fails to build or compile is reported and left out
            runs[name] = _routed(name, x_TxD, w_ExDxF, experts_A, k, E)
            for run in runs[name].values():
                jax.block_until_ready(run())
        except Exception as error:  # noqa: BLE001
            print(f"FAIL {name}: {type(error).__name__}: {str(error).splitlines()[0][:300]}")
            runs.pop(name, None)
    flops = 2 * T * k * D * F
    results = {}
    for mode in ("forward", "with_gradients"):
        median = alternating_medians({n: r[mode] for n, r in runs.items()}, WARMUP, ROUNDS, STEPS)
        useful = flops * (1 if mode == "forward" else 3)
        results[mode] = {n: {"ms": round(s * 1e3, 3), "tflops": round(useful / s / 1e12, 1),
                             "vs_dense": round(median["dense"] / s, 3)}
                         for n, s in median.items()}
        for n, r in results[mode].items():
            print(f"{mode:>14} {n:>10}: {r['ms']:9.3f} ms  {r['tflops']:7.1f} TFLOP/s  "
                  f"{r['vs_dense']:.2f}x dense")
    out = {"device_kind": jax.devices()[0].device_kind, "tokens": T, "k": k, "experts": E,
           "dim": D, "hidden": F, "dtype": args.dtype, **results}
    print(json.dumps(out))
    return out


def _dense(x_AxD, w_DxF) -> dict:
    return _passes(lambda x, w: x @ w, x_AxD, w_DxF)


def _passes(product, x, w) -> dict:
    """The forward pass, and the forward pass with the gradients of x and w for a random
    output gradient passed in (a constant one, as a sum's, lets XLA fold the dense matmul's
    backward into sums: 1,090 TFLOP/s on an H100, past its peak, 2026-11-27). The output is
    returned with the gradients, as a train step needs it: unreturned, XLA drops the forward
    matmul and times the backward's two alone (1,096 "TFLOP/s" on an H200, 2026-12-04)."""
    forward = jax.jit(product)
    dy = jax.random.normal(jax.random.key(1), jax.eval_shape(product, x, w).shape, x.dtype)

    def with_gradients(x, w, dy):
        y, pullback = jax.vjp(product, x, w)
        return y, pullback(dy)

    grads = jax.jit(with_gradients)
    return {"forward": lambda: forward(x, w), "with_gradients": lambda: grads(x, w, dy)}


def _routed(name: str, x_TxD, w_ExDxF, experts_A, k: int, E: int) -> dict:
    """The layout's rows of x (built once, outside the timing: the model's sort is its own
    cost) times the experts' weights."""
    layout = moe.MATMULS.get(name) or functools.partial(moe.ragged, dot=_tokamax_triton)
    rows = layout(experts_A, k, E)
    x_PxD = jax.jit(rows.from_tokens)(x_TxD)

    return _passes(rows.matmul, x_PxD, w_ExDxF)


def _tokamax_triton(lhs, rhs, sizes_E):
    """tokamax's Triton kernels by name (on Hopper it picks its Mosaic GPU ones, which fail on
    jax 0.11.2: docs/performance.md)."""
    import tokamax

    return tokamax.ragged_dot(lhs, rhs, sizes_E, implementation="triton")


def _has(module: str) -> bool:
    try:
        __import__(module)
    except ImportError:
        print(f"{module} is not installed: not timed")
        return False
    return True


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--ragged", action="store_true", help="also XLA's ragged_dot")
    return parser.parse_args(argv)


if __name__ == "__main__":
    main(sys.argv[1:])
