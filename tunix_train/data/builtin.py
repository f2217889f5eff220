"""The bundled corpus: the running Python's own standard-library source, which every machine has.

Documents are `.py` files in a fixed (sorted) order, capped at `max_bytes`. Files are only listed
here; their text is read when the pipeline reaches them.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

# Vendored or generated trees that would dominate the corpus with repetitive text.
_SKIP_DIRS = {"site-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__", "encodings"}


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def files(max_bytes: int) -> list[Path]:
    """The corpus's files, sorted, until their sizes add up to `max_bytes`."""
    root = stdlib_root()
    chosen, total = [], 0
    for path in sorted(root.rglob("*.py")):
        if _SKIP_DIRS.intersection(path.relative_to(root).parts[:-1]):
            continue
        size = path.stat().st_size
        if size == 0:
            continue
        chosen.append(path)
        total += size
        if total >= max_bytes:
            break
    return chosen
