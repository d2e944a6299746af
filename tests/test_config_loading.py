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
                            "configs/"),
    ("configs/tyni.py", [], "--config configs/tyni.py: no such file; nearest: configs/tiny.py"),
    ("configs/tiny.py", ["model.depth=3"], "config.model.depth: no such field"),
    ("configs/tiny.py", ["train.stepz=3"], "config.train.stepz: no such field; nearest: train.steps,"),
    ("configs/tiny.py", ["modle.num_layers=3"],
     "config.modle.num_layers: no such field; nearest: model.num_layers,"),
    ("configs/tiny.py", ["xyzzy=3"], "config.xyzzy: no such field; the config has: attention, "
                                     "checkpoint, data, distributed, dpo, mesh, model, name, train, "
                                     "wandb"),
    ("configs/tiny.py", ["model.num_layers=two"], "config.model.num_layers='two': expected a int"),
    ("configs/tiny.py", ["attention.document_mask=maybe"],
     "config.attention.document_mask='maybe': expected a bool"),
    ("configs/tiny.py", ["model.num_layers"], "override 'model.num_layers' is not FIELD=VALUE"),
])
def test_bad_file_or_override_is_one_line(path, overrides, message):
    with pytest.raises(ConfigFileError, match="^" + message.replace("(", r"\(").replace(".", r"\.")):
        load(path, overrides)


def test_a_config_file_argument_reaches_get_config(tmp_path):
    """``FILE.py:ARG`` (train.py's spelling) works in the scripts too: configs/from_run.py takes
    a run directory's saved config over the base defaults, set to start from its weights."""
    rng = np.random.default_rng()
    saved = tiny.get_config()
    saved.model.num_layers = int(rng.integers(1, 9))
    saved.model.rope_scaling.type = "yarn"
    del saved.train["loss_chunk"]  # a run saved before the field existed reads its default
    (tmp_path / "config.json").write_text(saved.to_json())
    (tmp_path / "tokenizer.json").write_text("{}")
    c = load(f"configs/from_run.py:{tmp_path}", ["train.lr=2e-05"])
    assert c.model.num_layers == saved.model.num_layers and c.model.rope_scaling.type == "yarn"
    assert c.train.loss_chunk == tiny.get_config().train.loss_chunk and c.train.lr == 2e-5
    assert c.checkpoint.restore_from == str(tmp_path) and c.checkpoint.restore_weights_only
    assert c.data.tokenizer == str(tmp_path / "tokenizer.json")
    with pytest.raises(ConfigFileError, match=r"^configs/from_run\.py:.*: not a run directory"):
        load(f"configs/from_run.py:{tmp_path / 'nowhere'}")
