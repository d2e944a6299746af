"""Attention chosen per layer: each layer's window and RoPE (Gemma 3, Qwen3, SmolLM3).

``model.layer_types`` is a comma-separated list with one kind per layer:
- ``full``: causal attention over the whole row, with the model's RoPE (``model.rope_theta``
  and ``model.rope_scaling``);
- ``sliding``: a sliding window of ``model.sliding_window`` tokens (a query at p sees keys
  p - W < k <= p), with the local RoPE: base ``model.local_rope_theta`` without scaling, or
  the model's own RoPE when that is 0 (Gemma 3's local layers: base 1e4; Qwen3's: the same);
- ``full_nope`` / ``sliding_nope``: the same without any rotary embedding (SmolLM3's NoPE).
An empty list is every layer alike, as before the field existed: ``sliding`` when
``model.sliding_window`` is set, else ``full``.

The stack is one scan over its layers, each step switching to its layer's kind (one branch
compiled per kind; model/decoder.py over_layers): compile time stays flat in depth, the stacked
weights are read in place whatever the depth (Gemma-3-1B's 26 layers are 4 periods of 6 and 2
more), and a model whose layers are all alike scans one layer a step, exactly as before.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # importing this module must not import jax: configs/ build patterns with it
    from model.rope import Rope

KINDS = ("full", "sliding", "full_nope", "sliding_nope")


@dataclasses.dataclass(frozen=True)
class LayerKind:
    """A layer's attention, static (hashable): its window (0: full) and RoPE (None: NoPE); and
    in a model whose MLP slots differ (some layers a mixture of experts: model/flops.py
    ``moe_layers``) its MLP's, ``moe`` or ``dense`` (model/decoder.py; "" where every layer's
    is the model's one MLP, as ``kinds`` gives them)."""
    window: int
    rope: Rope | None
    mlp: str = ""


def names(m) -> tuple[str, ...]:
    """Each layer's kind name, from ``model.layer_types`` (or the model's one window)."""
    given = str(m.get("layer_types", "") or "").strip()
    if not given:
        return ("sliding" if int(m.get("sliding_window", 0)) else "full",) * int(m.num_layers)
    return tuple(part.strip() for part in given.split(","))


def check(m) -> str | None:
    """Why ``model.layer_types`` is not valid for ``m`` (one line), or None. A window or a
    local RoPE base that no layer reads is refused too: the run would go without it, silently."""
    local = float(m.get("local_rope_theta", 0.0) or 0.0)
    if local < 0:
        return f"model.local_rope_theta={local:g} must be >= 0 (0: the model's own RoPE)"
    given = str(m.get("layer_types", "") or "").strip()
    window = m.get("sliding_window", 0)
    if not given:  # every layer alike: sliding when there is a window
        if local and not window:
            return (f"model.local_rope_theta={local:g} is the sliding layers' RoPE base, but no "
                    f"layer slides (model.sliding_window={window!r}); set it to 0")
        return None
    kinds = names(m)
    unknown = sorted({k for k in kinds if k not in KINDS})
    if unknown:
        return (f"model.layer_types has {', '.join(map(repr, unknown))}; each layer is one of "
                f"{', '.join(KINDS)}")
    if len(kinds) != int(m.num_layers):
        return (f"model.layer_types lists {len(kinds)} layers but model.num_layers="
                f"{m.num_layers}; give one kind per layer")
    sliding = any(k.startswith("sliding") for k in kinds)
    if sliding and not window:
        return (f"model.layer_types has sliding layers but model.sliding_window={window!r}; "
                f"a sliding layer needs a window >= 1 token")
    listed = ", ".join(dict.fromkeys(kinds))
    if window and not sliding:
        return (f"model.sliding_window={window} is the sliding layers' window, but "
                f"model.layer_types has none ({listed}); set it to 0 or list sliding layers")
    if local and "sliding" not in kinds:
        return (f"model.local_rope_theta={local:g} is the sliding layers' RoPE base, but "
                f"model.layer_types has no sliding layer with RoPE ({listed}); set it to 0")
    return None


def kinds(m) -> tuple[LayerKind, ...]:
    """Each layer's ``LayerKind`` for model config ``m`` (checked by ``check`` first)."""
    from model.rope import Rope, from_config as rope_from_config
    full_rope = rope_from_config(m)
    local = float(m.get("local_rope_theta", 0.0) or 0.0)
    local_rope = Rope(theta=local) if local else full_rope
    window = int(m.get("sliding_window", 0))
    out = []
    for name in names(m):
        sliding = name.startswith("sliding")
        rope = None if name.endswith("_nope") else local_rope if sliding else full_rope
        out.append(LayerKind(window=window if sliding else 0, rope=rope))
    return tuple(out)


def period(kinds_: tuple) -> int:
    """The shortest p with ``kinds[i] == kinds[i % p]`` for every layer: the pattern's
    repeating unit (``describe``); the last ``len % p`` layers are its first ones again."""
    n = len(kinds_)
    for p in range(1, n + 1):
        if all(kinds_[i] == kinds_[i % p] for i in range(n)):
            return p
    return n


def repeat(unit: str, num_layers: int) -> str:
    """``layer_types`` of ``num_layers`` layers repeating ``unit`` ("sliding,full"), the last
    repeat cut short: ``repeat("sliding,sliding,full", 4)`` = "sliding,sliding,full,sliding"."""
    parts = [p.strip() for p in unit.split(",")]
    return ",".join(parts[i % len(parts)] for i in range(num_layers))


def runs(seq) -> list[tuple[object, int, int]]:
    """``(item, start, stop)`` of each run of equal consecutive items of ``seq``:
    ``runs("aab")`` = [("a", 0, 2), ("b", 2, 3)]."""
    out = []
    for i, item in enumerate(seq):
        if out and out[-1][0] == item:
            out[-1] = (item, out[-1][1], i + 1)
        else:
            out.append((item, i, i + 1))
    return out


def describe(m) -> str:
    """A short line for the startup log: ``5 sliding : full (W=512)``, or ``full``."""
    unit = names(m)[:period(kinds(m))]
    text = " : ".join(f"{b - a} {k}" if b - a > 1 else k for k, a, b in runs(unit))
    if any(k.startswith("sliding") for k in unit):
        text += f" (W={int(m.get('sliding_window', 0))})"
    return text
