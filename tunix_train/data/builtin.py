"""The bundled corpus: the running Python's own standard-library source, which every machine has.

Documents are `.py` files in a fixed (sorted) order, capped at `max_bytes`; a stable hash of each
file's relative path sends about `validation_fraction` of them to the held-out split, so the split
does not depend on the cap or on the training seed.
"""

from __future__ import annotations

import sysconfig
import zlib
from pathlib import Path

# Vendored or generated trees that would dominate the corpus with repetitive text.
_SKIP_DIRS = {"site-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__", "encodings"}


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def documents(max_bytes: int, validation_fraction: float) -> tuple[list[bytes], list[bytes]]:
    """(train, validation) documents read from the standard library."""
    root = stdlib_root()
    train, validation, total = [], [], 0
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root)
        if _SKIP_DIRS.intersection(relative.parts[:-1]):
            continue
        text = path.read_bytes()
        held_out = zlib.crc32(str(relative).encode()) % 10_000 < validation_fraction * 10_000
        (validation if held_out else train).append(text)
        total += len(text)
        if total >= max_bytes:
            break
    if not validation and len(train) > 1:  # a small cap may hash no file to validation
        validation.append(train.pop())
    return train, validation
