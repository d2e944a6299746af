"""hf/mxfp4.py against transformers' MXFP4 reader (gpt-oss's released expert weights): random
blocks and scales dequantize to transformers' tensors bit for bit, in fp32 and bf16, in the
orientation of its model parameters (gate_up_proj [E, D, 2F], down_proj [E, F, D]); a tiny
GptOss checkpoint written with ``quantize_param`` loads in transformers to the tensors
``dequantize_state`` gives; ``quantize`` roundtrips representable values exactly and rounds the
others to the nearest FP4 value (ties to even); config and state errors are one line each."""
import json

import numpy as np
import pytest

# The reference, from requirements-test.txt (make test installs it).
import torch
from transformers import GptOssConfig, GptOssForCausalLM, Mxfp4Config
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from errors import ConversionError
from hf import mxfp4
from hf.safetensors import save

E, D, F = 4, 64, 32  # experts, hidden_size, intermediate_size (multiples of the 32-value block)


def random_mxfp4(rng, rows_shape, groups, low=110, high=140):
    """Random packed bytes (every nibble code) and scales 2^(low-127) .. 2^(high-127)."""
    blocks = rng.integers(0, 256, (*rows_shape, groups, 16), dtype=np.uint8)
    scales = rng.integers(low, high + 1, (*rows_shape, groups), dtype=np.uint8)
    return blocks, scales


def transformers_param(blocks, scales, dtype=torch.float32):
    # What Mxfp4Dequantize.convert returns for the model parameter (the transpose is inside).
    return convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales),
                                      dtype=dtype)


@pytest.mark.parametrize("name,rows,groups,param_shape", [
    ("gate_up_proj", 2 * F, D // 32, [E, D, 2 * F]),  # blocks [E, 2F, D/32, 16]
    ("down_proj", D, 3, [E, 96, D]),  # blocks [E, D, F/32, 16], F = 96 here: not square
    ("gate_up_proj", 24, 2, [E, 64, 24]),
])
def test_dequantize_param_is_transformers_bit_for_bit(name, rows, groups, param_shape):
    rng = np.random.default_rng(0)
    blocks, scales = random_mxfp4(rng, (E, rows), groups)
    ours = mxfp4.dequantize_param(blocks, scales)
    assert ours.dtype == np.float32 and list(ours.shape) == param_shape
    theirs = transformers_param(blocks, scales).numpy()
    assert np.array_equal(ours.view(np.uint32), theirs.view(np.uint32))
    # The loader's default dtype: every FP4 value x 2^k in this range is a bf16.
    theirs_bf16 = transformers_param(blocks, scales, torch.bfloat16)
    assert torch.equal(torch.from_numpy(ours).to(torch.bfloat16).view(torch.int16),
                       theirs_bf16.view(torch.int16))


def test_every_scale_byte_reads_as_transformers():
    # 0 (a subnormal 2^-127), 254 and 255 (past float32's range for some values: inf) included.
    rng = np.random.default_rng(1)
    blocks = rng.integers(0, 256, (2, 256, 2, 16), dtype=np.uint8)
    scales = np.broadcast_to(np.arange(256, dtype=np.uint8)[None, :, None], (2, 256, 2)).copy()
    ours = mxfp4.dequantize_param(blocks, scales)
    theirs = transformers_param(blocks, scales).numpy()
    assert np.isinf(ours).any()
    assert np.array_equal(ours.view(np.uint32), theirs.view(np.uint32))


def test_nibble_order_and_orientation():
    # Byte 0x71: low nibble 1 (+0.5) is value 0, high nibble 7 (+6.0) value 1; 0xF8: -0.0, -6.0.
    blocks = np.zeros((1, 2, 1, 16), np.uint8)
    blocks[0, 1, 0, :2] = [0x71, 0xF8]
    scales = np.array([[[127], [128]]], np.uint8)  # row 1 x 2
    row = mxfp4.dequantize(blocks, scales)  # [1, 2, 32]: the checkpoint's rows
    assert row[0, 1, :4].tolist() == [1.0, 12.0, 0.0, -12.0] and np.signbit(row[0, 1, 2])
    param = mxfp4.dequantize_param(blocks, scales)  # [1, 32, 2]: rows become the last axis
    assert param.shape == (1, 32, 2) and param[0, :4, 1].tolist() == [1.0, 12.0, 0.0, -12.0]


def representable(rng, shape):
    """FP4 values times one power of two per 32-value block, every code (-0.0 too) included."""
    codes = rng.integers(0, 16, shape, dtype=np.uint8)
    exponents = rng.integers(-20, 20, (*shape[:-1], shape[-1] // 32, 1))
    blocked = mxfp4.FP4_VALUES[codes].reshape(*shape[:-1], -1, 32)
    return np.ldexp(blocked, exponents).reshape(shape).astype(np.float32)


def test_representable_values_roundtrip_exactly():
    rng = np.random.default_rng(2)
    w = representable(rng, (E, 2 * F, D))
    blocks, scales = mxfp4.quantize(w)
    assert blocks.dtype == scales.dtype == np.uint8
    assert blocks.shape == (E, 2 * F, D // 32, 16) and scales.shape == (E, 2 * F, D // 32)
    assert np.array_equal(mxfp4.dequantize(blocks, scales).view(np.uint32), w.view(np.uint32))
    # The parameter orientation: [E, D, 2F] -> the checkpoint's [E, 2F, D/32, 16] and back.
    param = np.ascontiguousarray(np.swapaxes(w, 1, 2))
    blocks_param, scales_param = mxfp4.quantize_param(param)
    assert np.array_equal(blocks_param, blocks) and np.array_equal(scales_param, scales)
    assert blocks_param.flags.c_contiguous and scales_param.flags.c_contiguous
    assert np.array_equal(mxfp4.dequantize_param(blocks_param, scales_param), param)


def test_rounding_is_nearest_with_ties_to_even():
    w = np.zeros(32, np.float32)
    w[:15] = [6, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, -0.25, -0.75, -2.5, -5, 0.1, 5.1, -3.2]
    got = mxfp4.dequantize(*mxfp4.quantize(w))  # scale 2^0: max |w| is 6
    assert got[:15].tolist() == [6, 0, 1, 1, 2, 2, 4, 4, -0.0, -1, -2, -4, 0, 6, -3]


def test_random_values_round_to_the_nearest_grid_point():
    rng = np.random.default_rng(3)
    w_bgv = rng.normal(size=(E, 2 * F, D // 32, 32)) * 10.0 ** rng.uniform(-4, 4, (E, 2 * F,
                                                                                    D // 32, 1))
    w = w_bgv.reshape(E, 2 * F, D).astype(np.float32)
    blocks, scales = mxfp4.quantize(w)
    got_bgv = mxfp4.dequantize(blocks, scales).reshape(w_bgv.shape).astype(np.float64)
    w_bgv = w.astype(np.float64).reshape(w_bgv.shape)
    scale = np.ldexp(1.0, scales.astype(np.int64) - 127)[..., None]
    # The scale is the smallest power of two putting the block's max |w| within 6.
    max_scaled = np.abs(w_bgv / scale).max(axis=-1)
    assert (max_scaled <= 6).all() and (max_scaled > 3).all()
    # Within the FP4 grid's half-step there (0.25 below 2, 0.5 below 4, 1 up to 6) x the scale,
    # and no grid value is nearer.
    scaled = np.abs(w_bgv / scale)
    half_step = np.where(scaled <= 2, 0.25, np.where(scaled <= 4, 0.5, 1.0))
    error = np.abs(got_bgv - w_bgv)
    assert (error <= half_step * scale).all()
    grid = np.unique(mxfp4.FP4_VALUES.astype(np.float64))
    nearest = np.abs(grid * scale[..., None] - w_bgv[..., None]).min(axis=-1)
    assert np.array_equal(error, nearest)


def test_tiny_gpt_oss_mxfp4_checkpoint_loads_in_transformers_as_dequantize_state(tmp_path):
    config = GptOssConfig(vocab_size=64, hidden_size=D, intermediate_size=F,
                          num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=16, num_local_experts=E, num_experts_per_tok=2,
                          layer_types=["full_attention"])
    torch.manual_seed(0)
    model = GptOssForCausalLM(config).float()
    rng = np.random.default_rng(4)
    checkpoint = {}
    for name, tensor in model.state_dict().items():
        tensor = tensor.numpy()
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            # Random normals, not the model's: gate_up_proj [E, D, 2F] is square here, and the
            # loaded tensor must be ours whichever axis is which.
            param = rng.normal(size=tensor.shape).astype(np.float32)
            checkpoint[name + "_blocks"], checkpoint[name + "_scales"] = (
                mxfp4.quantize_param(param))
        else:
            checkpoint[name] = tensor
    assert checkpoint["model.layers.0.mlp.experts.gate_up_proj_blocks"].shape == (E, 2 * F,
                                                                                 D // 32, 16)
    assert checkpoint["model.layers.0.mlp.experts.down_proj_blocks"].shape == (E, D, F // 32, 16)
    config.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    save(checkpoint, tmp_path / "model.safetensors", metadata={"format": "pt"})
    assert mxfp4.check_quantization(cfg) == "mxfp4"

    # dequantize=True: transformers' own reference path (Mxfp4Dequantize), on any device.
    loaded = GptOssForCausalLM.from_pretrained(
        tmp_path, dtype=torch.float32, quantization_config=Mxfp4Config(dequantize=True))
    theirs = {name: t.numpy() for name, t in loaded.state_dict().items()}
    ours = mxfp4.dequantize_state(checkpoint)
    assert set(ours) == set(theirs)
    for name, tensor in ours.items():
        assert tensor.shape == theirs[name].shape and tensor.dtype == theirs[name].dtype, name
        assert np.array_equal(tensor.view(np.uint32), theirs[name].view(np.uint32)), name
    assert ours["model.layers.0.mlp.experts.gate_up_proj"].shape == (E, D, 2 * F)
    assert ours["model.layers.0.mlp.experts.down_proj"].shape == (E, F, D)


def test_check_quantization():
    assert mxfp4.check_quantization({"model_type": "llama"}) is None
    assert mxfp4.check_quantization({"quantization_config": {"quant_method": "mxfp4"}}) == "mxfp4"
    with pytest.raises(ConversionError) as refused:
        mxfp4.check_quantization({"quantization_config": {"quant_method": "gptq", "bits": 4}})
    message = str(refused.value)
    assert "\n" not in message and "'gptq'" in message and "mxfp4" in message
    assert "bf16" in message


def test_dequantize_state_pairs_and_errors():
    rng = np.random.default_rng(5)
    blocks, scales = random_mxfp4(rng, (E, 2 * F), D // 32)
    norm = np.ones(D, np.float32)
    state = {"a.gate_up_proj_blocks": blocks, "a.gate_up_proj_scales": scales, "a.norm": norm}
    out = mxfp4.dequantize_state(state)
    assert set(out) == {"a.gate_up_proj", "a.norm"} and out["a.norm"] is norm
    assert np.array_equal(out["a.gate_up_proj"], mxfp4.dequantize_param(blocks, scales))

    def refused(tensors):
        with pytest.raises(ConversionError) as error:
            mxfp4.dequantize_state(tensors)
        assert "\n" not in str(error.value)
        return str(error.value)

    assert "a.gate_up_proj_scales" in refused({"a.gate_up_proj_blocks": blocks})
    assert "a.gate_up_proj_blocks" in refused({"a.gate_up_proj_scales": scales})
    assert "[4, 64, 1]" in refused({"a.gate_up_proj_blocks": blocks,
                                    "a.gate_up_proj_scales": scales[..., :1]})
    assert "float32" in refused({"a.gate_up_proj_blocks": blocks.astype(np.float32),
                                 "a.gate_up_proj_scales": scales})
