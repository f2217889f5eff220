"""`model.mesh_shape` → `jax.sharding.Mesh`. The only module that spells the mesh axis names.

`mesh_shape` is `[[sizes...], [names...]]`, e.g. `[[4, 2], ["fsdp", "tp"]]`, with pipeline
stages `[[2, 2, 2], ["pp", "fsdp", "tp"]]`, with each sequence split over devices (context
parallelism) `[[2, 2, 2], ["fsdp", "cp", "tp"]]`, with a mixture of experts' experts split over
devices (expert parallelism) `[[2, 2, 2], ["fsdp", "ep", "tp"]]`; one size may be -1 and is
filled from the device count. None (the default) puts every device on fsdp. Devices are ordered
so that `tp` groups stay inside one process (one host or GPU group), then `cp` groups, then `ep`
groups, `fsdp` spans processes, and `pp` is outermost: tensor parallelism communicates every
layer's activations, context parallelism every attention layer's keys and values, expert
parallelism every routed layer's tokens (an all-to-all each way), data parallelism once per
layer's weights, and pipeline stages only their boundary activations, so `pp` is the axis for
the slowest links. An ep device is a data-parallel rank (its own batch rows) for every weight
but the experts it holds.
"""

from __future__ import annotations

import logging
import math
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from tunix_train import backend
from tunix_train.config import ConfigError

FSDP = "fsdp"
TP = "tp"
PP = "pp"
CP = "cp"
EP = "ep"
AXES = (FSDP, TP)  # always present; PP, CP and EP are optional
ORDER = (PP, FSDP, EP, CP, TP)  # outermost to innermost in the device grid
DATA_AXES = (FSDP, EP)  # the axes whose devices take batch rows of their own
DEFAULT_SHAPE = [[-1, 1], [FSDP, TP]]  # model.mesh_shape=None: every device on fsdp

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MeshShape:
    sizes: tuple[int, ...]
    names: tuple[str, ...]

    def size(self, axis: str) -> int:
        return self.sizes[self.names.index(axis)]

    @property
    def fsdp(self) -> int:
        return self.size(FSDP)

    @property
    def tp(self) -> int:
        return self.size(TP)

    @property
    def pp(self) -> int:
        return self.size(PP) if PP in self.names else 1

    @property
    def cp(self) -> int:
        return self.size(CP) if CP in self.names else 1

    @property
    def ep(self) -> int:
        return self.size(EP) if EP in self.names else 1

    @property
    def data_ranks(self) -> int:
        """Devices that compute on different batch rows: fsdp × ep."""
        return self.fsdp * self.ep


def parse(mesh_shape: Sequence[Any] | None, num_devices: int) -> MeshShape:
    """Checks `model.mesh_shape` against the device count and fills a single -1."""
    sizes, names = _split(DEFAULT_SHAPE if mesh_shape is None else mesh_shape)
    if not set(AXES) <= set(names) <= set(ORDER) or len(set(names)) != len(names):
        raise ConfigError(
            f"model.mesh_shape names {list(names)} must be {list(AXES)}, with \"pp\", \"cp\" "
            f"and/or \"ep\" beside them if wanted, each once, in some order."
        )
    if any(s == 0 or s < -1 for s in sizes) or sizes.count(-1) > 1:
        raise ConfigError(
            f"model.mesh_shape sizes {list(sizes)} must be positive, with at most one -1."
        )
    known = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        if num_devices % known:
            raise ConfigError(
                f"model.mesh_shape {list(sizes)} cannot fill -1: {num_devices} devices are not "
                f"divisible by {known}; choose sizes whose product divides {num_devices}."
            )
        sizes = tuple(num_devices // known if s == -1 else s for s in sizes)
    if math.prod(sizes) != num_devices:
        arithmetic = " × ".join(map(str, sizes))
        raise ConfigError(
            f"model.mesh_shape {list(sizes)} needs {arithmetic} = {math.prod(sizes)} devices but "
            f"{num_devices} are available; make the product {num_devices} or use -1 on one axis"
            f"{cpu_hint(math.prod(sizes))}."
        )
    return MeshShape(tuple(sizes), tuple(names))


def cpu_hint(wanted: int) -> str:
    """What to do when JAX runs on the CPU but the mesh was meant for accelerators."""
    if not backend.is_cpu():
        return ""
    gpu = (", or for this machine's NVIDIA GPUs install JAX's CUDA wheels (pip install -c "
           "constraints.txt -e '.[cuda]')" if nvidia_gpus_present() else "")
    processes = jax.process_count()
    if processes == 1:
        return (f"; JAX runs on the CPU here: to simulate {wanted} devices set "
                f"XLA_FLAGS=--xla_force_host_platform_device_count={wanted}{gpu}")
    if wanted % processes:
        return (f"; JAX runs on the CPU here, in {processes} processes: a simulated mesh needs a "
                f"device count divisible by {processes}{gpu}")
    # The flag counts one process's devices: each of the job's processes gets that many.
    return (f"; JAX runs on the CPU here: to simulate {wanted} devices over {processes} "
            f"processes set XLA_FLAGS=--xla_force_host_platform_device_count="
            f"{wanted // processes} (devices per process){gpu}")


def nvidia_gpus_present() -> bool:
    """Whether the machine has NVIDIA GPUs, whatever JAX was installed with."""
    return Path("/dev/nvidiactl").exists() or shutil.which("nvidia-smi") is not None


def _split(mesh_shape: Sequence[Any]) -> tuple[tuple[int, ...], tuple[str, ...]]:
    try:
        sizes, names = mesh_shape
        sizes, names = tuple(int(s) for s in sizes), tuple(str(n) for n in names)
    except (TypeError, ValueError):
        raise ConfigError(
            f"model.mesh_shape={mesh_shape!r} must look like [[4,2],[\"fsdp\",\"tp\"]]."
        ) from None
    if len(sizes) != len(names):
        raise ConfigError(
            f"model.mesh_shape gives {len(sizes)} sizes for {len(names)} axis names."
        )
    return sizes, names


def create_mesh(shape: MeshShape, devices: Sequence[jax.Device] | None = None,
                processes_per_node: int = 1) -> Mesh:
    """Arranges devices into the mesh with Auto axis types (sharded matmuls need Auto)."""
    devices = list(devices if devices is not None else jax.devices())
    grid = _device_grid(shape, devices, processes_per_node)
    return Mesh(grid, shape.names, axis_types=(AxisType.Auto,) * len(shape.names))


def _device_grid(shape: MeshShape, devices: list[jax.Device], per_node: int) -> np.ndarray:
    """Device array in the order of `shape.names`: tp groups inside a process, else a node."""
    if {PP, CP, EP} & set(shape.names):
        grid = _ordered_grid(shape, devices)
        present = [axis for axis in ORDER if axis in shape.names]
        return grid.transpose([present.index(n) for n in shape.names])
    fsdp, tp = shape.fsdp, shape.tp
    nprocs = len({d.process_index for d in devices})
    local = len(devices) // nprocs
    if nprocs == 1:
        grid = mesh_utils.create_device_mesh((fsdp, tp), devices)
    elif local % tp == 0:
        grid = mesh_utils.create_hybrid_device_mesh(
            (local // tp, tp), (nprocs, 1), devices, process_is_granule=True)
    else:
        # tp spans processes; ranks of a node are consecutive, so consecutive devices in
        # (process, id) order keep each tp group on as few nodes as possible.
        if tp > local * per_node:
            log.warning(
                "model.mesh_shape puts tp=%d across nodes of %d devices: every layer will "
                "communicate over the network; prefer tp <= %d and more fsdp.",
                tp, local * per_node, local * per_node)
        grid = np.empty(len(devices), dtype=object)
        grid[:] = sorted(devices, key=lambda d: (d.process_index, d.id))
        grid = grid.reshape(fsdp, tp)
    return grid if shape.names == AXES else grid.T


def _ordered_grid(shape: MeshShape, devices: list[jax.Device]) -> np.ndarray:
    """The axes present in ORDER ([pp, fsdp, ep, cp, tp]): devices in (process, id) order, so tp
    is innermost (inside a process), cp and ep next, and pp outermost: consecutive processes
    (one node's) form a stage, stages span nodes."""
    sizes = tuple(shape.size(axis) for axis in ORDER if axis in shape.names)
    if len({d.process_index for d in devices}) == 1:
        return mesh_utils.create_device_mesh(sizes, devices)
    grid = np.empty(len(devices), dtype=object)
    grid[:] = sorted(devices, key=lambda d: (d.process_index, d.id))
    return grid.reshape(sizes)
