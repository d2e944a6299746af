"""data/chat_template.py against transformers: the same text for every family's template, the
same assistant mask as return_assistant_tokens_mask on a template with generation marks, and on
templates without marks the assistant turns found turn by turn (each turn's content and
end-of-turn, never a header), token by token through transformers' own char_to_token."""
import json
import pathlib

import numpy as np
import pytest
from tokenizers import Tokenizer
from transformers import AutoTokenizer

import chat_templates as ct
from data import chat_template
from errors import DataError

WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi "
         "rho sigma tau upsilon phi chi psi omega 12 345 6789 naïve café — “quoted” code(): "
         "return x + 1").split()


def sentence(rng, n=None):
    words = rng.choice(WORDS, n or int(rng.integers(1, 12)))
    text = " ".join(words)
    # leading/trailing whitespace and newlines, which some templates trim and others keep
    return rng.choice(["", " ", "\n"]) + text + rng.choice(["", " ", "\n\n"])


def conversation(rng, turns=None, system=None):
    """Alternating user/assistant turns ending with the assistant, a system prompt or not."""
    turns = turns or int(rng.integers(1, 4))
    out = [{"role": "system", "content": sentence(rng)}] if (
        rng.random() < 0.5 if system is None else system) else []
    for _ in range(turns):
        out += [{"role": "user", "content": sentence(rng)},
                {"role": "assistant", "content": sentence(rng)}]
    return out


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    """family -> (our template, transformers' tokenizer, our tokenizer)."""
    out = {}
    for family in ct.FAMILIES:
        d = tmp_path_factory.mktemp(family)
        ct.write_tokenizer_dir(family, d)
        out[family] = (chat_template.load("", str(d / "tokenizer.json")),
                       AutoTokenizer.from_pretrained(str(d)), Tokenizer.from_file(str(d / "tokenizer.json")))
    return out


def our_mask(template, tok, messages, train_on="assistant"):
    text, spans = template.spans(messages, train_on)
    enc = tok.encode(text, add_special_tokens=False)
    return text, list(enc.ids), chat_template.token_mask(enc.offsets, spans).astype(int).tolist()


@pytest.mark.parametrize("family", list(ct.FAMILIES))
def test_every_family_renders_as_transformers_renders(families, family, rng):
    template, hf, _ = families[family]
    for _ in range(12):
        messages = conversation(rng)
        for prompt in (False, True):
            want = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)
            assert template.render(messages, add_generation_prompt=prompt) == want


def test_marked_template_gives_transformers_assistant_mask(families, rng):
    template, hf, tok = families["marked"]
    for _ in range(20):
        messages = conversation(rng)
        _, ids, mask = our_mask(template, tok, messages)
        want = hf.apply_chat_template(messages, tokenize=True, return_dict=True,
                                      return_assistant_tokens_mask=True)
        assert ids == list(want["input_ids"])
        assert mask == list(want["assistant_masks"])
        assert sum(mask) > 0


# What each family writes for an assistant turn of ``content`` that the model must produce:
# (in the middle of a conversation, as its last turn).
TURN = {
    "smollm2": (lambda c: c + "<|im_end|>\n", lambda c: c + "<|im_end|>\n"),
    "qwen3": (lambda c: c + "<|im_end|>\n",
              lambda c: "<think>\n\n</think>\n\n" + c.lstrip("\n") + "<|im_end|>\n"),
    "gemma3": (lambda c: c.strip() + "<end_of_turn>\n", lambda c: c.strip() + "<end_of_turn>\n"),
    "llama3": (lambda c: c.strip() + "<|eot_id|>", lambda c: c.strip() + "<|eot_id|>"),
}


@pytest.mark.parametrize("family", list(TURN))
def test_turn_by_turn_masks_are_each_assistant_turn_and_its_end(families, family, rng):
    """Without generation marks: the trained tokens are, for each assistant turn, the text that
    family writes for it (content, end-of-turn), starting where transformers' rendering of the
    conversation before it with the generation prompt ends; located with transformers' own
    tokenizer (char_to_token). Qwen3's last turn carries its empty think block, earlier ones do
    not: each is trained as the conversation's text holds it."""
    template, hf, tok = families[family]
    for _ in range(12):
        messages = conversation(rng)
        text, ids, mask = our_mask(template, tok, messages)
        full = hf.apply_chat_template(messages, tokenize=False)
        assert text == full
        enc = hf(full, add_special_tokens=False)
        assert ids == enc["input_ids"]
        want = np.zeros(len(ids), int)
        last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            start = len(hf.apply_chat_template(messages[:i], tokenize=False,
                                               add_generation_prompt=True))
            turn = TURN[family][i == last](m["content"])
            assert full[start:start + len(turn)] == turn
            if not turn:
                continue
            first, final = enc.char_to_token(start), enc.char_to_token(start + len(turn) - 1)
            want[first:final + 1] = 1
        assert mask == want.tolist(), (family, messages)


def test_train_on_last_assistant_and_all(families, rng):
    template, hf, tok = families["marked"]
    messages = conversation(rng, turns=3)
    text, ids, every = our_mask(template, tok, messages)
    _, _, last = our_mask(template, tok, messages, "last_assistant")
    _, _, everything = our_mask(template, tok, messages, "all")
    runs = np.flatnonzero(np.diff(np.concatenate([[0], every, [0]])))  # starts and ends of runs
    assert len(runs) == 6  # three assistant turns, each one run of tokens
    assert last == [int(runs[4] <= t < runs[5]) for t in range(len(ids))]
    assert everything == [1] * len(ids)


def test_reasoning_under_any_name_reaches_the_template(families):
    """transformers hands a template a message's reasoning as reasoning_content whatever it was
    called (thinking, reasoning): Qwen3's renders it in the last turn's think block."""
    template, hf, _ = families["qwen3"]
    for name in ("reasoning_content", "thinking", "reasoning"):
        messages = [{"role": "user", "content": "2+2?"},
                    {"role": "assistant", "content": "4", name: "add them"}]
        text = template.render(messages)
        assert "<think>\nadd them\n</think>\n\n4<|im_end|>" in text
        assert text == hf.apply_chat_template(messages, tokenize=False)


def test_a_template_that_refuses_a_conversation_is_a_template_error(families):
    template, _, _ = families["gemma3"]
    with pytest.raises(chat_template.TemplateError, match="roles must alternate"):
        template.spans([{"role": "user", "content": "a"}, {"role": "user", "content": "b"},
                        {"role": "assistant", "content": "c"}])


def test_finding_the_template_and_its_absence(tmp_path):
    """Beside the tokenizer, in its hf/ side files, in the runs it started from, or the file
    data.chat_template names (a .jinja or a tokenizer_config.json); none: one line."""
    run = tmp_path / "import"
    ct.write_tokenizer_dir("smollm2", run / "hf")
    (run / "tokenizer.json").write_text((run / "hf" / "tokenizer.json").read_text())
    (run / "config.json").write_text(json.dumps({"checkpoint": {"restore_from": ""}}))
    found = chat_template.load("", str(run / "tokenizer.json"))
    assert found.source == ct.SMOLLM2 and found.where.endswith("hf/tokenizer_config.json")
    assert found.special_tokens["eos_token"] == "<|im_end|>"
    sft = tmp_path / "sft"  # a run started from the import, its tokenizer copied
    sft.mkdir()
    (sft / "tokenizer.json").write_text((run / "tokenizer.json").read_text())
    (sft / "config.json").write_text(json.dumps({"checkpoint": {"restore_from": str(run / "checkpoints")}}))
    (run / "checkpoints").mkdir()
    assert chat_template.load("", str(sft / "tokenizer.json")).source == ct.SMOLLM2
    (sft / "chat_template.jinja").write_text(ct.LLAMA3)  # what a chat run writes: it wins
    assert chat_template.load("", str(sft / "tokenizer.json")).source == ct.LLAMA3
    other = tmp_path / "t.jinja"
    other.write_text(ct.GEMMA3)
    assert chat_template.load(str(other), str(sft / "tokenizer.json")).source == ct.GEMMA3
    with pytest.raises(DataError, match=r"data.chat_template: no such file .*missing.jinja"):
        chat_template.load(str(tmp_path / "missing.jinja"), "")
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "tokenizer.json").write_text("{}")
    with pytest.raises(DataError, match="no chat template: the tokenizer .* comes with none") as e:
        chat_template.load("", str(bare / "tokenizer.json"))
    assert "\n" not in str(e.value) and "data.chat_template=FILE" in str(e.value)
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}{{ m.content }")
    with pytest.raises(DataError, match="does not parse"):
        chat_template.load(str(broken), "").render([{"role": "user", "content": "x"}])
