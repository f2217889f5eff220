"""One process of tests/test_data_order.py's multi-process run.

Usage: data_order_worker.py OUT_DIR BATCHES RESTORE_STATE OVERRIDE... (rank and world from the
environment, as `tunix_train.distributed` reads them). Writes `rank<R>.npz` with the global
batches it took part in, the batch after restoring RESTORE_STATE, and `rank<R>.json` with the
iterator state after BATCHES batches and the training documents (file pieces) this process
read.
"""

import json
import sys
from pathlib import Path

import jax
import numpy as np

jax.config.update("jax_cpu_collectives_implementation", "gloo")
sys.path.insert(0, str(Path(__file__).parent))

from helpers import compose_config  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from tunix_train.parallel import distributed  # noqa: E402
from tunix_train.data import sources  # noqa: E402
from tunix_train.training.setup import Setup  # noqa: E402


def _record_reads(read: list[str]) -> None:
    original = sources.TextFiles.__getitem__

    def getitem(self, index):
        read.append(f"{self.files[self.file_ids[index]].name}@{self.starts[index]}")
        return original(self, index)

    sources.TextFiles.__getitem__ = getitem


def _global(batch) -> dict[str, np.ndarray]:
    return {k: np.asarray(v) for k, v in multihost_utils.process_allgather(batch, tiled=True).items()}


def main(out: Path, count: int, restore: Path, overrides: list[str]) -> None:
    cfg = compose_config(*overrides)
    distributed.initialize(cfg.distributed)
    read: list[str] = []
    _record_reads(read)
    data = Setup.create(cfg).open_data()
    batches = [_global(next(data.train)) for _ in range(count)]
    state = data.train.get_state()  # collective: every process calls it
    batches.append(_global(next(data.train)))
    data.train.set_state(json.loads(restore.read_text()))
    restored = _global(next(data.train))
    data.close()
    rank = jax.process_index()
    arrays = {f"{i}/{k}": v for i, b in enumerate(batches) for k, v in b.items()}
    arrays.update({f"restored/{k}": v for k, v in restored.items()})
    np.savez(out / f"rank{rank}.npz", **arrays)
    # Held-out documents are few and shared by all rows of the evaluation batches: count only
    # training documents.
    held_out = {f.name for f in sources.open_corpus(cfg.data, cfg.model.vocab_size).validation.files}
    read = {piece for piece in read if piece.split("@")[0] not in held_out}
    (out / f"rank{rank}.json").write_text(json.dumps(
        {"state": state, "read": sorted(read), "streams": data.train.streams,
         "devices": jax.local_device_count()}))


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]), sys.argv[4:])
