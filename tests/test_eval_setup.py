"""Where a run is evaluated (evaluation/setup.py): on its own mesh when this machine holds it;
on one device, saying why, only when the mesh does not fit; any other mistake in the config
stops in its own line instead of passing for a mesh that does not fit."""
import jax
import pytest

from configs import tiny
from errors import ConfigError
from evaluation.setup import eval_setup


def test_a_run_whose_mesh_fits_is_evaluated_on_it():
    lines = []
    config, mesh = eval_setup(tiny.get_config(), lines.append)
    assert dict(mesh.shape) == {"data": 1, "fsdp": 2, "sequence": 4, "tensor": 1}
    assert config.attention.impl == "ring" and config.attention.layout == "striped"
    assert lines == []


def test_only_a_mesh_that_does_not_fit_falls_back_to_one_device():
    c = tiny.get_config()
    c.mesh.update(sequence=8)  # 16 devices, 8 here
    lines = []
    config, mesh = eval_setup(c, lines.append)
    assert mesh.devices.size == 1 and jax.device_count() == 8
    assert (config.attention.impl, config.attention.layout) == ("dense", "contiguous")
    assert len(lines) == 1 and "mesh does not fit" in lines[0]
    assert "1x2x8x1" in lines[0] and "has 16 devices but 8 are available" in lines[0]


@pytest.mark.parametrize("sequence", [4, 8])
def test_any_other_mistake_stops_in_its_own_line(sequence):
    """A field no device count mends (here an activation this model has not), on a mesh that
    fits and on one that does not: the field's own line, no fallback."""
    c = tiny.get_config()
    c.mesh.update(sequence=sequence)
    c.model.mlp_activation = "relu"
    lines = []
    with pytest.raises(ConfigError) as e:
        eval_setup(c, lines.append)
    assert str(e.value) == "model.mlp_activation='relu' is not one of silu, gelu_tanh"
    assert lines == []
