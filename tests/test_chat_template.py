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


# What each family writes for an assistant turn of ``content`` that the model must produce, up
# to its end-of-turn token (in the middle of a conversation, as its last turn): the newline the
# template writes after it separates turns and is not trained (generation marks leave it out).
TURN = {
    "smollm2": (lambda c: c + "<|im_end|>", lambda c: c + "<|im_end|>"),
    "qwen3": (lambda c: c + "<|im_end|>",
              lambda c: "<think>\n\n</think>\n\n" + c.lstrip("\n") + "<|im_end|>"),
    "gemma3": (lambda c: c.strip() + "<end_of_turn>", lambda c: c.strip() + "<end_of_turn>"),
    "llama3": (lambda c: c.strip() + "<|eot_id|>", lambda c: c.strip() + "<|eot_id|>"),
    # the eos_token it writes after the last message is not the last turn's
    "phi3": (lambda c: c + "<|end|>", lambda c: c + "<|end|>"),
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


def test_turn_by_turn_trains_what_generation_marks_train(families, rng):
    """The marked ChatML template without its marks, found turn by turn, trains the same tokens
    as with them: each turn's content and <|im_end|>, not the newline after it."""
    template, _, tok = families["marked"]
    bare = chat_template.ChatTemplate(chat_template.GENERATION_MARK.sub("", template.source)
                                      .replace("{% endgeneration %}", ""), "bare",
                                      template.special_tokens)
    assert not bare.marked
    for _ in range(12):
        messages = conversation(rng)
        assert bare.render(messages) == template.render(messages)
        assert our_mask(bare, tok, messages) == our_mask(template, tok, messages)


def test_a_turn_rendered_otherwise_when_last_is_refused_naming_the_difference(families):
    """A template that ends its last message otherwise, in the same piece of text as the turn
    (not a suffix after the conversation): one line that shows both endings."""
    template, _, _ = families["smollm2"]
    olmo_like = chat_template.ChatTemplate(
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
        "('<|im_end|>' if not (loop.last and m['role'] == 'assistant') else eos_token) + "
        "'\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}",
        "olmo-like", {"eos_token": "<|endoftext|>"})
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "bcd"},
                {"role": "user", "content": "e"}, {"role": "assistant", "content": "f"}]
    with pytest.raises(chat_template.TemplateError) as e:
        olmo_like.spans(messages)
    said = str(e.value)
    assert "assistant turn 1" in said and "\n" not in said
    assert "'bcd<|endoftext|>" in said and "'bcd<|im_end|>" in said
    assert "when it is the last message" in said and "differ after 5 characters" in said


def test_tools_and_template_kwargs_of_a_record_reach_the_template(families, rng):
    """A record's tools (a list of JSON schemas, or that list as a JSON string) and its
    chat_template_kwargs render as transformers renders them with tools= and the kwargs."""
    from data import chat
    template, hf, _ = families["qwen3"]
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]}}}]
    messages = conversation(rng, turns=2, system=True)
    for record in ({"messages": messages, "tools": tools},
                   {"messages": messages, "tools": json.dumps(tools),
                    "chat_template_kwargs": {"enable_thinking": False}}):
        context = chat.template_context(record)
        kwargs = record.get("chat_template_kwargs", {})
        for prompt in (False, True):
            want = hf.apply_chat_template(messages, tools=tools, tokenize=False,
                                          add_generation_prompt=prompt, **kwargs)
            assert "get_weather" in want
            assert template.render(messages, prompt, context=context) == want
        text, spans = template.spans(messages, context=context)
        assert text == hf.apply_chat_template(messages, tools=tools, tokenize=False, **kwargs)
        assert [text[a:b] for a, b in spans][0] == messages[2]["content"] + "<|im_end|>"
    for record, why in (({"tools": "{not json"}, "'tools' is a string that is not JSON"),
                        ({"tools": {"name": "f"}}, "'tools' is dict, not a list"),
                        ({"chat_template_kwargs": ["x"]}, "'chat_template_kwargs' is list"),
                        ({"chat_template_kwargs": {"messages": 1}}, "sets messages")):
        with pytest.raises(chat.BadConversation, match=why):
            chat.template_context(record)


def test_long_conversations_are_found_in_one_render_as_turn_by_turn_finds_them(families, rng):
    """The linear path (_fast_turns: the first and last turns found turn by turn, the others
    from one render with their contents marked) gives exactly the turn-by-turn spans, in every
    family, with tool calls and tool replies in Qwen3's; and a conversation it cannot read
    (a template that trims the marked contents' whitespace) is left to the turn-by-turn path."""
    call = {"name": "get_weather", "arguments": {"city": "Paris"}}
    fast_read = 0
    for family in ("smollm2", "qwen3", "gemma3", "llama3", "phi3"):
        template = families[family][0]
        for _ in range(6):
            messages = conversation(rng, turns=int(rng.integers(3, 7)), system=family != "gemma3")
            if family == "qwen3":  # an agent's turn: a tool call, the tool's reply, the answer
                k = 2 * int(rng.integers(1, 3)) + 2  # before an answer, after its question
                messages[k:k] = [{"role": "assistant", "content": "", "tool_calls": [
                    {"type": "function", "function": call}]},
                    {"role": "tool", "content": sentence(rng)},]
            for m in messages:
                if rng.random() < 0.7:
                    m["content"] = m["content"].strip() or "x"
            chunks = []
            text = template.render(messages, chunks=chunks)
            wanted = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
            suffix = template._suffix(messages, None, chunks)
            exact = [template._turn(messages, i, text, None, suffix) for i in wanted]
            fast = template._fast_turns(messages, wanted, text, None, suffix)
            if fast is not None:
                fast_read += 1
                assert fast == exact, (family, messages)
            assert template.spans(messages)[1] == [s for s in exact if s[1] > s[0]]
    assert fast_read >= 12
    # a content with whitespace under a trimming template: the marks would change the text
    gemma = families["gemma3"][0]
    messages = conversation(rng, turns=4, system=False)
    messages[3]["content"] = " padded "
    assert gemma._fast_turns(messages, [1, 3, 5, 7], gemma.render(messages), None, "") is None


def test_the_tokenizing_bench_times_both_paths_and_they_agree(tmp_path):
    from scripts import bench_chat_data
    out = tmp_path / "chat.json"
    got = bench_chat_data.main(["--turns", "24", "--count", "12", "--repeats", "1",
                                "--families", "qwen3,phi3", "--json", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert rows == got["rows"] and [(r["family"], r["path"]) for r in rows] == [
        ("qwen3", "turn by turn"), ("qwen3", "linear"), ("phi3", "turn by turn"), ("phi3", "linear")]
    assert all(r["same_masks"] and r["one_long_s"] > 0 and r["many_s"] > 0 for r in rows)
    assert [r["trusted"] for r in rows] == [False, True] * 2
    assert rows[0]["assistant_turns"] >= chat_template.FAST_FROM


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
