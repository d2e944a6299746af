"""The byte-level BPE: training, caching, fingerprint, loading a tokenizer.json, and its errors."""
import json
import os
import subprocess
import sys

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from errors import DataError
from data import tokenizer as tk, tokens
import llama3_tokenizer


def real_docs():
    """Real text: a handful of standard-library modules."""
    import argparse, csv, difflib, json as js, textwrap as tw  # noqa: E401
    out = []
    for m in (argparse, csv, difflib, js, tw):
        with open(m.__file__, encoding="utf-8") as f:
            out.append(f.read())
    return out


@pytest.fixture(scope="module")
def trained():
    return tk.train_bpe(real_docs(), 400)


def test_trained_bpe_has_the_vocab_size_eos_and_round_trips_any_text(trained):
    assert trained.get_vocab_size() == 400
    eos = tk.eos_id(trained)
    assert trained.id_to_token(eos) == tk.EOS
    text = "def ünïcode(x):  # 日本語 and an emoji 🙂\n\treturn x ** 2\n"
    ids = trained.encode(text).ids
    assert trained.decode(ids) == text
    assert eos not in ids  # EOS is only ever inserted by packing
    # Merges were learned: real code needs fewer tokens than bytes.
    code = real_docs()[1]
    assert len(trained.encode(code).ids) < 0.6 * len(code.encode())


def test_vocab_too_small_for_the_byte_alphabet():
    with pytest.raises(DataError, match=r"^model.vocab_size=256 is too small .* at least 257 "):
        tk.train_bpe(real_docs(), 256)


def test_empty_corpus():
    with pytest.raises(DataError, match=r"^no documents in my corpus: the corpus is empty$"):
        tk.train_bpe([], 300, description="my corpus")


def test_fingerprint_is_stable_across_copies_and_processes(trained, tmp_path):
    fp = tk.fingerprint(trained)
    assert len(fp) == 16 and int(fp, 16) >= 0
    assert tk.fingerprint(Tokenizer.from_str(trained.to_str())) == fp
    path = tmp_path / "tokenizer.json"
    trained.save(str(path))
    code = f"from data.tokenizer import fingerprint; from tokenizers import Tokenizer; " \
           f"print(fingerprint(Tokenizer.from_file({str(path)!r})))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.stdout.strip() == fp
    assert tk.fingerprint(tk.train_bpe(real_docs(), 300)) != fp


def test_cached_bpe_trains_once_and_reuses(tmp_path):
    calls = []

    def docs():
        calls.append(1)
        return iter(real_docs())

    tok1, path1 = tk.cached_bpe(str(tmp_path), "source-A", 320, docs)
    mtime = os.stat(path1).st_mtime_ns
    tok2, path2 = tk.cached_bpe(str(tmp_path), "source-A", 320, docs)
    assert len(calls) == 1 and path1 == path2 and os.stat(path2).st_mtime_ns == mtime
    assert tk.fingerprint(tok1) == tk.fingerprint(tok2)
    assert tok2.get_vocab_size() == 320
    # Another source or vocab size is another tokenizer.
    _, path3 = tk.cached_bpe(str(tmp_path), "source-B", 320, docs)
    _, path4 = tk.cached_bpe(str(tmp_path), "source-A", 330, docs)
    assert len(calls) == 3 and len({path1, path3, path4}) == 3
    # Training is deterministic: every host of a multi-host run trains the same tokenizer.
    tok5, _ = tk.cached_bpe(str(tmp_path / "elsewhere"), "source-A", 320, docs)
    assert tk.fingerprint(tok5) == tk.fingerprint(tok1)


def test_load_a_tokenizer_json(trained, tmp_path):
    path = tmp_path / "tok.json"
    trained.save(str(path))
    loaded = tk.load(str(path), 400)
    assert tk.fingerprint(loaded) == tk.fingerprint(trained)
    assert tk.load(str(path), 1000).get_vocab_size() == 400  # a larger model vocab is fine


def test_load_errors(trained, tmp_path):
    path = tmp_path / "tok.json"
    trained.save(str(path))
    with pytest.raises(DataError, match=r"has 400 tokens but model.vocab_size is 399; "
                                        r"set --config.model.vocab_size=400 or more$"):
        tk.load(str(path), 399)
    with pytest.raises(DataError, match=r"^data.tokenizer: no such file "):
        tk.load(str(tmp_path / "missing.json"), 400)
    bad = tmp_path / "bad.json"
    bad.write_text("{ this is not json")
    with pytest.raises(DataError, match=r"is not a tokenizer.json") as e:
        tk.load(str(bad), 400)
    assert "\n" not in str(e.value)
    no_eos = Tokenizer(models.BPE())
    no_eos.pre_tokenizer = pre_tokenizers.ByteLevel()
    no_eos.save(str(tmp_path / "no_eos.json"))
    with pytest.raises(DataError, match="has no end-of-text token"):
        tk.load(str(tmp_path / "no_eos.json"), 400)


def test_eos_of_other_tokenizer_families():
    tok = Tokenizer(models.BPE())
    tok.add_special_tokens(["<s>", "</s>"])
    assert tk.eos_id(tok) == tok.token_to_id("</s>")
    assert json.loads(tok.to_str())["added_tokens"][1]["content"] == "</s>"


def random_text(rng, docs):
    """Words of real code, numbers of up to 9 digits, non-Latin text and newlines, shuffled."""
    words = " ".join(docs).split()
    pieces = [*rng.choice(words, 40), *(str(rng.integers(10 ** rng.integers(1, 10))) for _ in range(8)),
              "日本語の文", "ünïcode", "🙂", "\n\n", "\t", "don't", "WE'LL"]
    return " ".join(pieces[i] for i in rng.permutation(len(pieces)))


@pytest.fixture(scope="module")
def llama3_json(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama3") / "tokenizer.json"
    numbers = " ".join(["x=1234567"] * 3000)  # so that BPE would merge across digit groups if allowed
    llama3_tokenizer.build([*real_docs(), numbers], 600).save(str(path))
    return str(path)


def test_a_llama3_tokenizer_json_loads_round_trips_and_packs_without_bos(llama3_json, rng, tmp_path):
    """Meta's Llama 3 tokenizer.json, built small here: the tiktoken-style split, byte-level BPE,
    specials after the vocabulary and a post-processor that prepends <|begin_of_text|>."""
    size = 600 + len(llama3_tokenizer.SPECIALS)
    with pytest.raises(DataError, match=rf"has {size} tokens but model.vocab_size is {size - 1}; "):
        tk.load(llama3_json, size - 1)
    tok = tk.load(llama3_json, size)
    assert tok.get_vocab_size() == size and tk.eos_id(tok) == 601  # <|end_of_text|>, after BOS
    bos = tok.token_to_id(llama3_tokenizer.BOS)
    assert bos == 600
    text = random_text(rng, real_docs())
    ids = tok.encode(text).ids
    assert ids[0] == bos and ids[1:] == tok.encode(text, add_special_tokens=False).ids
    assert tok.decode(ids) == text and bos not in ids[1:]
    # The Llama 3 split: digits in groups of three from the left, never merged across a group.
    assert tok.encode("x=1234567", add_special_tokens=False).tokens == ["x", "=", "123", "456", "7"]
    chat = "<|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>"
    chat_ids = tok.encode(chat, add_special_tokens=False).ids
    assert [chat_ids[0], chat_ids[-1]] == [tok.token_to_id("<|start_header_id|>"), tok.token_to_id("<|eot_id|>")]
    # The data pipeline encodes documents without the BOS (packing puts EOS between them).
    docs = [random_text(rng, real_docs()) for _ in range(3)]
    corpus = tokens.tokenize(docs, tok, str(tmp_path / "corpus"), "three docs")
    for i, doc in enumerate(docs):
        assert corpus.doc(i).tolist() == tok.encode(doc, add_special_tokens=False).ids
