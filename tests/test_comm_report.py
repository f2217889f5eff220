"""The communication report: HLO forms it reads, loop counting, mesh axes, gradient sync."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from helpers import TINY, compiled_run, compose_config, mesh_arg
from tunix_train.analysis import comm_report
from tunix_train.analysis import hlo
from tunix_train.parallel import mesh as mesh_lib
from tunix_train.parallel.collectives import cpu_safe_reduction


@pytest.fixture(scope="module")
def mesh_2x4():
    return mesh_lib.create_mesh(mesh_lib.parse([[2, 4], ["fsdp", "tp"]], 8))


@pytest.mark.parametrize("attrs", [
    "replica_groups={{0,4},{1,5},{2,6},{3,7}}",
    "replica_groups=[4,2]<=[2,4]T(1,0)",
    "replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_0'}",
    "replica_groups=mesh['axis_0'=4,'axis_1'=2], device_ids=([2,4]T(1,0)) {'axis_1'}",
])
def test_every_printed_form_of_fsdp_groups_maps_to_fsdp(mesh_2x4, attrs):
    groups = comm_report.device_groups(attrs, 8)
    assert sorted(map(sorted, groups)) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert comm_report.axes_of(groups, mesh_2x4) == "fsdp"


def test_groups_spanning_both_axes_and_permutes(mesh_2x4):
    assert comm_report.axes_of(comm_report.device_groups("replica_groups={}", 8),
                               mesh_2x4) == "fsdp+tp"
    pairs = comm_report.device_groups("source_target_pairs={{0,1},{1,2},{2,3},{3,0}}", 8)
    assert comm_report.axes_of(pairs, mesh_2x4) == "tp"


def test_collectives_inside_loops_count_once_per_trip():
    """A scan of 5 all-reduces and a bf16 reduce-scatter, compiled on 8 CPU devices."""
    mesh = mesh_lib.create_mesh(mesh_lib.parse([[8, 1], ["fsdp", "tp"]], 8))

    def per_device(x):
        step = lambda c, _: (c + jax.lax.psum(c, "fsdp") * 0.5, None)  # noqa: E731
        summed, _ = jax.lax.scan(step, x[0], None, length=5)
        scattered = jax.lax.psum_scatter(x[0].astype(jnp.bfloat16), "fsdp", tiled=True)
        return summed, scattered.astype(jnp.float32)

    fn = jax.shard_map(per_device, mesh=mesh, in_specs=P("fsdp"),
                       out_specs=(P("fsdp"), P("fsdp")))
    x = jax.ShapeDtypeStruct((8, 64, 32), jnp.float32, sharding=NamedSharding(mesh, P("fsdp")))
    report = comm_report.from_hlo(hlo.parse(jax.jit(fn).lower(x).compile().as_text()), mesh)
    assert report.total(kind="all-reduce", axis="fsdp") == (5, 5 * 64 * 32 * 4)
    [scatter] = [c for c in report.collectives if c.kind == "reduce-scatter"]
    assert (scatter.dtype, scatter.count, scatter.bytes) == ("bf16", 1, 64 * 32 * 2)


def test_a_widened_reduction_under_autodiff_counts_in_its_own_dtype():
    """A CPU backend carries a bf16 reduction in fp32 (collectives.cpu_safe_reduction names
    it so); under jax.grad, as the pipeline's reduce-scatter over pp runs, the name reads
    `jvp(cpu_widened_from_bfloat16)` in the op name."""
    mesh = mesh_lib.create_mesh(mesh_lib.parse([[8, 1], ["fsdp", "tp"]], 8))
    scatter = cpu_safe_reduction(lambda v: jax.lax.psum_scatter(v, "fsdp", tiled=True))

    def loss(x):
        return jnp.sum(scatter(x.astype(jnp.bfloat16)).astype(jnp.float32) ** 2)

    fn = jax.shard_map(jax.grad(loss), mesh=mesh, in_specs=P("fsdp"), out_specs=P("fsdp"))
    x = jax.ShapeDtypeStruct((8 * 64, 32), jnp.float32, sharding=NamedSharding(mesh, P("fsdp")))
    report = comm_report.from_hlo(hlo.parse(jax.jit(fn).lower(x).compile().as_text()), mesh)
    [scattered] = [c for c in report.collectives if c.kind == "reduce-scatter"]
    assert (scattered.dtype, scattered.bytes) == ("bf16", 64 * 32 * 2)


@pytest.fixture(scope="module")
def sync_runs():
    """accumulation 2 on fsdp 2 × tp 4, reduced every micro-step or once per step."""
    runs = {}
    for every in (1, 2):
        cfg = compose_config(*TINY, mesh_arg(2, 4), "training.micro_batch_size=1",
                             "training.gradient_accumulation_steps=2",
                             f"training.sync_gradients_every={every}")
        _, analysis, losses, _ = compiled_run(cfg, steps=3)
        runs[every] = (analysis.comm, losses)
    return runs


def test_gradient_reductions_per_step_are_accumulation_over_sync_every(sync_runs):
    assert sync_runs[1][0].gradient_reductions_per_step == 2
    assert sync_runs[2][0].gradient_reductions_per_step == 1
    np.testing.assert_allclose(sync_runs[2][1], sync_runs[1][1], rtol=1e-5)


def test_hybrid_mesh_communicates_each_kind_on_its_axis(sync_runs):
    report = sync_runs[1][0]
    param_gathers = {c.axis for c in report.collectives
                     if c.kind == "all-gather" and c.phase == "forward" and c.dtype == "f32"}
    assert "fsdp" in param_gathers
    assert {c.axis for c in report.collectives if c.phase == "gradient sync"} == {"fsdp"}
    for phase in ("forward", "backward"):  # tensor parallelism's activation reductions
        assert report.total(kind="all-reduce", axis="tp", phase=phase)[0] > 0


def test_tensor_parallel_mesh_communicates_on_tp_only():
    cfg = compose_config(*TINY, mesh_arg(1, 8), "model.num_heads=8")
    _, analysis, _, _ = compiled_run(cfg, steps=0)
    axes = {c.axis for c in analysis.comm.collectives}
    assert axes == {"tp"}
    for phase in ("forward", "backward"):
        assert analysis.comm.total(axis="tp", phase=phase)[0] > 0


def test_flops_count_every_trip_of_a_loop():
    """XLA's cost_analysis() counts a loop body once; hlo.flops multiplies by its trips."""

    def matmuls(x):
        return jax.lax.scan(lambda c, _: (c @ x, None), x, None, length=5)[0]

    x = jax.ShapeDtypeStruct((64, 64), jnp.float32)
    module = hlo.parse(jax.jit(matmuls).lower(x).compile().as_text())
    assert hlo.flops(module) == 5 * 2 * 64**3


# Two lines in the form XLA prints for an H100 (jax 0.11): a cuBLAS product and cuDNN's flash
# attention forward, the way large matmuls and attention appear there instead of `dot`s.
GPU_HLO = """
HloModule jit_step

ENTRY %main.1 (p0: bf16[4096,6912], p1: bf16[6912,1152], q: bf16[2,128,4,32], k: bf16[2,128,1,32], v: bf16[2,128,1,32], b: bf16[2,4,128,128]) -> bf16[4096,1152] {
  %p0 = bf16[4096,6912]{1,0} parameter(0)
  %p1 = bf16[6912,1152]{1,0} parameter(1)
  %q = bf16[2,128,4,32]{3,2,1,0} parameter(2)
  %k = bf16[2,128,1,32]{3,2,1,0} parameter(3)
  %v = bf16[2,128,1,32]{3,2,1,0} parameter(4)
  %b = bf16[2,4,128,128]{3,2,1,0} parameter(5)
  %gemm = (bf16[4096,1152]{1,0}, s8[4194304]{0}) custom-call(%p0, %p1), custom_call_target="__cublas$gemm", backend_config={"gemm_backend_config":{"alpha_real":1,"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]}}}
  %fmha = (bf16[2,4,128,32]{3,1,2,0}, f32[2,4,128]{2,1,0}, u8[256]{0}) custom-call(%q, %k, %v, %b), custom_call_target="__cudnn$fmhaScaleBiasSoftmax", operand_layout_constraints={bf16[2,128,4,32]{3,2,1,0}, bf16[2,128,1,32]{3,2,1,0}, bf16[2,128,1,32]{3,2,1,0}, bf16[2,4,128,128]{3,2,1,0}}, api_version=API_VERSION_STATUS_RETURNING
  ROOT %out = bf16[4096,1152]{1,0} get-tuple-element(%gemm), index=0
}
"""


def test_flops_count_gpu_library_calls():
    expected = 2 * 4096 * 1152 * 6912 + 4 * 2 * 4 * 128 * 128 * 32
    assert hlo.flops(hlo.parse(GPU_HLO)) == expected
