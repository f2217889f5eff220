"""The suite's persistent compilation cache, shared by every process it starts (tests/conftest.py).

JAX's cache (jax._src.lru_cache.LRUCache) with a size limit holds a file lock for every read and
write, so that no process reads an entry another is still writing (tests/test_internals.py), and
before every write it also stats every entry and reads its access time, to evict the oldest past
the limit: 113 ms a write with the ~2,900 entries one run of the suite leaves (2026-11-27), some
minutes of a cold run, each scan holding the lock every other process waits on. The suite's
processes keep the lock and skip that scan (`patch`); `trim` evicts once, as the suite starts."""

from __future__ import annotations

import sys

MODULE = "jax._src.lru_cache"


def patch() -> None:
    """Every write of this process skips the scan: now if JAX's cache module is loaded, else
    right after it is."""
    if MODULE in sys.modules:
        _skip_scan()
    else:
        after_import(MODULE, _skip_scan)


def trim(path: str, max_size: int) -> None:
    """Evicts the least recently used entries past `max_size` bytes, scanning once."""
    from jax._src import lru_cache

    cache = lru_cache.LRUCache(path, max_size=max_size)
    _scan_of(lru_cache.LRUCache)(cache)


def _skip_scan() -> None:
    cls = sys.modules[MODULE].LRUCache
    if not hasattr(cls, "_suite_scan"):
        cls._suite_scan = cls._evict_if_needed
        cls._evict_if_needed = lambda self, *, additional_size=0: None


def _scan_of(cls):
    return getattr(cls, "_suite_scan", cls._evict_if_needed)


def after_import(name: str, then) -> None:
    """Runs `then()` right after module `name` is first imported (nothing for processes that
    never import it)."""
    import importlib.abc
    import importlib.machinery

    class Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path, target=None):
            if fullname != name:
                return None
            sys.meta_path.remove(self)
            spec = importlib.machinery.PathFinder.find_spec(fullname, path)
            if spec is None or spec.loader is None:
                return spec
            exec_module = spec.loader.exec_module

            def exec_and_then(module):
                exec_module(module)
                then()

            spec.loader.exec_module = exec_and_then
            return spec

    sys.meta_path.insert(0, Finder())
