"""Mesh construction and the logical-axis rules table."""
import pytest
from jax.sharding import PartitionSpec as P

from errors import MeshError
from parallel.mesh import fit_spec, logical_to_spec, make_mesh, mesh_shape


def test_fill_axis_takes_the_remaining_devices():
    assert mesh_shape({"data": 1, "fsdp": -1, "sequence": 4, "tensor": 1}, 8) == \
        {"data": 1, "fsdp": 2, "sequence": 4, "tensor": 1}
    with pytest.raises(MeshError, match="cannot fill 8 devices"):
        mesh_shape({"data": 1, "fsdp": -1, "sequence": 3, "tensor": 1}, 8)


def test_params_shard_over_fsdp_and_sequence_and_stacked_layers_stay_whole():
    assert logical_to_spec(("embed", "mlp")) == P(("fsdp", "sequence"), "tensor")
    assert logical_to_spec(("embed", "mlp"), ndim=3) == P(None, ("fsdp", "sequence"), "tensor")


def test_fit_spec_keeps_the_axes_that_divide():
    mesh = make_mesh({"data": 1, "fsdp": 2, "sequence": 4, "tensor": 1})
    spec = P(("fsdp", "sequence"), "tensor")
    assert fit_spec(spec, (16, 8), mesh) == P(("fsdp", "sequence"), None)  # tensor is size 1
    assert fit_spec(spec, (6, 8), mesh) == P("fsdp", None)  # 6 splits 2 ways, not 8
    assert fit_spec(spec, (3, 8), mesh) == P(None, None)
