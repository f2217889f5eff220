"""Reading a compiled program's optimised HLO text (`compiled.as_text()`).

Only what the reports need: computations and their instructions, result shapes in bytes, how
many times each computation runs per call (a `while` body runs once per trip: the scans over
layers and micro-batches), and the FLOPs of its dot products. XLA's own `cost_analysis()`
counts a loop body once whatever its trip count, which undercounts a scanned model by the
number of layers; counting here avoids that.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from dataclasses import dataclass
from typing import Iterator

_DTYPE_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
    "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "s4": 0.5, "u4": 0.5,
    "f8e4m3fn": 1, "f8e5m2": 1,
}
_ARRAY = re.compile(r"\b([a-z]\w*)\[([\d,]*)\]")
_HEADER = re.compile(r"^(ENTRY\s+)?%([\w.\-]+)\s*\(.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(ROOT\s+)?%([\w.\-]+)\s*=\s*(.*)$")


@dataclass(frozen=True)
class Instruction:
    name: str
    shape: str  # result shape, e.g. "f32[8,64]{1,0}" or a tuple "(f32[], bf16[4]{0})"
    opcode: str
    operands: tuple[str, ...]
    attrs: str  # everything after the operand list


@dataclass
class Module:
    computations: dict[str, list[Instruction]]
    roots: dict[str, str]  # computation → its ROOT instruction's name
    runs: dict[str, int]  # executions of each computation per call of the entry computation
    warnings: list[str]

    def instructions(self) -> Iterator[tuple[Instruction, int, dict[str, Instruction]]]:
        """(instruction, executions per call, its computation's instructions by name)."""
        for name, instructions in self.computations.items():
            if self.runs.get(name):
                by_name = {i.name: i for i in instructions}
                for inst in instructions:
                    yield inst, self.runs[name], by_name


def parse(hlo_text: str) -> Module:
    computations, roots, entry, current = {}, {}, "", ""
    for line in hlo_text.splitlines():
        header = _HEADER.match(line)
        if header:
            current = header.group(2)
            computations.setdefault(current, [])
            entry = current if header.group(1) else entry
        elif current and (m := _INSTRUCTION.match(line)):
            computations[current].append(_instruction(m.group(2), m.group(3)))
            if m.group(1):
                roots[current] = m.group(2)
    warnings: list[str] = []
    return Module(computations, roots, _runs(computations, entry, warnings), warnings)


_LAYOUT_ONLY = ("bitcast", "copy", "reshape", "transpose")
_LAID_OUT = re.compile(r"\b([a-z]\w*)\[([\d,]*)\]\{([^}]*)\}")
HOST_MEMORY_SPACE = "S(5)"  # how a layout marks an array in (pinned) host memory


def host_bytes(hlo_text: str) -> tuple[float, float]:
    """(argument bytes, result bytes) of the entry computation that XLA placed in host memory,
    read off its `entry_computation_layout`: the same on every backend, including CPUs whose
    `memory_analysis()` counts host and device memory as one."""
    header = hlo_text.split("\n", 1)[0]
    start = header.find("entry_computation_layout={")
    if start < 0:
        return 0.0, 0.0
    start = header.index("{", start)
    layout = header[start + 1:_matching(header, start)]
    arguments, _, results = layout.partition(")->")

    def on_host(text: str) -> float:
        return sum(_DTYPE_BYTES.get(dtype, 0) * math.prod(ints(dims))
                   for dtype, dims, tiling in _LAID_OUT.findall(text)
                   if HOST_MEMORY_SPACE in tiling)

    return on_host(arguments), on_host(results)



def widened_from(inst: Instruction, by_name: dict[str, Instruction], module: Module) -> str | None:
    """The narrower float type `inst`'s value was converted from, if it is a widening convert
    (possibly inside a fusion, behind layout-only ops): CPU backends widen bf16 collectives."""
    while inst.opcode in _LAYOUT_ONLY and inst.operands and inst.operands[0] in by_name:
        inst = by_name[inst.operands[0]]
    if inst.opcode == "fusion":
        callee = re.search(r"calls=%([\w.\-]+)", inst.attrs)
        body = module.computations.get(callee.group(1), []) if callee else []
        inner = {i.name: i for i in body}
        root = module.roots.get(callee.group(1)) if callee else None
        return widened_from(inner[root], inner, module) if root in inner else None
    if inst.opcode == "convert" and inst.operands and inst.operands[0] in by_name:
        source = dtype_of(by_name[inst.operands[0]].shape)
        return source if source in ("bf16", "f16") else None
    return None


def _instruction(name: str, rest: str) -> Instruction:
    shape_end = _matching(rest, 0) + 1 if rest.startswith("(") else rest.index(" ")
    shape, rest = rest[:shape_end], rest[shape_end:].lstrip()
    opcode = rest[: rest.index("(")]
    close = _matching(rest, len(opcode))
    operands = tuple(re.findall(r"%([\w.\-]+)", rest[len(opcode) + 1: close]))
    return Instruction(name, shape, opcode, operands, rest[close + 1:])


def _matching(text: str, open_at: int) -> int:
    """Index of the bracket that closes the one at `open_at`."""
    depth = 0
    for i in range(open_at, len(text)):
        depth += text[i] in "([{"
        depth -= text[i] in ")]}"
        if depth == 0:
            return i
    raise ValueError(f"unbalanced HLO text: {text[:80]}")


def _runs(computations: dict[str, list[Instruction]], entry: str,
          warnings: list[str]) -> dict[str, int]:
    runs: dict[str, int] = defaultdict(int)

    def visit(name: str, times: int) -> None:
        runs[name] += times
        for inst in computations.get(name, ()):
            for callee, factor in _callees(inst, warnings):
                visit(callee, times * factor)

    visit(entry, 1)
    return runs


def _callees(inst: Instruction, warnings: list[str]) -> Iterator[tuple[str, int]]:
    if inst.opcode == "while":
        trips = re.search(r'"known_trip_count":\{"n":"(\d+)"', inst.attrs)
        if trips is None:
            warnings.append(f"{inst.name}: a while loop of unknown trip count, counted once")
        yield re.search(r"body=%([\w.\-]+)", inst.attrs).group(1), int(trips.group(1)) \
            if trips else 1
        return
    if inst.opcode in ("async-update", "async-done"):
        return  # the same computation as its async-start: counted there
    for key in ("calls", "branch_computations", "true_computation", "false_computation"):
        found = re.search(key + r"=\{?([^}]*?)(?:\}|,\s*\w+=|$)", inst.attrs)
        if found:
            for callee in re.findall(r"%([\w.\-]+)", found.group(1)):
                yield callee, 1


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def shape_bytes(shape: str) -> float:
    return sum(_DTYPE_BYTES.get(dtype, 0) * math.prod(ints(dims))
               for dtype, dims in _ARRAY.findall(shape))


def dtype_of(shape: str) -> str:
    found = _ARRAY.findall(shape)
    return found[0][0] if found else "?"


def dtype_bytes(dtype: str) -> float:
    return _DTYPE_BYTES[dtype]


def users(instructions: dict[str, Instruction]) -> dict[str, list[Instruction]]:
    found = defaultdict(list)
    for inst in instructions.values():
        for operand in inst.operands:
            found[operand].append(inst)
    return found


def flops(module: Module) -> float:
    """Multiply-adds × 2 of every matrix product, times the executions of its computation.

    On GPUs the products are also cuBLAS and cuDNN custom calls, not `dot`s: those count too.
    """
    total = 0.0
    for inst, runs, by_name in module.instructions():
        if inst.opcode == "dot":
            total += _dot_flops(inst, by_name) * runs
        elif inst.opcode == "custom-call":
            total += _custom_call_flops(inst, by_name) * runs
    return total


def _dot_flops(inst: Instruction, by_name: dict[str, Instruction]) -> float:
    contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", inst.attrs)
    return _matmul_flops(inst.shape, by_name[inst.operands[0]].shape,
                         ints(contracting.group(1)) if contracting else [])


def _matmul_flops(result_shape: str, lhs_shape: str, contracting: list[int]) -> float:
    lhs_dims = ints(_ARRAY.search(lhs_shape).group(2))
    k = math.prod(lhs_dims[d] for d in contracting)
    return 2.0 * math.prod(ints(_ARRAY.search(result_shape).group(2))) * k


def _custom_call_flops(inst: Instruction, by_name: dict[str, Instruction]) -> float:
    target = re.search(r'custom_call_target="([^"]+)"', inst.attrs)
    target = target.group(1) if target else ""
    if target.startswith("__cublas"):  # $gemm, $lt$matmul: result is (product, workspace)
        contracting = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', inst.attrs)
        dims = ints(contracting.group(1).replace('"', "")) if contracting else []
        return _matmul_flops(inst.shape, by_name[inst.operands[0]].shape, dims)
    if target.startswith("__cudnn$fmha"):
        # Flash attention, counted dense (masks not discounted): QKᵀ and PV forward (4·BNTSH);
        # backward recomputes QKᵀ and forms dQ, dK, dV, dP (10·BNTSH), as FlashAttention-2 counts.
        shapes = _ARRAY.findall(inst.attrs[inst.attrs.index("operand_layout_constraints"):])
        (batch, t, heads, head_dim), s = ints(shapes[0][1]), ints(shapes[1][1])[1]
        return (10.0 if "Backward" in target else 4.0) * batch * heads * t * s * head_dim
    return 0.0
