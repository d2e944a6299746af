"""Conversations read from records: the ``messages`` format (TRL, axolotl, OpenAI) and ShareGPT's,
and preference pairs (TRL's ``prompt`` / ``chosen`` / ``rejected``).

A record is a dict holding a list of messages under ``data.messages_field`` (``""``: ``messages``,
else ShareGPT's ``conversations``). A message is ``{"role": system|user|assistant|tool,
"content": text}``; ShareGPT's ``{"from": human|gpt|system|tool|..., "value": text}`` is read as
one. Other keys of a message (``tool_calls``, ``name``, ``reasoning_content``) pass through to the
template. A record that is not a conversation (no list, an unknown role, content that is not
text, no assistant turn) is a ``BadConversation``: the pipeline counts it and names the first.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json

ROLES = ("system", "user", "assistant", "tool")
# ShareGPT's speaker names and the roles they are
SHAREGPT = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
            "chatgpt": "assistant", "bing": "assistant", "bard": "assistant",
            "system": "system", "tool": "tool", "function": "tool", "observation": "tool",
            "function_response": "tool"}
FIELDS = ("messages", "conversations")  # looked for in this order when no field is named
# what a template is called with besides a record's chat_template_kwargs (transformers' names)
RESERVED = ("messages", "tools", "documents", "add_generation_prompt")


class BadConversation(ValueError):
    """Why a record is not a conversation (one line, without where it is)."""


@dataclasses.dataclass
class Tally:
    """Conversations passed over in one read, by reason, and the first of each."""
    read: int = 0  # records seen
    bad: int = 0  # not a conversation
    first_bad: str = ""
    empty: int = 0  # a conversation with nothing to train (its mask is empty)
    first_empty: str = ""
    too_long: int = 0  # longer than a row: dropped, or truncated (data.too_long)
    first_too_long: str = ""
    cut_to_nothing: int = 0  # truncated, and then nothing of it was trained: dropped too
    first_cut_to_nothing: str = ""

    def add(self, kind: str, where: str) -> None:
        setattr(self, kind, getattr(self, kind) + 1)
        first = "first_" + kind
        if not getattr(self, first):
            setattr(self, first, where)


def _content(value, where: str):
    if value is None or isinstance(value, str):
        return value
    # content parts (the multimodal format): text parts only
    if isinstance(value, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                       and isinstance(p.get("text"), str) for p in value):
        return value
    raise BadConversation(f"{where} content is {type(value).__name__}, not text")


def _turns(turns, name: str) -> list[dict]:
    """A list of messages (the messages format or ShareGPT's) checked and in the messages
    format; BadConversation else."""
    if not isinstance(turns, list) or not turns:
        raise BadConversation(f"{name!r} is {'empty' if turns == [] else type(turns).__name__}, "
                              f"not a list of messages")
    out = []
    for i, turn in enumerate(turns):
        where = f"{name} message {i}" if name != "messages" else f"message {i}"
        if not isinstance(turn, dict):
            raise BadConversation(f"{where} is {type(turn).__name__}, not an object")
        if "role" in turn:
            role, content = turn["role"], turn.get("content")
            rest = {k: v for k, v in turn.items() if k not in ("role", "content")}
        elif "from" in turn:  # ShareGPT
            speaker = turn["from"]
            role = SHAREGPT.get(speaker.lower()) if isinstance(speaker, str) else None
            if role is None:
                raise BadConversation(f"{where} is from {speaker!r}, not one of "
                                      f"{', '.join(SHAREGPT)}")
            content = turn.get("value")
            rest = {k: v for k, v in turn.items() if k not in ("from", "value")}
        else:
            raise BadConversation(f"{where} has no role (nor ShareGPT's 'from')")
        if not isinstance(role, str) or role not in ROLES:
            raise BadConversation(f"{where} has role {role!r}, not one of {', '.join(ROLES)}")
        content = _content(content, where)
        if content is None and not (role == "assistant" and rest.get("tool_calls")):
            raise BadConversation(f"{where} ({role}) has no content")
        out.append({"role": role, "content": content, **rest})
    return out


def _shared_prefix(chosen: list[dict], rejected: list[dict]) -> int:
    """How many first messages chosen and rejected share, backed off so that each side starts
    at a response (a shared assistant turn at the end belongs to the sides)."""
    n = 0
    while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
        n += 1
    while n and chosen[n - 1]["role"] == "assistant":
        n -= 1
    return n


def _text(content) -> str:
    """A message's text for comparing prompts (content parts joined)."""
    if isinstance(content, list):
        return "".join(p["text"] for p in content)
    return content or ""


def pair_of(record) -> tuple[list[dict], list[dict], list[dict]]:
    """(prompt, chosen, rejected) messages of a preference record, TRL's formats:
    - ``prompt`` (messages, or a string: one user message) and ``chosen`` / ``rejected``
      (messages, or a string: one assistant message);
    - no ``prompt``: chosen and rejected are whole conversations, the prompt the messages they
      share before they part (TRL's ``extract_prompt``);
    - a string ``prompt`` beside whole conversations that already hold it (UltraFeedback and most
      DPO sets on the hub): the prompt is taken from the conversations, once, as TRL's
      ``maybe_extract_prompt`` takes it; a prompt that is not the user turn they share is a
      BadConversation. Conversations that start with a ``prompt`` given as messages lose that
      repeat too: a record means one prompt, never two.
    Each side needs an assistant turn after the prompt; BadConversation else."""
    if not isinstance(record, dict):
        raise BadConversation(f"the record is {type(record).__name__}, not an object")
    missing = [k for k in ("chosen", "rejected") if k not in record]
    if missing:
        raise BadConversation(f"no {' or '.join(map(repr, missing))} field (fields: "
                              f"{', '.join(map(str, record)) or 'none'})")

    def side(value, name, role):
        if isinstance(value, str):
            return [{"role": role, "content": value}]
        return _turns(value, name)

    chosen, rejected = side(record["chosen"], "chosen", "assistant"), side(
        record["rejected"], "rejected", "assistant")
    given = record.get("prompt")
    n = _shared_prefix(chosen, rejected)
    shared = chosen[:n]
    if given is None:  # an implicit prompt: the messages both sides share
        if not shared:
            raise BadConversation("no prompt, and chosen and rejected share no first message")
        prompt = shared
    elif isinstance(given, str) and shared:
        # conversations that hold the prompt already: it is their shared user turn
        asked = [_text(m["content"]) for m in shared if m["role"] == "user"]
        if not asked or asked[-1].strip() != given.strip():
            said = repr(asked[-1][:60]) if asked else "no user turn"
            raise BadConversation(f"the prompt {given[:60]!r} is not the user turn chosen and "
                                  f"rejected share ({said}): give the prompt once, either as "
                                  f"'prompt' or inside the conversations")
        prompt = shared
    else:
        prompt = side(given, "prompt", "user")
        k = len(prompt)
        if not isinstance(given, str) and chosen[:k] == prompt and rejected[:k] == prompt:
            shared = prompt  # conversations that repeat the prompt given as messages
        else:
            shared = []
    chosen, rejected = chosen[len(shared):], rejected[len(shared):]
    for name, msgs in (("chosen", chosen), ("rejected", rejected)):
        if not any(m["role"] == "assistant" for m in msgs):
            raise BadConversation(f"{name} holds no assistant turn after the prompt")
    return prompt, chosen, rejected


def split_key(prompt: list[dict]) -> float:
    """Where a record falls in [0, 1) for the held-out split: a hash of its prompt (the messages
    before the first assistant turn, roles and text), so a conversation keeps its side across
    runs, and an SFT conversation and a preference pair made from it (the same prompt) share a
    side."""
    first = next((k for k, m in enumerate(prompt) if m["role"] == "assistant"), len(prompt))
    blob = json.dumps([[m["role"], _text(m.get("content"))] for m in prompt[:first]],
                      ensure_ascii=False)
    return int.from_bytes(hashlib.sha256(blob.encode()).digest()[:8], "big") / 2.0 ** 64


def template_context(record) -> dict:
    """The template variables a record brings besides its messages, as TRL hands them to
    ``apply_chat_template``: ``tools`` (a list of JSON schemas, or a JSON string of one, as some
    hub sets store it) and ``chat_template_kwargs`` (Qwen3's ``enable_thinking``, say); {} when
    it brings none. BadConversation when they are not what a template can read."""
    out = {}
    tools = record.get("tools")
    if isinstance(tools, str):
        try:
            tools = json.loads(tools) if tools.strip() else None
        except ValueError:
            raise BadConversation("'tools' is a string that is not JSON") from None
    if tools is not None:
        if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
            raise BadConversation(f"'tools' is {type(tools).__name__}, not a list of JSON "
                                  f"schemas (objects)")
        out["tools"] = tools
    kwargs = record.get("chat_template_kwargs")
    if kwargs is not None:
        if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
            raise BadConversation(f"'chat_template_kwargs' is {type(kwargs).__name__}, not an "
                                  f"object of template variables")
        clash = [k for k in kwargs if k in RESERVED]
        if clash:
            raise BadConversation(f"'chat_template_kwargs' sets {', '.join(clash)}, which the "
                                  f"template gets from the record itself")
        out.update(kwargs)
    return out


def messages_of(record, field: str = "") -> list[dict]:
    """The record's messages, each with a known role and text content; BadConversation else."""
    if not isinstance(record, dict):
        raise BadConversation(f"the record is {type(record).__name__}, not an object")
    if field:
        if field not in record:
            raise BadConversation(f"no {field!r} field (fields: {', '.join(map(str, record))})")
        name = field
    else:
        name = next((f for f in FIELDS if f in record), None)
        if name is None:
            raise BadConversation(f"no messages (looked for {' or '.join(map(repr, FIELDS))}; "
                                  f"fields: {', '.join(map(str, record)) or 'none'}); set "
                                  f"data.messages_field")
    out = _turns(record[name], name)
    if not any(m["role"] == "assistant" for m in out):
        raise BadConversation("no assistant turn")
    return out
