"""A real pretrained model end to end (scripts/get_smollm2.py, then hf/gguf_file.py): the
SmolLM2-135M-Instruct GGUF file from the wheel on the package index, imported, against
transformers' own GGUF loader reading the same file: logits on real English prose within fp32
noise, the same greedy tokens, the same token ids (digits split one by one), and the
perplexity of a trained model (tens, not the 49,152 of a random one)."""
import functools
import math
import os
import pathlib
import sysconfig

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from checkpoints.rundir import open_run
from scripts import get_smollm2
from test_hf_convert import our_logits, relative

CACHE = pathlib.Path(os.path.expanduser("~")) / ".cache" / "stripedjax"  # make smollm2's


def prose(words: int) -> str:
    """The history of Python from the standard library's LICENSE.txt: English prose that ships
    with every Python."""
    text = (pathlib.Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt").read_text()
    return " ".join(text.split("\n\n", 1)[1].split()[:words])


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    """(our run, transformers' model of the same file, transformers' tokenizer)."""
    out = tmp_path_factory.mktemp("smollm2") / "run"
    assert get_smollm2.main(["--out", str(out), "--cache", str(CACHE)]) == 0
    path = get_smollm2.gguf_file(CACHE, print)
    # transformers' loader, unchanged, with two of gguf's pure functions memoized: it parses the
    # file once for the model's config, once for its weights and once for the tokenizer, and
    # builds gguf's tensor-name table once per submodule (397 here): about 10 CPU s of the 30
    # it takes. What it computes is its own.
    import gguf
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf, "GGUFReader", functools.cache(gguf.GGUFReader))
        mp.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
        theirs = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                      dtype=torch.float32).eval()
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return open_run(out), theirs, tok


def test_the_real_model_gives_transformers_logits_and_a_trained_perplexity(smollm2, capsys):
    run, theirs, _ = smollm2
    m = run.config.model
    assert (m.num_layers, m.d_model, m.num_heads, m.num_kv_heads, m.ffn_dim, m.vocab_size,
            m.tie_embeddings, run.config.data.seq_len) == (30, 576, 9, 3, 1536, 49152, True, 8192)
    ids = np.array([run.tokenizer.encode(prose(120)).ids[:128]])
    with torch.no_grad():
        want = theirs(torch.tensor(ids)).logits.numpy()
    got = our_logits(run, ids)
    assert relative(got, want) < 1e-4
    logp = got[0, :-1] - np.logaddexp.reduce(got[0, :-1].astype(np.float64), axis=-1)[:, None]
    nll = -logp[np.arange(ids.shape[1] - 1), ids[0, 1:]].mean()
    with capsys.disabled():
        print(f"\nSmolLM2-135M-Instruct (Q4_1): perplexity {math.exp(nll):.2f} on "
              f"{ids.shape[1]} tokens of the LICENSE's prose")
    assert 1.5 < math.exp(nll) < 60  # a trained model, not a random one (49,152)


def test_the_real_model_generates_as_transformers_and_tokenizes_with_digits_split(smollm2):
    """Our KV cache's greedy continuation of the prose (one device) is transformers'
    generate's."""
    import jax

    from evaluation.kv_cache import Generator
    from evaluation.lengths import Buckets
    from model.sharded import ShardedModel
    from parallel.mesh import make_mesh
    run, theirs, tok = smollm2
    config = run.config.copy_and_resolve_references()
    config.mesh.update(data=1, fsdp=1, sequence=1, tensor=1)
    mesh = make_mesh(config.mesh, jax.devices()[:1])
    sharded = ShardedModel(config, mesh)
    params = run.restore_params(sharded.abstract_params).params
    ids = run.tokenizer.encode(prose(60)).ids
    ours = Generator(sharded, run.tokenizer.get_vocab_size()).generate(
        params, [ids], 12, length=Buckets(config, mesh, 8192)(len(ids)), eos=run.eos)[0]
    with torch.no_grad():
        want = theirs.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False,
                               eos_token_id=run.eos)[0, len(ids):].tolist()
    assert ours == [t for t in want if t != run.eos] and len(ours) >= 6
    text = "".join(c for c in prose(200) if not c.isdigit())
    assert run.tokenizer.encode(text).ids == tok(text, add_special_tokens=False)["input_ids"]
    pieces = [run.tokenizer.id_to_token(i) for i in run.tokenizer.encode("in 1995, 2001").ids]
    assert pieces == ["in", "Ġ", "1", "9", "9", "5", ",", "Ġ", "2", "0", "0", "1"]
    assert run.eos == run.tokenizer.token_to_id("<|im_end|>")  # the instruct model's end of turn
