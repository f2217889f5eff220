"""The command line before Hydra sees it: overrides checked, mistakes named in one sentence.

Hydra reports its own errors (an unknown key, an unknown `model=` option, a value of the wrong
type, an override it cannot parse) as several lines and exit code 1, and accepts a typo with a
`+` in front (`+training.setps=3`) by silently ignoring it. Every entry point composes the
config through `compose_checked` first, so each of these is one sentence naming the key, with a
"did you mean" for a near miss, and exit code 2 (cli.py), before anything else runs.

Two Hydra internals are used, each behind one function here and pinned by tests/test_internals.py:
its command-line parser (`hydra._internal.utils.get_args_parser`) and its override grammar
(`OverridesParser`).
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import re
import typing
from pathlib import Path
from typing import Sequence

from tunix_train.config import CONFIG_DIR, Config, ConfigError, register_configs
from tunix_train.trainers import TRAINERS

log = logging.getLogger("tunix_train")

# data.path given without a data= group: the group its extension means.
DATA_GROUP_BY_SUFFIX = {".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet",
                        ".txt": "text", ".md": "text", ".bin": "tokens"}
OPEN_SECTIONS = {"model.sharding_rules"}  # dicts whose keys the user chooses


def hydra_arguments(argv: Sequence[str]):
    """Hydra's own reading of a command line: `.overrides`, `.multirun`, `.cfg`, `.help`…"""
    from hydra._internal.utils import get_args_parser

    return get_args_parser().parse_args(list(argv))


def parse(overrides: Sequence[str]) -> list:
    """Hydra's `Override` objects (key, value, sweep or not), or a ConfigError naming the one
    override its grammar cannot read."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    parser, parsed = OverridesParser.create(), []
    for override in overrides:
        try:
            parsed.extend(parser.parse_overrides([override]))
        except OverrideParseException as error:
            reason = str(error).splitlines()[0]
            key, _, value = override.partition("=")
            example = "'model.mesh_shape=[[4,1],[\"fsdp\",\"tp\"]]' in single quotes"
            if value and not value.lstrip().startswith(("[", "{")) and '"' not in value:
                # Text (a prompt, a name): Hydra reads ( ) = , : and spaces as its own syntax.
                example = f"text in double quotes inside single ones: '{key}=\"{value}\"'"
            raise ConfigError(f"{override!r} is not a valid override ({reason}); check its "
                              f"brackets and quotes, e.g. {example}.") from None
    return parsed


def groups() -> dict[str, list[str]]:
    """Config groups and their options: {"model": ["gemma3_1b", …], …}."""
    return {d.name: sorted(p.stem for p in d.glob("*.yaml"))
            for d in sorted(CONFIG_DIR.iterdir()) if d.is_dir()}


def with_data_group(overrides: Sequence[str]) -> tuple[list[str], str | None]:
    """`data.path=…` without a `data=` group reads the bundled corpus and ignores the path; the
    group is the trainer's own (trainers.TRAINERS) or taken from the file's extension
    instead, or the mistake is refused.
    Returns (overrides, the added group's note or None)."""
    parsed = parse(overrides)
    keys = {o.key_or_group for o in parsed}
    paths = [o for o in parsed if o.key_or_group == "data.path" and not o.is_delete()]
    if "data" in keys or not paths:
        return list(overrides), None
    path, trainer = str(paths[-1].value()), _trainer(parsed)
    own = TRAINERS.get(trainer)  # None before the trainer is chosen, or a mistyped name
    group, why = own.data if own else None, f"trainer={trainer}'s data"
    if group is None:
        suffix = Path(path.rstrip("*/")).suffix.lower()
        group, why = DATA_GROUP_BY_SUFFIX.get(suffix), "its extension"
    if group is None:
        raise ConfigError(
            f"data.path={path} needs a data= group to say how to read it (without one the "
            f"bundled corpus is used); add data=text, data=jsonl, data=parquet or data=tokens.")
    return [f"data={group}", *overrides], f"data.path={path}: read as data={group} ({why})"


def _trainer(parsed: list) -> str | None:
    chosen = [o.value() for o in parsed if o.key_or_group == "trainer"]
    return str(chosen[-1]) if chosen else None


def single_values(overrides: Sequence[str]) -> list[str]:
    """A multirun's overrides with each sweep replaced by its first value (what the first job
    composes), so the same checks apply; range and interval sweeps are left to Hydra."""
    out = []
    for override, parsed in zip(overrides, parse(overrides)):
        if not parsed.is_sweep_override():
            out.append(override)
            continue
        with_prefix = override.split("=", 1)[0]
        try:
            first = next(iter(parsed.sweep_string_iterator()))
        except Exception:  # noqa: BLE001 - ranges, intervals: Hydra checks them per job
            continue
        out.append(f"{with_prefix}={first}")
    return out


def compose_checked(overrides: Sequence[str], return_hydra_config: bool = False):
    """Hydra's composition of `overrides`, or one ConfigError sentence naming what is wrong."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    register_configs()
    parse(overrides)  # an unreadable override is named before Hydra says "no viable input"
    try:
        with initialize_config_dir(str(CONFIG_DIR), version_base=None):
            cfg = compose("config", overrides=list(overrides),
                          return_hydra_config=return_hydra_config)
    except (HydraException, OmegaConfBaseException) as error:
        raise ConfigError(explain(error, overrides)) from None
    unknown = [k for k in unknown_keys(cfg) if k != "hydra"]
    if unknown:
        raise ConfigError(_unknown_key_sentence(unknown[0], added=True))
    return cfg


def explain(error: Exception, overrides: Sequence[str]) -> str:
    """One sentence for a Hydra or OmegaConf composition error."""
    text = str(error)
    missing_group = re.search(r"Could not find '(\w+)/([^']+)'", text)
    if missing_group:
        group, option = missing_group.groups()
        options = groups().get(group, [])
        close = difflib.get_close_matches(option, options, n=1)
        hint = f"did you mean {group}={close[0]}? " if close else ""
        return (f"{group}={option} is not a known option; {hint}the options are "
                f"{', '.join(options)}.")
    override = re.search(r"Could not (?:override|append to|delete from) '([^']+)'", text)
    if override or "is not in struct" in text:
        return _unknown_key_sentence(override.group(1) if override else _key_in(text))
    merging = re.search(r"Error merging override (\S+)", text)
    cause = _deepest_message(error)
    if merging:
        key, _, value = merging.group(1).lstrip("+~").partition("=")
        if "is not a ListConfig, list or tuple" in cause:
            return (f"{key}={value}: {key} is a list; write {key}=[{value}] (several: "
                    f"{key}=[a,b]).")
        return f"{merging.group(1)} does not fit {key}: {cause}; give a value of the right type."
    return f"the overrides {' '.join(overrides)} do not compose: {cause}."


def _key_in(text: str) -> str:
    found = re.search(r"full_key:\s*(\S+)", text)
    return found.group(1) if found else "an override's key"


def _deepest_message(error: BaseException) -> str:
    while error.__cause__ is not None:
        error = error.__cause__
    lines = [line for line in str(error).splitlines() if line.strip()]
    return lines[0].strip().rstrip(".") if lines else type(error).__name__


def _unknown_key_sentence(key: str, added: bool = False) -> str:
    """`added`: the key came in with a `+`, which Hydra suggests for a key it does not know."""
    close = difflib.get_close_matches(key, known_keys(), n=1, cutoff=0.6)
    hint = f" (did you mean {close[0]}?)" if close else ""
    plus = ", with or without a '+' in front" if added else ""
    return (f"{key} is not a config key{hint}{plus}; docs/configuration.md lists every key.")


def known_keys(schema: type = Config, prefix: str = "") -> list[str]:
    """Every dotted key of the typed schema: ["model.name", …, "training.steps", …]."""
    keys = []
    for name, hint in _fields(schema).items():
        if dataclasses.is_dataclass(hint):
            keys += known_keys(hint, f"{prefix}{name}.")
        else:
            keys.append(f"{prefix}{name}")
    return keys


def unknown_keys(cfg, schema: type = Config, prefix: str = "") -> list[str]:
    """Keys of a composed config that the typed schema does not have (a `+`-added typo)."""
    fields = _fields(schema)
    found = []
    for key in cfg.keys():
        dotted = f"{prefix}{key}"
        if key not in fields:
            found.append(dotted)
        elif dataclasses.is_dataclass(fields[key]) and dotted not in OPEN_SECTIONS:
            found += unknown_keys(cfg[key], fields[key], dotted + ".")
    return found


def _fields(schema: type) -> dict[str, type]:
    hints = typing.get_type_hints(schema)
    return {f.name: hints[f.name] for f in dataclasses.fields(schema)}
