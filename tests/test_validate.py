"""Every bad config value stops with one line naming the field and what would be valid."""
import os
import subprocess
import sys

import pytest

from configs import tiny
from errors import ConfigError
from configs.validate import validate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cfg(**overrides):
    c = tiny.get_config()
    for key, value in overrides.items():
        section, field = key.split("__")
        c[section][field] = value
    return c


def test_tiny_config_is_valid_on_8_devices():
    assert validate(tiny.get_config(), 8) == {"data": 1, "fsdp": 2, "sequence": 4, "tensor": 1}


@pytest.mark.parametrize("overrides,devices,message", [
    ({"attention__layout": "spiral"}, 8, "attention.layout='spiral' is not one of contiguous, striped, zigzag"),
    ({"attention__impl": "flash"}, 8, "attention.impl='flash' is not one of ring, allgather, ulysses, usp, dense"),
    ({"data__seq_len": 510}, 8, "data.seq_len: seq_len 510 is not divisible by shards x stripe width (4 x 1 = 4)"),
    ({"data__seq_len": 516, "attention__layout": "zigzag"}, 8, "not divisible by 2 x shards (2 x 4 = 8) for the zigzag layout"),
    ({"attention__block_q": 48}, 8, "attention.block_q=48 does not divide the per-device chunk of 128 tokens (seq_len 512 / 4 sequence shards); valid attention.block_q: 1, 2, 4, 8, 16, 32, 64, 128"),
    ({"mesh__fsdp": 4}, 8, "mesh 1x4x4x1 (data x fsdp x sequence x tensor) has 16 devices but 8 are available"),
    ({"mesh__fsdp": -1, "mesh__data": -1}, 8, "only one mesh axis may be -1"),
    ({"mesh__fsdp": -1, "mesh__sequence": 3}, 8, "mesh.fsdp=-1 cannot fill 8 devices"),
    ({"mesh__tensor": 2, "mesh__fsdp": 1, "model__num_kv_heads": 1}, 8, "model.num_kv_heads=1 is not divisible by mesh.tensor=2"),
    ({"mesh__tensor": 8, "mesh__fsdp": 1, "mesh__sequence": 1}, 8, "model.num_heads=4 is not divisible by mesh.tensor=8"),
    ({"model__num_kv_heads": 3}, 8, "model.num_kv_heads=3 must divide model.num_heads=4"),
    ({"train__steps": -5}, 8, "train.steps=-5 must be >= 1"),
    ({"train__lr": 0.0}, 8, "train.lr=0.0 must be > 0"),
    ({"train__warmup_steps": -1}, 8, "train.warmup_steps=-1 must be >= 0"),
    ({"model__mlp_chunk": -1}, 8, "model.mlp_chunk=-1 must be >= 0"),
    ({"model__sliding_window": -4}, 8, "model.sliding_window=-4 must be an int >= 0 (0: full attention; W: a query at position p sees keys p - W < k <= p)"),
    ({"train__loss_chunk": -8}, 8, "train.loss_chunk=-8 must be >= 0"),
    ({"train__microbatches": 3}, 8, "train.microbatches=3 must be >= 1 and divide the rows per data x fsdp group (data.batch_size 8 / 2 = 4); valid: 1, 2, 4"),
    ({"train__microbatches": 0}, 8, "train.microbatches=0 must be >= 1"),
    ({"data__batch_size": 3}, 8, "data.batch_size=3 must be a positive multiple of mesh data x fsdp = 2"),
    ({"data__source": "s3"}, 8, "data.source='s3' is not one of stdlib, text, jsonl, parquet, hf, tfds"),
    ({"model__dtype": "float16"}, 8, "model.dtype='float16' is not one of float32, bfloat16, auto"),
    ({"model__remat": "some"}, 8, "model.remat='some' is not one of none, attention, full, offload"),
    ({"wandb__mode": "cloud"}, 8, "wandb.mode='cloud' is not one of disabled, offline, online"),
    ({"train__on_nonfinite": "ignore"}, 8, "train.on_nonfinite='ignore' is not one of stop, rollback"),
    ({"train__max_rollbacks": -1}, 8, "train.max_rollbacks=-1 must be >= 0"),
    ({"data__bad_records": "drop"}, 8, "data.bad_records='drop' is not one of stop, skip"),
    ({"data__format": "dialogue"}, 8, "data.format='dialogue' is not one of text, chat"),
    ({"data__format": "chat"}, 8, "data.format=chat reads records from data.source=jsonl or hf, not 'stdlib'"),
    ({"data__format": "chat", "data__source": "jsonl", "data__tokenizer": "t.json",
      "data__train_on": "user"}, 8, "data.train_on='user' is not one of assistant, last_assistant, all"),
    ({"data__format": "chat", "data__source": "jsonl", "data__tokenizer": "t.json",
      "data__too_long": "wrap"}, 8, "data.too_long='wrap' is not one of drop, truncate"),
    ({"data__format": "chat", "data__source": "hf"}, 8, "data.format=chat needs the model's tokenizer and its chat template: set data.tokenizer"),
    ({"distributed__heartbeat_timeout_s": 0}, 8, "distributed.heartbeat_timeout_s=0 must be >= 1"),
    ({"distributed__init_timeout_s": 0}, 8, "distributed.init_timeout_s=0 must be >= 1 (seconds)"),
    ({"distributed__step_timeout_s": -1.0}, 8, "distributed.step_timeout_s=-1.0 must be >= 0 (seconds; 0: automatic)"),
    ({}, 1, "has 8 devices but 1 are available"),
    ({"attention__kernel": "triton"}, 8, "attention.kernel='triton' is not one of auto, xla, pallas_gpu, pallas_tpu"),
    ({"attention__kernel": "pallas_gpu", "attention__pallas_block_q": 48}, 8, "attention.pallas_block_q=48 does not divide the per-device chunk of 128 tokens"),
    ({"attention__pallas_block_kv": -1}, 8, "attention.pallas_block_kv=-1 must be >= 0 (0: the kernel's default)"),
    ({"attention__impl": "ulysses"}, 8, "attention.impl=ulysses: ulysses splits heads over the 4-way sequence axis, but query heads (4) and kv heads (2) per tensor shard are not both divisible by 4; sequence axis sizes that work: 1, 2 (or usp/ring/allgather)"),
    ({"attention__impl": "usp", "attention__ulysses": 4}, 8, "attention.ulysses=4: usp ulysses degree 4 must divide the sequence axis (4) and both query heads (4) and kv heads (2) per tensor shard; valid: 1, 2"),
    ({"attention__impl": "usp", "attention__ulysses": 0}, 8, "attention.ulysses=0: usp ulysses degree 0 must divide"),
    ({"attention__impl": "usp", "mesh__tensor": 2, "mesh__fsdp": 1}, 8, "attention.ulysses=2: usp ulysses degree 2 must divide the sequence axis (4) and both query heads (2) and kv heads (1) per tensor shard; valid: 1"),
    # Qwen2.5-7B's heads (28/4) over a 4-way tensor axis: 7/1 per shard split over no U but 1.
    ({"attention__impl": "usp", "mesh__tensor": 4, "mesh__sequence": 2, "mesh__fsdp": 1,
      "model__num_heads": 28, "model__num_kv_heads": 4, "model__head_dim": 16}, 8,
     "attention.ulysses=2: usp ulysses degree 2 must divide the sequence axis (2) and both query heads (7) and kv heads (1) per tensor shard; valid: 1"),
    ({"attention__impl": "allgather", "attention__block_kv": 48}, 8, "attention.block_kv=48 does not divide the per-device chunk of 128 tokens"),
    ({"data__min_doc_tokens": -1}, 8, "data.min_doc_tokens=-1 must be >= 0 (0 keeps every document)"),
    ({"data__long_doc_upsample": 0, "data__long_doc_tokens": 512}, 8, "data.long_doc_upsample=0 must be >= 1"),
    ({"data__long_doc_upsample": 4}, 8, "data.long_doc_upsample=4 needs data.long_doc_tokens > 0"),
    ({"data__source": "jsonl", "data__mixture": "a.jsonl=2,b.jsonl=-1"}, 8, "data.mixture entry 'b.jsonl=-1': weight '-1' must be a finite number > 0"),
    ({"data__mixture": "a.txt=1"}, 8, "data.mixture needs data.source text, jsonl, parquet, hf or tfds"),
])
def test_bad_value_gives_one_clear_line(overrides, devices, message):
    with pytest.raises(ConfigError) as e:
        validate(cfg(**overrides), devices)
    assert message in str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("impl,overrides", [("allgather", {}), ("usp", {}),
                                            ("ulysses", {"mesh__sequence": 2, "mesh__fsdp": 4})])
def test_every_strategy_validates(impl, overrides):
    assert validate(cfg(attention__impl=impl, **overrides), 8)["sequence"] in (2, 4)


def test_auto_kernel_tiles_follow_the_platform():
    """auto resolves per platform, and so do the tile fields that get checked: the xla tile is
    not looked at when a GPU would run the Pallas kernel, and vice versa."""
    c = cfg(attention__block_q=48)  # bad for xla only
    with pytest.raises(ConfigError, match="attention.block_q=48"):
        validate(c, 8, platform="cpu")
    validate(c, 8, platform="gpu")
    c = cfg(attention__pallas_block_q=48)  # bad for the Pallas kernels only
    validate(c, 8, platform="cpu")
    with pytest.raises(ConfigError, match=r"attention.pallas_block_q=48 .*\[kernel pallas_tpu\]"):
        validate(c, 8, platform="tpu")


@pytest.mark.parametrize("overrides,platform,message", [
    ({"attention__pallas_block_q": 8}, "gpu", "attention.pallas_block_q=8: the Triton kernel (pallas_gpu) needs powers of two >= 16 dividing the chunk of 128 tokens [kernel pallas_gpu]"),
    ({"model__head_dim": 40}, "gpu", "head dim 40 (model.head_dim, or d_model / num_heads): the Triton kernel (pallas_gpu) needs a power of two >= 16; use attention.kernel=xla"),
    ({"attention__pallas_block_kv": 64}, "tpu", "attention.pallas_block_kv=64: the Mosaic kernel (pallas_tpu) needs a multiple of 128 dividing the chunk of 128 tokens, or the chunk itself"),
])
def test_pallas_tiles_meet_the_kernel_rules(overrides, platform, message):
    """Tiles the real kernel cannot run stop before compiling, in one line; on a CPU (interpret
    mode) the same values run."""
    with pytest.raises(ConfigError) as e:
        validate(cfg(**overrides), 8, platform=platform)
    assert message in str(e.value) and "\n" not in str(e.value)
    validate(cfg(**overrides), 8, platform="cpu")


# Bad values on train.py's command line: each stops before anything compiles or is written.
ONE_LINE = [
    ("--config.attention.layout=spiral", {"attention__layout": "spiral"},
     "error: attention.layout='spiral' is not one of"),
    ("--config.train.steps=-1", {"train__steps": -1}, "error: train.steps=-1 must be >= 1"),
    ("--config.data.mixture=books.jsonl:2", {"data__mixture": "books.jsonl:2"},
     "error: data.mixture needs data.source text, jsonl"),
]


def one_error_line(code, err, message, workdir):
    assert code == 2, err
    lines = [l for l in err.splitlines() if l.startswith("error:")]
    assert len(lines) == 1 and message in lines[0], err
    assert "Traceback" not in err
    assert not (workdir / "checkpoints").exists()


def test_cli_prints_one_line_and_no_traceback(tmp_path):
    """train.py itself, once: the flag parsed into the config, which its entry validates; the
    other values take the same path from the entry on (test_the_entry_stops_*)."""
    flag, _, message = ONE_LINE[-1]
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "train.py", "--config", "configs/tiny.py",
                           "--workdir", str(tmp_path / "run"), flag],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    one_error_line(proc.returncode, proc.stderr, message, tmp_path / "run")


@pytest.mark.parametrize("flag,overrides,message", ONE_LINE, ids=[f for f, _, _ in ONE_LINE])
def test_the_entry_stops_in_one_line_with_exit_code_2(tmp_path, capsys, flag, overrides, message):
    """What train.py does with the parsed config (training/entry.py's main_with_errors), here in
    this process: one error line on stderr, exit code 2, nothing written."""
    from parallel.cluster import Place
    from training.entry import main_with_errors
    code = main_with_errors(cfg(**overrides), tmp_path / "run", Place("one process"))
    one_error_line(code, capsys.readouterr().err, message, tmp_path / "run")


def moe_cfg(**moe):
    c = tiny.get_config()
    c.model.moe.update(num_experts=8, top_k=2)
    c.model.moe.update(**moe)
    return c


@pytest.mark.parametrize("moe,model,message", [
    ({"num_experts": -1}, {}, "model.moe.num_experts=-1 must be an int >= 0 (0: the dense MLP)"),
    ({"top_k": 0}, {}, "model.moe.top_k=0 must be an int in [1, 8] (experts per token, at most model.moe.num_experts=8)"),
    ({"top_k": 9}, {}, "model.moe.top_k=9 must be an int in [1, 8]"),
    ({"expert_dim": -2}, {}, "model.moe.expert_dim=-2 must be >= 0 (each expert's hidden width; 0: model.ffn_dim)"),
    ({"router": "sigmoid"}, {}, "model.moe.router='sigmoid' is not one of softmax_topk, topk_softmax"),
    ({"grouped": "cutlass"}, {}, "model.moe.grouped='cutlass' is not one of auto, ragged, blocks, dense"),
    ({"capacity": -1.0}, {}, "model.moe.capacity=-1.0 must be >= 0 (picks an expert takes as a multiple of its even share; 0: dropless)"),
    ({"capacity": 1.25, "grouped": "dense"}, {}, "model.moe.capacity=1.25 with model.moe.grouped=dense: dense computes every expert"),
    ({"aux_loss": -0.01}, {}, "model.moe.aux_loss=-0.01 must be >= 0 (the loss's weight; 0: off)"),
    ({"z_loss": -1e-3}, {}, "model.moe.z_loss=-0.001 must be >= 0"),
    ({"every": 0}, {}, "model.moe.every=0 must be an int >= 1 (layer i is a mixture of experts when (i + 1) % every == 0"),
    ({"first_dense": 2}, {}, "model.moe.first_dense=2 must be an int in [0, 1] (the first k of model.num_layers=2 layers dense: DeepSeek's first_k_dense_replace)"),
    ({"dense_layers": "0,x"}, {}, "model.moe.dense_layers='0,x': 'x' is not a layer index"),
    ({"dense_layers": "2"}, {}, "model.moe.dense_layers='2': layer 2 is out of range for model.num_layers=2 (layers 0 to 1)"),
    ({"dense_layers": "0,0"}, {}, "model.moe.dense_layers='0,0' lists layer 0 twice"),
    ({"every": 3}, {}, "model.moe.num_experts=8 but no layer is a mixture of experts (model.moe.every=3, first_dense=0, dense_layers='': all 2 layers dense); set model.moe.num_experts=0 for a dense model"),
    ({"balance": "row"}, {}, "model.moe.balance='row' is not one of batch, sequence (the load-balancing loss over the whole batch's tokens, or per row of the batch)"),
    ({}, {"mlp_chunk": 128}, "model.mlp_chunk=128 with model.moe.num_experts=8: the chunked MLP is the dense one; set model.mlp_chunk=0 for a mixture of experts"),
    ({"expert_dim": 3}, {}, "model.moe.expert_dim=3 (each expert's width: 3) is not divisible by mesh.tensor=2"),
    ({"num_experts": 0}, {"qk_norm": True, "qk_norm_scope": "projections"}, "model.qk_norm_scope='projections' is not one of head, projection"),
])
def test_bad_moe_value_gives_one_clear_line(moe, model, message):
    c = moe_cfg(**moe)
    c.model.update(**model)
    if "mesh.tensor" in message:
        c.mesh.update(fsdp=1, tensor=2)
    with pytest.raises(ConfigError) as e:
        validate(c, 8)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_moe_fields_are_read_only_with_experts():
    """num_experts 0 (dense) reads no other model.moe field; the MoE configs validate."""
    import importlib
    c = moe_cfg(num_experts=0, top_k=0, router="none", grouped="none")
    c.model.mlp_chunk = 128
    validate(c, 8)
    validate(importlib.import_module("configs.moe_tiny").get_config(), 8)
