"""DPO: model/preference.py's losses against float64 formulas written here, data/preference.py's
packed pairs and the reference pass, training/objective.py's Preference on a mesh: per-side
log-probabilities are transformers', the first step's loss is ln 2 with zero rewards, the same
step on any mesh, layout, strategy and microbatching (two meshes that cover them); bad records
counted; a run resumes exactly."""
import json
import math
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from data import chat
from data.pipeline import make_pipeline
from errors import DataError
from model import preference
from parallel.mesh import make_mesh
from test_sft import MESHES, SEQ, chat_run, entry_run, say, write_jsonl  # noqa: F401
from training.state import Trainer


def pair(rng, prompt_turns=1):
    prompt = []
    for t in range(prompt_turns):
        prompt += [{"role": "user", "content": say(rng)}]
        if t < prompt_turns - 1:
            prompt += [{"role": "assistant", "content": say(rng)}]
    return {"prompt": prompt, "chosen": [{"role": "assistant", "content": say(rng)}],
            "rejected": [{"role": "assistant", "content": say(rng)}]}


@pytest.fixture(scope="module")
def pairs_file(chat_run, tmp_path_factory):
    rng = np.random.default_rng(5)
    records = [pair(rng, int(rng.integers(1, 3))) for _ in range(30)]
    return write_jsonl(tmp_path_factory.mktemp("pairs") / "pairs.jsonl", records), records


def config(chat_run, pairs_file, tmp_path, mesh=None, **data):
    from configs import dpo
    c = dpo.get_config(str(chat_run[0]))
    c.data.update({"path": str(pairs_file[0]), "seq_len": SEQ, "batch_size": 4,
                   "heldout_fraction": 0.1, "prefetch": 0, "cache_dir": str(tmp_path / "cache"),
                   **data})
    c.model.update(dtype="float32", remat="none")
    c.attention.update(block_q=16, block_kv=16)
    c.mesh.update(mesh or {"data": 1, "fsdp": 1, "sequence": 1, "tensor": 1})
    c.train.update(loss_chunk=0, warmup_steps=0)
    return c


def prepared(c, tmp_path, devices=None):
    """(pipeline with its reference computed from the run's weights, trainer, params)."""
    from checkpoints.rundir import open_run
    mesh = make_mesh(c.mesh, devices or jax.devices()[:1])
    pipe = make_pipeline(c, mesh)
    trainer = Trainer(c, mesh)
    params = open_run(c.checkpoint.restore_from).restore_params(trainer.abstract_state.params).params
    pipe.prepare(trainer, params, tmp_path / "run", 0, lambda m: None)
    return pipe, trainer, params


# -- the losses -------------------------------------------------------------------------------
def log_sigmoid(x):
    return -np.logaddexp(0.0, -x)


@pytest.mark.parametrize("loss_type,smoothing", [("sigmoid", 0.0), ("sigmoid", 0.2),
                                                  ("ipo", 0.0), ("hinge", 0.0)])
def test_losses_and_their_gradients_are_the_float64_formulas(rng, loss_type, smoothing):
    beta = float(rng.uniform(0.05, 0.5))
    # the float64 formulas read the same fp32 inputs the losses get: per-side sums, and each
    # side's count of response tokens
    pc, pr, rc, rr = (rng.normal(-40, 10, 64).astype(np.float32).astype(np.float64)
                      for _ in range(4))
    nc, nr = (rng.integers(1, 100, 64).astype(np.float64) for _ in range(2))
    z = (pc - pr) - (rc - rr)
    if loss_type == "sigmoid":
        want = -log_sigmoid(beta * z) * (1 - smoothing) - log_sigmoid(-beta * z) * smoothing
        dz = -beta * (1 - smoothing) / (1 + np.exp(beta * z)) + beta * smoothing / (1 + np.exp(-beta * z))
        dc, dr = dz, -dz
    elif loss_type == "ipo":
        # TRL's DPOTrainer (loss_type="ipo"): policy and reference log-probabilities of each side
        # averaged over that side's response tokens, then (logits - 1/(2 beta))^2
        z = (pc / nc - pr / nr) - (rc / nc - rr / nr)
        want = (z - 1 / (2 * beta)) ** 2
        dc, dr = 2 * (z - 1 / (2 * beta)) / nc, -2 * (z - 1 / (2 * beta)) / nr
    else:
        want = np.maximum(0, 1 - beta * z)
        dz = np.where(1 - beta * z > 0, -beta, 0.0)
        dc, dr = dz, -dz
    tokens = (jnp.asarray(nc, jnp.float32), jnp.asarray(nr, jnp.float32))

    def total(pc, pr):
        return preference.losses(pc, pr, jnp.asarray(rc, jnp.float32), jnp.asarray(rr, jnp.float32),
                                 beta=beta, loss_type=loss_type, label_smoothing=smoothing,
                                 tokens=tokens)[0].sum()

    got, (gc, gr) = jax.value_and_grad(total, argnums=(0, 1))(jnp.asarray(pc, jnp.float32),
                                                             jnp.asarray(pr, jnp.float32))
    np.testing.assert_allclose(float(got), want.sum(), rtol=2e-5)
    # fp32 noise: z's rounding (its terms are near 40, a ulp 4e-6) scaled by the gradient's own
    # slope, so a gradient near zero is held to the largest one's noise (IPO's summed form, slope
    # 2, once gave 0.0052388 for 0.0052406)
    atol = 1e-6 * max(1.0, np.abs(dc).max(), np.abs(dr).max())
    np.testing.assert_allclose(np.asarray(gc), dc, rtol=1e-4, atol=atol)
    np.testing.assert_allclose(np.asarray(gr), dr, rtol=1e-4, atol=atol)
    # the rewards are sums for every loss type (IPO's too), as TRL logs them
    _, chosen, rejected = preference.losses(pc, pr, rc, rr, beta=beta, loss_type=loss_type,
                                            tokens=tokens)
    np.testing.assert_allclose(np.asarray(chosen), beta * (pc - rc), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(rejected), beta * (pr - rr), rtol=1e-6)
    if loss_type == "ipo":
        ipo_on_packed_rows(rng)


def ipo_on_packed_rows(rng):
    """The DPO objective on packed rows gives IPO each side's count of ``loss_mask`` tokens
    (not its length: a side's prompt is in its segment), and a padding pair stays out."""
    import ml_collections
    from training.objective import Preference
    L, beta = 32, 0.1
    seg = np.zeros((2, L), np.int32)
    seg[0, :9], seg[0, 9:14], seg[0, 14:25], seg[0, 25:30] = 1, 2, 3, 4
    seg[1, :12], seg[1, 12:30] = 1, 2
    mask = np.zeros((2, L), np.float32)
    for r, spans in ((0, [(3, 9), (11, 14), (17, 25), (26, 30)]), (1, [(5, 12), (16, 30)])):
        for a, b in spans:  # each side's response; the tokens before it are its prompt
            mask[r, a:b] = 1
    nll = rng.uniform(0.1, 5, (2, L)).astype(np.float32) * mask
    ref = np.zeros((2, L), np.float32)  # a side's reference sum at its first token
    sides = [(r, s) for r in range(2) for s in range(1, seg[r].max() + 1)]
    ref_sum = {side: float(rng.normal(-30, 5)) for side in sides}
    for (r, s), v in ref_sum.items():
        ref[r, np.argmax(seg[r] == s)] = v
    c = ml_collections.ConfigDict({"data": {"seq_len": L}, "dpo": {
        "beta": beta, "loss_type": "ipo", "label_smoothing": 0.0, "rpo_alpha": 0.0}})
    objective = Preference(c)
    batch = {"segment_ids": jnp.asarray(seg), "loss_mask": jnp.asarray(mask),
             "ref_logps": jnp.asarray(ref)}
    counts = objective.counts(batch)
    loss, _ = objective.contribution(jnp.asarray(nll), batch, counts)

    def mean_logp(r, s):  # (policy, reference) per response token, float64
        n = mask[r][seg[r] == s].sum()
        return -nll[r][seg[r] == s].astype(np.float64).sum() / n, ref_sum[(r, s)] / n

    want = []
    for r, s in sides[::2]:
        (pc, rc), (pr, rr) = mean_logp(r, s), mean_logp(r, s + 1)
        want.append(((pc - pr) - (rc - rr) - 1 / (2 * beta)) ** 2)
    assert float(counts["pairs"]) == 3
    np.testing.assert_allclose(float(loss), np.mean(want), rtol=1e-5)


def test_sides_are_read_by_segment_in_any_order(rng):
    """Pair k of a row is segments 2k - 1 (chosen) and 2k (rejected): the per-side sums do not
    depend on where the tokens sit (a layout permutes them)."""
    L = 32
    seg = np.zeros((2, L), np.int32)
    seg[0, :6], seg[0, 6:10], seg[0, 10:20], seg[0, 20:24] = 1, 2, 3, 4
    seg[1, :12], seg[1, 12:30] = 1, 2
    values = rng.normal(size=(2, L))
    chosen, rejected = preference.pairs(jnp.asarray(values), jnp.asarray(seg), L)
    perm = rng.permutation(L)
    pc, pr = preference.pairs(jnp.asarray(values[:, perm]), jnp.asarray(seg[:, perm]), L)
    want_c = [[values[0, :6].sum(), values[0, 10:20].sum()], [values[1, :12].sum(), 0]]
    want_r = [[values[0, 6:10].sum(), values[0, 20:24].sum()], [values[1, 12:30].sum(), 0]]
    # (atol: a side's sum of random normals can land near 0, where fp32's rounding of the
    # terms, ~1e-7 each, is no longer small against the sum: a flake seen once in test-next)
    close = dict(rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(chosen)[:, :2], want_c, **close)
    np.testing.assert_allclose(np.asarray(rejected)[:, :2], want_r, **close)
    np.testing.assert_allclose(np.asarray(pc), np.asarray(chosen), **close)
    np.testing.assert_allclose(np.asarray(pr), np.asarray(rejected), **close)
    assert not np.asarray(chosen)[:, 2:].any()


# -- against transformers, and the first step -------------------------------------------------
def test_side_log_probs_are_transformers_and_the_first_step_is_ln2(chat_run, pairs_file, tmp_path):
    """Each side of the first batch's pairs through transformers (float64): the sum of its
    response tokens' log-probabilities (return_assistant_tokens_mask over prompt + response)
    is ours within 1e-4; at step 0 the policy is the reference: the loss is ln 2, the rewards
    and margin 0, and the step says how many pairs it saw.

    Ours: the batch's ``ref_logps`` (each side's sum at its first token), which the reference
    pass computed with the objective's ``sides_logps`` of ``token_losses`` on these weights,
    the very function of the policy's sides in the step (``reference_params`` is the weights
    themselves without adapters): one program for both, not a second compile of it."""
    import torch  # the reference, from requirements-test.txt (the newest JAX's set lacks it)
    _, theirs, hf_tok, _, _ = chat_run
    records = pairs_file[1]
    c = config(chat_run, pairs_file, tmp_path)
    pipe, trainer, params = prepared(c, tmp_path)
    assert trainer.reference_params(params) is params
    batch = pipe.device_batch(0)
    host = jax.device_get(batch)
    rows = pipe.conversations(0, c.data.batch_size)
    n = 0
    for r, row in enumerate(rows):
        for k, i in enumerate(row):
            prompt, ch, rj = chat.pair_of(records[i])
            chosen, rejected = (float(host["ref_logps"][r, np.argmax(host["segment_ids"][r] == s)])
                                for s in (2 * k + 1, 2 * k + 2))
            for side, got in ((ch, chosen), (rj, rejected)):
                out = hf_tok.apply_chat_template(prompt + side, tokenize=True, return_dict=True,
                                                 return_assistant_tokens_mask=True)
                ids, mask = np.array(out["input_ids"]), np.array(out["assistant_masks"])
                if sum(m["role"] == "assistant" for m in prompt):  # the prompt's own turns out
                    start = len(hf_tok(hf_tok.apply_chat_template(
                        prompt, tokenize=False, add_generation_prompt=True),
                        add_special_tokens=False)["input_ids"])
                    mask[:start] = 0
                with torch.no_grad():
                    logp = torch.log_softmax(theirs(torch.tensor(ids[None])).logits[0], -1).numpy()
                want = float((logp[np.arange(len(ids) - 1), ids[1:]] * mask[1:]).sum())
                assert abs(got - want) < 1e-4 * abs(want), (got, want)
            n += 1
    assert n > c.data.batch_size  # rows hold several pairs
    # the first step's loss and metrics: trainer.gradients, the train step less its update
    # (test_a_dpo_run_learns_the_pairs_resumes_exactly_and_exports logs a whole step's at ln 2)
    loss, _, _, metrics = jax.device_get(jax.jit(trainer.gradients)(params, batch))
    assert abs(float(loss) - math.log(2)) < 1e-5
    for key in ("reward_chosen", "reward_rejected", "reward_margin"):
        assert abs(float(metrics[key])) < 1e-5, key
    assert int(metrics["pairs"]) == n
    pipe.close()


def step_of(chat_run, pairs_file, tmp_path, impl, layout, mesh, microbatches, shift):
    """(loss, metrics, gradient norm, gradients) of the first batch, the reference shifted by
    ``shift`` (so the loss is not at its ln 2 start and every gradient term counts)."""
    c = config(chat_run, pairs_file, tmp_path, mesh)
    c.attention.update(impl=impl, layout=layout, ulysses=2)
    c.train.microbatches = microbatches
    c.dpo.update(rpo_alpha=0.5, label_smoothing=0.1)
    pipe, trainer, params = prepared(c, tmp_path, jax.devices()[:8] if mesh else None)
    for rows in (pipe._train_rows, pipe._heldout_rows):
        rows.ref = rows.ref + shift[:rows.ref.size]
    loss, _, grads, metrics = jax.jit(trainer.gradients)(params, pipe.device_batch(0))
    pipe.close()
    grads = jax.device_get(grads)
    norm = float(np.sqrt(sum(np.sum(np.square(g, dtype=np.float64)) for g in jax.tree.leaves(grads))))
    return float(loss), jax.device_get(metrics), norm, grads


@pytest.fixture(scope="module")
def shift():
    return np.random.default_rng(9).normal(0, 3, 1000)


@pytest.fixture(scope="module")
def one_device(chat_run, pairs_file, tmp_path_factory, shift):
    return step_of(chat_run, pairs_file, tmp_path_factory.mktemp("one"), "dense", "contiguous",
                   None, 1, shift)


@pytest.mark.parametrize("impl,layout,mesh,microbatches", MESHES,
                         ids=[f"{i}-{lay}-{'x'.join(map(str, m.values()))}-mb{k}"
                              for i, lay, m, k in MESHES])
def test_the_same_step_on_any_mesh_layout_strategy_and_microbatching(
        chat_run, pairs_file, one_device, shift, tmp_path, impl, layout, mesh, microbatches):
    loss, metrics, norm, grads = step_of(chat_run, pairs_file, tmp_path, impl, layout, mesh,
                                         microbatches, shift)
    want_loss, want_metrics, want_norm, want_grads = one_device
    assert abs(loss - want_loss) < 1e-5 * abs(want_loss)
    assert abs(loss - math.log(2)) > 0.05  # away from the start: the gradients carry the loss
    for key in ("pairs", "tokens", "reward_accuracy"):
        assert float(metrics[key]) == float(want_metrics[key]), key
    for key in ("reward_chosen", "reward_rejected", "reward_margin", "dpo_loss"):
        assert abs(float(metrics[key]) - float(want_metrics[key])) < 1e-4 * max(
            1.0, abs(float(want_metrics[key]))), key
    assert abs(norm - want_norm) < 1e-5 * want_norm
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
        assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()


# -- records ----------------------------------------------------------------------------------
def test_pair_formats_and_bad_records():
    user, answer = {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}
    other = {"role": "assistant", "content": "b"}
    assert chat.pair_of({"prompt": "q", "chosen": "a", "rejected": "b"}) == ([user], [answer], [other])
    assert chat.pair_of({"prompt": [user], "chosen": [answer], "rejected": [other]}) == \
        ([user], [answer], [other])
    # implicit prompt: two whole conversations that part at the last answer
    system = {"role": "system", "content": "s"}
    assert chat.pair_of({"chosen": [system, user, answer], "rejected": [system, user, other]}) == \
        ([system, user], [answer], [other])
    for record, why in (({"prompt": "q", "chosen": "a"}, "no 'rejected' field"),
                        ({"prompt": "q", "chosen": [user], "rejected": "b"},
                         "chosen holds no assistant turn"),
                        ({"chosen": [answer], "rejected": [other]}, "share no first message"),
                        ({"prompt": 3, "chosen": "a", "rejected": "b"}, "'prompt' is int"),
                        ("text", "the record is str")):
        with pytest.raises(chat.BadConversation, match=why):
            chat.pair_of(record)


def ultrafeedback(rng):
    """A record as HuggingFaceH4/ultrafeedback_binarized writes it: a string prompt, and chosen
    and rejected as whole conversations that already hold it (and its other columns)."""
    ask = say(rng)
    user = {"role": "user", "content": ask}
    chosen, rejected = ({"role": "assistant", "content": say(rng)} for _ in range(2))
    return {"prompt": ask, "prompt_id": "0" * 64, "chosen": [user, chosen],
            "rejected": [user, rejected], "messages": [user, chosen], "score_chosen": 8.0,
            "score_rejected": 5.5}


def test_ultrafeedback_pairs_hold_their_prompt_once(chat_run, rng):
    """The hub's shape (a string prompt beside conversations that repeat it) gives one prompt,
    as TRL's maybe_extract_prompt takes it: each side is the conversation itself, rendered and
    masked as transformers renders it (return_assistant_tokens_mask); a prompt that is not the
    user turn both share is a bad record; a prompt given as messages that the conversations
    repeat is not doubled either; Gemma 3's template (roles must alternate) takes the pair."""
    from data import chat_template
    from data.preference import tokenize_pairs
    import chat_templates as ct
    hf_tok = chat_run[2]
    template = chat_template.load("", str(chat_run[0] / "tokenizer.json"))
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(chat_run[0] / "tokenizer.json"))
    records = [ultrafeedback(rng) for _ in range(6)]
    conv = tokenize_pairs([(f"line {i}", r) for i, r in enumerate(records)], template, tok,
                          chat.Tally())
    assert conv.count == 12
    for i, record in enumerate(records):
        prompt, chosen, rejected = chat.pair_of(record)
        assert prompt == record["chosen"][:1] and chosen == record["chosen"][1:]
        for k, whole in enumerate((record["chosen"], record["rejected"])):
            want = hf_tok.apply_chat_template(whole, tokenize=True, return_dict=True,
                                              return_assistant_tokens_mask=True)
            ids, trained = conv.one(2 * i + k)
            assert ids.tolist() == list(want["input_ids"])
            assert trained.astype(int).tolist() == list(want["assistant_masks"])
    # the repeat given as messages; and a prompt the conversations do not hold
    record = records[0]
    assert chat.pair_of(dict(record, prompt=record["chosen"][:1])) == chat.pair_of(record)
    with pytest.raises(chat.BadConversation, match=r"the prompt 'something else' is not the user "
                                                   r"turn chosen and rejected share"):
        chat.pair_of(dict(record, prompt="something else"))
    gemma = ct.FAMILIES["gemma3"]
    gemma3 = chat_template.ChatTemplate(gemma[0], "gemma3", gemma[2])
    prompt, chosen, _ = chat.pair_of(record)
    text, spans = gemma3.response_spans(prompt, chosen)
    # (the user's turn, once: the prompt's words may also occur in a random response)
    assert text.count(f"<start_of_turn>user\n{record['prompt'].strip()}") == 1
    assert [text[a:b] for a, b in spans] == [chosen[0]["content"].strip() + "<end_of_turn>"]


def test_pairs_that_all_overflow_a_row_and_fields_pairs_never_read_are_one_line(
        chat_run, pairs_file, tmp_path):
    from configs.validate import validate
    from errors import ConfigError
    rng = np.random.default_rng(3)
    long = [{"prompt": say(rng, 150, 151), "chosen": say(rng), "rejected": say(rng)}
            for _ in range(4)]
    path = write_jsonl(tmp_path / "long.jsonl", long)
    for policy, why in (("drop", r"\(data.too_long=drop\); raise data.seq_len"),
                        ("truncate", r"and cut to half a row each side trains nothing")):
        c = config(chat_run, pairs_file, tmp_path, path=str(path), too_long=policy)
        with pytest.raises(DataError, match=r"every training pair is longer than "
                                            r"data.seq_len=256 tokens " + why):
            make_pipeline(c, make_mesh(c.mesh, jax.devices()[:1]))
    for field, value in (("train_on", "last_assistant"), ("messages_field", "conversations")):
        c = config(chat_run, pairs_file, tmp_path, **{field: value})
        with pytest.raises(ConfigError, match=rf"data.{field}='{value}' is not read with "
                                              r"data.format=preference"):
            validate(c, 1)


def test_a_reference_is_reused_only_for_the_same_tokens_and_starting_weights(
        chat_run, pairs_file, tmp_path):
    """A rerun in the same run directory from other starting weights, or on pairs whose chosen
    and rejected are swapped (the same sizes, so the same packing plan), computes the reference
    anew; the same data and weights read it."""
    c = config(chat_run, pairs_file, tmp_path)
    pipe, trainer, params = prepared(c, tmp_path)
    said = []
    first = pipe._train_rows.ref.copy()
    again = make_pipeline(c, pipe.mesh)
    again.prepare(trainer, params, tmp_path / "run", 0, said.append)
    assert said == [f"reference log-probabilities: {tmp_path / 'run' / 'reference_logps.npz'}"]
    np.testing.assert_array_equal(again._train_rows.ref, first)
    other = jax.tree.map(lambda x: x * 1.01, params)  # another RUN_DIR's weights
    said.clear()
    again.prepare(trainer, other, tmp_path / "run", 0, said.append)
    assert "other starting weights: computing the reference anew" in said[0]
    assert not np.array_equal(again._train_rows.ref, first)
    swapped = write_jsonl(tmp_path / "swapped.jsonl", [
        dict(r, chosen=r["rejected"], rejected=r["chosen"]) for r in pairs_file[1]])
    c_swapped = config(chat_run, pairs_file, tmp_path, path=str(swapped))
    flipped = make_pipeline(c_swapped, pipe.mesh)
    assert flipped.plan_digest == pipe.plan_digest  # what the old key read
    said.clear()
    flipped.prepare(trainer, params, tmp_path / "run", 0, said.append)
    assert "computing the reference anew" in said[0]
    ref = flipped._train_rows.ref
    np.testing.assert_allclose(ref.reshape(-1, 2)[:, ::-1].reshape(-1), first, rtol=1e-5)
    for p in (pipe, again, flipped):
        p.close()


def test_bad_records_are_counted_and_a_file_without_pairs_is_one_line(
        chat_run, pairs_file, tmp_path):
    rng = np.random.default_rng(1)
    good = [pair(rng) for _ in range(10)]
    path = write_jsonl(tmp_path / "mixed.jsonl", good[:3] + [{"prompt": "x", "chosen": "y"},
                                                             {"messages": []}] + good[3:])
    pipe = make_pipeline(config(chat_run, pairs_file, tmp_path, path=str(path)),
                         make_mesh(config(chat_run, pairs_file, tmp_path).mesh, jax.devices()[:1]))
    assert (pipe.tally.read, pipe.tally.bad, pipe.conversations_read) == (12, 2, 10)
    assert f"2 not preference pairs (first: {path} line 4: no 'rejected' field" in pipe.plan_line()
    with pytest.raises(DataError, match="the reference log-probabilities are not computed yet"):
        pipe.device_batch(0)
    # a resume needs the reference its run computed at the start: missing, or another data's
    from errors import CheckpointError
    with pytest.raises(CheckpointError, match=r"reference_logps.npz is missing: a preference run "
                                              r"resumes with the reference"):
        pipe.prepare(None, None, tmp_path / "resumed", 4, print)
    other = tmp_path / "other"
    other.mkdir()
    np.savez(other / "reference_logps.npz", train=np.zeros(2), heldout=np.zeros(2),
             identity=np.frombuffer(b"{}", np.uint8))
    with pytest.raises(CheckpointError, match="was computed for other pairs"):
        pipe.prepare(None, None, other, 4, print)
    none = write_jsonl(tmp_path / "none.jsonl", [{"messages": []}])
    c = config(chat_run, pairs_file, tmp_path, path=str(none))
    with pytest.raises(DataError, match=r"no preference pair to train in .*none.jsonl: 1 not "
                                        r"preference pairs \(first: .* no 'chosen' or 'rejected'") as e:
        make_pipeline(c, make_mesh(c.mesh, jax.devices()[:1]))
    assert "\n" not in str(e.value)


# -- a whole run ------------------------------------------------------------------------------
def dpo_run(chat_run, pairs_file, workdir, *flags):
    return entry_run("configs/dpo.py", chat_run, pairs_file[0], workdir,
                     "data.heldout_fraction=0.2", "train.lr=1e-3", *flags)


def test_a_dpo_run_learns_the_pairs_resumes_exactly_and_exports(chat_run, pairs_file, tmp_path):
    import trained_run as tr
    from scripts import convert_hf
    whole = tmp_path / "whole"
    done = dpo_run(chat_run, pairs_file, whole)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    import re
    from data.split import heldout_by_key  # each pair's side: a hash of its prompt
    held = heldout_by_key(np.array([chat.split_key(r["prompt"]) for r in pairs_file[1]]), 0.2)[1]
    long = re.search(r"held out: (\d+) pair\(s\) longer than 256 tokens, (\d+) dropped", out)
    dropped = int(long[2]) if long else 0
    assert long is None or long[1] == long[2]
    train, kept = 30 - held.size, held.size - dropped
    assert "data: preference pairs, 30 records read" in out and f"{train} train / {kept} held out" in out
    assert f"reference log-probabilities of {train} train and {kept} held-out pairs computed" in out
    metrics, evals = tr.metrics(whole), tr.evals(whole)
    assert abs(metrics[1]["loss"] - math.log(2)) < 1e-5 and metrics[1]["pairs"] > 4
    assert metrics[3]["loss"] < metrics[1]["loss"]
    assert abs(evals[0]["eval_loss"] - math.log(2)) < 1e-5 and evals[0]["eval_reward_margin"] == \
        pytest.approx(0, abs=1e-5)
    assert evals[3]["eval_reward_margin"] > 0 and evals[3]["eval_loss"] < math.log(2)
    # resumed after step 2's checkpoint: the stored reference, the same step 3 to the last bit
    half = tmp_path / "half"
    shutil.copytree(whole, half)
    shutil.rmtree(half / "checkpoints" / "3")
    resumed = dpo_run(chat_run, pairs_file, half)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"reference log-probabilities: {half / 'reference_logps.npz'}" in resumed.stdout
    # step 3 from step 2's state, and the weights it leaves (the held-out loss after it)
    assert [tr.metrics(half)[3][k] for k in ("loss", "grad_norm")] == \
        [metrics[3][k] for k in ("loss", "grad_norm")]
    assert tr.evals(half)[3]["eval_loss"] == evals[3]["eval_loss"]
    assert convert_hf.main(["export", "--run", str(whole), "--out", str(tmp_path / "out"),
                            "--dtype", "float32"]) == 0
    from transformers import AutoModelForCausalLM
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "out").config.num_hidden_layers == 2


# -- on a mixture of experts ------------------------------------------------------------------
def test_dpo_on_a_mixture_of_experts_starts_at_ln2_plus_the_policys_aux_terms_and_steps(
        chat_run, pairs_file, tmp_path):
    """DPO runs on an MoE unchanged: the policy's forward adds its aux terms (aux x the
    load-balancing loss + z x the z-loss of its router statistics on the batch), the reference's
    (computed once, with the starting weights, outside the step) nothing. So the first step's
    loss is ln 2 + those terms, and steps on the batch take the DPO loss below ln 2."""
    from test_sft import fresh_state, moe_model
    c = moe_model(config(chat_run, pairs_file, tmp_path))
    c.train.lr = 1e-2
    mesh = make_mesh(c.mesh, jax.devices()[:1])
    pipe = make_pipeline(c, mesh)
    trainer = Trainer(c, mesh)
    state = fresh_state(trainer)
    pipe.prepare(trainer, state.params, tmp_path / "run", 0, lambda m: None)
    batch = pipe.device_batch(0)
    # the run's own step (training/loop.py), from a state placed as the step returns one: one
    # program traced and compiled for all 4 steps (jax.jit(trainer._train_step) on
    # trainer.state_of(params), whose scalars are not placed, traced and compiled it twice)
    step = trainer.train_step
    state, metrics = step(state, batch)
    metrics = jax.device_get(metrics)
    assert abs(float(metrics["dpo_loss"]) - math.log(2)) < 1e-5
    # the aux metrics are the batch's router statistics' (test_sft.py's MoE test holds that)
    # about k = 2 (balanced) from a fresh router, which scores the experts nearly alike
    assert abs(float(metrics["aux_loss"]) - 2) < 0.2 and float(metrics["z_loss"]) > 0
    want = math.log(2) + 0.05 * float(metrics["aux_loss"]) + 0.01 * float(metrics["z_loss"])
    assert abs(float(metrics["loss"]) - want) < 1e-6 * want
    for _ in range(3):
        state, metrics = step(state, batch)
    metrics = jax.device_get(metrics)
    assert np.isfinite(float(metrics["aux_loss"])) and int(metrics["bad_step"]) == -1
    assert float(metrics["dpo_loss"]) < math.log(2) - 0.05
    pipe.close()


# -- with LoRA adapters -----------------------------------------------------------------------
def test_dpo_with_adapters_starts_at_ln2_steps_and_its_reference_is_the_base(chat_run, pairs_file,
                                                                          tmp_path):
    """configs/dpo.py with train.lora.rank=4 from the imported base: new adapters (B zero), so
    the reference pass (the starting weights) and the policy agree and the first step's DPO
    loss is ln 2; steps on the batch take it below. The reference is the base with the
    adapters off: under adapters whose B is not zero (an imported adapter's), the reference
    pass gives the same log-probabilities as under new ones."""
    from checkpoints.rundir import open_run
    from model import lora
    c = config(chat_run, pairs_file, tmp_path)
    c.train.update(lr=1e-2)
    c.train.lora.rank = 4
    mesh = make_mesh(c.mesh, jax.devices()[:1])
    pipe, trainer = make_pipeline(c, mesh), Trainer(c, mesh)
    base = open_run(chat_run[0]).restore_params(
        lora.without_adapters(trainer.abstract_state.params)).params
    params = lora.join(base, trainer.fresh_adapters(0))
    host = jax.device_get(params)
    state = trainer.init_from(params)
    pipe.prepare(trainer, state.params, tmp_path / "run", 0, lambda m: None)
    reference = pipe._train_rows.ref.copy()
    batch = pipe.device_batch(0)
    state, metrics = trainer.train_step(state, batch)
    assert abs(float(metrics["dpo_loss"]) - math.log(2)) < 1e-5
    for _ in range(3):
        state, metrics = trainer.train_step(state, batch)
    assert float(metrics["dpo_loss"]) < math.log(2) - 0.05 and int(metrics["bad_step"]) == -1
    rng = np.random.default_rng(2)
    moved = jax.tree_util.tree_map_with_path(
        lambda k, v: rng.normal(0, 0.5, v.shape).astype(v.dtype)
        if "lora_" in jax.tree_util.keystr(k) else v, host)
    pipe.prepare(trainer, jax.device_put(moved, trainer.param_shardings), tmp_path / "other", 0,
                 lambda m: None)
    np.testing.assert_allclose(pipe._train_rows.ref, reference, rtol=1e-6, atol=1e-5)
    pipe.close()
