"""A run's chat template: rendered with jinja2 as transformers renders it, and what to train.

The template is the one the run's tokenizer carries (``tokenizer_config.json``'s
``chat_template``, or a ``chat_template.jinja`` beside it, as an import or an SFT run writes)
or the file ``data.chat_template`` names. It renders in a sandbox with transformers' settings
(``trim_blocks``, ``lstrip_blocks``, loop controls, its ``tojson``, ``raise_exception`` and
``strftime_now``) and the tokenizer's special tokens as variables, so a conversation becomes the
same text here as under ``tokenizer.apply_chat_template``.

What is trained (``spans``) is a list of character spans of that text:
- a template with ``{% generation %}`` marks: the text inside them (transformers'
  ``return_assistant_tokens_mask``);
- a template without (SmolLM2's, Qwen3's, Gemma 3's, Llama 3's): each assistant turn's text,
  found turn by turn: the turn starts where the conversation rendered up to it with the
  generation prompt ends, and it is what rendering it as the last message adds. A template may
  render a turn differently once later messages follow (Qwen3 gives only the last turn an empty
  ``<think>`` block): then the turn is the longest tail of what it adds that the whole
  conversation holds at that place, so the trained text is always the text the model reads.
Role headers are never trained; the end-of-turn token (and what the template writes after it
within the turn) is.
"""
from __future__ import annotations

import dataclasses
import datetime
import functools
import hashlib
import json
import pathlib
import re

from errors import DataError

TRAIN_ON = ("assistant", "last_assistant", "all")
GENERATION_MARK = re.compile(r"\{%-?\s*generation\s*-?%\}")
# The names transformers passes a message's reasoning under (its _REASONING_FIELDS): a template
# may read any of them.
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                  "mask_token")


class TemplateError(DataError):
    """A conversation the template refuses (its raise_exception) or cannot render."""


@functools.lru_cache(maxsize=8)
def _compile(source: str):
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """``{% generation %}...{% endgeneration %}``: records where its text lands in the output
        (the output so far is the chunks ``render`` has collected when the block is emitted)."""
        tags = {"generation"}

        def __init__(self, environment):
            super().__init__(environment)
            self.chunks, self.spans = None, None

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(lineno)

        def _mark(self, caller):
            text = caller()
            if self.chunks is not None:
                start = sum(map(len, self.chunks))
                self.spans.append((start, start + len(text)))
            return text

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # jinja's own tojson escapes HTML characters; transformers' (and so the templates') does not
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    try:
        template = env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise DataError(f"the chat template does not parse (line {e.lineno}: {e.message})") from None
    return template, env.extensions[Generation.identifier]


def with_reasoning_aliases(messages: list[dict]) -> list[dict]:
    """Each message with reasoning under any of its names gets it under all of them, as
    transformers passes it (a template reads ``reasoning_content`` or ``thinking``)."""
    out = []
    for m in messages:
        reasoning = next((m[k] for k in REASONING_FIELDS if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


# A character no text holds (Unicode's private use area): marks where contents land (_fast_turns)
MARK = "\ue000"
# Conversations on which a template's fast turn spans must equal its turn-by-turn ones before
# they are used alone; template digest -> how many have (-1: one differed, never again).
TRUST_AFTER = 8
FAST_FROM = 5  # assistant turns from which the linear path costs fewer renders
_TRUSTED: dict[str, int] = {}


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
    source: str  # the jinja text
    where: str  # where it came from, for the startup line
    special_tokens: dict  # bos_token, eos_token, ... as the tokenizer's config names them

    @property
    def digest(self) -> str:
        """What the token cache is keyed by: the text and the variables it renders with."""
        blob = json.dumps([self.source, self.special_tokens], sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    @property
    def marked(self) -> bool:
        """Whether the template marks what to train with ``{% generation %}``."""
        return bool(GENERATION_MARK.search(self.source))

    def render(self, messages: list[dict], add_generation_prompt: bool = False,
               marks: list | None = None, context: dict | None = None,
               chunks: list | None = None) -> str:
        """The conversation's text; ``marks``, when given, receives the generation spans;
        ``context``: the record's own template variables (``tools``, its chat_template_kwargs:
        data/chat.py ``template_context``), over the tokenizer's special tokens as transformers
        lays them; ``chunks``, when given, receives the pieces the template wrote, in order."""
        import jinja2
        template, generation = _compile(self.source)
        out = [] if chunks is None else chunks
        generation.chunks, generation.spans = (out, marks) if marks is not None else (None, None)
        variables = {"tools": None, **self.special_tokens, **(context or {})}
        try:
            for chunk in template.generate(messages=with_reasoning_aliases(messages),
                                           documents=None,
                                           add_generation_prompt=add_generation_prompt,
                                           **variables):
                out.append(chunk)
        except jinja2.exceptions.TemplateError as e:
            raise TemplateError(f"the chat template refuses it: {e}") from None
        except Exception as e:  # a template reading a field the messages lack, say
            raise TemplateError(f"the chat template fails on it ({type(e).__name__}: {e})") from None
        finally:
            generation.chunks, generation.spans = None, None
        return "".join(out)

    def spans(self, messages: list[dict], train_on: str = "assistant",
              context: dict | None = None) -> tuple[str, list[tuple[int, int]]]:
        """(the whole conversation's text, the character spans to train, in order)."""
        if train_on == "all":
            text = self.render(messages, context=context)
            return text, [(0, len(text))]
        if self.marked:
            marks: list = []
            text = self.render(messages, marks=marks, context=context)
            spans = [s for s in marks if s[1] > s[0]]
        else:
            chunks: list = []
            text = self.render(messages, context=context, chunks=chunks)
            spans = self._turns(messages, range(len(messages)), text, context, chunks)
        if train_on == "last_assistant":
            spans = spans[-1:]
        return text, spans

    def response_spans(self, prompt: list[dict], response: list[dict],
                       context: dict | None = None) -> tuple[str, list[tuple[int, int]]]:
        """(the text of ``prompt + response``, the spans of the response's assistant turns):
        a preference pair's side, whose log-probability is taken over its response only."""
        messages = prompt + response
        if self.marked:
            marks: list = []
            text = self.render(messages, marks=marks, context=context)
            before = sum(m["role"] == "assistant" for m in prompt)
            if len(marks) == sum(m["role"] == "assistant" for m in messages):
                spans = marks[before:]  # one mark per assistant turn: the response's are last
            else:  # marks that are not one per turn: those after the prompt's text
                start = len(self.render(prompt, add_generation_prompt=True, context=context))
                spans = [s for s in marks if s[0] >= start]
            return text, [s for s in spans if s[1] > s[0]]
        chunks: list = []
        text = self.render(messages, context=context, chunks=chunks)
        return text, self._turns(messages, range(len(prompt), len(messages)), text, context,
                                 chunks)

    def _turns(self, messages, among, text, context, chunks) -> list[tuple[int, int]]:
        """The non-empty spans of the assistant turns whose index is in ``among``: each found
        turn by turn (``_turn``, two renders of the conversation up to it: quadratic in turns),
        or, past the first and last, from one more render of the whole (``_fast_turns``: for
        FAST_FROM turns or more, where it costs fewer renders). ``chunks``: ``text``'s pieces."""
        suffix = self._suffix(messages, context, chunks)
        wanted = [i for i in among if messages[i]["role"] == "assistant"]
        spans = None
        if len(wanted) >= FAST_FROM and _TRUSTED.get(self.digest, 0) >= 0:
            spans = self._fast_turns(messages, wanted, text, context, suffix)
            if spans is not None and _TRUSTED.get(self.digest, 0) < TRUST_AFTER:
                exact = [self._turn(messages, i, text, context, suffix) for i in wanted]
                _TRUSTED[self.digest] = _TRUSTED.get(self.digest, 0) + 1 if exact == spans else -1
                spans = exact
        if spans is None:
            spans = [self._turn(messages, i, text, context, suffix) for i in wanted]
        return [s for s in spans if s[1] > s[0]]

    def _fast_turns(self, messages, wanted, text, context, suffix
                    ) -> list[tuple[int, int]] | None:
        """``_turn``'s spans for the assistant turns ``wanted`` (three or more) in linear time,
        or None where this conversation does not allow it. The first and last turns are found
        as ``_turn`` finds them; the first tells what the template writes between a turn's
        start and its content (``head``: "" for most) and after the content to the turn's end
        (``tail``: the end-of-turn token). Every message's content is located by one render with
        a private-use character around each (the conversation must render the same without
        them); a middle turn is then its content with ``head`` before it and everything after it
        through the first ``tail`` before the next message's content (its tool calls
        included). A middle turn where ``head`` or ``tail`` is not found is found by ``_turn``.
        Until a template's fast spans have equalled ``_turn``'s on TRUST_AFTER conversations
        (``_turns``), both are computed and ``_turn``'s are used; one difference and the
        template is only ever read turn by turn."""
        if MARK in text:
            return None
        # (an empty content stays unmarked: a template may test it, Qwen3's before tool calls)
        owners = [i for i, m in enumerate(messages)
                  if isinstance(m.get("content"), str) and m["content"]]
        marked = [dict(m, content=MARK + m["content"] + MARK) if i in owners else m
                  for i, m in enumerate(messages)]
        try:
            rendered = self.render(marked, context=context)
        except TemplateError:
            return None
        if rendered.replace(MARK, "") != text:
            return None  # the marks changed the text (a template that trims the content)
        at, found = -1, []
        while True:
            at = rendered.find(MARK, at + 1)
            if at == -1:
                break
            found.append(at - len(found))  # its place in the text without the marks
        if len(found) != 2 * len(owners):
            return None  # a content written twice, or not at all
        content = {i: (found[2 * k], found[2 * k + 1]) for k, i in enumerate(owners)}
        first, last = wanted[0], wanted[-1]
        exact = {i: self._turn(messages, i, text, context, suffix) for i in (first, last)}
        if first not in content:
            return None
        (start, end), (lo, hi) = exact[first], content[first]
        if not start <= lo <= hi <= end:
            return None
        head, tail = text[start:lo], text[hi:end]
        header = self._header(messages[:first], context, start) if any(
            i not in content for i in wanted[1:-1]) else ""
        out = []
        for i in wanted:
            got = exact.get(i)
            prev = max((content[j][1] for j in content if j < i), default=0)
            bound = min((content[j][0] for j in content if j > i), default=len(text) - len(suffix))
            s = -1
            if got is None and i in content:
                lo, hi = content[i]
                s = lo - len(head) if lo >= len(head) and text.startswith(head, lo - len(head)) else -1
            elif got is None and header:  # no content: after the generation prompt's header
                s = text.find(header, prev, bound)
                s, hi = (s + len(header),) * 2 if s != -1 else (-1, -1)
            if got is None and s != -1:
                e = text.find(tail, hi, bound) if tail else hi
                if e != -1:
                    e += len(tail)
                    got = (s, s + len(text[s:e].rstrip()))
            out.append(got if got is not None else
                        self._turn(messages, i, text, context, suffix))
        return out

    def _header(self, before: list[dict], context, start: int) -> str:
        """The generation prompt's header: what the conversation ``before`` a turn gains with it,
        past the pieces of its text without it ("" when that is not plain); a turn with no
        content to mark starts after it."""
        plain: list = []
        self.render(before, context=context, chunks=plain)
        prompted = self.render(before, add_generation_prompt=True, context=context)
        shared, at = 0, 0
        while shared < len(plain) and prompted.startswith(plain[shared], at):
            at += len(plain[shared])
            shared += 1
        header = prompted[at:]
        return header if header and len(prompted) == start else ""

    def _suffix(self, messages, context, plain: list) -> str:
        """What the template writes after the last message when no generation prompt follows
        (Phi-3's eos_token; "" for most): the pieces of the conversation's text (``plain``) past
        those it shares, piece for piece, with the same conversation rendered with the prompt."""
        prompted: list = []
        self.render(messages, add_generation_prompt=True, context=context, chunks=prompted)
        k = 0
        while k < min(len(plain), len(prompted)) and plain[k] == prompted[k]:
            k += 1
        return "".join(plain[k:])

    def _turn(self, messages: list[dict], i: int, text: str, context: dict | None,
              suffix: str = "") -> tuple[int, int]:
        """Where assistant turn ``i`` lies in ``text`` (the whole conversation rendered): from
        where the conversation before it with the generation prompt ends, through the turn's last
        non-space character (its end-of-turn token): the separator a template writes after it
        (SmolLM2's and Qwen3's newline after ``<|im_end|>``) is not the model's to produce, and
        templates with generation marks leave it out too."""
        prompt = self.render(messages[:i], add_generation_prompt=True, context=context)
        upto = self.render(messages[:i + 1], context=context)
        if not upto.startswith(prompt):
            raise TemplateError(
                f"the chat template renders the conversation before assistant turn {i} "
                f"otherwise once the turn follows it ({_difference(prompt, upto, 'it ends there')}), "
                f"so the turn cannot be found; give data.chat_template a template with "
                f"{{% generation %}} marks")
        added = upto[len(prompt):]
        # The turn starts in the conversation where its generation prompt ends, or, when the
        # template fills in the start of the reply for the last turn only (Qwen3's empty think
        # block under enable_thinking=False: the model does not write it), where the two part.
        start = len(prompt) if text.startswith(prompt) else _common_prefix(prompt, text)
        if not added.strip():  # the template writes nothing for this turn: nothing to train
            return start, start
        content = messages[i].get("content")
        # a piece that lost the content's end is no longer this turn: refuse rather than train a
        # piece of it
        needle = content.strip()[-32:] if isinstance(content, str) else ""
        # The turn is what it adds less the suffix the template writes after the last message
        # (Phi-3's eos_token): no turn but the last is followed by it in the conversation, and
        # it is not the last turn's either.
        ends = [len(added)]
        if suffix and upto.endswith(suffix) and len(added) > len(suffix):
            ends.insert(0, len(added) - len(suffix))
        # the turn's place may start with whitespace that its last-message rendering drops
        # (Qwen3 strips the last turn's leading newlines, not the others')
        head = text[start:start + 64]
        lead = len(head) - len(head.lstrip())
        for end in ends:
            piece = added[:end]
            for at in range(start, start + lead + 1):
                # the longest tail of it found in place (a template may write more for the last
                # turn: Qwen3's empty <think> block); a tail without the content's end is not
                # this turn, and a shorter one would not hold it either
                cut = piece.find(text[at]) if at < len(text) else -1
                while cut != -1:
                    if text.startswith(piece[cut:], at):
                        if needle in piece[cut:]:
                            return start, at + len(piece[cut:].rstrip())
                        break
                    cut = piece.find(text[at], cut + 1)
        raise TemplateError(f"the chat template renders assistant turn {i} otherwise once "
                            f"later messages follow it ({_difference(added, text[start:], 'it is the last message')}), "
                            f"so the turn cannot be found; give data.chat_template a template "
                            f"with {{% generation %}} marks")


def _common_prefix(a: str, b: str) -> int:
    """The length of the longest common prefix of ``a`` and ``b`` (a bisection of slice
    comparisons: C speed on long conversations)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _difference(alone: str, in_context: str, when: str, width: int = 24) -> str:
    """Where two renderings part, in words: '...A... when <when>, ...B... in the conversation,
    after N characters'."""
    n = _common_prefix(alone, in_context)
    lo = max(0, n - width)
    return (f"...{alone[lo:n + width]!r}... when {when}, ...{in_context[lo:n + width]!r}... in "
            f"the conversation: they differ after {n} characters")


def token_mask(offsets, spans: list[tuple[int, int]]):
    """Per token (its character ``offsets`` [n, 2]), whether it overlaps a trained span: the
    token holding a span's first character through the one holding its last, as transformers
    maps generation marks to tokens (``char_to_token``). A bool array [n]."""
    import numpy as np
    offsets = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
    out = np.zeros(len(offsets), dtype=bool)
    for lo, hi in spans:
        out |= (offsets[:, 0] < hi) & (offsets[:, 1] > lo)
    return out


# -- finding a run's template -----------------------------------------------------------------
def _special_tokens(tok_config: dict) -> dict:
    """The special tokens a tokenizer_config.json names, as strings (an AddedToken dict gives its
    content)."""
    out = {}
    for name in SPECIAL_TOKENS:
        value = tok_config.get(name)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            out[name] = value
    return out


def _template_in(config: dict, where: str) -> str | None:
    t = config.get("chat_template")
    if isinstance(t, list):  # several named templates: the default one, as transformers picks
        named = {x.get("name"): x.get("template") for x in t if isinstance(x, dict)}
        t = named.get("default")
        if t is None:
            raise DataError(f"{where} holds named chat templates ({', '.join(map(str, named))}) "
                            f"but none named 'default'; give data.chat_template=FILE")
    return t if isinstance(t, str) and t.strip() else None


def _read_json(path: pathlib.Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise DataError(f"{path}: not readable JSON ({e})") from None


def candidate_dirs(tokenizer_path: str) -> list[pathlib.Path]:
    """Where a run's template may be: beside its tokenizer.json, that directory's hf/ (an
    import's side files), and the runs it started from (checkpoint.restore_from)."""
    if not tokenizer_path:
        return []
    d = pathlib.Path(tokenizer_path).expanduser().absolute().parent
    out = [d, d / "hf"]
    for _ in range(8):  # a chain of runs, each started from the one before
        try:
            src = json.loads((d / "config.json").read_text())["checkpoint"]["restore_from"]
        except (OSError, ValueError, KeyError, TypeError):
            break
        if not src:
            break
        d = pathlib.Path(src).expanduser().absolute()
        while d != d.parent and not (d / "config.json").is_file():
            d = d.parent  # restore_from may name checkpoints/ or one step inside the run
        out += [d, d / "hf"]
    return out


def load(template_path: str, tokenizer_path: str) -> ChatTemplate:
    """``data.chat_template`` (a .jinja file, or a tokenizer_config.json holding one), else the
    template the tokenizer at ``tokenizer_path`` came with; one line when there is none."""
    special: dict = {}
    for d in candidate_dirs(tokenizer_path):  # the tokenizer's special tokens, wherever found
        if (d / "tokenizer_config.json").is_file():
            special = _special_tokens(_read_json(d / "tokenizer_config.json"))
            break
    if template_path:
        p = pathlib.Path(template_path).expanduser()
        if not p.is_file():
            raise DataError(f"data.chat_template: no such file {str(p)!r} (give a .jinja file or "
                            f"a tokenizer_config.json with a chat_template)")
        if p.suffix == ".json":
            cfg = _read_json(p)
            source = _template_in(cfg, str(p))
            if source is None:
                raise DataError(f"data.chat_template: {p} holds no chat_template")
            special = {**special, **_special_tokens(cfg)}
        else:
            source = p.read_text()
        return ChatTemplate(source, str(p), special)
    for d in candidate_dirs(tokenizer_path):
        if (d / "chat_template.jinja").is_file():
            return ChatTemplate((d / "chat_template.jinja").read_text(),
                                str(d / "chat_template.jinja"), special)
        if (d / "tokenizer_config.json").is_file():
            source = _template_in(_read_json(d / "tokenizer_config.json"),
                                  str(d / "tokenizer_config.json"))
            if source is not None:
                return ChatTemplate(source, str(d / "tokenizer_config.json"), special)
    said = f"the tokenizer {tokenizer_path}" if tokenizer_path else "a trained BPE (data.tokenizer is empty)"
    raise DataError(f"no chat template: {said} comes with none (no chat_template in a "
                    f"tokenizer_config.json or chat_template.jinja beside it or its run's "
                    f"import); give data.chat_template=FILE (a .jinja file)")
