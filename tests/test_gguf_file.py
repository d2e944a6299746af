"""hf/gguf_file.py and ``convert_hf.py import --gguf``: a small random Llama written as llama.cpp
writes GGUF (q/k rows permuted for its rotary kernel, quantized linears, float32 norms, the
tokenizer as tokens, merges and types) imports to transformers' own GGUF loader's logits and
greedy tokens; RoPE scaling and the Llama 3 tokenizer are read as llama.cpp reads them; bad files
stop in one line."""
import json

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer

from checkpoints.rundir import open_run
from data.tokenizer import EOS
from errors import ConversionError
from hf.gguf_file import (QUANT_TYPES, GGUFFile, decode, dequantize, permute, read_layout,
                          unpermute)
from scripts import convert_hf
from test_hf_convert import (ORIGINAL, assert_greedy_tokens_match, hf_logits, hf_model,
                             our_logits, relative)

import llama3_tokenizer

# the linears' types, dealt over the tensors in turn: every type a small file can hold
LINEAR_TYPES = (Q.Q4_1, Q.Q8_0, Q.Q4_0, Q.Q5_0, Q.Q5_1, Q.F16, Q.BF16, Q.F32)
NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
         "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate",
         "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
         "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"


def llama_cpp_permute(weights, n_head, n_head_kv=None):
    """convert_hf_to_gguf.py's ``LlamaModel.permute``, as written there: q goes through it with
    (n_head, n_head), k with (n_head, n_head_kv)."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def gguf_writer(path, arch, shape, tok, *, pre, bos, eos, add_bos, rope):
    """A GGUFWriter holding the metadata convert_hf_to_gguf.py writes: ``shape`` the model's
    sizes, ``tok`` (a tokenizers.Tokenizer) as tokens (its added tokens included, by id), merges
    and types, ``add_bos`` None for no tokenizer.ggml.add_bos_token key, ``rope`` extra
    ``{arch}.KEY: value`` entries (str, int or float, as llama.cpp types them)."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(shape["layers"])
    w.add_context_length(shape["context"])
    w.add_embedding_length(shape["hidden"])
    w.add_feed_forward_length(shape["ffn"])
    w.add_head_count(shape["heads"])
    w.add_head_count_kv(shape["kv_heads"])
    w.add_rope_freq_base(shape["theta"])
    w.add_layer_norm_rms_eps(shape["eps"])
    w.add_rope_dimension_count(shape["hidden"] // shape["heads"])
    w.add_vocab_size(shape["vocab"])
    for key, value in (rope or {}).items():
        add = (w.add_string if isinstance(value, str) else
               w.add_uint32 if isinstance(value, int) else w.add_float32)
        add(f"{arch}.{key}", value)
    spec = json.loads(tok.to_str())
    ids = {**spec["model"]["vocab"], **{a["content"]: a["id"] for a in spec["added_tokens"]}}
    tokens = sorted(ids, key=ids.get)
    assert [ids[t] for t in tokens] == list(range(len(tokens)))
    special = {a["content"] for a in spec["added_tokens"] if a["special"]}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([3 if t in special else 1 for t in tokens])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]])
    if bos is not None:
        w.add_bos_token_id(tok.token_to_id(bos))
    w.add_eos_token_id(tok.token_to_id(eos))
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    w.add_chat_template(TEMPLATE)
    return w


def finish(w):
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_gguf(model, tok, path, *, arch="llama", pre="smollm", corrupt_type=None, rope=None,
               exact=False, context=None):
    """``model`` (an HF LlamaForCausalLM) and ``tok`` (its tokenizers.Tokenizer) as llama.cpp's
    convert_hf_to_gguf.py writes them; ``exact``: every tensor F32; ``context``: the
    context_length written (the model's max_position_embeddings by default)."""
    c = model.config
    shape = dict(layers=c.num_hidden_layers, context=context or c.max_position_embeddings,
                 hidden=c.hidden_size, ffn=c.intermediate_size, heads=c.num_attention_heads,
                 kv_heads=c.num_key_value_heads, theta=c.rope_parameters["rope_theta"],
                 eps=c.rms_norm_eps, vocab=c.vocab_size)
    w = gguf_writer(path, arch, shape, tok, pre=pre, bos=EOS, eos=EOS, add_bos=False, rope=rope)
    kinds = iter((Q.F32,) * 64 if exact else LINEAR_TYPES * 8)
    for name, p in model.state_dict().items():
        a = p.detach().float().numpy()
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        if name == "model.embed_tokens.weight":
            out, kind = "token_embd.weight", Q.F32 if exact else Q.Q8_0
        elif name == "lm_head.weight":
            out, kind = "output.weight", Q.F32 if exact else Q.Q8_0
        elif name == "model.norm.weight":
            out, kind = "output_norm.weight", Q.F32
        else:
            layer, rest = name[len("model.layers."):].split(".", 1)
            out = f"blk.{layer}.{NAMES[rest.rsplit('.', 1)[0]]}.weight"
            kind = Q.F32 if a.ndim == 1 else next(kinds)
            if rest.startswith("self_attn.q_proj"):
                a = llama_cpp_permute(a, c.num_attention_heads, c.num_attention_heads)
            elif rest.startswith("self_attn.k_proj"):
                a = llama_cpp_permute(a, c.num_attention_heads, c.num_key_value_heads)
        if corrupt_type is not None and out == "blk.0.ffn_up.weight":
            kind = corrupt_type
        if kind == corrupt_type:  # bytes of a type this converter does not read
            data = np.zeros(gguf.quants.quant_shape_to_byte_shape(a.shape, kind), np.uint8)
        elif kind in (Q.F32, Q.F16):
            data = a.astype(np.float16 if kind == Q.F16 else np.float32)
        else:
            data = gguf.quants.quantize(a, kind)
        w.add_tensor(out, data, raw_shape=data.shape, raw_dtype=kind)
    finish(w)
    return path


def write_meta_gguf(path, tok, *, pre="llama-bpe", add_bos=None, rope=None, context=64,
                    bos=llama3_tokenizer.BOS, eos=llama3_tokenizer.EOS):
    """A GGUF file of metadata alone (a small llama's sizes, the tokenizer, ``rope`` keys): what
    GGUFFile reads for its config and tokenizer, and transformers for its tokenizer."""
    shape = dict(layers=2, context=context, hidden=64, ffn=96, heads=4, kv_heads=2,
                 theta=10000.0, eps=1e-5, vocab=tok.get_vocab_size())
    finish(gguf_writer(path, "llama", shape, tok, pre=pre, bos=bos, eos=eos, add_bos=add_bos,
                       rope=rope))
    return path


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """A random tied Llama (2 layers, 4/2 heads) as a GGUF file, beside its HF directory."""
    rng = np.random.default_rng(int.from_bytes(b"gguf", "little"))
    d = tmp_path_factory.mktemp("gguf")
    model = hf_model(rng, d / "hf", tied=True, kv_heads=2)
    tok = Tokenizer.from_file(str(d / "hf" / "tokenizer.json"))
    return write_gguf(model, tok, d / "tiny.gguf"), tok


def same_floats(got, want):
    """Bit for bit the same float32 values (NaN where NaN), shapes aside."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype == np.float32 and got.size == want.size
    got, want = got.reshape(-1), want.reshape(-1)
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(got), nan)
    np.testing.assert_array_equal(got.view(np.uint32)[~nan], want.view(np.uint32)[~nan])


def assert_reads_as_gguf(path):
    """hf/gguf_file's own reader and dequantizer give what llama.cpp's gguf package gives: every
    metadata value (of the same Python types), the tensors' names, types, shapes, places and
    sizes, and their float32 values bit for bit."""
    theirs = gguf.GGUFReader(str(path))
    data = path.read_bytes()
    ours = read_layout(data, len(data))
    assert ours.version == theirs.fields["GGUF.version"].contents()
    keys = [k for k in theirs.fields if not k.startswith("GGUF.")]
    assert list(ours.metadata) == keys
    for key in keys:
        got, want = decode(ours.metadata[key]), theirs.fields[key].contents()
        assert got == want and type(got) is type(want), key
        if isinstance(want, list):
            assert [type(v) for v in got] == [type(v) for v in want], key
    assert ours.data_offset == theirs.data_offset
    assert [(t.name, t.type, t.shape, t.offset + ours.data_offset, t.n_bytes)
            for t in ours.tensors] == [
        (t.name, t.tensor_type.name, tuple(int(n) for n in t.shape), t.data_offset, t.n_bytes)
        for t in theirs.tensors]
    for t, want in zip(ours.tensors, theirs.tensors):
        raw = np.frombuffer(data, np.uint8, t.n_bytes, ours.data_offset + t.offset)
        same_floats(dequantize(raw, t.type), gguf.quants.dequantize(want.data, want.tensor_type))
    return ours


def test_our_reader_reads_what_the_gguf_package_reads(tiny_gguf, tmp_path, rng):
    """The model file (every type a small file holds), a metadata file of strings, ints,
    floats and a bool, and a file of every value type (extremes, arrays of each, arrays of
    arrays) with another alignment."""
    ours = assert_reads_as_gguf(tiny_gguf[0])
    assert {t.type for t in ours.tensors} == {q.name for q in LINEAR_TYPES}
    tok = llama3_tokenizer.build(["ab cd ef"] * 4, 300)
    assert_reads_as_gguf(write_meta_gguf(
        tmp_path / "meta.gguf", tok, add_bos=True,
        rope={"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0,
              "rope.scaling.original_context_length": 16}))
    V = gguf.GGUFValueType
    values = {V.UINT8: 255, V.INT8: -128, V.UINT16: 65535, V.INT16: -32768,
              V.UINT32: 2 ** 32 - 1, V.INT32: -2 ** 31, V.UINT64: 2 ** 64 - 1,
              V.INT64: -2 ** 63, V.FLOAT32: float(np.float32(rng.normal())),
              V.FLOAT64: float(rng.normal()), V.BOOL: True, V.STRING: "naïve 日本語 🙂"}
    w = gguf.GGUFWriter(str(tmp_path / "all.gguf"), "llama")
    w.add_custom_alignment(64)
    for kind, value in values.items():
        w.add_key_value(f"test.{kind.name}", value, kind)
        w.add_key_value(f"test.{kind.name}s", [value, value, values[V.BOOL] and value], V.ARRAY,
                        sub_type=kind)
    w.add_key_value("test.bools", [True, False, True], V.ARRAY, sub_type=V.BOOL)
    w.add_key_value("test.empty", "", V.STRING)
    w.add_key_value("test.nested", [[1, 2], [3]], V.ARRAY)
    w.add_key_value("test.nested_strings", [["a", "bc"], ["é"]], V.ARRAY)
    w.add_tensor("odd", rng.normal(size=3).astype(np.float32))
    w.add_tensor("q", gguf.quants.quantize(rng.normal(size=(3, 64)).astype(np.float32), Q.Q8_0),
                 raw_dtype=Q.Q8_0)
    finish(w)
    ours = assert_reads_as_gguf(tmp_path / "all.gguf")
    assert ours.data_offset % 64 == 0 and len(ours.metadata) == 2 * len(values) + 6


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # inf * 0 in both
@pytest.mark.parametrize("kind", QUANT_TYPES)
def test_dequantize_is_the_gguf_packages_bit_for_bit(rng, kind):
    """Random bytes (NaN, infinite and subnormal scales included) of every type that converts:
    our whole-tensor numpy is gguf.quants.dequantize, bit for bit, over more rows than its
    groups of 16."""
    block, size = gguf.GGML_QUANT_SIZES[Q[kind]]
    rows, blocks = int(rng.integers(1, 70)), int(rng.integers(1, 6)) * (32 if block == 1 else 1)
    raw = rng.integers(0, 256, (rows, blocks * size), dtype=np.uint8)
    want = gguf.quants.dequantize(raw, Q[kind])
    assert want.shape == (rows, blocks * block)
    same_floats(dequantize(raw, kind), want)


def test_a_file_cut_short_anywhere_stops_in_one_line(tiny_gguf, tmp_path, rng):
    """Cut in its header, metadata (the vocabulary's strings), tensor infos or data: one
    ConversionError line each; a big-endian file is refused by name."""
    data = tiny_gguf[0].read_bytes()
    layout = read_layout(data, len(data))
    bad = tmp_path / "bad.gguf"
    cuts = {5, 23, 24, 100, 2000, layout.data_offset - 1, layout.data_offset + 7,
            len(data) - 1, *rng.integers(4, len(data), 8).tolist()}
    for cut in sorted(cuts):
        bad.write_bytes(data[:cut])
        with pytest.raises(ConversionError, match="cannot be read as GGUF"):
            GGUFFile(bad)
    bad.write_bytes(data[:4] + (3).to_bytes(4, "big") + data[8:])
    with pytest.raises(ConversionError, match="a big-endian GGUF file does not convert"):
        GGUFFile(bad)


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(8, 2, 16), (9, 3, 64), (6, 1, 12),
                                                     (4, 4, 8)])
def test_unpermute_undoes_llama_cpps_permute(rng, heads, kv_heads, head_dim):
    """GQA shapes: q permuted with n_head, k with n_head_kv, by convert_hf_to_gguf.py's own
    definition, come back in HF's order; and in each GGUF head, rows 2i and 2i+1 (the pair
    ggml's rope rotates together) are the HF head's rows i and i + head_dim/2 (the pair HF's
    rotate_half rotates together)."""
    width = int(rng.integers(8, 48))
    q = rng.normal(size=(heads * head_dim, width))
    k = rng.normal(size=(kv_heads * head_dim, width))
    gguf_q = llama_cpp_permute(q, heads, heads)
    gguf_k = llama_cpp_permute(k, heads, kv_heads)
    for w, g, n in ((q, gguf_q, heads), (k, gguf_k, kv_heads)):
        np.testing.assert_array_equal(unpermute(g, n), w)
        np.testing.assert_array_equal(permute(w, n), g)
        half = head_dim // 2
        for h in range(n):
            np.testing.assert_array_equal(g[h * head_dim:(h + 1) * head_dim:2],
                                          w[h * head_dim:h * head_dim + half])
            np.testing.assert_array_equal(g[h * head_dim + 1:(h + 1) * head_dim:2],
                                          w[h * head_dim + half:(h + 1) * head_dim])
        assert not np.array_equal(g, w)  # the order does change


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


UNICODE = ["naïve", "Größe", "日本語", "ünïcödé", "café", "🙂", "Ελληνικά", "x²", "Œuvre"]
CODE = ["def f(x):\n    return x + 1", "if (a != b) { c++; }", "x = [1, 2, 3];", "a_b.c->d",
        "don't", "I'LL", "we've", "#include <stdio.h>", "    ", "\t\t", "\n\n", " \r\n "]


def varied_text(rng, words, whole=()):
    """Words, numbers of 1 to 9 digits, unicode, code, whitespace runs, and ``whole`` words
    with their leading space, in random order and spacing."""
    kinds = [lambda: str(rng.choice(words)),
             lambda: str(rng.integers(0, 10 ** int(rng.integers(1, 10)))),
             lambda: str(rng.choice(UNICODE)), lambda: str(rng.choice(CODE)),
             lambda: " " * int(rng.integers(2, 7))]
    if whole:
        kinds.append(lambda: " " + str(rng.choice(whole)))
    return "".join(str(rng.choice(["", " ", " ", "\n"])) + kinds[rng.integers(len(kinds))]()
                   for _ in range(int(rng.integers(40, 80))))


def llama3_with_a_whole_word(rng):
    """A Llama 3 tokenizer (llama3_tokenizer.build: Meta's split, byte-level BPE with
    ignore_merges, <|begin_of_text|> first) trained on varied text, with one more word in its
    vocabulary that no merge builds: ``(tokenizer, the tokenizer without ignore_merges, the
    word, the training words)``."""
    words = ["".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz"), rng.integers(2, 9)))
             for _ in range(300)]
    word = "".join(rng.choice(list("qvwxzjk"), 7))  # not a training word: no merge builds it
    words = [w for w in words if w != word]
    tok = llama3_tokenizer.build([varied_text(rng, words) for _ in range(80)], 600,
                                 whole=[" " + word])
    spec = json.loads(tok.to_str())
    spec["model"]["ignore_merges"] = False
    merged = Tokenizer.from_str(json.dumps(spec))
    assert len(merged.encode(" " + word, add_special_tokens=False).ids) > 1  # not by merges
    return tok, merged, word, words


def test_a_llama_bpe_file_tokenizes_as_llama_cpp(rng, tmp_path):
    """llama.cpp's llama-bpe (src/llama-vocab.cpp: LLAMA_VOCAB_PRE_TYPE_LLAMA3, ignore_merges,
    add_bos when the file does not say): a word whole in the vocabulary is one token, and a file
    without tokenizer.ggml.add_bos_token begins with <|begin_of_text|>, as Meta's tokenizer.json
    tokenizes. transformers' GGUF tokenizer (integrations/gguf/gguf_tokenizer_mapping.py) does
    neither: its BPE merges such a word into pieces and it adds BOS by default only to a
    sentencepiece (tokenizer.ggml.model "llama") file; it is compared where it agrees."""
    tok, _, word, words = llama3_with_a_whole_word(rng)
    path = write_meta_gguf(tmp_path / "llama3.gguf", tok)  # no add_bos_token key
    ours = GGUFFile(path).tokenizer()
    bos = tok.token_to_id(llama3_tokenizer.BOS)
    assert ours.encode(" " + word).ids == [bos, tok.token_to_id("Ġ" + word)]
    for _ in range(4):
        text = varied_text(rng, words, whole=[word])
        assert ours.encode(text).ids == tok.encode(text).ids
        assert ours.decode(ours.encode(text).ids) == text
    theirs = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    for _ in range(4):
        text = varied_text(rng, words)  # no whole word that merges do not build
        assert (ours.encode(text, add_special_tokens=False).ids
                == theirs(text, add_special_tokens=False)["input_ids"]
                == tok.encode(text, add_special_tokens=False).ids)


@pytest.mark.parametrize("pre,add_bos", [("llama-bpe", None), ("llama-bpe", False),
                                         ("llama-bpe", True), ("smollm", None),
                                         ("smollm", True)])
def test_bos_and_whole_words_follow_the_pre_tokenizer_as_in_llama_cpp(rng, tmp_path, pre,
                                                                       add_bos):
    """llama-vocab.cpp: llama-bpe sets ignore_merges and add_bos, smollm neither; a
    tokenizer.ggml.add_bos_token key overrides add_bos either way. The run's
    tokenizer_config.json says the same as the tokenizer."""
    tok, merged, word, _ = llama3_with_a_whole_word(rng)
    f = GGUFFile(write_meta_gguf(tmp_path / "f.gguf", tok, pre=pre, add_bos=add_bos))
    bos = [tok.token_to_id(llama3_tokenizer.BOS)]
    adds = pre == "llama-bpe" if add_bos is None else add_bos
    pieces = ([tok.token_to_id("Ġ" + word)] if pre == "llama-bpe" else
              merged.encode(" " + word, add_special_tokens=False).ids)
    assert f.tokenizer().encode(" " + word).ids == bos * adds + pieces
    assert f.side_files()["tokenizer_config.json"]["add_bos_token"] is adds


def test_a_file_that_begins_with_bos_but_names_no_bos_stops_in_one_line(tmp_path, capsys):
    tok = llama3_tokenizer.build(["ab cd ef"] * 4, 300)
    path = write_meta_gguf(tmp_path / "f.gguf", tok, bos=None)  # llama-bpe: BOS by default
    message = (f"tokenizer.ggml.bos_token_id is missing; a token id below {tok.get_vocab_size()} "
               f"is needed")
    with pytest.raises(ConversionError, match=message):
        GGUFFile(path).tokenizer()
    capsys.readouterr()
    assert convert_hf.main(["import", "--gguf", str(path), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not (tmp_path / "run").exists()


# RoPE keys of a file -> the rope_scaling llama.cpp runs it with (src/llama-model.cpp
# load_hparams: type "linear" unless given, rope.scaling.factor else the older rope.scale_linear,
# 0 or none unscaled, YaRN's original context the training context unless given and non-zero;
# src/llama-context.cpp: type "none" never scales). F: a random factor, G another, C the file's
# context_length, O a random original context.
ROPE_CASES = {
    "factor, no type": ({"rope.scaling.factor": "F"}, {"rope_type": "linear", "factor": "F"}),
    "rope.scale_linear": ({"rope.scale_linear": "F"}, {"rope_type": "linear", "factor": "F"}),
    "both factor keys": ({"rope.scaling.factor": "F", "rope.scale_linear": "G"},
                         {"rope_type": "linear", "factor": "F"}),
    "linear": ({"rope.scaling.type": "linear", "rope.scaling.factor": "F"},
               {"rope_type": "linear", "factor": "F"}),
    "yarn, no original": ({"rope.scaling.type": "yarn", "rope.scaling.factor": "F"},
                          {"rope_type": "yarn", "factor": "F",
                           "original_max_position_embeddings": "C"}),
    "yarn, original 0": ({"rope.scaling.type": "yarn", "rope.scaling.factor": "F",
                          "rope.scaling.original_context_length": 0},
                         {"rope_type": "yarn", "factor": "F",
                          "original_max_position_embeddings": "C"}),
    "yarn": ({"rope.scaling.type": "yarn", "rope.scaling.factor": "F",
              "rope.scaling.original_context_length": "O"},
             {"rope_type": "yarn", "factor": "F", "original_max_position_embeddings": "O"}),
    "none with a factor": ({"rope.scaling.type": "none", "rope.scaling.factor": "F"}, None),
    "linear, no factor": ({"rope.scaling.type": "linear"}, None),
    "factor 0": ({"rope.scaling.factor": 0.0, "rope.scale_linear": "F"}, None),
    "no key": ({}, None),
}


@pytest.mark.parametrize("case", ROPE_CASES)
def test_rope_scaling_is_read_as_llama_cpp_reads_it(rng, tmp_path, case):
    keys, want = ROPE_CASES[case]
    values = {"F": float(np.float32(rng.uniform(1.5, 16))),
              "G": float(np.float32(rng.uniform(1.5, 16))),
              "C": int(rng.integers(64, 4096)), "O": int(rng.integers(16, 64))}

    def fill(d):
        return {k: values.get(v, v) if isinstance(v, str) else v for k, v in d.items()}

    tok = llama3_tokenizer.build(["ab cd ef"] * 4, 300)
    path = write_meta_gguf(tmp_path / "f.gguf", tok, rope=fill(keys), context=values["C"])
    config = GGUFFile(path).config
    assert config["max_position_embeddings"] == values["C"]
    assert config.get("rope_scaling") == (want and fill(want))


@pytest.mark.parametrize("scaling,rope", [
    ("linear", {"rope.scaling.factor": 4.0}),  # what a file with no type says
    ("linear", {"rope.scale_linear": 4.0}),  # the key's older name
    ("yarn", {"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0}),  # original: context
])
def test_a_scaled_file_gives_the_scaled_models_logits(rng, tmp_path, scaling, rope):
    """Past the original context, the import of a file whose scaling llama.cpp reads from these
    keys gives the logits of the scaled HF model the file was written from (every tensor F32).
    transformers' GGUF loader is no reference here: it reads no rope.scaling key for a llama
    file and runs every one of these unscaled."""
    model = hf_model(rng, tmp_path / "hf", scaling=scaling, kv_heads=2)
    tok = Tokenizer.from_file(str(tmp_path / "hf" / "tokenizer.json"))
    path = write_gguf(model, tok, tmp_path / "scaled.gguf", rope=rope, exact=True,
                      context=ORIGINAL)
    assert convert_hf.main(["import", "--gguf", str(path), "--out", str(tmp_path / "run"),
                            "--config.data.seq_len=128"]) == 0
    run = open_run(tmp_path / "run")
    assert (run.config.model.rope_scaling.type, run.config.model.rope_scaling.factor) == (
        scaling, 4.0)
    tokens = rng.integers(0, run.config.model.vocab_size, (2, 4 * ORIGINAL))
    assert relative(our_logits(run, tokens), hf_logits(model, tokens)) < 1e-4


@pytest.mark.parametrize("case,message", [
    ("arch", "architecture 'qwen3' does not convert; llama does"),
    ("pre", "pre-tokenizer 'qwen2' is not known here"),
    ("type", "is of type IQ4_NL, which does not dequantize here"),
    ("truncated", "cannot be read as GGUF"),
    ("not gguf", "not a GGUF file"),
    ("longrope", "llama.rope.scaling.type='longrope' does not convert; none, linear and yarn do"),
    ("attn_factor", "llama.rope.scaling.attn_factor=2 does not convert; only 1"),
    ("factor < 1", "llama.rope.scale_linear=0.5 does not convert; a factor >= 1 does"),
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
        rope = {"longrope": {"rope.scaling.type": "longrope", "rope.scaling.factor": 4.0},
                "attn_factor": {"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0,
                                "rope.scaling.original_context_length": 16,
                                "rope.scaling.attn_factor": 2.0},
                "factor < 1": {"rope.scale_linear": 0.5}}.get(case)
        write_gguf(model, tok, bad, arch="qwen3" if case == "arch" else "llama",
                   pre="qwen2" if case == "pre" else "smollm",
                   corrupt_type=Q.IQ4_NL if case == "type" else None, rope=rope)
    if case != "pre":
        with pytest.raises(ConversionError, match=message):
            GGUFFile(bad)
    capsys.readouterr()
    assert convert_hf.main(["import", "--gguf", str(bad), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not (tmp_path / "run").exists()  # nothing written
