"""configs/loading.py: config files and FIELD=VALUE overrides for the scripts outside train.py."""
import numpy as np
import pytest

from configs import tiny
from configs.loading import load
from errors import ConfigFileError


def test_overrides_are_typed_like_the_field_they_replace():
    rng = np.random.default_rng()
    layers, lr = int(rng.integers(1, 9)), float(rng.random())
    c = load("configs/tiny.py", [f"model.num_layers={layers}", f"train.lr={lr!r}",
                                 "attention.document_mask=false", "attention.layout=zigzag"])
    assert c.model.num_layers == layers and isinstance(c.model.num_layers, int)
    assert c.train.lr == lr and c.attention.document_mask is False
    assert c.attention.layout == "zigzag"
    untouched = tiny.get_config()
    assert c.model.d_model == untouched.model.d_model and c.mesh.to_dict() == untouched.mesh.to_dict()


@pytest.mark.parametrize("path,overrides,message", [
    ("configs/nope.py", [], "--config configs/nope.py: no such file; configs: configs/base.py, "
                            "configs/llama_1b.py, configs/llama_3b.py, configs/llama_7b.py, "
                            "configs/tiny.py"),
    ("configs/tyni.py", [], "--config configs/tyni.py: no such file; nearest: configs/tiny.py"),
    ("configs/tiny.py", ["model.depth=3"], "config.model.depth: no such field"),
    ("configs/tiny.py", ["train.stepz=3"], "config.train.stepz: no such field; nearest: train.steps,"),
    ("configs/tiny.py", ["modle.num_layers=3"],
     "config.modle.num_layers: no such field; nearest: model.num_layers,"),
    ("configs/tiny.py", ["xyzzy=3"], "config.xyzzy: no such field; the config has: attention, "
                                     "checkpoint, data, mesh, model, name, train, wandb"),
    ("configs/tiny.py", ["model.num_layers=two"], "config.model.num_layers='two': expected a int"),
    ("configs/tiny.py", ["attention.document_mask=maybe"],
     "config.attention.document_mask='maybe': expected a bool"),
    ("configs/tiny.py", ["model.num_layers"], "override 'model.num_layers' is not FIELD=VALUE"),
])
def test_bad_file_or_override_is_one_line(path, overrides, message):
    with pytest.raises(ConfigFileError, match="^" + message.replace("(", r"\(").replace(".", r"\.")):
        load(path, overrides)
