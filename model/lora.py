"""LoRA adapters (``train.lora``): a low-rank ``scale * (x @ A) @ B`` added to chosen projections
of the one decoder, the base frozen.

An adapter is two parameters beside its projection, stacked over layers as the projection is:
``A [in..., r]`` along the projection's input axes and ``B [r, out...]`` along its output axes,
so the sharding rules table splits each as its base (A's input axis, B's output axis; the rank
axis ``lora`` whole). ``attn.lora_q`` adapts ``wq [D, H, hd]`` with ``a [D, r]``, ``b [r, H,
hd]``; ``attn.lora_o`` adapts ``wo [H, hd, D]`` with ``a [H, hd, r]``, ``b [r, D]``; the MLP's
``lora_gate``, ``lora_up`` ``[D, r]``, ``[r, F]`` and ``lora_down`` ``[F, r]``, ``[r, D]``.

As PEFT starts them: A uniform in +-1/sqrt(fan_in) (its kaiming_uniform with a = sqrt(5)), B
zero, so step 0 is the base model; the scale is alpha / r, or alpha / sqrt(r) with rslora. The
adapters draw from their own random stream (folded from their layer's key), so the base's
weights are the same with and without them. PEFT's module names are the target names
(``q_proj`` ... ``down_proj``); ``modules_to_save`` (LongLoRA's embeddings and norms) name
whole weights that train in full: ``embed_tokens``, ``lm_head`` and ``norm`` (every RMSNorm).

The trained parameters are the adapters and the saved modules; the rest is frozen: no gradient,
no optimizer state (training/state.py), optionally held in bf16 (``train.lora.base_dtype``).
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from errors import ConfigError

# PEFT's target module name -> (the module holding the projection, its weight, our adapter name);
# each one's index is its dropout mask's salt
TARGETS = {"q_proj": ("attn", "wq", "lora_q"), "k_proj": ("attn", "wk", "lora_k"),
           "v_proj": ("attn", "wv", "lora_v"), "o_proj": ("attn", "wo", "lora_o"),
           "gate_proj": ("mlp", "w_gate", "lora_gate"), "up_proj": ("mlp", "w_up", "lora_up"),
           "down_proj": ("mlp", "w_down", "lora_down")}
ALL_LINEAR = "all-linear"  # PEFT's spelling of every projection above
# modules_to_save -> what of our parameter tree trains in full (a path's first key, or any norm)
SAVABLE = ("embed_tokens", "lm_head", "norm")
BASE_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


@dataclasses.dataclass(frozen=True)
class Spec:
    """What ``train.lora`` asks for, resolved (static: hashable model metadata)."""
    rank: int
    alpha: float
    targets: tuple[str, ...]  # PEFT names, in TARGETS' order
    modules_to_save: tuple[str, ...] = ()
    rslora: bool = False
    dropout: float = 0.0

    @property
    def scale(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)

    def adapts(self, weight: str) -> bool:
        """Whether the projection ``weight`` (``wq``, ``w_down``, ...) carries an adapter."""
        return any(TARGETS[t][1] == weight for t in self.targets)


def names(text: str) -> tuple[str, ...]:
    """A comma-separated config list as names (blanks dropped)."""
    return tuple(n.strip() for n in str(text or "").split(",") if n.strip())


def target_names(text: str) -> tuple[str, ...]:
    """``train.lora.targets`` as PEFT names in TARGETS' order (all-linear: every one)."""
    listed = names(text)
    return tuple(t for t in TARGETS if t in listed or ALL_LINEAR in listed)


def spec_of(config) -> Spec | None:
    """The run's adapters (``config.train.lora``), or None when ``rank`` is 0 (every weight
    trains). Assumes configs/validate.py's ``check`` passed."""
    lora = config.train.get("lora")
    if lora is None or not int(lora.rank):
        return None
    return Spec(rank=int(lora.rank), alpha=float(lora.alpha), targets=target_names(lora.targets),
                modules_to_save=names(lora.modules_to_save), rslora=bool(lora.rslora),
                dropout=float(lora.dropout))


def check(config) -> None:
    """One line for a ``train.lora`` the model cannot take (configs/validate.py)."""
    lora, m = config.train.get("lora"), config.model
    if lora is None:
        return
    rank = lora.rank
    if not isinstance(rank, int) or rank < 0:
        raise ConfigError(f"train.lora.rank={rank!r} must be an int >= 0 (0: no adapters, every "
                          f"weight trains)")
    if not rank:
        return
    targets = names(lora.targets)
    unknown = [t for t in targets if t not in TARGETS and t != ALL_LINEAR]
    if unknown or not targets:
        raise ConfigError(f"train.lora.targets={lora.targets!r}: "
                          f"{'unknown module ' + repr(unknown[0]) if unknown else 'none given'}; "
                          f"name some of {', '.join(TARGETS)} (PEFT's names), or {ALL_LINEAR}")
    targets = target_names(lora.targets)
    hd = m.head_dim or m.d_model // m.num_heads
    sizes = {"q_proj": (m.d_model, m.num_heads * hd), "k_proj": (m.d_model, m.num_kv_heads * hd),
             "v_proj": (m.d_model, m.num_kv_heads * hd), "o_proj": (m.num_heads * hd, m.d_model),
             "gate_proj": (m.d_model, m.ffn_dim), "up_proj": (m.d_model, m.ffn_dim),
             "down_proj": (m.ffn_dim, m.d_model)}
    for t in targets:
        if rank > min(sizes[t]):
            raise ConfigError(f"train.lora.rank={rank} is above {t}'s size {sizes[t][0]} x "
                              f"{sizes[t][1]}: a rank of at most {min(sizes[t])} adapts it")
    from model.flops import num_experts
    mlp = [t for t in targets if TARGETS[t][0] == "mlp"]
    if mlp and num_experts(m):
        raise ConfigError(f"train.lora.targets: {', '.join(mlp)} name the MLP, which in this "
                          f"model is a mixture of experts; adapters on experts are not built yet: "
                          f"target q_proj,k_proj,v_proj,o_proj")
    if not lora.alpha > 0:
        raise ConfigError(f"train.lora.alpha={lora.alpha!r} must be > 0 (the scale is alpha / "
                          f"rank, or alpha / sqrt(rank) with rslora)")
    if not 0 <= float(lora.dropout) < 1:
        raise ConfigError(f"train.lora.dropout={lora.dropout!r} must be in [0, 1)")
    bad = [s for s in names(lora.modules_to_save) if s not in SAVABLE]
    if bad:
        raise ConfigError(f"train.lora.modules_to_save: unknown module {bad[0]!r}; name some of "
                          f"{', '.join(SAVABLE)} (norm: every RMSNorm)")
    if lora.base_dtype not in BASE_DTYPES:
        raise ConfigError(f"train.lora.base_dtype={lora.base_dtype!r} is not one of "
                          f"{', '.join(BASE_DTYPES)}")


class Adapter(nnx.Module):
    """``scale * (dropout(x) @ A) @ B`` for a projection whose input axes are ``in_shape`` (the
    last of x) and whose output axes are ``out_shape``; ``salt`` tells its dropout mask from
    the other projections'."""

    def __init__(self, rngs: nnx.Rngs, in_shape, in_axes, out_shape, out_axes, spec: Spec,
                 salt: int = 0):
        bound = 1.0 / math.sqrt(math.prod(in_shape))
        self.a = nnx.Param(jax.random.uniform(rngs.params(), (*in_shape, spec.rank), jnp.float32,
                                              -bound, bound), axes=(*in_axes, "lora"))
        self.b = nnx.Param(jnp.zeros((spec.rank, *out_shape), jnp.float32),
                           axes=("lora", *out_axes))
        self.scale, self.rate, self.salt, self.inputs = spec.scale, spec.dropout, salt, len(in_shape)

    def __call__(self, x, dtype):
        x = dropout(x, self.rate, self.salt, self.inputs)
        return delta(x, self.a[...].astype(dtype), self.b[...].astype(dtype), self.scale)


# ----------------------------------------------------------------------------- dropout
# PEFT's lora_dropout: each adapter's input, in training steps only, zeroed with probability p
# and the rest scaled by 1 / (1 - p). The mask is a hash of the step's seed, the layer, the
# projection, the token (its row of the global batch and its natural position in the row) and
# the feature: nothing a mesh, a layout, a strategy or microbatching changes, so a step with
# dropout is still one device's step. Set while the train step traces (``dropping``), read by
# each adapter; evaluation, generation and DPO's reference pass never set it.
_DROPPING: contextvars.ContextVar = contextvars.ContextVar("lora_dropping", default=None)


def _mix(x):
    """A 32-bit integer hash (murmur3's finaliser) of uint32 ``x``, elementwise."""
    x = x.astype(jnp.uint32)
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x7FEB352D)
    x = x ^ (x >> 15)
    x = x * jnp.uint32(0x846CA68B)
    return x ^ (x >> 16)


def token_ids(rows_B, natural_L):
    """Each token's identity ``[B, L]`` uint32: a hash of its row of the global batch and its
    natural position in the row (``natural_L``: the layout's natural index of each slot)."""
    return _mix(_mix(rows_B.astype(jnp.uint32))[:, None]
                ^ (natural_L.astype(jnp.uint32)[None, :] * jnp.uint32(0x9E3779B9)))


@contextlib.contextmanager
def dropping(seed, ids_BL):
    """Dropout on (``seed``: the step's uint32; ``ids_BL``: ``token_ids`` of the tokens the
    forward runs on, in their layout) while the block traces."""
    token = _DROPPING.set({"seed": _mix(seed), "ids": ids_BL, "layer": jnp.uint32(0)})
    try:
        yield
    finally:
        _DROPPING.reset(token)


@contextlib.contextmanager
def in_layer(index):
    """Inside ``dropping``: the layer whose adapters trace now (a scan's traced index)."""
    state = _DROPPING.get()
    if state is None:
        yield
        return
    token = _DROPPING.set({**state, "layer": jnp.asarray(index).astype(jnp.uint32)})
    try:
        yield
    finally:
        _DROPPING.reset(token)


def dropping_ids():
    """The tokens' ids while dropout is on (a chunked MLP carries them into its chunks), else
    None."""
    state = _DROPPING.get()
    return None if state is None else state["ids"]


def dropout(x, rate: float, salt: int, inputs: int, ids=None, offset=None):
    """``x`` (``[B, L, in...]``, ``inputs`` trailing input axes) with PEFT's dropout at
    ``rate`` while ``dropping``, else as it is. ``ids``: the tokens' ids where ``x`` holds a
    chunk of them; ``offset``: the first feature's index where ``x`` holds a slice of them (a
    shard of a tensor-split input)."""
    state = _DROPPING.get()
    if not rate or state is None:
        return x
    ids = state["ids"] if ids is None else ids
    shape = x.shape[-inputs:]
    features = jnp.arange(math.prod(shape), dtype=jnp.uint32).reshape(shape)
    if offset is not None:
        features = features + jnp.asarray(offset).astype(jnp.uint32)
    key = _mix(state["seed"] ^ _mix(state["layer"] * jnp.uint32(0x27D4EB2F) + jnp.uint32(salt)))
    bits = _mix(ids.reshape(ids.shape + (1,) * inputs) ^ _mix(features ^ key))
    keep = bits >= jnp.uint32(min(int(rate * 2.0**32), 2**32 - 1))
    return jnp.where(keep, x / jnp.asarray(1.0 - rate, x.dtype), jnp.zeros((), x.dtype))


def delta(x, a, b, scale: float):
    """``scale * (x @ a) @ b``, ``a``'s leading axes contracting x's last ones."""
    h = jnp.tensordot(x, a, axes=a.ndim - 1)
    return jnp.tensordot(h, b, axes=1) * jnp.asarray(scale, h.dtype)


def salt(name: str) -> int:
    """The dropout salt of our adapter ``name`` (``lora_q``, ...): its target's index."""
    return [t[2] for t in TARGETS.values()].index(name)


def adapter(module, name: str):
    """``module``'s adapter ``name`` (``lora_q``, ...), None where it has none."""
    return getattr(module, name, None)


# ----------------------------------------------------------------------------- trained and frozen

def is_adapter(path) -> bool:
    """Whether a parameter's ``path`` (keys of the pure params dict) is inside an adapter."""
    return any(str(k).startswith("lora_") for k in path)


def is_norm(path) -> bool:
    """Whether ``path`` is an RMSNorm's scale (modules_to_save's ``norm``)."""
    return any(str(k).endswith("norm") for k in path)


def path_trains(path: tuple[str, ...], spec: Spec, tied: bool) -> bool:
    """Whether the parameter at ``path`` trains under ``spec``: an adapter, or a weight
    ``modules_to_save`` names (``tied``: the table is also the head)."""
    saved = spec.modules_to_save
    if is_adapter(path) or ("norm" in saved and is_norm(path)):
        return True
    if path[0] == "embed" and ("embed_tokens" in saved or (tied and "lm_head" in saved)):
        return True
    return path[0] == "head" and "lm_head" in saved


def _keys(path) -> tuple:
    return tuple(getattr(k, "key", k) for k in path)


def mask(params: dict, where) -> dict:
    """``params``' nested dict with ``where(path)`` at each leaf."""
    return jax.tree_util.tree_map_with_path(lambda p, _: where(_keys(p)), params)


def trained_mask(params: dict, spec: Spec, tied: bool) -> dict:
    """``params``' nested dict with True where a leaf trains (adapters, modules_to_save)."""
    return mask(params, lambda path: path_trains(path, spec, tied))


def split(params: dict, where: dict) -> tuple[dict, dict]:
    """(the leaves where the mask ``where`` is True, the rest), each a nested dict of
    ``params``' shape without the other's leaves (empty dicts dropped)."""
    def part(node, m, want):
        if isinstance(node, dict):
            out = {k: part(v, m[k], want) for k, v in node.items()}
            return {k: v for k, v in out.items() if not (isinstance(v, dict) and not v)}
        return node if bool(m) == want else {}
    return part(params, where, True), part(params, where, False)


def join(a: dict, b: dict) -> dict:
    """The nested dicts ``a`` and ``b`` (disjoint leaves) as one."""
    out = dict(a)
    for k, v in b.items():
        out[k] = join(out[k], v) if k in out and isinstance(v, dict) else v
    return out


def adapters_only(params: dict) -> dict:
    """The adapter leaves of ``params`` (empty where it has none)."""
    return split(params, mask(params, is_adapter))[0]


def without_adapters(params: dict) -> dict:
    """``params`` less its adapters: the base model's tree."""
    return split(params, mask(params, is_adapter))[1]


def switched_off(params: dict) -> dict:
    """``params`` with every adapter's B at zero: the base model's function (DPO's reference)."""
    def off(path, v):
        path = _keys(path)
        return jnp.zeros_like(v) if is_adapter(path) and path[-1] == "b" else v
    return jax.tree_util.tree_map_with_path(off, params)
