"""hf/gguf_file.py and ``convert_hf.py import --gguf``: a small random Llama written as llama.cpp
writes GGUF (q/k rows permuted for its rotary kernel, quantized linears, float32 norms, the
tokenizer as tokens, merges and types) imports to transformers' own GGUF loader's logits and
greedy tokens; bad files stop in one line."""
import json

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from transformers import AutoModelForCausalLM, AutoTokenizer

from checkpoints.rundir import open_run
from data.tokenizer import EOS
from errors import ConversionError
from hf.gguf_file import GGUFFile, permute, unpermute
from scripts import convert_hf
from test_hf_convert import assert_greedy_tokens_match, hf_model, our_logits, relative

# the linears' types, dealt over the tensors in turn: every type a small file can hold
LINEAR_TYPES = (Q.Q4_1, Q.Q8_0, Q.Q4_0, Q.Q5_0, Q.Q5_1, Q.F16, Q.BF16, Q.F32)
NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
         "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate",
         "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
         "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"


def write_gguf(model, tok, path, *, arch="llama", pre="smollm", corrupt_type=None):
    """``model`` (an HF LlamaForCausalLM) and ``tok`` (its tokenizers.Tokenizer) as llama.cpp's
    convert_hf_to_gguf.py writes them."""
    c = model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
    w.add_vocab_size(c.vocab_size)
    spec = json.loads(tok.to_str())
    vocab = sorted(spec["model"]["vocab"].items(), key=lambda kv: kv[1])
    special = {a["content"] for a in spec["added_tokens"] if a["special"]}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list([t for t, _ in vocab])
    w.add_token_types([3 if t in special else 1 for t, _ in vocab])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]])
    w.add_bos_token_id(tok.token_to_id(EOS))
    w.add_eos_token_id(tok.token_to_id(EOS))
    w.add_add_bos_token(False)
    w.add_chat_template(TEMPLATE)
    kinds = iter(LINEAR_TYPES * 8)
    for name, p in model.state_dict().items():
        a = p.detach().float().numpy()
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        if name == "model.embed_tokens.weight":
            out, kind = "token_embd.weight", Q.Q8_0
        elif name == "lm_head.weight":
            out, kind = "output.weight", Q.Q8_0
        elif name == "model.norm.weight":
            out, kind = "output_norm.weight", Q.F32
        else:
            layer, rest = name[len("model.layers."):].split(".", 1)
            out = f"blk.{layer}.{NAMES[rest.rsplit('.', 1)[0]]}.weight"
            kind = Q.F32 if a.ndim == 1 else next(kinds)
            if rest.startswith("self_attn.q_proj"):
                a = permute(a, c.num_attention_heads)
            elif rest.startswith("self_attn.k_proj"):
                a = permute(a, c.num_key_value_heads)
        if corrupt_type is not None and out == "blk.0.ffn_up.weight":
            kind = corrupt_type
        if kind == corrupt_type:  # bytes of a type this converter does not read
            data = np.zeros(gguf.quants.quant_shape_to_byte_shape(a.shape, kind), np.uint8)
        elif kind in (Q.F32, Q.F16):
            data = a.astype(np.float16 if kind == Q.F16 else np.float32)
        else:
            data = gguf.quants.quantize(a, kind)
        w.add_tensor(out, data, raw_shape=data.shape, raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """A random tied Llama (2 layers, 4/2 heads) as a GGUF file, beside its HF directory."""
    rng = np.random.default_rng(int.from_bytes(b"gguf", "little"))
    d = tmp_path_factory.mktemp("gguf")
    model = hf_model(rng, d / "hf", tied=True, kv_heads=2)
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(d / "hf" / "tokenizer.json"))
    return write_gguf(model, tok, d / "tiny.gguf"), tok


def test_unpermute_inverts_llama_cpps_rotary_order(rng):
    for heads, rows_per_head in ((9, 64), (3, 64), (4, 16)):
        w = rng.normal(size=(heads * rows_per_head, 40))
        assert np.array_equal(unpermute(permute(w, heads), heads), w)
        assert not np.array_equal(permute(w, heads), w)  # the order does change


def test_an_import_gives_transformers_logits_greedy_tokens_and_tokenizer(tiny_gguf, tmp_path,
                                                                        capsys, rng):
    path, tok = tiny_gguf
    assert convert_hf.main(["import", "--gguf", str(path), "--out", str(tmp_path / "run"),
                            "--config.data.seq_len=128"]) == 0
    run = open_run(tmp_path / "run")
    theirs = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                  dtype=torch.float32).eval()
    assert run.config.model.tie_embeddings and run.config.model.num_kv_heads == 2
    tokens = rng.integers(3, tok.get_vocab_size(), (2, 24))
    with torch.no_grad():
        want = theirs(torch.tensor(tokens)).logits.numpy()
    assert relative(our_logits(run, tokens), want) < 1e-4
    # the weights are the dequantized file's, not the model before quantizing: the 4-bit
    # types move logits far more than fp32 noise
    original = AutoModelForCausalLM.from_pretrained(str(path.parent / "hf"),
                                                    dtype=torch.float32).eval()
    with torch.no_grad():
        assert relative(original(torch.tensor(tokens)).logits.numpy(), want) > 1e-3
    assert_greedy_tokens_match(rng, run, theirs, capsys)
    # ids: transformers' GGUF tokenizer on text without digits, and the chat template kept
    hf_tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    text = " ".join(tok.decode([int(i)]) for i in rng.integers(5, 250, 40))
    assert run.tokenizer.encode(text).ids == hf_tok(text, add_special_tokens=False)["input_ids"]
    assert json.loads((tmp_path / "run" / "hf" / "tokenizer_config.json").read_text())[
        "chat_template"] == TEMPLATE
    assert run.eos == tok.token_to_id(EOS)


def test_the_smollm_pre_tokenizer_splits_every_digit(tiny_gguf):
    """llama.cpp's smollm rule: each digit alone, then GPT-2's byte-level split."""
    pre = GGUFFile(tiny_gguf[0]).tokenizer().pre_tokenizer
    assert [p for p, _ in pre.pre_tokenize_str("in 2024 ab12")] == [
        "in", "Ġ", "2", "0", "2", "4", "Ġab", "1", "2"]


@pytest.mark.parametrize("case,message", [
    ("arch", "architecture 'qwen3' does not convert; llama does"),
    ("pre", "pre-tokenizer 'qwen2' is not known here"),
    ("type", "is of type IQ4_NL, which does not dequantize here"),
    ("truncated", "cannot be read as GGUF"),
    ("not gguf", "not a GGUF file"),
])
def test_a_bad_file_stops_in_one_line(tiny_gguf, tmp_path, capsys, case, message):
    path, tok = tiny_gguf
    bad = tmp_path / "bad.gguf"
    if case == "truncated":
        bad.write_bytes(path.read_bytes()[:path.stat().st_size // 2])
    elif case == "not gguf":
        bad.write_text("{}")
    else:
        rng = np.random.default_rng(0)
        model = hf_model(rng, tmp_path / "hf", kv_heads=2)
        write_gguf(model, tok, bad, arch="qwen3" if case == "arch" else "llama",
                   pre="qwen2" if case == "pre" else "smollm",
                   corrupt_type=Q.IQ4_NL if case == "type" else None)
    if case != "pre":
        with pytest.raises(ConversionError, match=message):
            GGUFFile(bad)
    capsys.readouterr()
    assert convert_hf.main(["import", "--gguf", str(bad), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not (tmp_path / "run").exists()  # nothing written
