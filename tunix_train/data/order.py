"""Small in-memory datasets (GRPO's prompts, DPO's preference pairs) visited epoch after epoch,
each epoch in an order drawn from the seed and the epoch. The position (epoch, index) is what a
checkpoint saves, so a resumed run draws what the uninterrupted one would have."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from tunix_train.config import ConfigError


class SeededOrder:
    """`per_step` items at a time; `get_state`/`set_state` are the checkpoint's data position."""

    noun = "items"  # what the items are, for the error of a resume onto other data

    def __init__(self, items: Sequence[Any], per_step: int, seed: int):
        self.items, self.per_step, self.seed = items, per_step, seed
        self.epoch, self.index = 0, 0

    def __iter__(self) -> SeededOrder:
        return self

    def __next__(self) -> list[Any]:
        batch = []
        while len(batch) < self.per_step:
            order = np.random.default_rng([self.seed, self.epoch]).permutation(len(self.items))
            take = order[self.index:self.index + self.per_step - len(batch)]
            batch += [self.items[i] for i in take]
            self.index += len(take)
            if self.index >= len(self.items):
                self.epoch, self.index = self.epoch + 1, 0
        return batch

    def get_state(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "index": self.index, self.noun: len(self.items),
                "per_step": self.per_step}

    def set_state(self, state: dict[str, Any]) -> None:
        if state.get(self.noun) != len(self.items):
            raise ConfigError(f"the checkpoint's data position is for {state.get(self.noun)} "
                              f"{self.noun}, data.path now has {len(self.items)}; resume with the "
                              f"same {self.noun}.")
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
