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

ROLES = ("system", "user", "assistant", "tool")
# ShareGPT's speaker names and the roles they are
SHAREGPT = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
            "chatgpt": "assistant", "bing": "assistant", "bard": "assistant",
            "system": "system", "tool": "tool", "function": "tool", "observation": "tool",
            "function_response": "tool"}
FIELDS = ("messages", "conversations")  # looked for in this order when no field is named


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
            role = SHAREGPT.get(speaker.lower() if isinstance(speaker, str) else speaker)
            if role is None:
                raise BadConversation(f"{where} is from {speaker!r}, not one of "
                                      f"{', '.join(SHAREGPT)}")
            content = turn.get("value")
            rest = {k: v for k, v in turn.items() if k not in ("from", "value")}
        else:
            raise BadConversation(f"{where} has no role (nor ShareGPT's 'from')")
        if role not in ROLES:
            raise BadConversation(f"{where} has role {role!r}, not one of {', '.join(ROLES)}")
        content = _content(content, where)
        if content is None and not (role == "assistant" and rest.get("tool_calls")):
            raise BadConversation(f"{where} ({role}) has no content")
        out.append({"role": role, "content": content, **rest})
    return out


def pair_of(record) -> tuple[list[dict], list[dict], list[dict]]:
    """(prompt, chosen, rejected) messages of a preference record, TRL's format: ``prompt``
    (messages, or a string: one user message) and ``chosen`` / ``rejected`` (messages, or a
    string: one assistant message); without ``prompt``, chosen and rejected are whole
    conversations and the prompt is what they share before they part. Each side needs an
    assistant turn after the prompt; BadConversation else."""
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
    if record.get("prompt") is not None:
        prompt = side(record["prompt"], "prompt", "user")
    else:  # an implicit prompt: the messages both sides share
        n = 0
        while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
            n += 1
        while n and chosen[n - 1]["role"] == "assistant":  # a response starts a side
            n -= 1
        prompt, chosen, rejected = chosen[:n], chosen[n:], rejected[n:]
        if not prompt:
            raise BadConversation("no prompt, and chosen and rejected share no first message")
    for name, msgs in (("chosen", chosen), ("rejected", rejected)):
        if not any(m["role"] == "assistant" for m in msgs):
            raise BadConversation(f"{name} holds no assistant turn")
    return prompt, chosen, rejected


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
