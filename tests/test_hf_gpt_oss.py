"""scripts/convert_hf.py against transformers for gpt-oss (GptOssForCausalLM): attention sinks,
biases on q, k, v and o, a window on the even layers and full attention on the odd ones, YaRN
unrounded (truncate false), the router's top k logits then a softmax over them with a bias,
experts with biases, gate and up interleaved in one tensor, and the clamped unit (a random
swiglu_limit and swiglu_alpha, so that the clamps bite). A small random fp32 model with every
weight random (sinks, biases and norms too): imported, it gives transformers' logits, greedy
tokens and first step's loss (LM + router_aux_loss_coef x the load-balancing loss) on a batch
with padding; exported, it loads in transformers to the original's logits, its tensors the
checkpoint's bit for bit. Its experts written as the released checkpoints write them (MXFP4
blocks and e8m0 scales, hf/mxfp4.py) import dequantized as transformers dequantizes them. What
GptOssForCausalLM cannot hold is one line."""
import json

import numpy as np
import pytest

# The reference, from requirements-test.txt (make test installs it).
import torch
from transformers import GptOssConfig, GptOssForCausalLM, Mxfp4Config

from errors import ConversionError
from hf import config as hf_config, mxfp4
from hf.safetensors import Tensors, save

from test_hf_convert import (ORIGINAL, assert_greedy_tokens_match, hf_logits, import_run,
                             our_logits, relative)
from test_hf_moe import (SHAPE, WINDOW, export_bit_for_bit, first_step, model_config,
                         moe_model)

D, F = SHAPE["hidden_size"], 32  # multiples of MXFP4's 32-value blocks


def gpt_oss(rng, eos):
    # 4 experts of width 32, top 2; heads of 16; layer 0 slides (WINDOW), layer 1 is full
    return GptOssForCausalLM, GptOssConfig(
        **{**SHAPE, "max_position_embeddings": 4 * ORIGINAL}, vocab_size=0, head_dim=16,
        intermediate_size=F, num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW,
        swiglu_limit=float(rng.uniform(1.5, 3.0)), swiglu_alpha=float(rng.uniform(1.2, 2.2)),
        router_aux_loss_coef=float(rng.uniform(0.01, 0.1)),
        rms_norm_eps=float(rng.uniform(1e-6, 1e-4)), eos_token_id=eos, bos_token_id=None,
        pad_token_id=None, tie_word_embeddings=False,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                         "truncate": False, "original_max_position_embeddings": ORIGINAL,
                         "rope_theta": float(rng.uniform(1e4, 2e5))})


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    """(the random HF model, its import, the seed) on one device."""
    seed = np.random.SeedSequence().entropy
    rng = np.random.default_rng(seed)
    d = tmp_path_factory.mktemp("gpt_oss")
    model = moe_model(rng, d / "hf", "gpt_oss", build=gpt_oss)
    run = import_run(d / "hf", d / "run", "--config.data.seq_len=128", "--config.mesh.fsdp=1")
    return model, run, seed


def test_import_sets_gpt_oss_block_and_gives_transformers_logits(family, rng):
    model, run, seed = family
    m, c = run.config.model, model.config
    assert (m.attention_sinks, m.qkv_bias, m.o_bias, m.qk_norm) == (True, True, True, False)
    assert (m.layer_types, m.sliding_window, m.head_dim) == ("sliding,full", WINDOW, 0)  # 64 / 4
    assert m.rope_scaling.type == "yarn" and m.rope_scaling.truncate is False
    want = dict(num_experts=4, top_k=2, expert_dim=F, router="topk_softmax", router_bias=True,
                expert_bias=True, glu="clamped", glu_limit=c.swiglu_limit,
                glu_alpha=c.swiglu_alpha, aux_loss=c.router_aux_loss_coef, z_loss=0.0)
    assert {k: m.moe[k] for k in want} == want, seed
    tokens = rng.integers(0, m.vocab_size, (2, 4 * ORIGINAL))  # 5 windows, past the context
    got, theirs = our_logits(run, tokens), hf_logits(model, tokens)
    assert relative(got, theirs) < 1e-4, (relative(got, theirs), seed)


def test_greedy_generation_gives_transformers_tokens(family, rng, capsys):
    """The KV cache with sinks, a window and gpt-oss's experts: transformers' greedy tokens."""
    model, run, seed = family
    assert_greedy_tokens_match(rng, run, model, capsys)


def test_the_first_step_loss_with_padding_is_transformers_loss_with_router_logits(family, rng):
    """The first step on a batch with padding: the loss is transformers' with
    output_router_logits=True (the cross-entropy + router_aux_loss_coef x its load-balancing
    loss over the real tokens of both layers), and the aux_loss metric its aux_loss."""
    model, run, seed = family
    out, loss, counts, sums, tokens, real = first_step(run, model, rng)
    aux, want_aux = float(sums["aux_loss"]), float(out.aux_loss)
    assert abs(aux - want_aux) < 1e-5 * want_aux, (aux, want_aux, seed)
    assert abs(float(loss) - float(out.loss)) < 1e-5 * float(out.loss), (float(loss),
                                                                          float(out.loss), seed)


def test_export_loads_in_transformers_with_the_original_logits(family, rng, tmp_path):
    """GptOssForCausalLM's own names (gate and up interleaved again), its tensors the
    checkpoint's bit for bit, its config read by transformers to the same block, its logits the
    original's."""
    model, run, seed = family
    theirs = export_bit_for_bit(run, tmp_path / "out", seed)
    assert type(theirs) is GptOssForCausalLM, seed
    for key in ("num_local_experts", "num_experts_per_tok", "intermediate_size", "head_dim",
                "sliding_window", "layer_types", "swiglu_limit", "swiglu_alpha",
                "router_aux_loss_coef", "attention_bias", "tie_word_embeddings"):
        assert getattr(theirs.config, key) == getattr(model.config, key), (key, seed)
    # (the export leaves out YaRN's defaults, as transformers does when it reads them)
    yarn = {"beta_fast": 32.0, "beta_slow": 1.0}
    assert {**yarn, **theirs.config.rope_parameters} == {**yarn, **model.config.rope_parameters}
    tokens = rng.integers(0, run.config.model.vocab_size, (2, 4 * ORIGINAL))
    assert relative(hf_logits(theirs, tokens), hf_logits(model, tokens)) < 1e-5, seed


def test_released_mxfp4_experts_import_as_transformers_dequantizes_them(family, rng, tmp_path):
    """The model's experts written as gpt-oss's releases hold them (gate_up_proj_blocks [E, 2F,
    D/32, 16] and _scales, down_proj's likewise, quantization_config mxfp4): the import's
    experts are transformers' dequantized ones bit for bit, and its logits transformers'."""
    model, run, seed = family
    hf = run.directory.parent / "hf"
    quantized = tmp_path / "mxfp4"
    quantized.mkdir()
    tensors, original = {}, Tensors(hf)
    for name in original.names():
        tensor = original[name]
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            tensors[name + "_blocks"], tensors[name + "_scales"] = mxfp4.quantize_param(tensor)
        else:
            tensors[name] = np.asarray(tensor)
    save(tensors, quantized / "model.safetensors")
    cfg = json.loads((hf / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (quantized / "config.json").write_text(json.dumps(cfg))
    for side in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (hf / side).is_file():
            (quantized / side).write_bytes((hf / side).read_bytes())
    theirs = GptOssForCausalLM.from_pretrained(
        quantized, dtype=torch.float32, attn_implementation="eager",
        quantization_config=Mxfp4Config(dequantize=True)).eval()
    ours = import_run(quantized, tmp_path / "run", "--config.data.seq_len=128",
                      "--config.mesh.fsdp=1")
    from model.decoder import single_device_model
    params = ours.restore_params(single_device_model(ours.config)[1]).params
    experts = theirs.model.layers[1].mlp.experts
    gate_up = experts.gate_up_proj.detach().numpy()
    mlp = {k: np.asarray(v[1], np.float32) for k, v in params["blocks"]["mlp"].items()}
    np.testing.assert_array_equal(mlp["w_gate"], gate_up[..., 0::2])
    np.testing.assert_array_equal(mlp["w_up"], gate_up[..., 1::2])
    np.testing.assert_array_equal(mlp["w_down"], experts.down_proj.detach().numpy())
    tokens = rng.integers(0, ours.config.model.vocab_size, (2, 4 * ORIGINAL))
    got, want = our_logits(ours, tokens), hf_logits(theirs, tokens)
    assert relative(got, want) < 1e-4, (relative(got, want), seed)


def test_released_gpt_oss_20b_config_reads_as_transformers_builds_it():
    """gpt-oss-20b's config.json (its keys as released): the fields configs/gpt_oss_20b.py
    has, and the same parameter count as transformers' model of it."""
    from configs import gpt_oss_20b
    from model.flops import param_count
    cfg = {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss",
           "attention_bias": True, "attention_dropout": 0.0, "eos_token_id": 200002,
           "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880,
           "initial_context_length": 4096, "initializer_range": 0.02,
           "intermediate_size": 2880, "layer_types": ["sliding_attention", "full_attention"] * 12,
           "max_position_embeddings": 131072, "num_attention_heads": 64,
           "num_experts_per_tok": 4, "num_hidden_layers": 24, "num_key_value_heads": 8,
           "num_local_experts": 32, "output_router_logits": False, "pad_token_id": 199999,
           "rms_norm_eps": 1e-05, "rope_scaling": {
               "beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
               "original_max_position_embeddings": 4096, "rope_type": "yarn", "truncate": False},
           "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128,
           "swiglu_limit": 7.0, "tie_word_embeddings": False, "vocab_size": 201088,
           "quantization_config": {"quant_method": "mxfp4"}}
    fields = hf_config.model_fields(cfg)
    want = gpt_oss_20b.get_config().model
    for key in ("vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads", "norm_eps",
                "tie_embeddings", "qkv_bias", "o_bias", "attention_sinks", "layer_types",
                "sliding_window", "rope_theta"):
        assert fields[key] == want[key], key
    assert (fields["head_dim"] or 2880 // 64) == want.head_dim
    for key, value in fields["moe"].items():
        if key in want.moe:
            assert value == want.moe[key], key
    for key, value in fields["rope_scaling"].items():
        assert value == want.rope_scaling[key], key
    with torch.device("meta"):
        theirs = GptOssForCausalLM(GptOssConfig(**cfg))
    assert param_count(want) == sum(p.numel() for p in theirs.parameters()) == 20_914_757_184


GPT_OSS = dict(attention_sinks=True, qkv_bias=True, o_bias=True, sliding_window=8,
               layer_types="sliding,full,sliding,full",
               moe=dict(router="topk_softmax", router_bias=True, expert_bias=True, glu="clamped"))


def test_export_writes_gpt_oss_and_reads_back_the_same():
    m = model_config(**GPT_OSS)
    assert hf_config.architecture(m) == "gpt_oss"
    out = hf_config.hf_config(m, seq_len=64, dtype="bfloat16", base=None, bos=None, eos=None)
    read = hf_config.model_fields(json.loads(json.dumps(out)))
    for key in ("attention_sinks", "qkv_bias", "o_bias", "sliding_window", "layer_types",
                "num_kv_heads"):
        assert read[key] == m[key], key
    for key in ("router", "router_bias", "expert_bias", "glu", "glu_limit", "glu_alpha",
                "num_experts", "top_k", "expert_dim", "aux_loss"):
        assert read["moe"][key] == m.moe[key], key
    theirs = GptOssConfig(**out)
    assert theirs.layer_types == ["sliding_attention", "full_attention"] * 2


@pytest.mark.parametrize("fields,fragment", [
    (dict(moe=dict(num_experts=0)), "model.attention_sinks with no mixture of experts"),
    (dict(o_bias=False), "model.qkv_bias=True with model.o_bias=False"),
    (dict(moe=dict(glu="gated")), "model.moe.glu='gated' (not 'clamped')"),
    (dict(moe=dict(router="softmax_topk")), "model.moe.router='softmax_topk'"),
    (dict(qk_norm=True), "model.attention_sinks with model.qk_norm"),
    (dict(attention_sinks=False), "model.o_bias, model.moe.expert_bias, model.moe.glu=clamped "
                                  "without model.attention_sinks"),
])
def test_what_gpt_oss_cannot_hold_is_one_line(fields, fragment):
    merged = {**GPT_OSS, **fields, "moe": {**GPT_OSS["moe"], **fields.get("moe", {})}}
    with pytest.raises(ConversionError) as e:
        hf_config.architecture(model_config(**merged))
    assert fragment in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_another_quantization_is_one_line(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"],
        "quantization_config": {"quant_method": "awq"}}))
    (tmp_path / "tokenizer.json").write_text("{}")
    from hf.convert import import_hf
    with pytest.raises(ConversionError) as e:
        import_hf(tmp_path, tmp_path / "run")
    assert "'awq'" in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "run").exists()
