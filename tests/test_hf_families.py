"""scripts/convert_hf.py against transformers for the families past LLaMA: Qwen3 (q/k norms,
its own head_dim, tied; and with its upper layers sliding), Gemma 3 (1 + w norms, sandwich
norms, scaled embeddings, GeGLU, 5 sliding : 1 full layers with their own RoPE bases, linear
scaling on the global ones, final logit soft-capping, query_pre_attn_scalar; text alone and the
language model of Gemma3ForConditionalGeneration) and SmolLM3 (NoPE every 4th layer; and with a
window on those layers). Small random models, every norm weight random too, imported give
transformers' logits and greedy tokens and export back to a checkpoint transformers loads to
the same logits; what these families have that the model lacks is one line."""
import json
import pathlib

import numpy as np
import pytest

# The reference, from requirements-test.txt (make test installs it).
import torch
from transformers import (AutoModelForCausalLM, Gemma3Config, Gemma3ForCausalLM,
                          Gemma3ForConditionalGeneration, Gemma3TextConfig, Qwen3Config,
                          Qwen3ForCausalLM, SmolLM3Config, SmolLM3ForCausalLM)

from configs.loading import load
from data.tokenizer import EOS
from errors import ConversionError
from hf import config as hf_config, weights
from hf.safetensors import Tensors
from scripts import convert_hf

from test_hf_convert import (ORIGINAL, assert_greedy_tokens_match, assert_refused, hf_logits,
                             import_run, our_logits, relative, tokenizer_files)

WINDOW = 12  # not a multiple of the 8-token tiles; the logits run at 64 tokens, 5 windows
SHAPE = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=ORIGINAL)


def qwen3_tied(rng, eos):
    # head_dim 24, not hidden_size / heads = 16: q_proj is [96, 64]
    return Qwen3ForCausalLM, Qwen3Config(
        **SHAPE, vocab_size=0, num_hidden_layers=2, head_dim=24, tie_word_embeddings=True,
        rms_norm_eps=float(rng.uniform(1e-6, 1e-4)), eos_token_id=eos,
        rope_parameters={"rope_type": "default", "rope_theta": float(rng.uniform(1e3, 1e5))})


def qwen3_sliding(rng, eos):
    # layers 2 and 3 slide (from max_window_layers on), yarn on every layer
    return Qwen3ForCausalLM, Qwen3Config(
        **{**SHAPE, "max_position_embeddings": 4 * ORIGINAL}, vocab_size=0, num_hidden_layers=4,
        head_dim=16, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2,
        rms_norm_eps=float(rng.uniform(1e-6, 1e-4)), eos_token_id=eos,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": float(rng.uniform(1e3, 1e5)),
                         "original_max_position_embeddings": ORIGINAL})


def gemma3_text_config(rng, eos):
    """8 layers: 5 sliding, 1 full, then 2 sliding (the pattern's remainder); a local RoPE
    base and a global one with linear scaling; the softmax scale 1/sqrt(24), head_dim 16."""
    return Gemma3TextConfig(
        **SHAPE, vocab_size=0, num_hidden_layers=8, head_dim=16, sliding_window=WINDOW,
        query_pre_attn_scalar=24, final_logit_softcapping=float(rng.uniform(3.0, 6.0)),
        rms_norm_eps=float(rng.uniform(1e-6, 1e-4)), eos_token_id=eos, bos_token_id=None,
        pad_token_id=None,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0,
                                            "rope_theta": float(rng.uniform(1e5, 1e6))},
                         "sliding_attention": {"rope_type": "default",
                                               "rope_theta": float(rng.uniform(1e3, 1e4))}})


def gemma3(rng, eos):
    return Gemma3ForCausalLM, gemma3_text_config(rng, eos)


def gemma3_vision(rng, eos):
    """Gemma3ForConditionalGeneration with a one-layer SigLIP tower (2 x 2 patches)."""
    vision = {"model_type": "siglip_vision_model", "hidden_size": 16, "intermediate_size": 32,
              "num_hidden_layers": 1, "num_attention_heads": 2, "image_size": 28,
              "patch_size": 14}
    return Gemma3ForConditionalGeneration, Gemma3Config(
        text_config=gemma3_text_config(rng, eos).to_dict(), vision_config=vision,
        mm_tokens_per_image=4, eos_token_id=eos)


def smollm3(rng, eos):
    # layer 3 has no RoPE (no_rope_layer_interval 4); tied; yarn on the RoPE layers
    return SmolLM3ForCausalLM, SmolLM3Config(
        **{**SHAPE, "max_position_embeddings": 2 * ORIGINAL}, vocab_size=0, num_hidden_layers=4,
        rms_norm_eps=float(rng.uniform(1e-6, 1e-4)), eos_token_id=eos, bos_token_id=None,
        pad_token_id=None,
        rope_parameters={"rope_type": "yarn", "factor": 2.0, "rope_theta": float(rng.uniform(1e4, 1e6)),
                         "original_max_position_embeddings": ORIGINAL})


def smollm3_window(rng, eos):
    # the NoPE layer slides (transformers' layer_types rule); untied
    return SmolLM3ForCausalLM, SmolLM3Config(
        **SHAPE, vocab_size=0, num_hidden_layers=4, use_sliding_window=True,
        sliding_window=WINDOW, tie_word_embeddings=False,
        rms_norm_eps=float(rng.uniform(1e-6, 1e-4)), eos_token_id=eos, bos_token_id=None,
        pad_token_id=None, rope_parameters={"rope_type": "default",
                                            "rope_theta": float(rng.uniform(1e4, 1e6))})


# case -> (builder, the model fields the import must set beyond the shapes)
CASES = {
    "qwen3_tied": (qwen3_tied, dict(qk_norm=True, head_dim=24, tie_embeddings=True,
                                    layer_types="", sliding_window=0)),
    "qwen3_sliding": (qwen3_sliding, dict(qk_norm=True, head_dim=0, tie_embeddings=False,
                                          layer_types="full,full,sliding,sliding",
                                          sliding_window=WINDOW, local_rope_theta=0.0)),
    "gemma3": (gemma3, dict(qk_norm=True, norm_unit_offset=True, sandwich_norms=True,
                            scale_embeddings=True, mlp_activation="gelu_tanh",
                            query_pre_attn_scalar=24.0, tie_embeddings=True,
                            layer_types="sliding,sliding,sliding,sliding,sliding,full,sliding,"
                                        "sliding", sliding_window=WINDOW)),
    # Gemma3ForConditionalGeneration never applies its text_config's final_logit_softcapping
    "gemma3_vision": (gemma3_vision, dict(qk_norm=True, sandwich_norms=True, tie_embeddings=True,
                                          sliding_window=WINDOW, final_logit_softcap=0.0)),
    "smollm3": (smollm3, dict(qk_norm=False, tie_embeddings=True,
                              layer_types="full,full,full,full_nope", sliding_window=0)),
    "smollm3_window": (smollm3_window, dict(tie_embeddings=False,
                                            layer_types="full,full,full,sliding_nope",
                                            sliding_window=WINDOW)),
}
ARCH = {"qwen3_tied": Qwen3ForCausalLM, "qwen3_sliding": Qwen3ForCausalLM,
        "gemma3": Gemma3ForCausalLM, "gemma3_vision": Gemma3ForCausalLM,
        "smollm3": SmolLM3ForCausalLM, "smollm3_window": SmolLM3ForCausalLM}


def family_model(rng, directory: pathlib.Path, case: str):
    """Saves a random model of ``case`` (fp32, transformers' eager attention: a window is the
    mask it builds) with every weight far from its initial value: matrices N(0, 0.3), norm
    weights U(0.5, 1.5), Gemma's (1 + w) ones w ~ U(-0.5, 0.5). The end-of-text token's head
    row is 0, so that greedy decoding never stops at once."""
    directory.mkdir(parents=True)
    tok = tokenizer_files(rng, directory)
    eos = tok.token_to_id(EOS)
    model_class, cfg = CASES[case][0](rng, eos)
    text = cfg.text_config if hasattr(cfg, "text_config") and cfg.text_config is not None else cfg
    text.vocab_size = tok.get_vocab_size()
    cfg._attn_implementation = "eager"
    torch.manual_seed(int(rng.integers(2**31)))
    model = model_class(cfg).float()
    unit = text.model_type == "gemma3_text"
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0, 0.3)
            else:
                p.uniform_(-0.5, 0.5) if unit else p.uniform_(0.5, 1.5)
        model.get_output_embeddings().weight[eos] = 0
    model.save_pretrained(directory)
    return model.eval()


@pytest.fixture(scope="module", params=list(CASES))
def family(request, tmp_path_factory):
    """(case, the random HF model, its import, the seed): built once per case for the tests
    below. The run is on one device (mesh.fsdp=1): generation compiles a third faster, and the
    sharded KV cache has its own tests (tests/test_kv_cache.py, test_hf_convert.py's)."""
    case = request.param
    seed = np.random.SeedSequence().entropy
    rng = np.random.default_rng(seed)
    d = tmp_path_factory.mktemp(case)
    model = family_model(rng, d / "hf", case)
    run = import_run(d / "hf", d / "run", "--config.data.seq_len=128", "--config.mesh.fsdp=1")
    return case, model, run, seed


def test_import_sets_the_family_fields_and_gives_transformers_logits(family, rng):
    case, model, run, seed = family
    m = run.config.model
    for key, want in CASES[case][1].items():
        assert m[key] == want, (key, m[key], seed)
    assert (m.d_model, m.num_heads, m.num_kv_heads) == (64, 4, 2), seed
    tokens = rng.integers(0, m.vocab_size, (2, 4 * ORIGINAL))  # 5 windows, past the context
    assert relative(our_logits(run, tokens), hf_logits(model, tokens)) < 1e-4, seed


def test_greedy_generation_gives_transformers_tokens(family, rng, capsys):
    _, model, run, seed = family
    assert_greedy_tokens_match(rng, run, model, capsys)


def test_export_loads_in_transformers_with_the_original_logits(family, rng, tmp_path):
    """The export is the architecture imported (Gemma3ForConditionalGeneration's language
    model as a Gemma3ForCausalLM), its tensors the checkpoint's bit for bit, its config read
    by transformers to the same layers and RoPE, its logits the original's within 1e-5."""
    case, model, run, seed = family
    assert convert_hf.main(["export", "--run", str(run.directory), "--out",
                            str(tmp_path / "out")]) == 0
    original, _ = weights.language_model(Tensors(run.directory.parent / "hf"))
    exported = Tensors(tmp_path / "out")
    assert sorted(original.names()) == sorted(exported.names()), seed
    for name in original.names():
        np.testing.assert_array_equal(original[name].view(np.uint8), exported[name].view(np.uint8))
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager")
    theirs = theirs.float().eval()
    assert type(theirs) is ARCH[case], seed
    text = model.config.get_text_config()
    for key in ("layer_types", "rope_parameters", "sliding_window", "tie_word_embeddings",
                "head_dim", "no_rope_layers", "query_pre_attn_scalar", "final_logit_softcapping"):
        if hasattr(text, key):
            want = getattr(text, key)
            if case == "gemma3_vision" and key == "final_logit_softcapping":
                want = None  # Gemma3ForConditionalGeneration never applies it
            assert getattr(theirs.config, key) == want, (key, seed)
    tokens = rng.integers(0, run.config.model.vocab_size, (2, 4 * ORIGINAL))
    assert relative(hf_logits(theirs, tokens), hf_logits(model, tokens)) < 1e-5, seed


def test_the_vision_tower_is_left_out_and_named(tmp_path, rng, capsys):
    """Gemma3ForConditionalGeneration imports its language model alone (transformers 5.23
    saves it as released checkpoints have it: language_model.model.*, vision_tower.*,
    multi_modal_projector.*), and the import says in one line what it left out: the vision
    tower and the projector, by their names and tensor counts, and the text_config's
    final_logit_softcapping, which that class never applies."""
    family_model(rng, tmp_path / "hf", "gemma3_vision")
    saved = Tensors(tmp_path / "hf").names()
    capsys.readouterr()
    run = import_run(tmp_path / "hf", tmp_path / "run")
    err = capsys.readouterr().err.splitlines()
    said = [line for line in err if "left out" in line]
    assert len(said) == 1, err
    assert said[0].startswith("Gemma3ForConditionalGeneration: the language model alone")
    for part, name in (("vision_tower", "the vision tower"),
                       ("multi_modal_projector", "the image projector")):
        prefix = next(p for p in (f"model.{part}", part) if any(n.startswith(p + ".") for n in saved))
        count = sum(n.startswith(prefix + ".") for n in saved)
        assert f"{prefix}.* ({count} tensors, {name})" in said[0], said[0]
    assert "final_logit_softcapping=" in said[0] and run.config.model.final_logit_softcap == 0
    assert run.config.model.num_layers == 8 and (tmp_path / "run" / "hf" / "config.json").is_file()


def test_released_gemma3_configs_read_with_transformers_defaults():
    """A released Gemma 3 config.json lists only what differs from transformers' defaults
    (gemma-3-4b's text_config: sizes, linear scaling x8 on the global layers, window 1024), in
    the older spelling (rope_scaling); the import reads what transformers builds from it."""
    text = {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
            "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
            "sliding_window": 1024}
    cfg = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
           "text_config": text, "vision_config": {"model_type": "siglip_vision_model"},
           "mm_tokens_per_image": 256, "eos_token_id": [1, 106]}
    got = hf_config.model_fields(cfg)
    theirs = Gemma3Config(**cfg).text_config
    kinds = ["sliding" if t == "sliding_attention" else "full" for t in theirs.layer_types]
    assert got["layer_types"] == ",".join(kinds) and kinds.count("full") == 5
    assert (got["num_heads"], got["num_kv_heads"], got["vocab_size"]) == \
        (theirs.num_attention_heads, theirs.num_key_value_heads, theirs.vocab_size)
    assert got["head_dim"] == theirs.head_dim == 256 and got["sliding_window"] == 1024
    assert got["query_pre_attn_scalar"] == theirs.query_pre_attn_scalar
    full, local = theirs.rope_parameters["full_attention"], theirs.rope_parameters["sliding_attention"]
    assert (got["rope_theta"], got["rope_scaling"]) == (full["rope_theta"],
                                                        {"type": "linear", "factor": 8.0})
    assert got["local_rope_theta"] == local["rope_theta"] == 10000.0
    assert got["tie_embeddings"] is True and got["mlp_activation"] == "gelu_tanh"


@pytest.mark.parametrize("case", list(CASES))
def test_older_rope_spelling_reads_the_same(case, rng, tmp_path):
    """transformers 5 writes rope_parameters (flat, or keyed by layer type for Gemma 3); older
    files write rope_theta + rope_scaling (+ rope_local_base_freq for Gemma 3's sliding
    layers). Both read to the same model fields, as transformers reads them."""
    family_model(rng, tmp_path / "hf", case)
    new = json.loads((tmp_path / "hf" / "config.json").read_text())
    old = json.loads(json.dumps(new))
    text = old.get("text_config", old)
    params = text.pop("rope_parameters")
    if "full_attention" in params:
        full, local = params["full_attention"], params["sliding_attention"]
        text["rope_theta"], text["rope_local_base_freq"] = full.pop("rope_theta"), local["rope_theta"]
        text["rope_scaling"] = full
    else:
        text["rope_theta"] = params.pop("rope_theta")
        text["rope_scaling"] = params if params["rope_type"] != "default" else None
    assert hf_config.model_fields(old) == hf_config.model_fields(new)
    config_class = type(CASES[case][0](rng, 0)[1])
    read = lambda c: config_class(**c).get_text_config().rope_parameters  # noqa: E731
    assert read(old) == read(new)


# (config.json of a family beyond its Qwen3 / Gemma 3 base, what the one line must say)
REFUSALS = {
    "attention softcap": ({"model_type": "gemma3_text", "attn_logit_softcapping": 50.0},
                          ["attn_logit_softcapping=50.0: attention logit soft-capping does not "
                           "convert (Gemma3ForCausalLM)"]),
    "scaled local rope": ({"model_type": "gemma3_text", "rope_parameters": {
        "full_attention": {"rope_type": "default", "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}},
        ["the 'sliding_attention' layers' RoPE has rope_type 'linear'"]),
    "bidirectional": ({"model_type": "gemma3_text", "use_bidirectional_attention": True},
                      ["use_bidirectional_attention=true"]),
    "gemma4": ({"model_type": "gemma4", "architectures": ["Gemma4ForConditionalGeneration"]},
               ["Gemma 4 (model_type='gemma4')", "per-layer input embeddings"]),
    "gemma4_text": ({"model_type": "gemma4_text", "architectures": ["Gemma4ForCausalLM"]},
                    ["Gemma 4 (model_type='gemma4_text')", "shared across layers"]),
    "qwen3_next": ({"model_type": "qwen3_next", "architectures": ["Qwen3NextForCausalLM"]},
                   ["Qwen3-Next (model_type='qwen3_next')", "linear attention (Gated DeltaNet)"]),
    "qwen3_5": ({"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"]},
                ["Qwen3.5 (model_type='qwen3_5')", "linear attention"]),
    "qwen3_5_moe": ({"model_type": "qwen3_5_moe",
                     "architectures": ["Qwen3_5MoeForConditionalGeneration"]},
                    ["Qwen3.5-MoE (model_type='qwen3_5_moe')", "linear attention"]),
    "gemma3 rope 'type'": ({"model_type": "gemma3_text", "rope_scaling": {"type": "linear",
                                                                          "factor": 8.0}},
                           ["names its type as 'type', which transformers 5 ignores for Gemma 3"]),
    "smollm3 mlp bias": ({"model_type": "smollm3", "mlp_bias": True}, ["mlp_bias=true"]),
    "qwen3 biases": ({"model_type": "qwen3", "attention_bias": True},
                     ["attention_bias=true (biases on q, k, v and o)"]),
}


@pytest.mark.parametrize("name", list(REFUSALS))
def test_what_these_families_have_that_the_model_lacks_is_one_line(name):
    changes, fragments = REFUSALS[name]
    kind = changes["model_type"]
    cfg = {"architectures": [hf_config.CONVERTS.get(kind, "?")], "vocab_size": 300,
           "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
           "intermediate_size": 96, **changes}
    assert_refused(cfg, fragments)


def test_gemma3_sliding_layers_may_take_the_global_rope():
    """A sliding_attention RoPE equal to the full layers' (scaled) is the model's own RoPE on
    every layer (local_rope_theta 0); the export says so in keyed rope_parameters, the one
    spelling that can, and transformers reads it back the same."""
    full = {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}
    cfg = {"model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"],
           "vocab_size": 300, "hidden_size": 64, "num_hidden_layers": 8, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 96,
           "sliding_window": 12, "query_pre_attn_scalar": 16,
           "rope_parameters": {"full_attention": full, "sliding_attention": dict(full)}}
    got = hf_config.model_fields(cfg)
    assert got["local_rope_theta"] == 0.0 and got["rope_scaling"] == {"type": "linear", "factor": 8.0}
    m = model_config(**{k: v for k, v in got.items() if k != "rope_scaling"})
    m.num_layers = 8
    m.rope_scaling.update(got["rope_scaling"])
    out = hf_config.hf_config(m, seq_len=64, dtype="float32", base=cfg, bos=None, eos=None)
    assert "rope_scaling" not in out and out["rope_parameters"]["sliding_attention"] == full
    assert Gemma3TextConfig(**out).rope_parameters == Gemma3TextConfig(**cfg).rope_parameters
    assert hf_config.model_fields(out) == got


def model_config(**fields):
    m = load("configs/base.py").model
    m.update(vocab_size=300, d_model=64, num_layers=4, num_heads=4, num_kv_heads=2, ffn_dim=96)
    m.update(fields)
    return m


@pytest.mark.parametrize("fields,kind", [
    ({}, "llama"), (dict(sliding_window=8), "mistral"), (dict(qkv_bias=True), "qwen2"),
    (dict(qkv_bias=True, sliding_window=8, layer_types="full,full,sliding,sliding"), "qwen2"),
    (dict(qk_norm=True), "qwen3"), (dict(layer_types="full,full,full,full_nope"), "smollm3"),
    (dict(sliding_window=8, layer_types="sliding,full,sliding,full"), "smollm3"),
    (dict(qk_norm=True, norm_unit_offset=True, sandwich_norms=True, scale_embeddings=True),
     "gemma3_text")])
def test_export_picks_the_architecture_the_fields_need(fields, kind):
    m = model_config(**fields)
    assert hf_config.architecture(m) == kind
    out = hf_config.hf_config(m, seq_len=64, dtype="float32", base=None, bos=None, eos=None)
    assert out["model_type"] == kind and out["architectures"] == [hf_config.CONVERTS[kind]]
    read = hf_config.model_fields(out)  # what the export says is what the import reads
    for key in ("qk_norm", "qkv_bias", "sliding_window", "sandwich_norms", "head_dim"):
        assert read[key] == m[key], key
    want = m.layer_types if kind not in ("mistral", "qwen2") or "," in m.layer_types else ""
    assert read["layer_types"] == want


@pytest.mark.parametrize("layer_types,every", [
    ("sliding,full,sliding,full", 2), ("sliding,sliding,sliding,full", 4),
    ("full,sliding,sliding,full", None)])
def test_gemma_export_writes_the_pattern_older_transformers_read(layer_types, every):
    """Before layer_types (transformers 4.50-4.52) Gemma 3 read every sliding_window_pattern-th
    layer as full: written where the layers are that pattern, left out where they are not."""
    gemma = dict(qk_norm=True, norm_unit_offset=True, sandwich_norms=True, scale_embeddings=True)
    m = model_config(sliding_window=8, layer_types=layer_types, **gemma)
    out = hf_config.hf_config(m, seq_len=64, dtype="float32", base=None, bos=None, eos=None)
    assert out.get("sliding_window_pattern") == every
    if every:  # what that spelling means is the list the export wrote
        assert [t == "full_attention" for t in out["layer_types"]] == [
            (i + 1) % every == 0 for i in range(4)]


@pytest.mark.parametrize("fields,fragment", [
    (dict(sandwich_norms=True), "model.sandwich_norms, not model.qk_norm, not "
                                "model.norm_unit_offset, not model.scale_embeddings: no Hugging "
                                "Face architecture has this combination"),
    (dict(final_logit_softcap=30.0, qk_norm=True), "model.final_logit_softcap, not "
                                                   "model.norm_unit_offset"),
    (dict(qk_norm=True, qkv_bias=True), "model.qk_norm and model.qkv_bias: no Hugging Face "
                                        "architecture has both"),
    (dict(layer_types="full,full,full,full_nope", qk_norm=True), "NoPE layers and "
                                                                 "model.qk_norm"),
])
def test_a_combination_no_architecture_has_is_one_line(fields, fragment):
    with pytest.raises(ConversionError) as e:
        hf_config.architecture(model_config(**fields))
    assert fragment in str(e.value) and "\n" not in str(e.value)
