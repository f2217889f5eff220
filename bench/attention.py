"""Attention paths against each other, forward + backward of one layer's attention, per
sequence length, in one process: XLA's dense attention (the baseline), our blockwise attention
(`tunix_train/models/blockwise.py`) and, on a GPU, our Pallas flash attention kernels
(`tunix_train/models/flash.py`) and, in bf16, cuDNN's fused flash attention.

    python bench/attention.py                                   # CPU: fp32
    python bench/attention.py --dtype bfloat16 --lengths 2048 8192 32768   # on a GPU
    python bench/attention.py --head-dim 64 --lengths 256 512              # small heads
    python bench/attention.py --dtype bfloat16 --pallas-block 32 64    # kernel tile sizes

Gemma 3 1B's attention shape (4 query heads, 1 KV head, head dim 256 unless --head-dim), packed documents (a
segment mask: dense and cuDNN get it as a mask / bias, blockwise and the kernels as segment ids), 8,192 tokens
per call (batch = 8,192 / length, at least 1), a global layer (full causal) and a local one
(window 512). Calls are timed in alternating rounds; each line gives the milliseconds of every
path and its ratio to dense; the last line is JSON. A path that cannot run at a length (out of
memory, cuDNN's refusal) is reported as such.
"""

from __future__ import annotations

import argparse
import json
import statistics

import jax
import jax.numpy as jnp
import numpy as np

from timing import timed
from tunix_train.models import blockwise, flash
from tunix_train.models.attention import _mask_as_bias

HEADS, KV_HEADS, WINDOW, TOKENS = 4, 1, 512, 8192


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", nargs="+", type=int, default=[256, 1024, 4096])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--head-dim", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--pallas-block", nargs="+", type=int, default=[flash.BLOCK],
                        help="tile sizes of the Pallas kernels to time (GPU only)")
    return parser.parse_args()


def paths(window, dtype, pallas_blocks) -> dict:
    """Each path as fn(q, k, v, segments): the masks are built inside the compiled step, so a
    long row's [L, L] mask or bias is no constant captured at lowering (8.6 GB at 32,768)."""
    local = (window - 1, 0) if window else None

    def mask_of(segments):
        return segments[:, None, :, None] == segments[:, None, None, :]

    def dense(q, k, v, segments):
        return jax.nn.dot_product_attention(q, k, v, mask=mask_of(segments), is_causal=True,
                                            scale=0.0625, local_window_size=local,
                                            implementation="xla")

    def ours(q, k, v, segments):
        return blockwise.attention(q, k, v, segments, scale=0.0625, window=window)

    found = {"dense": dense, "blockwise": ours}
    if jax.default_backend() == "gpu":  # elsewhere the kernels are interpreted: no speed to see
        for block in pallas_blocks:
            found[f"pallas_{block}"] = lambda q, k, v, segments, block=block: flash.attention(
                q, k, v, segments, scale=0.0625, window=window, block=block)
    if jax.default_backend() == "gpu" and dtype != jnp.float32:
        found["cudnn"] = lambda q, k, v, segments: jax.nn.dot_product_attention(
            q, k, v, bias=_mask_as_bias(mask_of(segments), HEADS, dtype), is_causal=True,
            scale=0.0625, local_window_size=local, implementation="cudnn")
    return found


def compiled(fn, q, k, v, segments):
    """fwd + bwd of a scalar of the output, compiled; None with why if it cannot be."""
    loss = lambda q, k, v, segments: jnp.sum(fn(q, k, v, segments).astype(jnp.float32) ** 2)
    step = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    try:
        jax.block_until_ready(step(q, k, v, segments))
    except Exception as error:  # noqa: BLE001 — a benchmark reports what stopped a path
        return None, str(error).splitlines()[0][:120]
    return (lambda: step(q, k, v, segments)), None


def main() -> None:
    args = parse()
    dtype = jnp.dtype(args.dtype)
    rng = np.random.default_rng(0)
    results = []
    for length in args.lengths:
        batch = max(TOKENS // length, 1)
        q = jnp.asarray(rng.normal(size=(batch, length, HEADS, args.head_dim)), dtype)
        k, v = (jnp.asarray(rng.normal(size=(batch, length, KV_HEADS, args.head_dim)), dtype)
                for _ in range(2))
        # Documents of ~length/3 tokens on average, ids increasing along each row.
        segments = jnp.asarray(np.sort(rng.integers(0, 3, size=(batch, length)), axis=1))
        for layer, window in (("global", None), ("local", WINDOW)):
            runs, failed = {}, {}
            for name, fn in paths(window, dtype, args.pallas_block).items():
                runs[name], why = compiled(fn, q, k, v, segments)
                if why:
                    failed[name] = why
                    del runs[name]
            times = {name: [] for name in runs}
            for _ in range(args.rounds):
                for name, run in runs.items():
                    times[name].append(timed(run, 2))
            ms = {name: round(statistics.median(t) * 1e3, 1) for name, t in times.items()}
            ratio = {name: round(t / ms["dense"], 3) for name, t in ms.items()
                     if "dense" in ms and name != "dense"}
            print(f"{length:6d} tokens × {batch:2d}, {layer:6s}: ms {ms}  / dense {ratio}"
                  + (f"  failed {failed}" if failed else ""), flush=True)
            results.append({"length": length, "batch": batch, "layer": layer, "ms": ms,
                            "over_dense": ratio, "failed": failed})
    print(json.dumps({"device_kind": jax.devices()[0].device_kind, "dtype": dtype.name,
                      "head_dim": args.head_dim,
                      "results": results}))


if __name__ == "__main__":
    main()
