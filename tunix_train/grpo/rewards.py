"""Reward functions, named in `grpo.rewards` and weighted by `grpo.reward_weights`.

Every reward is called as `fn(prompts, completions, **fields) -> one float per completion`,
where `prompts` and `completions` are lists of text of the same length and each of `fields` is
the list of that field's values (the prompt records' other fields, e.g. `answer`). Built in:

    answer   1 if the first match of grpo.answer_pattern (its group 1) equals the record's
             grpo.answer_field: as numbers (answer_compare=numeric) or as text (exact); else 0
    format   1 if the completion matches grpo.format_pattern as a whole; else 0
    length   DAPO's soft overlong penalty: 0 up to max_new_tokens − length_buffer tokens, then
             down to −1 at max_new_tokens (lengths in tokens, EOS included)

Anything else is an import path `package.module:function` of the user's own.
"""

from __future__ import annotations

import importlib
import math
import re
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from tunix_train.config import ConfigError, GrpoConfig

RewardFn = Callable[..., Sequence[float]]
BUILT_IN = ("answer", "format", "length")


@dataclass(frozen=True)
class Rewards:
    names: tuple[str, ...]
    functions: tuple[RewardFn, ...]
    weights: tuple[float, ...]

    @classmethod
    def create(cls, g: GrpoConfig, record: dict[str, Any]) -> Rewards:
        """Checks every name before anything compiles, and calls each function once on the
        first prompt record (`record`: its fields) with an empty completion, so a function
        that raises or returns the wrong number of values is found at start-up."""
        functions = tuple(_function(name, g, list(record)) for name in g.rewards)
        weights = tuple(g.reward_weights) if g.reward_weights is not None else \
            (1.0,) * len(g.rewards)
        rewards = cls(tuple(g.rewards), functions, weights)
        rewards(["(a prompt)"], [""], [0], {name: [value] for name, value in record.items()})
        return rewards

    def __call__(self, prompts: list[str], completions: list[str], lengths: list[int],
                 fields: dict[str, list]) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """(weighted total per completion, each reward's own values by name)."""
        each = {}
        for name, fn in zip(self.names, self.functions):
            kwargs = dict(fields, lengths=lengths) if name == "length" else fields
            each[name] = _checked(name, fn, prompts, completions, kwargs)
        total = sum(w * each[name] for name, w in zip(self.names, self.weights))
        return np.asarray(total, np.float32), each


def _checked(name: str, fn: RewardFn, prompts, completions, fields) -> np.ndarray:
    try:
        values = fn(prompts, completions, **fields)
    except Exception as error:  # the user's code: say whose it is, keep the cause
        raise ConfigError(f"grpo.rewards: {name} raised {type(error).__name__}: {error}; fix the "
                          f"reward function.") from error
    try:
        array = np.asarray(values, np.float64).reshape(-1)
    except (TypeError, ValueError):
        raise ConfigError(f"grpo.rewards: {name} returned {type(values).__name__}, not numbers; "
                          f"return one float per completion.") from None
    if array.size != len(completions):
        raise ConfigError(f"grpo.rewards: {name} returned {array.size} values for "
                          f"{len(completions)} completions; return one float per completion.")
    if not np.all(np.isfinite(array)):
        raise ConfigError(f"grpo.rewards: {name} returned a non-finite value; return finite "
                          f"floats.")
    return array.astype(np.float32)


def _function(name: str, g: GrpoConfig, fields: Sequence[str]) -> RewardFn:
    if name == "answer":
        if g.answer_field not in fields:
            raise ConfigError(f"grpo.rewards=[answer] compares with the field "
                              f"grpo.answer_field={g.answer_field!r}, which the prompt records "
                              f"lack (they have {', '.join(fields) or 'no other field'}); set "
                              f"grpo.answer_field.")
        return _answer_reward(_compiled("grpo.answer_pattern", g.answer_pattern, group=True),
                              g.answer_field, g.answer_compare)
    if name == "format":
        if g.format_pattern is None:
            raise ConfigError("grpo.rewards names format but grpo.format_pattern is not set; "
                              "give the regular expression a completion must match.")
        return _format_reward(_compiled("grpo.format_pattern", g.format_pattern))
    if name == "length":
        buffer = g.length_buffer or max(g.max_new_tokens // 4, 1)
        return _length_reward(g.max_new_tokens, min(buffer, g.max_new_tokens))
    return _imported(name)


def _compiled(key: str, pattern: str, group: bool = False) -> re.Pattern:
    try:
        compiled = re.compile(pattern, re.DOTALL)
    except re.error as error:
        raise ConfigError(f"{key}={pattern!r} is not a regular expression ({error}).") from None
    if group and compiled.groups < 1:
        raise ConfigError(f"{key}={pattern!r} has no group; put the answer in parentheses.")
    return compiled


def _answer_reward(pattern: re.Pattern, field: str, compare: str) -> RewardFn:
    def answer(prompts, completions, **fields) -> list[float]:
        return [float(_same(_extract(pattern, c), str(expected), compare))
                for c, expected in zip(completions, fields[field])]

    return answer


def _extract(pattern: re.Pattern, completion: str) -> str | None:
    match = pattern.search(completion)
    return None if match is None else match.group(1)


def _same(found: str | None, expected: str, compare: str) -> bool:
    if found is None:
        return False
    if compare == "numeric":
        try:
            return math.isclose(float(found.replace(",", "")), float(expected.replace(",", "")),
                                rel_tol=1e-9, abs_tol=1e-9)
        except ValueError:
            pass
    return found.strip() == expected.strip()


def _format_reward(pattern: re.Pattern) -> RewardFn:
    def format_(prompts, completions, **fields) -> list[float]:
        return [float(pattern.fullmatch(c) is not None) for c in completions]

    return format_


def _length_reward(max_new_tokens: int, buffer: int) -> RewardFn:
    def length(prompts, completions, lengths, **fields) -> list[float]:
        start = max_new_tokens - buffer
        return [-min(max(n - start, 0) / buffer, 1.0) for n in lengths]

    return length


def _imported(name: str) -> RewardFn:
    module_name, _, attribute = name.partition(":")
    if not module_name or not attribute:
        raise ConfigError(f"grpo.rewards: {name!r} is neither a built-in reward "
                          f"({', '.join(BUILT_IN)}) nor an import path module:function.")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ConfigError(f"grpo.rewards: cannot import {module_name!r} for {name!r} ({error}); "
                          f"check the module is on PYTHONPATH.") from None
    fn: Any = getattr(module, attribute, None)
    if not callable(fn):
        raise ConfigError(f"grpo.rewards: {module_name} has no function {attribute!r}; name one "
                          f"that exists.")
    return fn
