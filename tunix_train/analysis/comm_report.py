"""What a compiled step communicates, read from its optimised HLO (`compiled.as_text()`).

For every collective instruction: its kind, the mesh axis it runs over (its replica groups'
device ids mapped to mesh coordinates), the dtype and bytes it carries per device, how often it
runs per call of the step (an instruction inside a `while` loop — the scans over layers and
micro-batches — runs once per trip), and which part of the step issued it (forward, backward,
gradient sync, update; from the instruction's metadata).

Bytes per device follow the nccl-tests convention: the size of the larger buffer, i.e. the
gathered result of an all-gather, the input of a reduce-scatter, the buffer of an all-reduce,
all-to-all or collective-permute. On the wire a ring moves (n-1)/n of that (twice for all-reduce).

CPU backends widen bf16 collectives to fp32 internally (a convert to fp32 just before, a
reduction renamed `*_promoted`, a convert back after); the report counts them in the dtype the
program communicates in, which is what GPUs and TPUs carry. The planner runs on CPU, so this is
what makes its bf16 numbers right.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Iterable

import numpy as np
from jax.sharding import Mesh

from tunix_train.analysis import hlo
from tunix_train.parallel.collectives import SYNC_SCOPE, WIDENED
from tunix_train.parallel.mesh import CP, FSDP

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute",
         "collective-broadcast", "ragged-all-to-all")


@dataclass
class Collective:
    """One row of the report: collectives of one kind, axis, dtype and phase, per step."""

    kind: str
    axis: str  # mesh axes it runs over, "+"-joined (fsdp, tp, fsdp+tp)
    dtype: str
    phase: str  # forward | backward | gradient sync | update
    count: int  # executions per step
    bytes: int  # per device, summed over executions


@dataclass
class CommReport:
    collectives: list[Collective]
    gradient_reductions_per_step: float | None = None
    warnings: list[str] = field(default_factory=list)

    def total(self, kind: str | None = None, axis: str | None = None,
              phase: str | None = None) -> tuple[int, int]:
        """(count, bytes) of the rows matching every given field."""
        rows = [c for c in self.collectives if (kind is None or c.kind == kind)
                and (axis is None or c.axis == axis) and (phase is None or c.phase == phase)]
        return sum(c.count for c in rows), sum(c.bytes for c in rows)

    def to_json(self) -> dict:
        return {"collectives": [dataclasses.asdict(c) for c in self.collectives],
                "gradient_reductions_per_step": self.gradient_reductions_per_step,
                "warnings": self.warnings}

    def table(self) -> str:
        if not self.collectives:
            lines = ["no collectives (every device computes alone)"]
        else:
            lines = [f"{'kind':<20}{'axis':<10}{'dtype':<7}{'phase':<15}{'count':>7}{'MB':>12}"]
        for c in self.collectives:
            lines.append(f"{c.kind:<20}{c.axis or '-':<10}{c.dtype:<7}{c.phase:<15}"
                         f"{c.count:>7}{c.bytes / 1e6:>12.2f}")
        if self.gradient_reductions_per_step is not None:
            lines.append(f"gradient reductions per step: {self.gradient_reductions_per_step:g}")
        return "\n".join(lines + [f"warning: {w}" for w in self.warnings])


# ---------------------------------------------------------------------------------------------
# Replica groups → mesh axes.

def device_groups(attrs: str, num_devices: int) -> list[list[int]] | None:
    """The device-id groups of a collective, from any of XLA's three printed forms."""
    if m := re.search(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}", attrs):
        return [[int(a), int(b)] for a, b in re.findall(r"\{(\d+),(\d+)\}", m.group(1))]
    if m := re.search(r"replica_groups=mesh\[([^\]]*)\](?:, device_ids=\(([^)]*\)?)\))?"
                      r"\s*(\{[^}]*\})?", attrs):
        return _mesh_groups(m.group(1), m.group(2), m.group(3) or "{}", num_devices)
    if m := re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", attrs):
        return _iota(m.group(2), m.group(3)).reshape(hlo.ints(m.group(1))).tolist()
    if m := re.search(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}", attrs):
        groups = [hlo.ints(g) for g in re.findall(r"\{([\d,]*)\}", m.group(1))]
        return groups if groups and groups[0] else [list(range(num_devices))]
    return None


def _iota(dims: str, perm: str | None) -> np.ndarray:
    ids = np.arange(math.prod(hlo.ints(dims))).reshape(hlo.ints(dims))
    return (ids.transpose(hlo.ints(perm)) if perm else ids).reshape(-1)


def _mesh_groups(axes: str, device_ids: str | None, selected: str,
                 num_devices: int) -> list[list[int]]:
    names = re.findall(r"'([^']+)'=(\d+)", axes)
    sizes = [int(s) for _, s in names]
    if device_ids is None:
        ids = np.arange(num_devices)
    elif m := re.match(r"\[([\d,]+)\](?:T\(([\d,]+)\))?", device_ids):
        ids = _iota(m.group(1), m.group(2))
    else:
        ids = np.array(hlo.ints(device_ids))
    grid = ids.reshape(sizes)
    chosen = [i for i, (n, _) in enumerate(names) if f"'{n}'" in selected]
    rest = [i for i in range(len(names)) if i not in chosen]
    return grid.transpose(rest + chosen).reshape(-1, math.prod(
        sizes[i] for i in chosen)).tolist()


def axes_of(groups: Iterable[Iterable[int]], mesh: Mesh) -> str:
    """Mesh axes along which the members of some group differ, in the mesh's order."""
    coords = np.stack(np.unravel_index(np.arange(mesh.devices.size), mesh.devices.shape), -1)
    varying = set()
    for group in groups:
        members = coords[list(group)]
        varying |= {i for i in range(members.shape[1]) if len(set(members[:, i])) > 1}
    return "+".join(mesh.axis_names[i] for i in sorted(varying))


# ---------------------------------------------------------------------------------------------
# The report.

def from_hlo(module: hlo.Module, mesh: Mesh, gradient_bytes: float | None = None) -> CommReport:
    """The report of one compiled step (`hlo.parse(compiled.as_text())`). `gradient_bytes`:
    per-device bytes of one full gradient reduction; with it the report counts how many
    reductions over fsdp the step makes: the bytes of the gradient sync's fsdp reduce-scatters
    and all-reduces over that figure. (The sync also holds tp all-reduces of tp-replicated
    gradients, and the embedding lookup's gradient rows, exchanged by all-to-all or all-gather:
    neither is a reduction over fsdp.)"""
    rows: dict[tuple, Collective] = {}
    for inst, runs, by_name in module.instructions():
        kind = inst.opcode.removesuffix("-start")
        if kind not in KINDS:
            continue
        groups = device_groups(inst.attrs, mesh.devices.size)
        axis = axes_of(groups, mesh) if groups else "?"
        if not axis:
            continue  # every group is a single device: nothing leaves it
        dtype, nbytes = _payload(inst, kind, by_name, module, len(groups[0]) if groups else 1)
        key = (kind, axis, dtype, _phase(inst.attrs))
        row = rows.setdefault(key, Collective(*key, count=0, bytes=0))
        row.count += runs
        row.bytes += int(nbytes * runs)
    report = CommReport(sorted(rows.values(), key=lambda c: (c.phase, c.kind, c.axis)),
                        warnings=module.warnings)
    if gradient_bytes:
        # Over the data-parallel axes (fsdp, cp), alone or with pp (sharding.spread_over_ranks).
        synced = sum(c.bytes for c in report.collectives if c.phase == "gradient sync"
                     and c.kind in ("reduce-scatter", "all-reduce")
                     and {FSDP, CP} & set(c.axis.split("+")))
        report.gradient_reductions_per_step = round(synced / gradient_bytes, 3)
    return report


def _payload(inst: hlo.Instruction, kind: str, by_name: dict[str, hlo.Instruction],
             module: hlo.Module, group_size: int) -> tuple[str, float]:
    """(dtype carrying most bytes, bytes per device). A value that a CPU backend widened to
    fp32 only to communicate it counts in its own, narrower type: a reduction the program
    widened itself (named so, see collectives.py) or that XLA promoted, or data only moved (a
    gather, an all-to-all) whose operand was widened. A reduction of a widened operand that
    is neither is a genuine fp32 reduction (training.grad_reduce_dtype=fp32)."""
    narrowed = None
    promoted = re.search(r"to_apply=%[\w.\-]*_promoted", inst.attrs) is not None
    # The scope ends in "/" or, under autodiff, in ")": jvp(cpu_widened_from_bfloat16).
    if (named := re.search(WIDENED + r"(\w+)[/)]", inst.attrs)) is not None:
        narrowed = {"bfloat16": "bf16", "float16": "f16"}.get(named.group(1))
    elif promoted:
        narrowed = _narrowed_dtype(inst, hlo.users(by_name))
    widening_is_the_backends = promoted or kind not in ("all-reduce", "reduce-scatter")
    by_dtype: dict[str, float] = defaultdict(float)
    for operand in (by_name[o] for o in inst.operands if o in by_name):
        dtype, nbytes = hlo.dtype_of(operand.shape), hlo.shape_bytes(operand.shape)
        widened = hlo.widened_from(operand, by_name, module) if widening_is_the_backends \
            else None
        narrow = (narrowed or widened) if dtype == "f32" else None
        if narrow:
            dtype, nbytes = narrow, nbytes * hlo.dtype_bytes(narrow) / hlo.dtype_bytes("f32")
        by_dtype[dtype] += nbytes
    scale = group_size if kind == "all-gather" else 1
    return max(by_dtype, key=by_dtype.get, default="?"), sum(by_dtype.values()) * scale


def _narrowed_dtype(inst: hlo.Instruction,
                    users: dict[str, list[hlo.Instruction]]) -> str | None:
    """The float type a promoted reduction's result is converted back to (CPU backends)."""
    frontier = [inst]
    for _ in range(3):  # its users, or through a get-tuple-element and a bitcast
        frontier = [u for i in frontier for u in users.get(i.name, ())]
        for user in frontier:
            if hlo.dtype_of(user.shape) in ("bf16", "f16"):
                return hlo.dtype_of(user.shape)
    return None


def _phase(attrs: str) -> str:
    op_name = re.search(r'op_name="([^"]*)"', attrs)
    op_name = op_name.group(1) if op_name else ""
    if SYNC_SCOPE in op_name:
        return "gradient sync"
    if "transpose(" in op_name:
        return "backward"
    if "jvp(" in op_name:
        return "forward"
    return "update"
