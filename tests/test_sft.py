"""data/sft.py: the chat pipeline. Whole conversations packed into rows; the first step's loss is
transformers' per-token assistant losses of each conversation run alone, summed over the
total count; the same loss and gradients on one device and usp over 8 in the zigzag layout with
two microbatches, the same loss, trained tokens and gradient norm as the first step of a run
striped over a ring of 8 (configs/sft.py's mesh); bad records counted and named, bad files one
line."""
import json
import pathlib

import jax
import numpy as np
import pytest
import chat_templates as ct
from configs import sft as sft_config
from data import chat, sft
from data.pipeline import make_pipeline
from errors import DataError
from parallel.mesh import make_mesh
from scripts import convert_hf
from training.state import Trainer

WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi "
         "rho sigma tau upsilon phi chi psi omega 12 345 naïve café code(): return x + 1").split()
SEQ = 256


def say(rng, lo=1, hi=7):
    return " ".join(rng.choice(WORDS, int(rng.integers(lo, hi))))


def conversation(rng):
    turns = int(rng.integers(1, 3))
    out = [{"role": "system", "content": say(rng)}] if rng.random() < 0.3 else []
    for _ in range(turns):
        out += [{"role": "user", "content": say(rng)}, {"role": "assistant", "content": say(rng)}]
    return {"messages": out}


def write_jsonl(path: pathlib.Path, records) -> pathlib.Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.fixture(scope="module")
def chat_run(tmp_path_factory):
    """(an imported random Llama with a ChatML tokenizer whose template marks the assistant's
    tokens, transformers' model in float64 and tokenizer, the conversations' file, records)."""
    import torch  # the reference, from requirements-test.txt (the newest JAX's set lacks it)
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
    rng = np.random.default_rng(42)
    root = tmp_path_factory.mktemp("chat")
    hf_dir = root / "hf"
    tok = ct.write_tokenizer_dir("marked", hf_dir)
    cfg = LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=96,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=SEQ, rope_theta=10000.0, rms_norm_eps=1e-5,
                      eos_token_id=tok.token_to_id("<|im_end|>"))
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).float()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    model.save_pretrained(hf_dir)
    run = root / "run"
    assert convert_hf.main(["import", "--hf", str(hf_dir), "--out", str(run)]) == 0
    records = [conversation(rng) for _ in range(40)]
    data = write_jsonl(root / "chats.jsonl", records)
    return run, model.double().eval(), AutoTokenizer.from_pretrained(str(hf_dir)), data, records


def config(chat_run, tmp_path, mesh=None, **data):
    run, _, _, path, _ = chat_run
    c = sft_config.get_config(str(run))
    c.data.update({"path": str(path), "seq_len": SEQ, "batch_size": 4, "heldout_fraction": 0.1,
                   "prefetch": 0, "cache_dir": str(tmp_path / "cache"), **data})
    c.model.update(dtype="float32", remat="none")
    c.attention.update(block_q=16, block_kv=16)
    c.mesh.update(mesh or {"data": 1, "fsdp": 1, "sequence": 1, "tensor": 1})
    c.train.update(loss_chunk=0, warmup_steps=0)
    return c


def pipeline(c, devices=None):
    mesh = make_mesh(c.mesh, devices or jax.devices()[:1])
    return make_pipeline(c, mesh), mesh


# -- packing ----------------------------------------------------------------------------------
def test_best_fit_packs_every_item_whole_once(rng):
    """Every item in exactly one row, no row over capacity, and within best-fit decreasing's
    guarantee of 11/9 of the fewest rows possible (+ 6/9), measured against a lower bound on
    them (the total over the capacity; the items of more than half a row, one row each)."""
    for spread in (100, 50, 20):
        lengths = rng.integers(1, spread, 300)
        rows = sft.best_fit(lengths, 100)
        assert sorted(i for r in rows for i in r) == list(range(300))
        assert max(lengths[r].sum() for r in rows) <= 100
        fewest = max(int(np.ceil(lengths.sum() / 100)), int((lengths > 50).sum()))
        assert len(rows) <= 11 / 9 * fewest + 6 / 9
        assert sft.best_fit(lengths, 100) == rows  # deterministic
    # the fullest row that fits, not the first: with rooms 2 and 1 left, the item of 1 goes to
    # the second row (first fit would put it in the first)
    assert sft.best_fit(np.array([1, 3, 6, 8]), 10) == [[3], [2, 1, 0]]
    with pytest.raises(ValueError):
        sft.best_fit(np.array([101]), 100)


def test_rows_hold_conversations_whole_with_their_own_positions_labels_and_mask(rng):
    lengths = [5, 3, 7]
    ids = [rng.integers(10, 99, n).astype(np.int32) for n in lengths]
    trained = [rng.random(n) < 0.5 for n in lengths]
    conv = sft.Conversations(np.concatenate(ids), np.concatenate(trained),
                             np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))
    got = sft.row_arrays(conv, [[2, 0], [1]], 12, pad_id=1)
    assert got["tokens"][0].tolist() == ids[2].tolist() + ids[0].tolist()
    assert got["segment_ids"][0].tolist() == [1] * 7 + [2] * 5
    assert got["positions"][0].tolist() == list(range(7)) + list(range(5))
    # labels: the next token of the same conversation; a conversation's last token has none
    assert got["labels"][0, :6].tolist() == ids[2][1:].tolist()
    assert got["loss_mask"][0].tolist() == (trained[2][1:].tolist() + [0] +
                                            trained[0][1:].tolist() + [0])
    assert got["tokens"][1].tolist() == ids[1].tolist() + [1] * 9  # padding
    assert got["segment_ids"][1].tolist() == [1] * 3 + [0] * 9
    assert got["positions"][1].tolist() == [0, 1, 2] + list(range(9))
    assert got["loss_mask"][1, 2:].sum() == 0


# -- the loss ---------------------------------------------------------------------------------
def test_the_first_step_loss_is_transformers_assistant_losses_over_the_total_count(
        chat_run, one_device, tmp_path):
    """Each conversation of the first batch run alone through transformers (float64): the sum of
    its per-token losses where return_assistant_tokens_mask marks the label, summed over the
    conversations, over their total count, is our step's loss (``one_device``'s, the step the
    meshes' are held to). So packing order, neighbours and padding cannot change it."""
    import torch
    _, theirs, hf_tok, _, records = chat_run
    c = config(chat_run, tmp_path)
    pipe, _ = pipeline(c)
    rows = pipe.conversations(0, c.data.batch_size)
    assert sum(map(len, rows)) > c.data.batch_size  # rows hold several conversations
    total, count = 0.0, 0
    for i in (i for row in rows for i in row):
        out = hf_tok.apply_chat_template(records[i]["messages"], tokenize=True, return_dict=True,
                                         return_assistant_tokens_mask=True)
        ids, mask = np.array(out["input_ids"]), np.array(out["assistant_masks"])
        with torch.no_grad():
            logp = torch.log_softmax(theirs(torch.tensor(ids[None])).logits[0], -1).numpy()
        picked = -logp[np.arange(len(ids) - 1), ids[1:]]
        total += float((picked * mask[1:]).sum())
        count += int(mask[1:].sum())
    loss, n, _, _ = one_device
    assert n == count
    assert abs(loss - total / count) < 2e-5 * total / count
    pipe.close()


# (impl, layout, mesh, microbatches): between them, the striped and zigzag layouts over 8, the
# ring and usp (Ulysses 2 x a ring of 4), and 2 microbatches (test_preference.py's meshes too).
# The first is configs/sft.py's own: SFT's step there is the chat run's first, which
# test_a_chat_run_trains_the_assistant_tokens_resumes_exactly_and_exports holds to one device's
# loss, trained tokens and gradient norm; the test below compiles the second.
MESHES = [
    ("ring", "striped", {"data": 1, "fsdp": 1, "sequence": 8, "tensor": 1}, 1),
    ("usp", "zigzag", {"data": 1, "fsdp": 1, "sequence": 8, "tensor": 1}, 2),
]


@pytest.fixture(scope="module")
def one_device(chat_run, tmp_path_factory):
    return step_of(chat_run, tmp_path_factory.mktemp("one"), "dense", "contiguous", None, 1)


def step_of(chat_run, tmp_path, impl, layout, mesh, microbatches):
    """(loss, trained-token count, gradient norm, gradients) of the first step's batch."""
    c = config(chat_run, tmp_path, mesh)
    c.attention.update(impl=impl, layout=layout, ulysses=2)
    c.train.microbatches = microbatches
    pipe, m = pipeline(c, jax.devices()[:8] if mesh else None)
    trainer = Trainer(c, m)
    from checkpoints.rundir import open_run
    params = open_run(chat_run[0]).restore_params(trainer.abstract_state.params).params
    loss, count, grads, _ = jax.jit(trainer.gradients)(params, pipe.device_batch(0))
    pipe.close()
    grads = jax.device_get(grads)
    norm = float(np.sqrt(sum(np.sum(np.square(g, dtype=np.float64)) for g in jax.tree.leaves(grads))))
    return float(loss), int(count), norm, grads


@pytest.mark.parametrize("impl,layout,mesh,microbatches", MESHES[1:],
                         ids=[f"{i}-{lay}-{'x'.join(map(str, m.values()))}-mb{k}"
                              for i, lay, m, k in MESHES[1:]])
def test_the_same_step_on_any_mesh_layout_strategy_and_microbatching(
        chat_run, one_device, tmp_path, impl, layout, mesh, microbatches):
    loss, count, norm, grads = step_of(chat_run, tmp_path, impl, layout, mesh, microbatches)
    want_loss, want_count, want_norm, want_grads = one_device
    assert count == want_count
    assert abs(loss - want_loss) < 1e-5 * want_loss
    assert abs(norm - want_norm) < 1e-5 * want_norm
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
        assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()


# -- what is read, and what is passed over ----------------------------------------------------
def test_bad_records_are_counted_and_the_first_named(chat_run, tmp_path):
    rng = np.random.default_rng(7)
    good = [conversation(rng) for _ in range(12)]
    sharegpt = {"conversations": [{"from": "human", "value": "hello there"},
                                  {"from": "gpt", "value": "general kenobi"}]}
    bad = [{"messages": "not a list"},
           {"messages": [{"role": "wizard", "content": "x"}, {"role": "assistant", "content": "y"}]},
           {"messages": [{"role": "user", "content": "no answer"}]},
           {"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "y"}]},
           {"text": "a document, not a conversation"}]
    path = write_jsonl(tmp_path / "mixed.jsonl", good[:6] + bad + [sharegpt] + good[6:])
    pipe, _ = pipeline(config(chat_run, tmp_path, path=str(path)))
    assert (pipe.tally.read, pipe.tally.bad, pipe.conversations_read) == (18, 5, 13)
    line = pipe.plan_line()
    assert "data: chat, 18 records read" in line and "13 conversations" in line
    assert f"5 not conversations (first: {path} line 7: 'messages' is str, not a list" in line
    assert "\n" not in line
    pipe.close()
    assert chat.messages_of(sharegpt) == [{"role": "user", "content": "hello there"},
                                          {"role": "assistant", "content": "general kenobi"}]
    for record, why in zip(bad[1:], ("role 'wizard'", "no assistant turn", "content is int",
                                      "no messages")):
        with pytest.raises(chat.BadConversation, match=why):
            chat.messages_of(record)


def test_a_file_with_no_conversation_and_a_torn_line_are_one_line(chat_run, tmp_path):
    path = write_jsonl(tmp_path / "none.jsonl", [{"text": "x"}, {"messages": []}])
    with pytest.raises(DataError, match=r"no conversation to train in jsonl file .*none.jsonl: "
                                        r"2 not conversations \(first: .* line 1: no messages") as e:
        pipeline(config(chat_run, tmp_path, path=str(path)))
    assert "\n" not in str(e.value)
    rng = np.random.default_rng(3)
    torn = tmp_path / "torn.jsonl"
    torn.write_text(json.dumps(conversation(rng)) + "\n{\"messages\": [\n" +
                    "".join(json.dumps(conversation(rng)) + "\n" for _ in range(10)))
    with pytest.raises(DataError, match=r"torn.jsonl line 2: not JSON .*data.bad_records=skip"):
        pipeline(config(chat_run, tmp_path, path=str(torn)))
    pipe, _ = pipeline(config(chat_run, tmp_path, path=str(torn), bad_records="skip"))
    assert pipe.conversations_read == 11 and "left out 1 record(s) that are not JSON" in \
        pipe.bad_records_line()
    pipe.close()


def test_nothing_to_train_is_reported_never_trained(chat_run, tmp_path):
    """A template that writes no assistant text leaves every conversation with an empty mask:
    one line that says so, rather than a run that trains nothing."""
    silent = tmp_path / "silent.jinja"
    silent.write_text("{% for m in messages %}{% if m.role != 'assistant' %}{{ m.content }}"
                      "{% endif %}{% endfor %}")
    with pytest.raises(DataError, match=r"40 with nothing to train under data.train_on="
                                        r"assistant \(first: .*chats.jsonl line 1\)"):
        pipeline(config(chat_run, tmp_path, chat_template=str(silent)))


def test_too_long_conversations_are_dropped_or_truncated_and_counted(chat_run, tmp_path):
    rng = np.random.default_rng(11)
    short = [{"messages": [{"role": "user", "content": say(rng, 1, 4)},
                           {"role": "assistant", "content": say(rng, 1, 6)}]} for _ in range(30)]
    long = {"messages": [{"role": "user", "content": say(rng, 5, 6)},  # the answer is cut
                         {"role": "assistant", "content": say(rng, 150, 151)}]}
    asks = {"messages": [{"role": "user", "content": say(rng, 200, 201)},  # nothing left to train
                         {"role": "assistant", "content": say(rng, 3, 4)}]}
    records = short + [long] * 3 + [asks] * 3
    path = write_jsonl(tmp_path / "long.jsonl", records)
    dropped, _ = pipeline(config(chat_run, tmp_path, path=str(path), heldout_fraction=0.05))
    cut, _ = pipeline(config(chat_run, tmp_path, path=str(path), heldout_fraction=0.05,
                             too_long="truncate"))
    held = set(i for row in cut.conversations(0, cut._heldout_rows.rows_per_pass, heldout=True)
               for i in row)
    n_long = sum(1 for i in range(30, 36) if i not in held)
    n_asks = sum(1 for i in range(33, 36) if i not in held)
    assert dropped.tally.too_long == cut.tally.too_long == n_long
    assert cut.tally.cut_to_nothing == n_asks > 0
    assert "dropped (data.too_long=drop" in dropped.plan_line()
    assert (f"truncated (data.too_long=truncate; first: conversation 30 (" in cut.plan_line() and
            f"{n_asks} of them then with nothing to train: dropped" in cut.plan_line())
    assert cut.train_conversations == dropped.train_conversations + n_long - n_asks
    # a truncated conversation keeps its first SEQ tokens and their mask
    full = sft.tokenize([("x", long)], cut.template, cut.tokenizer, "assistant")
    ids, trained = full.one(0)
    assert ids.size > SEQ
    rows = cut.conversations(0, cut.rows_per_epoch)
    r = next(k for k, row in enumerate(rows) if any(30 <= i < 33 for i in row))
    got = cut._train_rows.rows(r, 1)
    k = rows[r].index(next(i for i in rows[r] if 30 <= i < 33)) + 1
    at = got["segment_ids"][0] == k
    assert got["tokens"][0][at].tolist() == ids[:SEQ].tolist()
    assert got["loss_mask"][0][at].tolist() == trained[1:SEQ].tolist() + [0]
    dropped.close()
    cut.close()


def test_nothing_left_after_fitting_the_rows_is_one_line(chat_run, tmp_path):
    """Every training conversation too long (dropped, or cut to nothing), or every held-out one
    when an evaluation is asked for: one line naming data.seq_len, not a crash."""
    rng = np.random.default_rng(12)
    asks = [{"messages": [{"role": "user", "content": say(rng, 200, 201)},
                          {"role": "assistant", "content": say(rng, 3, 4)}]} for _ in range(6)]
    path = write_jsonl(tmp_path / "asks.jsonl", asks)
    for policy, why in (("drop", r"\(data.too_long=drop\); raise data.seq_len or set "
                                 r"data.too_long=truncate"),
                        ("truncate", r"and cut to its first data.seq_len tokens trains nothing "
                                     r"\(data.too_long=truncate\); raise data.seq_len")):
        with pytest.raises(DataError, match=r"every training conversation is longer than "
                                            r"data.seq_len=256 tokens " + why) as e:
            pipeline(config(chat_run, tmp_path, path=str(path), too_long=policy))
        assert "\n" not in str(e.value)
    # every held-out conversation too long: one line unless no evaluation is asked for
    keys = np.array([chat.split_key(r["messages"]) for r in chat_run[4]])
    from data.split import heldout_by_key
    held = set(heldout_by_key(keys, 0.1)[1].tolist())
    # the held-out ones made long after their prompt (which alone decides their side)
    records = [{"messages": [*r["messages"][:-1], {"role": "assistant", "content": say(
        rng, 200, 201)}]} if i in held else r for i, r in enumerate(chat_run[4])]
    path = write_jsonl(tmp_path / "held_long.jsonl", records)
    c = config(chat_run, tmp_path, path=str(path))
    c.train.eval_batches = 1
    with pytest.raises(DataError, match=rf"every held-out conversation \({len(held)}\) is longer "
                                        r"than data.seq_len=256 tokens \(data.too_long=drop\): "
                                        r"there is nothing to evaluate; .* train.eval_batches=0"):
        pipeline(c)
    c.train.eval_batches = 0
    pipe, _ = pipeline(c)
    assert pipe.heldout_conversations == 0 and pipe.heldout_batches(0) == []
    pipe.close()


def test_heldout_rows_are_each_evaluated_once_and_chosen_by_the_record(chat_run, tmp_path):
    """Fewer held-out rows than eval_batches x batch_size: each row once, the last batch padded
    with empty rows; a record's side is a hash of its prompt, the same whatever else is read."""
    c = config(chat_run, tmp_path, heldout_fraction=0.3, seq_len=64, too_long="truncate")
    pipe, _ = pipeline(c)
    rows = pipe._heldout_rows.rows_per_pass
    assert 4 < rows < 16 * c.data.batch_size
    firsts = pipe.heldout_rows(16)
    assert firsts == list(range(0, rows, c.data.batch_size))
    seen = [i for f in firsts for row in pipe.conversations(f, c.data.batch_size, heldout=True)
            for i in row]
    held = [i for row in pipe.conversations(0, rows, heldout=True) for i in row]
    assert sorted(seen) == sorted(held) and len(set(seen)) == len(seen)  # each once
    last = pipe.host_batch(firsts[-1], heldout=True)
    pad = firsts[-1] + c.data.batch_size - rows  # the padding rows: nothing to evaluate
    assert pad >= 0 and (pad == 0 or last["loss_mask"][-pad:].sum() == 0)
    # membership moves with neither max_docs nor the records around it
    fewer, _ = pipeline(config(chat_run, tmp_path, heldout_fraction=0.3, seq_len=64,
                               too_long="truncate", max_docs=25))
    held_fewer = [i for row in fewer.conversations(0, fewer._heldout_rows.rows_per_pass,
                                                   heldout=True) for i in row]
    assert sorted(held_fewer) == sorted(i for i in held if i < 25)
    want = [i for i, r in enumerate(chat_run[4]) if chat.split_key(r["messages"]) < 0.3]
    assert set(held) <= set(want)  # less those cut to nothing (their prompts fill 64 tokens)
    assert len(want) - len(held) == pipe.heldout_tally.cut_to_nothing
    pipe.close()
    fewer.close()


def test_fields_these_pipelines_do_not_read_and_document_mask_off_are_one_line(chat_run, tmp_path):
    from configs.validate import validate
    from errors import ConfigError
    for field, value, why in (
            ("attention.document_mask", False, r"attention.document_mask=False with data.format="
                                               r"chat: packed conversations would attend to each "
                                               r"other .* needs attention.document_mask=True"),
            ("data.min_doc_tokens", 8, r"data.min_doc_tokens=8 is not read with data.format=chat"),
            ("data.long_doc_tokens", 100, r"data.long_doc_tokens=100 is not read"),
            ("data.reset_positions_at_doc", False, r"data.reset_positions_at_doc=False is not read")):
        c = config(chat_run, tmp_path)
        section, name = field.split(".")
        c[section][name] = value
        with pytest.raises(ConfigError, match=why) as e:
            validate(c, 1)
        assert "\n" not in str(e.value)
    validate(config(chat_run, tmp_path), 1)


def test_sharegpt_speakers_that_are_not_text_are_bad_records():
    for speaker in (["human"], {"x": 1}, 3, None):
        with pytest.raises(chat.BadConversation, match="is from"):
            chat.messages_of({"conversations": [{"from": speaker, "value": "hi"},
                                                {"from": "gpt", "value": "yo"}]})
    with pytest.raises(chat.BadConversation, match=r"has role \['user'\]"):
        chat.messages_of({"messages": [{"role": ["user"], "content": "hi"}]})


def test_an_hf_dataset_on_disk_reads_as_the_jsonl_does(chat_run, tmp_path):
    import datasets
    records = chat_run[4]
    datasets.Dataset.from_list(records).save_to_disk(str(tmp_path / "ds"))
    from_disk, _ = pipeline(config(chat_run, tmp_path, source="hf", path=str(tmp_path / "ds")))
    from_file, _ = pipeline(config(chat_run, tmp_path))
    a, b = from_disk.host_batch(0), from_file.host_batch(0)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    from_disk.close()
    from_file.close()


# -- a whole run: train, resume, generate, export ---------------------------------------------
def entry_run(config_file, chat_run, data, workdir, *flags):
    """train.py's entry after ``--config CONFIG_FILE:RUN --config.a.b=v ...`` (3 steps of 4 rows,
    a checkpoint and an evaluation every 2 and at the end), in process. A run resumed after
    step 2's checkpoint trains step 3 alone: it starts from the checkpoint, evaluates only at
    its end (the whole run also at step 2, so an evaluation between steps must not move the
    training), and its data crosses into the second epoch there as the whole run's does."""
    import trained_run as tr
    from configs.loading import load
    config = load(f"{config_file}:{chat_run[0]}", [
        f"data.path={data}", f"data.seq_len={SEQ}", "data.batch_size=4",
        f"data.cache_dir={workdir.parent / 'cache'}", "model.dtype=float32",
        "attention.block_q=16", "attention.block_kv=16", "train.steps=3", "train.warmup_steps=0",
        "train.log_every=1", "train.eval_every=2", "train.eval_batches=1", "checkpoint.every=2",
        *flags])
    return tr.entry_of(config, workdir)


def sft_run(chat_run, workdir, *flags):
    return entry_run("configs/sft.py", chat_run, chat_run[3], workdir,
                     "data.heldout_fraction=0.1", "train.lr=3e-3", *flags)


def test_a_chat_run_trains_the_assistant_tokens_resumes_exactly_and_exports(chat_run, one_device,
                                                                           tmp_path):
    import trained_run as tr
    whole = tmp_path / "whole"
    done = sft_run(chat_run, whole)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    from data.split import heldout_by_key  # each record's side: a hash of its prompt
    held = heldout_by_key(np.array([chat.split_key(r["messages"]) for r in chat_run[4]]), 0.1)[1].size
    assert "data: chat, 40 records read" in out and f"{40 - held} train / {held} held out" in out
    assert "(turn by turn" not in out  # the marked template's own marks
    assert "attention ring/striped" in out and "'sequence': 8" in out  # configs/sft.py's mesh
    metrics = tr.metrics(whole)
    assert sorted(metrics) == [1, 2, 3] and all(m["trained_tokens"] > 0 for m in metrics.values())
    # its first step (MESHES[0]: striped over a ring of 8; the chunked loss, full remat) is one
    # device's on the same first batch: loss, trained tokens, gradient norm
    want_loss, want_count, want_norm, _ = one_device
    assert metrics[1]["trained_tokens"] == want_count
    assert abs(metrics[1]["loss"] - want_loss) < 1e-5 * want_loss
    assert abs(metrics[1]["grad_norm"] - want_norm) < 1e-5 * want_norm
    evals = tr.evals(whole)
    assert evals[3]["eval_loss"] < evals[0]["eval_loss"]  # the held-out assistant tokens
    assert (whole / "chat_template.jinja").read_text() == ct.MARKED
    # as if stopped after step 2's checkpoint, then resumed: the same step 3 to the last bit
    import shutil
    half = tmp_path / "half"
    shutil.copytree(whole, half)
    shutil.rmtree(half / "checkpoints" / "3")
    resumed = sft_run(chat_run, half)
    assert resumed.returncode == 0 and "resuming from step 2" in resumed.stdout
    # step 3 from step 2's state, and the weights it leaves (the held-out loss after it)
    assert [tr.metrics(half)[3][k] for k in ("loss", "grad_norm")] == \
        [metrics[3][k] for k in ("loss", "grad_norm")]
    assert tr.evals(half)[3]["eval_loss"] == evals[3]["eval_loss"]
    # the export carries the run's template: transformers renders a chat as we do
    assert convert_hf.main(["export", "--run", str(whole), "--out", str(tmp_path / "hf_out"),
                            "--dtype", "float32"]) == 0
    from transformers import AutoTokenizer
    exported = AutoTokenizer.from_pretrained(str(tmp_path / "hf_out"))
    messages = chat_run[4][0]["messages"]
    assert exported.apply_chat_template(messages, tokenize=False) == \
        chat_run[2].apply_chat_template(messages, tokenize=False)


def test_a_lora_run_starts_at_the_base_trains_its_adapters_alone_and_resumes_exactly(
        chat_run, one_device, tmp_path):
    """configs/sft.py with --config.train.lora.rank=4 (every projection, and the norms in
    full) from the imported base: new adapters with B zero, so the first step's loss and
    trained tokens are the full fine-tune's (one device's, as above); the held-out loss falls;
    the checkpoint's frozen weights are the import's to the bit; a resume after step 2 gives the
    same step 3 to the bit."""
    import shutil

    import trained_run as tr
    from checkpoints.rundir import open_run
    from model import lora
    from model.decoder import single_device_params
    flags = ("train.lora.rank=4", "train.lora.modules_to_save=norm")
    whole = tmp_path / "whole"
    done = sft_run(chat_run, whole, *flags)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    assert "LoRA: new adapters of rank 4 on q_proj, k_proj, v_proj, o_proj, gate_proj, " \
           "up_proj, down_proj" in out and "M trained: LoRA rank 4, the rest frozen)" in out
    metrics, (want_loss, want_count, _, _) = tr.metrics(whole), one_device
    assert metrics[1]["trained_tokens"] == want_count
    assert abs(metrics[1]["loss"] - want_loss) < 1e-5 * want_loss
    evals = tr.evals(whole)
    assert evals[3]["eval_loss"] < evals[0]["eval_loss"] - 0.01
    run = open_run(whole)
    params = jax.device_get(run.restore_params(single_device_params(run.config)).params)
    base = jax.device_get(open_run(chat_run[0]).restore_params(
        lora.without_adapters(single_device_params(run.config))).params)
    mask = lora.trained_mask(params, lora.spec_of(run.config), tied=False)
    trained, frozen = lora.split(params, mask)
    for (path, got), want in zip(jax.tree_util.tree_flatten_with_path(frozen)[0],
                                 jax.tree.leaves(lora.split(base, mask)[1])):
        assert np.array_equal(got, want), jax.tree_util.keystr(path)
    assert np.abs(trained["blocks"]["attn"]["lora_q"]["b"]).max() > 0
    half = tmp_path / "half"
    shutil.copytree(whole, half)
    shutil.rmtree(half / "checkpoints" / "3")
    resumed = sft_run(chat_run, half, *flags)
    assert resumed.returncode == 0 and "resuming from step 2" in resumed.stdout
    # step 3 from step 2's state, and the weights it leaves (the held-out loss after it)
    assert [tr.metrics(half)[3][k] for k in ("loss", "grad_norm")] == \
        [metrics[3][k] for k in ("loss", "grad_norm")]
    assert tr.evals(half)[3]["eval_loss"] == evals[3]["eval_loss"]


def test_generate_chat_gives_transformers_greedy_reply(chat_run, capsys):
    """generate.py --chat on the import: the prompt rendered with the generation prompt, the
    reply transformers' greedy continuation of apply_chat_template(add_generation_prompt=True),
    ending at the end of turn."""
    import torch
    from scripts import generate
    run, theirs, hf_tok, _, _ = chat_run
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "alpha beta gamma?"}]
    ids = hf_tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                     return_dict=True)["input_ids"]
    with torch.no_grad():
        want = theirs.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False,
                               eos_token_id=hf_tok.convert_tokens_to_ids("<|im_end|>"),
                               pad_token_id=0)[0, len(ids):].tolist()
    want = want[:want.index(hf_tok.convert_tokens_to_ids("<|im_end|>"))] if \
        hf_tok.convert_tokens_to_ids("<|im_end|>") in want else want
    code = generate.main(["--run", str(run), "--chat", "--system", "Be brief.", "--prompt",
                          "alpha beta gamma?", "--max-new-tokens", "12", "--json"])
    assert code == 0
    got = json.loads(capsys.readouterr().out)
    assert got["ids"] == want
    assert generate.main(["--run", str(run), "--system", "x", "--prompt", "y"]) == 2
    assert "--system is a chat's system message: give --chat too" in capsys.readouterr().err


def test_the_shipped_examples_answer_from_the_librarys_own_docstrings():
    """data/examples/stdlib_qa.jsonl (scripts/make_chat_data.py qa): 400 conversations, each
    first answer the signature and the first paragraph of the docstring of the function or class
    asked about, as the library's source file has it (read here with ast)."""
    import ast
    import gc
    import re
    import sysconfig
    path = pathlib.Path(__file__).resolve().parent.parent / "data" / "examples" / "stdlib_qa.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(records) == 400
    stdlib = pathlib.Path(sysconfig.get_paths()["stdlib"])
    checked, docs = 0, {}
    # ast.parse makes millions of nodes (160 modules), none in a reference cycle: among the
    # suite's objects (JAX, torch), the collections they set off were 2/3 of this test's CPU
    gc.disable()
    try:
        for r in records:
            messages = chat.messages_of(r)
            answer = next(m["content"] for m in messages if m["role"] == "assistant")
            dotted, doc = re.match(r"`([\w.]+)\(.*?\)`: (.*)", answer, flags=re.S).groups()
            module, name = dotted.rsplit(".", 1)
            base = stdlib / module.replace(".", "/")
            source = (base.with_suffix(".py") if base.with_suffix(".py").is_file()
                      else base / "__init__.py")
            if not source.is_file():  # a Python whose library lacks the module: not checked
                continue
            if source not in docs:  # each top-level name's first definition, its docstring
                docs[source] = {}
                for n in ast.parse(source.read_text(encoding="utf-8")).body:
                    if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                        docs[source].setdefault(n.name, ast.get_docstring(n))
            own = " ".join(line.strip() for line in docs[source][name].strip()
                           .split("\n\n")[0].splitlines())
            assert doc == own, dotted
            checked += 1
    finally:
        gc.enable()
    assert checked > 300


# -- on a mixture of experts ------------------------------------------------------------------
def moe_model(c):
    """``c`` on a tiny mixture of experts in place of the run's dense MLPs (4 experts of width
    32, 2 a token; aux 0.05, z 0.01), its weights fresh (``fresh_state``), not the run's."""
    c.model.moe.update(num_experts=4, top_k=2, expert_dim=32, aux_loss=0.05, z_loss=0.01)
    c.model.mlp_chunk = 0
    return c


def fresh_state(trainer):
    """``trainer.init(0)``'s step-0 state (fresh random weights), its program compiled as the
    tests compile the rest (tests/conftest.py: LLVM level 0), not at training/state.py's
    INIT_COMPILE_CPU level 1, which keeps every weight's last bit as XLA's default gives it
    (nothing here compares them to another compile's): an MoE's init, 1-2 CPU s less."""
    return jax.jit(trainer._init, out_shardings=trainer.state_shardings)(0)


def parts(trainer, params, batch):
    """(fp32 logits, router statistics summed over the layers) of ``batch``: the model's own
    forward (model/decoder.py), not the trainer's loss."""
    from flax import nnx
    model = nnx.merge(trainer.graphdef, params)
    args = (batch["tokens"], batch["positions"], batch["segment_ids"])
    return model(*args), model.hidden(*args, routed=True)[1]


def test_sft_on_a_mixture_of_experts_adds_its_aux_terms_to_the_first_steps_loss(chat_run,
                                                                                  tmp_path):
    """SFT runs on an MoE unchanged: the first step's loss is the assistant tokens' mean
    cross-entropy (float64, from the model's logits) + aux x the load-balancing loss + z x the
    z-loss of the batch's router statistics (model/moe.py aux_losses: real tokens only), and
    those are the step's metrics."""
    from model import moe
    c = moe_model(config(chat_run, tmp_path))
    pipe, mesh = pipeline(c)
    trainer = Trainer(c, mesh)
    params = fresh_state(trainer).params
    batch = pipe.device_batch(0)
    # the trainer's loss and the model's own forward side by side in one program (one compile,
    # not two: each is its own computation there, as each was in a program of its own)
    (loss, _, metrics), (logits, stats) = jax.device_get(jax.jit(
        lambda p, b: (trainer.loss_and_sums(p, b), parts(trainer, p, b)))(params, batch))
    host = jax.device_get(batch)
    logits = np.asarray(logits, np.float64)
    logp = logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)
    picked = -np.take_along_axis(logp, host["labels"][..., None], -1)[..., 0]
    lm = float((picked * host["loss_mask"]).sum() / host["loss_mask"].sum())
    aux = moe.aux_losses(stats, 4, 2)
    real = int((host["segment_ids"] > 0).sum())
    assert int(stats["tokens"]) == 2 * real and real < host["tokens"].size  # padding left out
    for key in ("aux_loss", "z_loss"):
        assert abs(float(metrics[key]) - float(aux[key])) < 1e-5 * float(aux[key]), key
    want = lm + 0.05 * float(aux["aux_loss"]) + 0.01 * float(aux["z_loss"])
    assert abs(float(loss) - want) < 1e-5 * want
    pipe.close()
