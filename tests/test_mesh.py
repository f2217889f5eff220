import jax
import pytest
from jax.sharding import AxisType

from tunix_train.parallel import mesh as mesh_lib
from tunix_train.config import ConfigError


def test_minus_one_is_filled_from_the_device_count():
    shape = mesh_lib.parse([[-1, 2], ["fsdp", "tp"]], 8)
    assert (shape.fsdp, shape.tp) == (4, 2)


def test_product_mismatch_names_the_arithmetic():
    with pytest.raises(ConfigError, match=r"needs 4 × 1 = 4 devices but 8 are available"):
        mesh_lib.parse([[4, 1], ["fsdp", "tp"]], 8)
    with pytest.raises(ConfigError, match=r"needs 2 × 2 × 1 = 4 devices but 8 are available"):
        mesh_lib.parse([[2, 2, 1], ["pp", "fsdp", "tp"]], 8)


def test_the_simulated_device_advice_counts_one_processs_devices(monkeypatch):
    """XLA_FLAGS's count is per process: under a launcher of 2 processes a 16-device mesh
    needs 8 each (following the whole count would ask for twice the devices)."""
    with pytest.raises(ConfigError, match=r"device_count=16\.$"):  # one process: all of them
        mesh_lib.parse([[8, 2], ["fsdp", "tp"]], 8)
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    with pytest.raises(ConfigError, match=r"to simulate 16 devices over 2 processes set "
                                          r"XLA_FLAGS=--xla_force_host_platform_device_count=8 "
                                          r"\(devices per process\)"):
        mesh_lib.parse([[8, 2], ["fsdp", "tp"]], 8)
    with pytest.raises(ConfigError, match="device count divisible by 2"):
        mesh_lib.parse([[3, 1], ["fsdp", "tp"]], 8)


def test_a_pipeline_axis_is_optional_and_filled_like_the_others():
    shape = mesh_lib.parse([[2, -1, 2], ["pp", "fsdp", "tp"]], 16)
    assert (shape.pp, shape.fsdp, shape.tp) == (2, 4, 2)
    assert mesh_lib.parse([[8, 1], ["fsdp", "tp"]], 8).pp == 1
    mesh = mesh_lib.create_mesh(mesh_lib.parse([[2, 2, 2], ["pp", "fsdp", "tp"]], 8))
    assert dict(mesh.shape) == {"pp": 2, "fsdp": 2, "tp": 2}
    with pytest.raises(ConfigError,
                       match=r"must be \['fsdp', 'tp'\], with \"pp\", \"cp\" and/or \"ep\""):
        mesh_lib.parse([[2, 4], ["pp", "fsdp"]], 8)
    with pytest.raises(ConfigError, match=r"each once"):
        mesh_lib.parse([[2, 2, 2], ["cp", "fsdp", "cp"]], 8)


def test_a_context_axis_sits_between_fsdp_and_tp_in_the_device_grid():
    """cp communicates every attention layer: its groups are consecutive devices (one node's),
    inside tp's neighbours, with fsdp spanning them and pp outermost."""
    shape = mesh_lib.parse([[2, 2, -1, 1], ["pp", "fsdp", "cp", "tp"]], 8)
    assert (shape.pp, shape.fsdp, shape.cp, shape.tp) == (2, 2, 2, 1)
    mesh = mesh_lib.create_mesh(mesh_lib.parse([[2, 2, 2], ["fsdp", "cp", "tp"]], 8))
    assert dict(mesh.shape) == {"fsdp": 2, "cp": 2, "tp": 2}
    ids = [[[d.id for d in row] for row in block] for block in mesh.devices]
    assert sorted(sum(sum(ids, []), [])) == list(range(8))
    swapped = mesh_lib.create_mesh(mesh_lib.parse([[2, 2, 2], ["tp", "cp", "fsdp"]], 8))
    assert (swapped.devices == mesh.devices.transpose(2, 1, 0)).all()


@pytest.mark.parametrize("bad", [[[4], ["fsdp", "tp"]], [[4, 2], ["data", "tp"]], "4x2",
                                 [[-1, -1], ["fsdp", "tp"]], [[0, 8], ["fsdp", "tp"]]])
def test_malformed_mesh_shapes_are_config_errors(bad):
    with pytest.raises(ConfigError, match="model.mesh_shape"):
        mesh_lib.parse(bad, 8)


def test_mesh_has_auto_axes_and_tp_is_the_fast_axis():
    mesh = mesh_lib.create_mesh(mesh_lib.parse([[4, 2], ["fsdp", "tp"]], 8))
    assert dict(mesh.shape) == {"fsdp": 4, "tp": 2}
    assert all(t == AxisType.Auto for t in mesh.axis_types)
    assert sorted(d.id for d in mesh.devices.flat) == [d.id for d in jax.devices()]


def test_axis_order_may_be_swapped():
    mesh = mesh_lib.create_mesh(mesh_lib.parse([[2, 4], ["tp", "fsdp"]], 8))
    assert dict(mesh.shape) == {"tp": 2, "fsdp": 4}
