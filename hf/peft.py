"""LoRA adapters (model/lora.py) in PEFT's format, both ways, and merged into the weights.

PEFT 0.21's ``PeftModel.save_pretrained`` writes a directory of ``adapter_config.json`` (peft_type
LORA, r, lora_alpha, use_rslora, target_modules, modules_to_save, base_model_name_or_path, ...)
and ``adapter_model.safetensors``, whose names are the model's own with the adapter's name
("default") taken out (peft/utils/save_and_load.py ``get_peft_model_state_dict``), under the
wrapper's prefix ``base_model.model.``. Per adapted projection of each layer, its HF module path
(hf/weights.py ATTENTION, MLP) and then:

    base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight   [r, in]
    base_model.model.model.layers.{i}.self_attn.q_proj.lora_B.weight   [out, r]

(delta W = scale * B @ A, ``[out, in]`` as the projection's ``weight``). Here ``a [L, in..., r]``
and ``b [L, r, out...]`` carry the projection's axes as its weight does (``lora_q``: ``a [L, D,
r]``, ``b [L, r, H, hd]``; ``lora_o``: ``a [L, H, hd, r]``, ``b [L, r, D]``), so layer ``i``'s
``lora_A`` is ``a[i]`` flattened to ``[in, r]`` and transposed, ``lora_B`` is ``b[i]`` flattened
to ``[r, out]`` and transposed: the heads' order is the base's (hf/weights.py's in_heads,
out_heads kinds). A module of ``modules_to_save`` is saved whole under its own name
(``base_model.model.model.embed_tokens.weight``, ``base_model.model.lm_head.weight``,
``base_model.model.model.layers.{i}.input_layernorm.weight``, ``base_model.model.model.norm.weight``).
PEFT picks those modules by the end of their name (``key.endswith(entry)``, peft/utils/other.py
``_set_trainable``), so ``norm`` names every RMSNorm, as ``train.lora.modules_to_save``'s
``norm`` does here. With tied embeddings the one table is ``embed_tokens`` with
``ensure_weight_tying`` (what PEFT writes for ``lm_head`` on a tied model), saved under both
names, as PEFT saves it.
"""
from __future__ import annotations

import json
import math
import pathlib
import re

import numpy as np

from errors import ConversionError
from hf import weights
from model import lora

PREFIX = "base_model.model."  # PeftModel's wrapper around the transformers model
CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
A, B = ".lora_A.weight", ".lora_B.weight"
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# adapter_config.json fields that change what the adapter computes, which this model does not
# build: (field, its value that means "off", what it is)
UNBUILT = (("use_dora", False, "DoRA (weight-decomposed LoRA)"),
           ("rank_pattern", {}, "per-module ranks"), ("alpha_pattern", {}, "per-module alphas"),
           ("layers_to_transform", None, "adapters on some layers only"),
           ("layer_replication", None, "layer replication"),
           ("bias", "none", "trained biases"), ("lora_bias", False, "a bias on lora_B"),
           ("fan_in_fan_out", False, "Conv1D weights (GPT-2's), not Linear"),
           ("target_parameters", None, "adapters on parameters rather than modules"),
           ("trainable_token_indices", None, "trainable tokens"),
           ("use_qalora", False, "QA-LoRA"), ("alora_invocation_tokens", None, "activated LoRA"),
           ("use_bdlora", None, "block-diagonal LoRA"), ("megatron_config", None, "Megatron layers"))


def _module(hf_name: str) -> str:
    return hf_name[: -len(".weight")] if hf_name.endswith(".weight") else hf_name


def projections(m, targets) -> list[tuple[str, str, tuple[str, ...]]]:
    """(PEFT target, HF module within a layer, our adapter's path) of each of ``targets``
    (lora.TARGETS' names), from hf/weights.py's tables."""
    table = {path: hf_name for path, hf_name, _ in weights.ATTENTION + weights.MLP}
    out = []
    for t in targets:
        module, weight, ours = lora.TARGETS[t]
        if module == "mlp" and weights._mixed(m):  # a mixed model's dense MLPs (lora.check)
            raise ConversionError(f"{t}: adapters on the dense MLPs of a model whose other MLPs "
                                  f"are experts are not converted")
        out.append((t, _module(table[(module, weight)]), ("blocks", module, ours)))
    return out


def _whole(m) -> list[tuple[str, tuple, int | None, str]]:
    """(HF name, our path, layer or None, hf/weights.py kind) of every weight that
    ``modules_to_save`` can name whole: the embeddings, the head, each layer's norms (and what
    else a layer holds outside the projections and experts), the final norm."""
    tied = bool(m.get("tie_embeddings", False))
    out = [("model.embed_tokens.weight", ("embed",), None, "vector"),
           ("lm_head.weight", ("embed",) if tied else ("head",), None, "vector" if tied else "t"),
           ("model.norm.weight", ("final_norm", "scale"), None, "vector")]
    for i in range(m.num_layers):
        out += [(weights.LAYER.format(i=i) + name, ("blocks",) + path, i, kind)
                for path, name, kind in weights._block(m)]
    return out


def _saved(entries, m) -> list[tuple[str, tuple, int | None, str]]:
    """The whole weights PEFT saves for ``modules_to_save`` ``entries`` (its own rule: a module
    whose name ends with an entry)."""
    return [w for w in _whole(m) if any(_module(w[0]).endswith(e) for e in entries)]


def peft_modules_to_save(spec: lora.Spec, m) -> tuple[list[str], bool]:
    """(PEFT's modules_to_save for ``spec``'s, ensure_weight_tying). One line where PEFT's
    names would save other weights than the ones that train here."""
    tied = bool(m.get("tie_embeddings", False))
    entries, tying = [], False
    saved = set(spec.modules_to_save)
    if "embed_tokens" in saved or "lm_head" in saved:
        if tied:  # one table: PEFT's tied embed_tokens, as it writes a tied model's lm_head
            entries.append("embed_tokens")
            tying = True
        else:
            entries += [n for n in ("embed_tokens", "lm_head") if n in saved]
    if "norm" in saved:
        entries.append("norm")
    # exact, or refused: PEFT's rule picks what the trained mask here marks, weight by weight
    picked = {(w[1], w[2]) for w in _saved(entries, m)}
    ours = {(w[1], w[2]) for w in _whole(m) if lora.path_trains(w[1], spec, tied)}
    if picked != ours:
        extra = sorted(map(str, picked ^ ours))[0]
        raise ConversionError(f"train.lora.modules_to_save={','.join(spec.modules_to_save)}: "
                              f"PEFT's modules_to_save={entries} would not save the same weights "
                              f"(e.g. {extra}); this architecture's names cannot say it exactly")
    return entries, tying


# ------------------------------------------------------------------------------------ ours -> PEFT

def to_peft(params: dict, spec: lora.Spec, m, dtype=np.float32) -> dict[str, np.ndarray]:
    """PEFT's adapter_model.safetensors tensors (name -> ``dtype`` array) of ``params``'
    adapters and of the weights ``spec.modules_to_save`` trains."""
    out = {}
    for i in range(m.num_layers):
        for _, module, path in projections(m, spec.targets):
            ad = weights._get(params, path)
            a, b = np.asarray(ad["a"][i]), np.asarray(ad["b"][i])
            name = PREFIX + weights.LAYER.format(i=i) + module
            out[name + A] = a.reshape(-1, a.shape[-1]).T
            out[name + B] = b.reshape(b.shape[0], -1).T
    entries, _ = peft_modules_to_save(spec, m)
    for hf_name, path, i, kind in _saved(entries, m):
        w = np.asarray(weights._get(params, path))
        out[PREFIX + hf_name] = weights._to_hf(w if i is None else w[i], kind)
    if bool(m.get("tie_embeddings", False)) and PREFIX + "model.embed_tokens.weight" in out:
        out[PREFIX + "lm_head.weight"] = out[PREFIX + "model.embed_tokens.weight"]
    return {k: np.ascontiguousarray(np.asarray(v).astype(dtype)) for k, v in sorted(out.items())}


def adapter_config(spec: lora.Spec, m, base_model: str | None) -> dict:
    """adapter_config.json for ``spec`` (PEFT's LoraConfig fields; the rest keep PEFT's
    defaults)."""
    entries, tying = peft_modules_to_save(spec, m)
    alpha = int(spec.alpha) if float(spec.alpha).is_integer() else float(spec.alpha)
    cfg = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
           "r": spec.rank, "lora_alpha": alpha, "lora_dropout": float(spec.dropout),
           "use_rslora": bool(spec.rslora), "target_modules": list(spec.targets),
           "modules_to_save": entries or None, "bias": "none", "fan_in_fan_out": False,
           "init_lora_weights": True, "inference_mode": True}
    if tying:
        cfg["ensure_weight_tying"] = True
    return cfg


def merge(params: dict, spec: lora.Spec) -> dict:
    """``params`` with each adapter folded into its projection (``W + scale * A @ B``, summed in
    float64, in W's dtype) and the adapters dropped: the base model's tree, the same function."""
    weight_of = {ours: weight for _, weight, ours in lora.TARGETS.values()}

    def visit(node):
        if not isinstance(node, dict):
            return node
        out = {k: visit(v) for k, v in node.items() if not lora.is_adapter((k,))}
        for k, ad in node.items():
            if not lora.is_adapter((k,)):
                continue
            w = np.asarray(out[weight_of[k]])
            merged = np.empty_like(w)
            for i in range(w.shape[0]):  # a layer at a time: float64 the size of one layer's
                a, b = np.asarray(ad["a"][i], np.float64), np.asarray(ad["b"][i], np.float64)
                delta = a.reshape(-1, a.shape[-1]) @ b.reshape(b.shape[0], -1)
                merged[i] = (w[i].astype(np.float64) + spec.scale * delta.reshape(w.shape[1:])
                             ).astype(w.dtype)
            out[weight_of[k]] = merged
        return out
    return visit(params)


# ------------------------------------------------------------------------------------ PEFT -> ours

def read(directory: str | pathlib.Path):
    """(adapter_config.json as a dict, adapter_model.safetensors' tensors under names without
    ``base_model.model.``) of a PEFT adapter directory; one line for what is missing."""
    from hf import safetensors
    d = pathlib.Path(directory).expanduser().absolute()
    if not d.is_dir():
        raise ConversionError(f"--adapter {d}: no such directory (give a PEFT adapter directory: "
                              f"{CONFIG} and {WEIGHTS})")
    if not (d / CONFIG).is_file():
        raise ConversionError(f"--adapter {d}: no {CONFIG} (not a PEFT adapter directory; "
                              f"PeftModel.save_pretrained writes one)")
    try:
        cfg = json.loads((d / CONFIG).read_text())
    except ValueError as e:
        raise ConversionError(f"{d / CONFIG}: not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise ConversionError(f"{d / CONFIG}: not a JSON object")
    if not (d / WEIGHTS).is_file():
        bin_only = (d / "adapter_model.bin").is_file()
        raise ConversionError(f"--adapter {d}: no {WEIGHTS}" + (
            " (only adapter_model.bin, a torch pickle: save it again with "
            "save_pretrained(DIR, safe_serialization=True))" if bin_only else ""))
    found = safetensors.Tensors(d)
    return cfg, named(found, found.names())


def named(tensors, names=None):
    """PEFT's adapter tensors (a dict, as get_peft_model_state_dict gives them, or a file's)
    under their names without ``base_model.model.`` (PEFT loads either spelling)."""
    names = list(tensors) if names is None else names
    return weights._Renamed(tensors, {n[len(PREFIX):] if n.startswith(PREFIX) else n: n
                                      for n in names})


def lora_fields(cfg: dict, tensors, m, where: str = CONFIG) -> tuple[dict, list[str]]:
    """(``train.lora`` fields of the adapter ``cfg`` with ``tensors``, for model config ``m``;
    lines to log). One line for an adapter this model cannot hold: another PEFT method, target
    modules or modules_to_save it has no name for, tensors of another architecture or shape."""
    kind = cfg.get("peft_type")
    if str(kind).upper() != "LORA":
        raise ConversionError(f"{where}: peft_type {kind!r}; only LORA adapters convert")
    task = cfg.get("task_type")
    if task not in (None, "CAUSAL_LM"):
        raise ConversionError(f"{where}: task_type {task!r}; a causal language model's adapter "
                              f"(CAUSAL_LM) is needed")
    for key, off, what in UNBUILT:
        value = cfg.get(key, off)
        if value not in (off, None, {}, [], False):
            raise ConversionError(f"{where}: {key}={value!r}: {what} is not built here; an "
                                  f"adapter with {key}={off!r} converts")
    r = cfg.get("r")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise ConversionError(f"{where}: r={r!r} must be an int >= 1")
    alpha = cfg.get("lora_alpha", 8)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not alpha > 0:
        raise ConversionError(f"{where}: lora_alpha={alpha!r} must be a number > 0")
    listed = cfg.get("target_modules")
    if isinstance(listed, (list, tuple)):
        bad = [t for t in listed if str(t).split(".")[-1] not in lora.TARGETS]
        if bad:
            raise ConversionError(f"{where}: target module {bad[0]!r} has no adapter here; "
                                  f"targets can be {', '.join(lora.TARGETS)} ({lora.ALL_LINEAR})")
    # what the tensors adapt decides the targets (a regex or all-linear in the config alike)
    names = tensors.names()
    layers = {t: set() for t in lora.TARGETS}
    mlp = not weights._experts(m)  # a mixture of experts' MLPs take no adapters (lora.check)
    by_module = {module: t for t, module, _ in projections(
        m, [t for t in lora.TARGETS if mlp or lora.TARGETS[t][0] != "mlp"])}
    saved = []
    for name in names:
        is_lora = name.endswith((A, B))
        got = _LAYER.match(name[: -len(A)] if is_lora else name)
        if is_lora:
            t = by_module.get(got.group(2)) if got else None
            if t is None:
                raise ConversionError(
                    f"{WEIGHTS}: tensor {PREFIX + name} adapts a module this model does not "
                    f"have (its adapters sit on model.layers.{{i}}. + one of "
                    f"{', '.join(by_module)}): an adapter for another architecture")
            i = int(got.group(1))
            if i >= m.num_layers:
                raise ConversionError(f"{WEIGHTS}: tensor {PREFIX + name} is for layer {i}, but "
                                      f"the run has {m.num_layers} layers: an adapter for another "
                                      f"model")
            layers[t].add(i)
        elif ".lora_" in name or "lora_magnitude" in name:
            raise ConversionError(f"{WEIGHTS}: tensor {PREFIX + name} is not a LoRA A or B of a "
                                  f"projection (LoRA on embeddings, DoRA?); it does not convert")
        else:
            saved.append(name)
    targets = tuple(t for t in lora.TARGETS if layers[t])
    if not targets:
        raise ConversionError(f"{WEIGHTS}: no lora_A / lora_B tensors of this model's "
                              f"projections (names like {PREFIX}model.layers.0.self_attn.q_proj"
                              f"{A}): an adapter for another architecture")
    for t in targets:
        if len(layers[t]) != m.num_layers:
            raise ConversionError(f"{WEIGHTS}: {t} is adapted on {len(layers[t])} of the run's "
                                  f"{m.num_layers} layers; adapters on some layers only are not "
                                  f"built (every layer's, or none)")
    if isinstance(listed, (list, tuple)):
        unadapted = [t for t in listed if str(t).split(".")[-1] not in targets]
        if unadapted:
            raise ConversionError(f"{where}: target_modules names {unadapted[0]!r} but {WEIGHTS} "
                                  f"holds no adapter for it")
    entries = cfg.get("modules_to_save") or []
    entries = [entries] if isinstance(entries, str) else list(entries)
    modules = _our_modules_to_save(entries, m, where)
    lines = []
    dropout = float(cfg.get("lora_dropout", 0.0) or 0.0)
    if not 0 <= dropout < 1:
        raise ConversionError(f"{where}: lora_dropout={dropout:g} is not in [0, 1)")
    fields = {"rank": int(r), "alpha": float(alpha), "rslora": bool(cfg.get("use_rslora", False)),
              "dropout": dropout,
              "targets": (lora.ALL_LINEAR if targets == tuple(lora.TARGETS) else ",".join(targets)),
              "modules_to_save": ",".join(modules)}
    # what modules_to_save names, and the embeddings PEFT saves beside an adapter when they were
    # resized or targeted (save_embedding_layers): read in place of the base's
    listed_saves = {w[0] for w in _saved(entries, m)}
    extra = [n for n in saved if n not in listed_saves
             and n not in ("model.embed_tokens.weight", "lm_head.weight")]
    if extra:
        raise ConversionError(f"{WEIGHTS}: tensor {PREFIX + extra[0]} is neither a LoRA A or B nor "
                              f"a weight of its modules_to_save: an adapter for another "
                              f"architecture")
    loose = [n for n in saved if n not in listed_saves and not (
        n == "lm_head.weight" and "model.embed_tokens.weight" in listed_saves
        and m.get("tie_embeddings", False))]
    if loose:
        lines.append(f"{WEIGHTS}: {', '.join(loose)} read in place of the base's (saved beside the "
                     f"adapter, not in modules_to_save: they stay frozen if training goes on)")
    return fields, lines


def _our_modules_to_save(entries, m, where) -> list[str]:
    """train.lora.modules_to_save's names for PEFT's ``entries`` (matched as PEFT matches them);
    one line for an entry that saves what does not train whole here, or only some norms."""
    tied = bool(m.get("tie_embeddings", False))
    whole = _whole(m)
    norms = {(w[1], w[2]) for w in whole if lora.is_norm(w[1])}
    ours: list[str] = []
    for e in entries:
        picked = _saved([e], m)
        if not picked:
            raise ConversionError(f"{where}: modules_to_save entry {e!r} names no weight of this "
                                  f"model that trains whole here (embed_tokens, lm_head, norm)")
        kinds = set()
        for hf_name, path, i, _ in picked:
            if path == ("embed",):
                kinds.add("lm_head" if hf_name == "lm_head.weight" else "embed_tokens")
            elif path == ("head",):
                kinds.add("lm_head")
            elif lora.is_norm(path):
                kinds.add("norm")
            else:
                raise ConversionError(f"{where}: modules_to_save entry {e!r} saves {hf_name} whole; "
                                      f"only embed_tokens, lm_head and the norms train whole here")
        got_norms = {(w[1], w[2]) for w in picked if lora.is_norm(w[1])}
        if got_norms and got_norms != norms:
            raise ConversionError(f"{where}: modules_to_save entry {e!r} saves {len(got_norms)} of "
                                  f"the model's {len(norms)} norms; train.lora.modules_to_save's "
                                  f"norm trains every one (name them all: norm)")
        if tied and kinds >= {"embed_tokens"}:
            kinds.discard("lm_head")  # the one table, saved under both names
        ours += [k for k in lora.SAVABLE if k in kinds and k not in ours]
    return [k for k in lora.SAVABLE if k in ours]


def from_peft(tensors, fields: dict, m, base: dict, abstract: dict) -> dict:
    """``base`` (our params, numpy, no adapters) with the adapter's saved weights in place of
    the base's and its adapters beside them, shaped as ``abstract`` (the params of the config
    with ``fields`` as train.lora); one line naming a tensor whose shape does not fit."""
    import jax
    targets = lora.target_names(fields["targets"])
    params = jax.tree.map(lambda a: a, base)  # new dicts, the same arrays
    for t, module, path in projections(m, targets):
        want = weights._get(abstract, path)
        a_shape, b_shape = tuple(want["a"].shape), tuple(want["b"].shape)
        r = a_shape[-1]
        fan_in, fan_out = math.prod(a_shape[1:-1]), math.prod(b_shape[2:])
        stacks = {"a": [], "b": []}
        for i in range(m.num_layers):
            name = weights.LAYER.format(i=i) + module
            for key, suffix, shape in (("a", A, (r, fan_in)), ("b", B, (fan_out, r))):
                got = np.asarray(tensors[name + suffix])
                if tuple(got.shape) != shape:
                    raise ConversionError(
                        f"{WEIGHTS}: tensor {PREFIX + name + suffix} has shape {tuple(got.shape)}, "
                        f"but this run's {t} at rank {r} takes {shape}: an adapter for another "
                        f"model shape or rank")
                stacks[key].append(got.astype(np.float32).T)
        weights._set(params, path, {"a": np.stack(stacks["a"]).reshape(a_shape),
                                    "b": np.stack(stacks["b"]).reshape(b_shape)})
    tied = bool(m.get("tie_embeddings", False))
    names = set(tensors.names())
    expected = weights._expected(m)
    for hf_name, path, i, kind in _whole(m):
        if hf_name not in names or (tied and hf_name == "lm_head.weight"):
            continue
        want = np.asarray(weights._get(params, path))
        shape = expected.get(hf_name, expected["model.embed_tokens.weight"])
        if tuple(tensors[hf_name].shape) != tuple(shape):
            raise ConversionError(f"{WEIGHTS}: tensor {PREFIX + hf_name} has shape "
                                  f"{tuple(tensors[hf_name].shape)}, but this run's takes "
                                  f"{tuple(shape)}: an adapter for another model shape")
        value = weights._to_ours(np.asarray(tensors[hf_name]), kind, m)
        if i is None:
            weights._set(params, path, value.astype(want.dtype))
        else:
            stacked = want.copy()
            stacked[i] = value
            weights._set(params, path, stacked)
    if tied and "lm_head.weight" in names:  # one table: a head apart from it cannot be held
        head = np.asarray(tensors["lm_head.weight"], np.float32)
        if head.shape == params["embed"].shape and not np.array_equal(head, params["embed"]):
            raise ConversionError(f"{WEIGHTS}: its lm_head.weight differs from the embeddings, "
                                  f"which this run ties (model.tie_embeddings); an adapter that "
                                  f"unties them does not convert")
    return params
