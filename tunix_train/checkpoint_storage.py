"""The storage under the checkpoints: whether its disk holds one more checkpoint, which errors are
the storage failing (rather than damage or a bug), and the one sentence a failed save stops the
run with (`StorageError`, exit code 6; `PeerSaveError`, exit code 5, in a process that waited for
another whose part failed). checkpoint.py asks; nothing here touches Orbax.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Any, Iterator

import jax
import numpy as np
from jax.experimental import multihost_utils

from tunix_train.paths import PeerSaveError, StorageError

# Storage that may answer if asked again (absl status codes, as tensorstore spells them).
STORAGE_CODES = ("UNAVAILABLE", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED", "ABORTED", "INTERNAL",
                 "UNKNOWN", "CANCELLED", "PERMISSION_DENIED")
# A collective's words when a process of the job is gone (Gloo's, on CPU).
PEER_GONE = ("closed by peer", "Connection reset by peer", "Broken pipe", "remote process exited")


def array_bytes(tree: Any) -> int:
    """The bytes of a tree's arrays (or of their shapes), uncompressed."""
    return sum(leaf.size * np.dtype(leaf.dtype).itemsize for leaf in jax.tree.leaves(tree))


def check_room(directory: Path, needed: int) -> None:
    """Refuses a checkpoint folder whose disk has fewer than `needed` bytes free. The job's
    processes share the folder (Orbax's condition) and decide on process 0's reading."""
    free = free_bytes(directory)
    if jax.process_count() > 1:  # in MiB: JAX carries 32-bit integers (without jax_enable_x64)
        mib = multihost_utils.broadcast_one_to_all(np.array(free >> 20, np.int32))
        free = int(mib) << 20
    if free < needed:
        raise StorageError(
            f"{directory} has {_gb(free)} GB free, and one checkpoint of this run takes up to "
            f"{_gb(needed)} GB (its parameters and optimizer state): make room there, or give "
            f"hydra.run.dir a folder on a disk with room.")


def save_failed(error: BaseException, step: int | None, directory: Path,
                needed: int | None) -> StorageError | PeerSaveError:
    """The sentence for a save of `step` that failed: for the storage's sake (a full disk, a lost
    mount), the system's words and the room there is and takes; at a barrier of the job's
    processes, the other process's failure. Either names the newest committed step, which is
    intact and where the same command goes on from."""
    latest = newest_committed(directory)
    if waited_for_peers(error):
        kept = (f"the newest saved step, {latest}, is intact: run the same command again to "
                f"go on from it" if latest is not None else "no earlier step of this run was "
                "saved")
        return PeerSaveError(
            f"could not save checkpoint step {step} in {directory}: another process of the job"
            f"{_named_peers(error)} did not finish its part ({first_line(error)}); the process "
            f"that failed says why in its own lines; {kept}.")
    size = "" if needed is None else f", a checkpoint of this run takes up to {_gb(needed)} GB"
    kept = (f"the newest saved step, {latest}, is intact: make room there (or lower "
            f"checkpoint.keep) and run the same command again to go on from it"
            if latest is not None else "no earlier step of this run was saved: make room "
            "there and run the same command again")
    return StorageError(
        f"could not save checkpoint step {step} in {directory} ({_os_error(error)}; "
        f"{_gb(free_bytes(directory))} GB free there{size}); {kept}.")


def waited_for_peers(error: BaseException) -> bool:
    """Whether a save failed waiting for the job's other processes, at a barrier (Orbax's: one
    process's part failed, or the process is gone) or in a collective (a synchronous save's,
    with a process gone), rather than at this process's storage."""
    return jax.process_count() > 1 and any(
        "barrier" in str(seen).lower() or any(words in str(seen) for words in PEER_GONE)
        for seen in _chain(error))


def _named_peers(error: BaseException) -> str:
    """The other processes JAX's coordination service names in `error` (`Task 1 heartbeat
    timeout`, `…/task:1`), as ` (process 1)`; "" where it names none (Gloo's words)."""
    named = {int(number) for seen in _chain(error)
             for number in re.findall(r"\btask:? ?(\d+)", str(seen), re.IGNORECASE)}
    others = sorted(named - {jax.process_index()})
    if not others:
        return ""
    return f" (process{'es' if len(others) > 1 else ''} {', '.join(map(str, others))})"


def newest_committed(directory: Path) -> int | None:
    """The newest step under its final name, read from the disk (Orbax renames a step's
    temporary folder once every process wrote its part). Orbax's manager lists a step from the
    start of its save on, failed or not."""
    try:
        return max((int(p.name) for p in directory.iterdir() if p.name.isdigit()), default=None)
    except OSError:  # the storage that failed the save
        return None


def is_storage(error: BaseException) -> bool:
    """Whether `error` (or one it came from) is the storage failing, which a retry may mend."""
    return any(isinstance(seen, OSError) or str(seen).startswith(STORAGE_CODES)
               for seen in _chain(error))


def _chain(error: BaseException) -> Iterator[BaseException]:
    """`error` and the errors it came from."""
    seen: BaseException | None = error
    while seen is not None:
        yield seen
        seen = seen.__cause__ or seen.__context__


def free_bytes(directory: Path) -> int:
    """Free bytes on the disk that holds `directory` (or would: its nearest existing parent)."""
    directory = directory.absolute()
    while not directory.exists():
        directory = directory.parent
    return shutil.disk_usage(directory).free


def first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:240] if text else ''}"


def _os_error(error: BaseException) -> str:
    """The system's words for the error under `error` (tensorstore spells it in a long line
    that names a file: `… No space left on device [os_error_code='28']`), else its first line."""
    for seen in _chain(error):
        if isinstance(seen, OSError) and seen.errno:
            return f"{os.strerror(seen.errno)}, errno {seen.errno}"
        code = re.search(r"os_error_code='(\d+)'", str(seen))
        if code:
            return f"{os.strerror(int(code.group(1)))}, errno {code.group(1)}"
    return first_line(error)


def _gb(count: int) -> str:
    return f"{count / 1e9:.3g}"
