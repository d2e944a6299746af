"""scripts/convert_hf.py against transformers for the mixtures of experts: MixtralForCausalLM
(Mistral's attention with a window on every layer; the top k weights always renormalised),
Qwen3MoeForCausalLM (q/k norms, its own head_dim; norm_topk_prob both ways) and OlmoeForCausalLM
(q/k norms over the whole projection: model.qk_norm_scope=projection). Small random fp32
models with every weight random, router included: imported, they give transformers' logits,
greedy tokens (Qwen3-MoE's: with its dense layers, below), and the first step's loss (LM +
router_aux_loss_coef x the load-balancing loss) of a batch with padding; exported, they load in
transformers to the original's logits, their tensors the checkpoint's bit for bit.
transformers 5's fused experts (gate_up_proj) import as the released per-expert names do.
Qwen3-MoE with dense layers (decoder_sparse_step and mlp_only_layers) imports and exports the
same way. OLMoE's clip_qkv and a combination no architecture has are one line each."""
import json

import jax
import numpy as np
import pytest

# The reference, from requirements-test.txt (make test installs it).
import torch
from transformers import (AutoModelForCausalLM, MixtralConfig, MixtralForCausalLM, OlmoeConfig,
                          OlmoeForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM)
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

from configs.loading import load
from data.tokenizer import EOS
from errors import ConversionError
from hf import config as hf_config, weights
from hf.safetensors import Tensors
from scripts import convert_hf

from test_hf_convert import (ORIGINAL, assert_greedy_tokens_match, assert_refused, hf_logits,
                             import_run, our_logits, relative, tokenizer_files)

WINDOW = 12  # not a multiple of the 8-token tiles; the logits run at 64 tokens, 5 windows
SHAPE = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
             max_position_embeddings=ORIGINAL)


def mixtral(rng, eos):
    # 4 experts of width 32, top 2; a window on every layer; untied
    return MixtralForCausalLM, MixtralConfig(
        **SHAPE, vocab_size=0, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
        sliding_window=WINDOW, router_aux_loss_coef=float(rng.uniform(0.01, 0.1)),
        rms_norm_eps=float(rng.uniform(1e-6, 1e-4)), eos_token_id=eos, bos_token_id=None,
        pad_token_id=None,
        rope_parameters={"rope_type": "default", "rope_theta": float(rng.uniform(1e4, 1e6))})


def qwen3_moe(rng, eos, renormalize: bool, **layers):
    # 6 experts of width 24, top 3; head_dim 24 (not hidden / heads = 16); the dense width
    # (intermediate_size, unused by these layers) apart
    return Qwen3MoeForCausalLM, Qwen3MoeConfig(
        **{**SHAPE, **layers}, vocab_size=0, intermediate_size=96, moe_intermediate_size=24, head_dim=24,
        num_experts=6, num_experts_per_tok=3, norm_topk_prob=renormalize,
        tie_word_embeddings=renormalize, router_aux_loss_coef=float(rng.uniform(0.01, 0.1)),
        rms_norm_eps=float(rng.uniform(1e-6, 1e-4)), eos_token_id=eos,
        rope_parameters={"rope_type": "default", "rope_theta": float(rng.uniform(1e3, 1e5))})


def olmoe(rng, eos):
    # 6 experts of width 24 (intermediate_size), top 3 not renormalised (OLMoE's default); q/k
    # norms over the whole projection (q_norm [64], k_norm [32]); a router_z_loss_coef, which
    # transformers never adds to the loss (left out: model.moe.z_loss stays 0)
    return OlmoeForCausalLM, OlmoeConfig(
        **SHAPE, vocab_size=0, intermediate_size=24, num_experts=6, num_experts_per_tok=3,
        norm_topk_prob=False, router_aux_loss_coef=float(rng.uniform(0.01, 0.1)),
        router_z_loss_coef=0.001, rms_norm_eps=float(rng.uniform(1e-6, 1e-4)), eos_token_id=eos,
        bos_token_id=None, pad_token_id=None,
        rope_parameters={"rope_type": "default", "rope_theta": float(rng.uniform(1e3, 1e5))})


# case -> (builder, the model fields the import must set beyond the shapes, model.moe's fields)
CASES = {
    "mixtral": (mixtral, dict(qk_norm=False, qk_norm_scope="head", head_dim=0,
                              tie_embeddings=False, layer_types="",
                              sliding_window=WINDOW, ffn_dim=32),
                dict(num_experts=4, top_k=2, expert_dim=32, renormalize=True)),
    "qwen3_moe": (lambda rng, eos: qwen3_moe(rng, eos, True),
                  dict(qk_norm=True, qk_norm_scope="head", head_dim=24, tie_embeddings=True,
                       sliding_window=0, ffn_dim=96),
                  dict(num_experts=6, top_k=3, expert_dim=24, renormalize=True)),
    "qwen3_moe_unnormalized": (lambda rng, eos: qwen3_moe(rng, eos, False),
                               dict(qk_norm=True, tie_embeddings=False, sliding_window=0),
                               dict(num_experts=6, top_k=3, expert_dim=24, renormalize=False)),
    "olmoe": (olmoe, dict(qk_norm=True, qk_norm_scope="projection", head_dim=0,
                          tie_embeddings=False, layer_types="", sliding_window=0, ffn_dim=24),
              dict(num_experts=6, top_k=3, expert_dim=24, renormalize=False)),
}
ARCH = {"mixtral": MixtralForCausalLM, "qwen3_moe": Qwen3MoeForCausalLM,
        "qwen3_moe_unnormalized": Qwen3MoeForCausalLM, "olmoe": OlmoeForCausalLM}


def moe_model(rng, directory, case: str, build=None):
    """Saves a random model of ``case`` (fp32, eager attention: a window is the mask it builds)
    with every weight far from its initial value: matrices, the router's and the experts'
    included, N(0, 0.3), norm weights U(0.5, 1.5). The end-of-text token's head row is 0, so
    that greedy decoding never stops at once. (OLMoE's q_norm and k_norm, one weight over the
    whole projection each, are norm weights: U(0.5, 1.5) entry by entry.)"""
    directory.mkdir(parents=True)
    tok = tokenizer_files(rng, directory)
    eos = tok.token_to_id(EOS)
    model_class, cfg = (build or CASES[case][0])(rng, eos)
    cfg.vocab_size = tok.get_vocab_size()
    cfg._attn_implementation = "eager"
    torch.manual_seed(int(rng.integers(2**31)))
    model = model_class(cfg).float()
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.normal_(0, 0.3) if p.dim() > 1 else p.uniform_(0.5, 1.5)
        model.get_output_embeddings().weight[eos] = 0
    model.save_pretrained(directory)
    return model.eval()


@pytest.fixture(scope="module", params=list(CASES))
def family(request, tmp_path_factory):
    """(case, the random HF model, its import, the seed), once per case, on one device."""
    case = request.param
    seed = np.random.SeedSequence().entropy
    rng = np.random.default_rng(seed)
    d = tmp_path_factory.mktemp(case)
    model = moe_model(rng, d / "hf", case)
    run = import_run(d / "hf", d / "run", "--config.data.seq_len=128", "--config.mesh.fsdp=1")
    return case, model, run, seed


def test_import_sets_the_experts_and_gives_transformers_logits(family, rng):
    case, model, run, seed = family
    m = run.config.model
    for key, want in CASES[case][1].items():
        assert m[key] == want, (key, m[key], seed)
    for key, want in {**CASES[case][2], "router": "softmax_topk", "router_bias": False,
                      "z_loss": 0.0, "capacity": 0.0}.items():
        assert m.moe[key] == want, (key, m.moe[key], seed)
    assert m.moe.aux_loss == model.config.router_aux_loss_coef, seed
    tokens = rng.integers(0, m.vocab_size, (2, 4 * ORIGINAL))  # 5 windows, past the context
    got, want = our_logits(run, tokens), hf_logits(model, tokens)
    assert relative(got, want) < 1e-4, (relative(got, want), seed)


# Qwen3-MoE decodes in test_qwen3_moe_dense_layers_import_and_export_as_transformers_builds_them
# (its greedy tokens: head-wise q/k norms, head_dim 24, a tied head, the top k renormalised, as
# the qwen3_moe case has them, 2 of its 6 layers experts); the top k not renormalised and an
# untied head decode here in olmoe: the qwen3_moe cases would compile and check no other path
@pytest.mark.parametrize("family", ["mixtral", "olmoe"], indirect=True)
def test_greedy_generation_gives_transformers_tokens(family, rng, capsys):
    _, model, run, seed = family
    assert_greedy_tokens_match(rng, run, model, capsys)


def first_step(run, model, rng):
    """A batch whose second row ends in padding (transformers: attention_mask 0 and labels
    -100 there; ours: segment id 0 and loss mask 0), through transformers with
    output_router_logits=True and through our loss on one device: (transformers' output, our
    loss, counts and sums, the tokens and the real-token mask)."""
    from parallel.mesh import make_mesh
    from training.state import Trainer
    B, L = 2, 40
    tokens = rng.integers(0, run.config.model.vocab_size, (B, L))
    real = np.ones((B, L), np.int32)
    real[1, int(rng.integers(8, 12)):] = 0
    tokens[real == 0] = tokens[1, 0]  # one padding token, routed alike: unbalanced if counted
    with torch.no_grad():
        out = model(input_ids=torch.tensor(tokens), attention_mask=torch.tensor(real),
                    labels=torch.tensor(np.where(real == 1, tokens, -100)),
                    output_router_logits=True)
    c = run.config.copy_and_resolve_references()
    c.mesh.update(data=1, fsdp=1, sequence=1, tensor=1)
    c.attention.update(impl="dense", layout="contiguous", block_q=8, block_kv=8)
    c.data.update(seq_len=L, batch_size=B)
    c.train.update(microbatches=1, loss_chunk=0)
    trainer = Trainer(c, make_mesh(c.mesh, jax.devices()[:1]))
    params = run.restore_params(trainer.abstract_state.params).params
    trained = np.zeros((B, L), np.float32)
    trained[:, :-1] = real[:, :-1] * real[:, 1:]  # the next token is a real one
    batch = {"tokens": tokens, "labels": np.roll(tokens, -1, 1),
             "positions": np.broadcast_to(np.arange(L), (B, L)), "segment_ids": real,
             "loss_mask": trained}
    batch = jax.device_put({k: np.ascontiguousarray(v, np.float32 if k == "loss_mask" else np.int32)
                            for k, v in batch.items()}, trainer.batch_shardings)
    loss, counts, sums = jax.jit(trainer.loss_and_sums)(params, batch)
    return out, loss, counts, sums, tokens, real


# (qwen3_moe's config takes its first step in
# test_qwen3_moe_dense_layers_import_and_export_as_transformers_builds_them, with 4 dense layers
# among its 6: the loss and aux loss against transformers' on this batch; the count of tokens and
# the padding's share in the aux loss are the same code in the other cases)
@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe_unnormalized", "olmoe"], indirect=True)
def test_the_first_step_loss_with_padding_is_transformers_loss_with_router_logits(family, rng):
    """The first step on a batch with padding (``first_step``): the loss is transformers' with
    output_router_logits=True (the mean cross-entropy + router_aux_loss_coef x
    load_balancing_loss_func over the real tokens of both layers), and its aux_loss metric
    transformers' aux_loss."""
    _, model, run, seed = family
    out, loss, counts, sums, tokens, real = first_step(run, model, rng)
    assert int(counts["tokens"]) == int((np.where(real == 1, tokens, -100)[:, 1:] >= 0).sum())
    aux, want_aux = float(sums["aux_loss"]), float(out.aux_loss)
    assert abs(aux - want_aux) < 1e-5 * want_aux, (aux, want_aux, seed)
    # (the padding matters: counted, it moves the load-balancing loss 10x further from
    # transformers' than ours is; how far depends on how far the random router is from uniform,
    # as little as 5.6e-5 relative in one seed, far above fp32 noise)
    E, k = run.config.model.moe.num_experts, run.config.model.moe.top_k
    unmasked = float(load_balancing_loss_func(out.router_logits, E, k, None))
    assert abs(unmasked - want_aux) > 10 * abs(aux - want_aux), (unmasked, aux, want_aux, seed)
    assert abs(float(loss) - float(out.loss)) < 1e-5 * float(out.loss), (float(loss),
                                                                          float(out.loss), seed)


def export_bit_for_bit(run, out, seed):
    """Exports ``run`` to ``out``, checks its tensors are the imported checkpoint's bit for bit
    under the same names, and returns transformers' model of the export (fp32, eager)."""
    assert convert_hf.main(["export", "--run", str(run.directory), "--out", str(out)]) == 0
    original, exported = Tensors(run.directory.parent / "hf"), Tensors(out)
    assert original.names() == exported.names(), seed
    for name in original.names():
        np.testing.assert_array_equal(original[name].view(np.uint8), exported[name].view(np.uint8))
    theirs = AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager")
    return theirs.float().eval()


def test_export_loads_in_transformers_with_the_original_logits(family, rng, tmp_path):
    """The export is the architecture imported with the released per-expert names (those
    transformers 5.23's save_pretrained writes), its tensors the checkpoint's bit for bit, its
    config read by transformers to the same experts, routing, window and aux loss weight, its
    logits the original's within 1e-5."""
    case, model, run, seed = family
    theirs = export_bit_for_bit(run, tmp_path / "out", seed)
    assert type(theirs) is ARCH[case], seed
    for key in ("num_local_experts", "num_experts_per_tok", "norm_topk_prob",
                "moe_intermediate_size", "intermediate_size", "sliding_window",
                "router_aux_loss_coef", "tie_word_embeddings", "rope_parameters",
                "decoder_sparse_step", "mlp_only_layers", "clip_qkv", "attention_bias"):
        if hasattr(model.config, key):
            assert getattr(theirs.config, key) == getattr(model.config, key), (key, seed)
    head_dim = lambda c: (getattr(c, "head_dim", None)  # noqa: E731
                          or c.hidden_size // c.num_attention_heads)
    assert head_dim(theirs.config) == head_dim(model.config), seed  # Mixtral's null, OLMoE's none
    tokens = rng.integers(0, run.config.model.vocab_size, (2, 4 * ORIGINAL))
    assert relative(hf_logits(theirs, tokens), hf_logits(model, tokens)) < 1e-5, seed


def test_fused_experts_import_as_the_per_expert_names_do(family, tmp_path):
    """transformers 5's own layout (save_pretrained(save_original_format=False): gate_up_proj
    [E, 2F, D] and down_proj [E, D, F] under mlp.experts, the router under mlp.gate, Mixtral's
    too) reads to the same parameters, bit for bit, as the released per-expert names."""
    case, model, run, seed = family
    model.save_pretrained(tmp_path / "fused", save_original_format=False)
    fused, released = Tensors(tmp_path / "fused"), Tensors(run.directory.parent / "hf")
    assert "model.layers.1.mlp.experts.gate_up_proj" in fused.names(), fused.names()
    assert not any(".experts.0." in n for n in fused.names())
    m = run.config.model
    assert weights.moe_layout(m, fused) == "fused"
    assert weights.moe_layout(m, released) == ("mixtral" if case == "mixtral" else "qwen3_moe")
    want, got = weights.params_from_hf(released, m), weights.params_from_hf(fused, m)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(a, b)


# -- what does not convert, in one line -------------------------------------------------------
BASE = {"vocab_size": 300, "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 96, "max_position_embeddings": 64}
QWEN3_MOE = {**BASE, "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"],
             "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
OLMOE = {**BASE, "model_type": "olmoe", "architectures": ["OlmoeForCausalLM"], "num_experts": 8,
         "num_experts_per_tok": 2}
REFUSALS = {
    "clip_qkv": ({**OLMOE, "clip_qkv": 8.0},
                 ["clip_qkv=8.0: transformers clamps q, k and v to +-clip_qkv (OlmoeForCausalLM); "
                  "this model's attention does not clip"]),
    "clip_qkv 0": ({**OLMOE, "clip_qkv": 0}, ["clip_qkv=0: transformers clamps"]),
    "olmoe head_dim": ({**OLMOE, "head_dim": 24},
                       ["head_dim=24 with hidden_size=64 and num_attention_heads=4: "
                        "OlmoeForCausalLM's q_norm weighs hidden_size values"]),
    "olmoe biases": ({**OLMOE, "attention_bias": True},
                     ["attention_bias=true (biases on q, k, v and o)"]),
    "decoder_sparse_step": ({**QWEN3_MOE, "decoder_sparse_step": 0},
                            ["decoder_sparse_step=0; it must be a whole number >= 1"]),
    "no moe layer": ({**QWEN3_MOE, "decoder_sparse_step": 2, "mlp_only_layers": [1, 3]},
                     ["decoder_sparse_step=2 and mlp_only_layers=[1, 3] leave no layer of the 4 "
                      "a mixture of experts"]),
    "top_k": ({**QWEN3_MOE, "num_experts_per_tok": 9},
              ["num_experts_per_tok=9; it must be a whole number from 1 to num_experts=8"]),
    "no experts": ({**BASE, "model_type": "mixtral", "architectures": ["MixtralForCausalLM"],
                    "num_local_experts": 0}, ["num_local_experts=0; a mixture of experts needs"]),
    "qwen3_moe biases": ({**QWEN3_MOE, "attention_bias": True},
                         ["attention_bias=true (biases on q, k, v and o)"]),
    "mixtral mixed layers": ({**BASE, "model_type": "mixtral",
                              "architectures": ["MixtralForCausalLM"], "sliding_window": 8,
                              "layer_types": ["sliding_attention", "full_attention"] * 2},
                             ["MixtralForCausalLM slides every layer by sliding_window=8 and "
                              "ignores layer_types"]),
}


@pytest.mark.parametrize("name", list(REFUSALS))
def test_what_these_families_have_that_the_model_lacks_is_one_line(name):
    assert_refused(*REFUSALS[name])


def test_olmoe_norms_q_and_k_over_the_whole_projection():
    """OLMoE's q_norm weighs hidden_size values and its k_norm kv heads x head_dim (one RMS over
    every head: model.qk_norm_scope=projection), where Qwen3-MoE's is one head_dim-wide norm
    applied to each head alone: the import's tensor map (every name and shape, the fused
    experts as transformers 5.23 holds them) is transformers' own model's."""
    for cfg, model_class, scope in (
            (OLMOE, OlmoeForCausalLM, "projection"),
            ({**QWEN3_MOE, "head_dim": 24}, Qwen3MoeForCausalLM, "head")):
        fields = hf_config.model_fields(cfg)
        assert (fields["qk_norm"], fields["qk_norm_scope"]) == (True, scope)
        m = model_config(**{k: v for k, v in fields.items() if k != "rope_scaling"})
        config_class = {OlmoeForCausalLM: OlmoeConfig, Qwen3MoeForCausalLM: Qwen3MoeConfig}
        theirs = model_class(config_class[model_class](**cfg)).state_dict()
        want = {k: tuple(v.shape) for k, v in theirs.items()}
        assert weights._expected(m, "fused") == want
    attn = OlmoeForCausalLM(OlmoeConfig(**OLMOE)).model.layers[0].self_attn
    assert tuple(attn.q_norm.weight.shape) == (64,) and tuple(attn.k_norm.weight.shape) == (32,)


def test_released_configs_read_as_transformers_builds_them():
    """Released files spell the expert count num_experts (Qwen3-MoE) or num_local_experts
    (Mixtral; transformers 5.23 writes that key for both), and leave out what is the
    default: each reads to the experts transformers builds, and a dense family's import sets
    no experts whatever the --config file has."""
    qwen = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
            "hidden_size": 2048, "head_dim": 128, "num_attention_heads": 32,
            "num_key_value_heads": 4, "num_hidden_layers": 48, "intermediate_size": 6144,
            "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
            "norm_topk_prob": True, "router_aux_loss_coef": 0.001, "decoder_sparse_step": 1,
            "mlp_only_layers": [], "use_sliding_window": False, "sliding_window": None,
            "max_window_layers": 48, "rope_theta": 1000000.0, "vocab_size": 151936}
    olmoe = {"architectures": ["OlmoeForCausalLM"], "model_type": "olmoe",  # OLMoE-1B-7B-0924
             "attention_bias": False, "attention_dropout": 0.0, "clip_qkv": None,
             "eos_token_id": 50279, "hidden_act": "silu", "hidden_size": 2048,
             "intermediate_size": 1024, "max_position_embeddings": 4096, "norm_topk_prob": False,
             "num_attention_heads": 16, "num_experts": 64, "num_experts_per_tok": 8,
             "num_hidden_layers": 16, "num_key_value_heads": 16, "output_router_logits": False,
             "pad_token_id": 1, "rms_norm_eps": 1e-05, "rope_scaling": None,
             "rope_theta": 10000.0, "router_aux_loss_coef": 0.01, "tie_word_embeddings": False,
             "vocab_size": 50304}
    mix = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 4096,
           "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8,
           "num_hidden_layers": 32, "num_local_experts": 8, "num_experts_per_tok": 2,
           "router_aux_loss_coef": 0.02, "sliding_window": None, "rope_theta": 1e6,
           "vocab_size": 32000}
    for cfg, config_class in ((qwen, Qwen3MoeConfig), (mix, MixtralConfig),
                              (olmoe, OlmoeConfig),
                              ({"model_type": "qwen3_moe",
                                "architectures": ["Qwen3MoeForCausalLM"]}, Qwen3MoeConfig),
                              ({"model_type": "mixtral", "architectures": ["MixtralForCausalLM"]},
                               MixtralConfig),
                              ({"model_type": "olmoe", "architectures": ["OlmoeForCausalLM"]},
                               OlmoeConfig)):
        got, theirs = hf_config.model_fields(cfg), config_class(**cfg)
        e = got["moe"]
        assert e["num_experts"] == theirs.num_local_experts == theirs.num_experts
        assert e["top_k"] == theirs.num_experts_per_tok
        assert e["aux_loss"] == theirs.router_aux_loss_coef
        assert e["expert_dim"] == getattr(theirs, "moe_intermediate_size", theirs.intermediate_size)
        assert e["renormalize"] == getattr(theirs, "norm_topk_prob", True)
        assert got["sliding_window"] == (getattr(theirs, "sliding_window", None) or 0)
        assert got["norm_eps"] == theirs.rms_norm_eps
        assert got["num_kv_heads"] == theirs.num_key_value_heads
        assert got["tie_embeddings"] == theirs.tie_word_embeddings
        assert got["rope_theta"] == theirs.rope_parameters["rope_theta"]
        assert got["ffn_dim"] == theirs.intermediate_size
        hd = getattr(theirs, "head_dim", None) or theirs.hidden_size // theirs.num_attention_heads
        assert (got["head_dim"] or theirs.hidden_size // theirs.num_attention_heads) == hd
    written = {**qwen, "num_local_experts": 64}
    del written["num_experts"]  # as transformers 5.23 writes it
    assert hf_config.model_fields(written)["moe"]["num_experts"] == 64
    assert hf_config.model_fields({**mix, "model_type": "mistral",
                                   "architectures": ["MistralForCausalLM"],
                                   "num_local_experts": None})["moe"] == {"num_experts": 0}


def model_config(**fields):
    m = load("configs/base.py").model
    m.update(vocab_size=300, d_model=64, num_layers=4, num_heads=4, num_kv_heads=2, ffn_dim=96)
    m.moe.update(num_experts=8, top_k=2, expert_dim=32, aux_loss=0.02)
    m.update(fields)
    return m


@pytest.mark.parametrize("fields,kind", [
    ({}, "mixtral"), (dict(sliding_window=8), "mixtral"),
    (dict(moe=dict(router="topk_softmax", renormalize=False)), "mixtral"),
    (dict(qk_norm=True), "qwen3_moe"),
    (dict(qk_norm=True, moe=dict(renormalize=False)), "qwen3_moe"),
    (dict(qk_norm=True, sliding_window=8), "qwen3_moe"),
    (dict(qk_norm=True, qk_norm_scope="projection"), "olmoe"),
    (dict(qk_norm=True, qk_norm_scope="projection", moe=dict(renormalize=True)), "olmoe")])
def test_export_picks_the_moe_architecture_and_reads_back_the_same(fields, kind):
    """A top k then softmax router (model.moe.router=topk_softmax) is the softmax's top k
    renormalised: the same weights, exported so."""
    m = model_config(**fields)
    assert hf_config.architecture(m) == kind
    out = hf_config.hf_config(m, seq_len=64, dtype="float32", base=None, bos=None, eos=None)
    assert out["model_type"] == kind and out["architectures"] == [hf_config.CONVERTS[kind]]
    read = hf_config.model_fields(json.loads(json.dumps(out)))
    for key in ("qk_norm", "qk_norm_scope", "sliding_window", "layer_types", "head_dim") + (
            ("ffn_dim",) if kind == "qwen3_moe" else ()):
        assert read[key] == m[key], key  # (Mixtral's and OLMoE's one width is their experts')
    renormalized = m.moe.router == "topk_softmax" or m.moe.renormalize
    assert read["moe"] == {"num_experts": 8, "top_k": 2, "expert_dim": 32,
                           "router": "softmax_topk", "renormalize": renormalized,
                           "router_bias": False, "expert_bias": False, "glu": "gated",
                           "glu_limit": 7.0, "glu_alpha": 1.702, "aux_loss": 0.02, "z_loss": 0.0,
                           "capacity": 0.0, "every": 1, "first_dense": 0, "dense_layers": ""}
    config_class = {"mixtral": MixtralConfig, "qwen3_moe": Qwen3MoeConfig,
                    "olmoe": OlmoeConfig}[kind]
    theirs = config_class(**out)
    assert (theirs.num_local_experts, theirs.num_experts_per_tok) == (8, 2)
    assert getattr(theirs, "sliding_window", None) == (m.sliding_window or None)
    if kind == "olmoe":  # no head_dim key: hidden_size / heads; nothing clipped
        assert "head_dim" not in out and out["clip_qkv"] is None
        assert (theirs.intermediate_size, theirs.norm_topk_prob) == (32, renormalized)


@pytest.mark.parametrize("fields,fragment", [
    (dict(moe=dict(renormalize=False)), "model.moe.renormalize=False without model.qk_norm: no "
                                        "Hugging Face architecture has this combination"),
    (dict(moe=dict(router_bias=True)), "model.moe.num_experts=8 with model.moe.router_bias: no "
                                       "Hugging Face architecture"),
    (dict(qkv_bias=True), "model.moe.num_experts=8 with model.qkv_bias"),
    (dict(sliding_window=8, layer_types="sliding,full,sliding,full"),
     "with sliding and full layers mixed (model.layer_types)"),
    (dict(qk_norm=True, norm_unit_offset=True, sandwich_norms=True, scale_embeddings=True),
     "model.moe.num_experts=8 with model.norm_unit_offset, model.sandwich_norms, "
     "model.scale_embeddings"),
    (dict(qk_norm=True, qk_norm_scope="projection", sliding_window=8),
     "model.qk_norm_scope=projection with a window (model.sliding_window): no Hugging Face "
     "architecture has this combination"),
    (dict(qk_norm=True, qk_norm_scope="projection", head_dim=24),
     "model.qk_norm_scope=projection with model.head_dim=24 (not d_model / num_heads = 16)"),
    (dict(qk_norm=True, qk_norm_scope="projection", moe=dict(num_experts=0)),
     "model.qk_norm_scope=projection without a mixture of experts"),
    (dict(moe=dict(every=2)), "model.moe.num_experts=8 with dense layers (0, 2 of 4: "
                              "model.moe.every, first_dense, dense_layers) and no q/k norms: only "
                              "Qwen3MoeForCausalLM"),
])
def test_a_mixture_no_architecture_has_is_one_line(fields, fragment):
    with pytest.raises(ConversionError) as e:
        hf_config.architecture(model_config(**fields))
    assert fragment in str(e.value) and "\n" not in str(e.value)


def test_router_jitter_is_left_out_in_one_line():
    """Mixtral's router_jitter_noise (noise on the router's input while transformers trains)
    imports with one line saying it is left out; the model is the same."""
    cfg = {**BASE, "model_type": "mixtral", "architectures": ["MixtralForCausalLM"],
           "num_local_experts": 4, "router_jitter_noise": 0.01}
    assert hf_config.left_out(cfg) == [
        "config.json: router_jitter_noise=0.01 is left out: transformers multiplies the "
        "router's input by noise in training, the router here takes none (the model is the "
        "same)"]
    assert hf_config.left_out({**cfg, "router_jitter_noise": 0.0}) == []
    assert hf_config.model_fields(cfg)["moe"]["num_experts"] == 4


def test_router_z_loss_coef_is_left_out_in_one_line():
    """OLMoE trained with a router z-loss (router_z_loss_coef), which transformers'
    OlmoeForCausalLM never adds to its loss (LM + router_aux_loss_coef x the load-balancing
    loss alone): left out in one line, model.moe.z_loss 0, the loss transformers computes."""
    cfg = {**OLMOE, "router_z_loss_coef": 0.001}
    assert hf_config.left_out(cfg) == [
        "config.json: router_z_loss_coef=0.001 is left out: OlmoeForCausalLM adds no z-loss to "
        "its loss, so model.moe.z_loss stays 0 (set --config.model.moe.z_loss=0.001 to train "
        "with one; the model is the same)"]
    assert hf_config.model_fields(cfg)["moe"]["z_loss"] == 0.0
    assert hf_config.left_out(OLMOE) == []


# -- Qwen3-MoE's dense layers -------------------------------------------------------------
def test_qwen3_moe_dense_layers_import_and_export_as_transformers_builds_them(rng, tmp_path,
                                                                            capsys):
    """Qwen3-MoE of 6 layers, decoder_sparse_step=2 and mlp_only_layers=[3, 9] (9: past the
    layers, which transformers never reads): a mixture of experts in layers 1 and 5, the dense
    MLP of intermediate_size in 0, 2, 3 and 4 (model.moe.every=2, dense_layers="3", the MLPs in
    the stacks moe_mlp and dense_mlp). Imported: transformers' logits, greedy tokens, and first
    step's loss and aux loss (a mean over the MoE layers, not all 6). Config
    fields written back (a first_dense layer is in mlp_only_layers) read to the same layers.
    Exported: the checkpoint's tensors bit for bit, loading in transformers to its logits."""
    from model.flops import moe_layers
    build = lambda rng, eos: qwen3_moe(rng, eos, True, num_hidden_layers=6,  # noqa: E731
                                       decoder_sparse_step=2, mlp_only_layers=[3, 9])
    model = moe_model(rng, tmp_path / "hf", "qwen3_moe", build)
    assert [type(layer.mlp).__name__ for layer in model.model.layers] == [
        "Qwen3MoeMLP", "Qwen3MoeSparseMoeBlock", "Qwen3MoeMLP", "Qwen3MoeMLP", "Qwen3MoeMLP",
        "Qwen3MoeSparseMoeBlock"]
    run = import_run(tmp_path / "hf", tmp_path / "run", "--config.data.seq_len=128",
                     "--config.mesh.fsdp=1")
    m = run.config.model
    assert (m.moe.every, m.moe.dense_layers, m.moe.first_dense, m.ffn_dim) == (2, "3", 0, 96)
    assert moe_layers(m) == (1, 5)
    tokens = rng.integers(0, m.vocab_size, (2, 4 * ORIGINAL))
    assert relative(our_logits(run, tokens), hf_logits(model, tokens)) < 1e-4
    assert_greedy_tokens_match(rng, run, model, capsys)
    out, loss, _, sums, _, _ = first_step(run, model, rng)  # pooled over the 2 MoE layers only
    assert abs(float(sums["aux_loss"]) - float(out.aux_loss)) < 1e-5 * float(out.aux_loss)
    assert abs(float(loss) - float(out.loss)) < 1e-5 * float(out.loss)
    first = m.copy_and_resolve_references()
    first.moe.update(first_dense=2, dense_layers="")  # layers 0 and 1 dense, 3 and 5 not
    out = hf_config.hf_config(first, seq_len=64, dtype="float32", base=None, bos=None, eos=None)
    assert (out["decoder_sparse_step"], out["mlp_only_layers"]) == (2, [1])
    assert moe_layers(model_config(**{k: v for k, v in hf_config.model_fields(out).items()
                                      if k != "rope_scaling"})) == (3, 5)

    assert convert_hf.main(["export", "--run", str(run.directory), "--out",
                            str(tmp_path / "out")]) == 0
    original, exported = Tensors(tmp_path / "hf"), Tensors(tmp_path / "out")
    assert original.names() == exported.names()
    for name in original.names():
        np.testing.assert_array_equal(original[name].view(np.uint8), exported[name].view(np.uint8))
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager")
    theirs = theirs.float().eval()
    assert (theirs.config.decoder_sparse_step, theirs.config.mlp_only_layers) == (2, [3])
    assert relative(hf_logits(theirs, tokens), hf_logits(model, tokens)) < 1e-5
