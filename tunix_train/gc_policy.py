"""How often Python's cyclic garbage collector runs in a tunix_train process.

Tracing a step builds hundreds of thousands of short-lived objects (tracers, avals, jaxpr
equations). At CPython's default thresholds (a young collection every 700 net allocations, a
full one every 100 of them) a 4-step run of the default tiny model collected 870 times, 7 of
them full scans of everything JAX, Flax and Orbax had imported: 0.75 s of an 11 s run; in one
long-lived process running tests/test_lora.py, 29.5 s of 147 (2026-11-28, gc.callbacks;
docs/performance.md). Young collections 14 times rarer still find a cycle soon after it dies
(within 10,000 allocations), full scans become about as rare, and whatever is alive when the
process starts its work (the modules) is left out of them. torchtitan goes further
(`training.gc_freq`: automatic collection off, a young one every 50 steps).
"""

import gc

YOUNG = 10_000  # net allocations between young collections (CPython's default: 700)
OLDER = 10  # collections of a generation between two of the next (CPython's default)


def collect_less_often() -> None:
    """For an entry point, once its imports are done: what exists now is never scanned again
    (gc.freeze), and collections run at YOUNG / OLDER."""
    gc.freeze()
    gc.set_threshold(YOUNG, OLDER, OLDER)
