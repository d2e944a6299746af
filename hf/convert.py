"""Hugging Face checkpoint directory <-> run directory.

Import writes what ``train.py`` leaves in a run directory: ``config.json`` (the given config,
model fields from HF, ``data.tokenizer`` pointing at the run's tokenizer), ``tokenizer.json``
and its fingerprint, ``checkpoints/0`` holding the parameters only (a weights-only start:
``--config.checkpoint.restore_weights_only=True``), and the HF side files in ``hf/`` for the
export. Parameters keep the checkpoint's dtype on disk (bf16 stays bf16) and become fp32 when
a run restores them. Export reads a run's newest checkpoint (or one step) and writes a
directory ``transformers.AutoModelForCausalLM`` / ``AutoTokenizer.from_pretrained`` load.

LoRA adapters (model/lora.py, in PEFT's format by hf/peft.py): a run with adapters exports
merged; ``export_adapter`` writes them alone as a PEFT adapter directory; ``import_adapter``
reads one onto a run's weights as a new run directory whose step-0 checkpoint holds both.
"""
from __future__ import annotations

import json
import pathlib
import shutil
from typing import Callable

import numpy as np

from errors import ConversionError
from hf import config as hf_config, mxfp4, safetensors, weights

HF_DIR = "hf"  # a run's copy of the imported HF config and tokenizer files
SIDE_FILES = ("config.json", "generation_config.json", "tokenizer_config.json",
              "special_tokens_map.json")
DTYPES = ("auto", "float32", "bfloat16", "float16")
BOS_NAMES = ("<s>", "<|begin_of_text|>", "<|startoftext|>", "<bos>")


def _fresh(out: pathlib.Path, flag: str):
    """Conversions write into a new (or empty) directory only: they never overwrite."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConversionError(f"{flag} {out} already exists and is not empty; give a new directory")


def _read_json(path: pathlib.Path) -> dict:
    try:
        return json.loads(path.read_text())
    except ValueError as e:
        raise ConversionError(f"{path}: not valid JSON ({e})") from None


def write_tokenizer(run, out: pathlib.Path, model_max_length: int) -> pathlib.Path:
    """The run's tokenizer as ``AutoTokenizer.from_pretrained(out)`` loads it, with the same
    ids: tokenizer.json, the imported tokenizer_config.json / special_tokens_map.json when the
    run came from Hugging Face (its chat template too), else a tokenizer_config.json naming
    the end-of-text and begin-of-text tokens (without it transformers has no eos)."""
    from data.tokenizer import EOS_NAMES
    tok = run.tokenizer
    side = _hf_side_dir(run.directory)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_text(tok.to_str())
    for name in SIDE_FILES[2:]:
        if side and (side / name).is_file():
            shutil.copyfile(side / name, out / name)
    own_template = run.directory / "chat_template.jinja"  # what a chat run trained with
    if own_template.is_file() and (out / "tokenizer_config.json").is_file():
        cfg = json.loads((out / "tokenizer_config.json").read_text())
        cfg["chat_template"] = own_template.read_text()
        (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    if not (side and (side / "tokenizer_config.json").is_file()):  # ours, written anew
        eos = next((tok.token_to_id(n) for n in EOS_NAMES if tok.token_to_id(n) is not None), None)
        bos_name = next((n for n in BOS_NAMES if tok.token_to_id(n) is not None), None)
        (out / "tokenizer_config.json").write_text(json.dumps({
            "tokenizer_class": "PreTrainedTokenizerFast",
            "eos_token": tok.id_to_token(eos) if eos is not None else None,
            "bos_token": bos_name, "model_max_length": int(model_max_length),
            "clean_up_tokenization_spaces": False,
            **({"chat_template": own_template.read_text()} if own_template.is_file() else {})},
            indent=2) + "\n")
    return out


def import_hf(hf: str | pathlib.Path, out: str | pathlib.Path, config_path: str = "configs/base.py",
              overrides=(), log: Callable[[str], None] = print) -> pathlib.Path:
    """Writes a run directory at ``out`` from the HF directory ``hf``; returns ``out``."""
    hf, out = pathlib.Path(hf).expanduser().absolute(), pathlib.Path(out).expanduser().absolute()
    if not (hf / "config.json").is_file():
        raise ConversionError(f"--hf {hf}: no config.json (give a local Hugging Face model directory)")
    if not (hf / "tokenizer.json").is_file():
        raise ConversionError(f"--hf {hf}: no tokenizer.json (a fast tokenizer is needed; "
                              f"AutoTokenizer.from_pretrained(...).save_pretrained(DIR) writes one)")
    cfg = _read_json(hf / "config.json")
    # gpt-oss's released experts are MXFP4: dequantized to bf16 (exact) as each is read
    quantized = mxfp4.check_quantization(cfg) == "mxfp4"
    _fresh(out, "--out")

    def tensors():
        found = safetensors.Tensors(hf)
        return mxfp4.Dequantized(found, safetensors.DTYPES["BF16"]) if quantized else found
    if quantized:
        log(f"{hf.name}: MXFP4 experts (quantization_config), dequantized to bfloat16")
    return _import(hf.name, str(hf), cfg, hf, tensors, out, config_path, overrides, log,
                   where=str(hf / "config.json"))


def import_gguf(path: str | pathlib.Path, out: str | pathlib.Path,
                config_path: str = "configs/base.py", overrides=(),
                log: Callable[[str], None] = print) -> pathlib.Path:
    """Writes a run directory at ``out`` from a llama.cpp GGUF file (hf/gguf_file.py): its
    weights dequantized to float32, its tokenizer rebuilt, its chat template kept."""
    import tempfile

    from hf.gguf_file import GGUFFile
    out = pathlib.Path(out).expanduser().absolute()
    f = GGUFFile(path)
    _fresh(out, "--out")
    with tempfile.TemporaryDirectory() as side:  # the file as an HF directory without weights
        side = pathlib.Path(side)
        f.write_side_files(side)
        (side / "tokenizer.json").write_text(f.tokenizer().to_str())
        return _import(f.path.name, str(f.path), f.config, side, lambda: f.tensors, out,
                       config_path, overrides, log)


def _import(name: str, source: str, cfg: dict, side: pathlib.Path, tensors, out: pathlib.Path,
            config_path: str, overrides, log, where: str | None = None) -> pathlib.Path:
    """The run directory from an HF config, a directory holding tokenizer.json and the side
    files, and ``tensors()`` (HF names -> arrays). ``where``: what a config error names."""
    import jax

    from configs.loading import load, set_field
    from data.tokenizer import fingerprint, load as load_tokenizer
    from model import pattern, rope
    fields = hf_config.model_fields(cfg)
    config = load(config_path)
    scaling = fields.pop("rope_scaling")
    config.model.update(fields)
    config.model.rope_scaling.update(scaling)
    for item in overrides:  # after the HF fields: the user's word wins (e.g. a new rope_theta)
        dotted, eq, text = item.partition("=")
        if not eq:
            raise ConversionError(f"--config.{item} is not --config.FIELD=VALUE")
        set_field(config, dotted, text)
    problem = rope.check(rope.from_config(config.model))  # the RoPE the run will have
    if problem:
        raise ConversionError(f"{where or source}: model.{problem}")
    problem = pattern.check(config.model)  # the layers' kinds, after the user's word too
    if problem:
        raise ConversionError(f"{where or source}: {problem}")
    tokenizer = load_tokenizer(str(side / "tokenizer.json"), config.model.vocab_size)
    arch = (cfg.get("architectures") or ["?"])[0]
    # a multimodal checkpoint: its language model's tensors, what is left out named in a line
    found, left_out = weights.language_model(tensors(), arch)
    params = weights.params_from_hf(found, config.model)
    if left_out:
        cap = (cfg.get("text_config") or {}).get("final_logit_softcapping")
        log(left_out + (f"; its text_config's final_logit_softcapping={cap} is left out too, as "
                        f"{arch} never applies it" if cap else ""))
    for line in hf_config.left_out(cfg):
        log(line)
    config.data.tokenizer = str(out / "tokenizer.json")
    max_pos = hf_config.read(cfg).get("max_position_embeddings")
    if not any(o.startswith("data.seq_len=") for o in overrides) and max_pos:
        config.data.seq_len = int(max_pos)  # the context it was trained at
    config.name = f"{config.name}-{name}"

    out.mkdir(parents=True, exist_ok=True)
    fp = fingerprint(tokenizer)
    (out / "tokenizer.json").write_text(tokenizer.to_str())
    (out / "tokenizer_fingerprint.txt").write_text(fp + "\n")
    (out / "config.json").write_text(config.to_json_best_effort(indent=2) + "\n")
    (out / HF_DIR).mkdir()
    for file in SIDE_FILES:
        if (side / file).is_file():
            shutil.copyfile(side / file, out / HF_DIR / file)
    _save_params(out, params, config, fp, source)
    leaves = jax.tree.leaves(params)
    n = sum(a.size for a in leaves)
    m = config.model
    log(f"imported {name}: {n / 1e6:.1f}M parameters ({leaves[0].dtype}), {m.num_layers} "
        f"layers, {m.num_heads}/{m.num_kv_heads} heads, vocab {m.vocab_size}, rope_theta "
        f"{m.rope_theta:g}, rope scaling {m.rope_scaling.type}"
        + (", tied embeddings" if m.tie_embeddings else "")
        + (", q/k/v biases" if m.get("qkv_bias", False) and not m.get("o_bias", False)
           else ", q/k/v/o biases" if m.get("qkv_bias", False) else "")
        + (", attention sinks" if m.get("attention_sinks", False) else "")
        + ((", q/k norms over the whole projection"
            if str(m.get("qk_norm_scope", "head")) == "projection" else ", q/k norms")
           if m.get("qk_norm", False) else "")
        + (f", {m.moe.num_experts} experts of width {m.moe.expert_dim}, top {m.moe.top_k}"
           f"{' renormalised' if m.moe.renormalize and m.moe.router == 'softmax_topk' else ''}"
           f"{' (top-k logits, softmax)' if m.moe.router == 'topk_softmax' else ''}"
           f"{', router and expert biases, clamped unit' if m.moe.get('glu') == 'clamped' else ''}"
           f", aux_loss {m.moe.aux_loss:g}"
           if m.get("moe", None) is not None and m.moe.num_experts else "")
        + (", Gemma's block (1 + w norms, sandwich norms, scaled embeddings)"
           if m.get("sandwich_norms", False) else "")
        + (f", final logit soft-cap {m.final_logit_softcap:g}"
           if m.get("final_logit_softcap", 0.0) else "")
        + (f", layers {pattern.describe(m)}" if m.get("layer_types", "") else
           f", sliding window {m.sliding_window}" if m.get("sliding_window", 0) else "")
        + (f", local rope_theta {m.local_rope_theta:g}" if m.get("local_rope_theta", 0.0) else "")
        + f" -> {out}")
    return out


def _save_params(out: pathlib.Path, params: dict, config, fp: str, source: str, **meta):
    import ml_collections

    from checkpoints.manager import Checkpoints
    ckpt = ml_collections.ConfigDict({"keep": 1, "keep_every": 0, "async_save": False})
    ckpts = Checkpoints(out / "checkpoints", ckpt, log=lambda _: None)
    meta = {"config": json.loads(config.to_json_best_effort()), "tokenizer": fp,
            "params_only": True, "imported_from": source, **meta}
    ckpts.save(0, {"params": params}, {}, meta, force=True)
    ckpts.wait()
    ckpts.close()


def _hf_side_dir(run_dir: pathlib.Path) -> pathlib.Path | None:
    """The ``hf/`` files of this run, or of the run it started from (restore_from), if any."""
    d = run_dir
    for _ in range(8):  # a chain of runs, each started from the one before
        if (d / HF_DIR / "config.json").is_file():
            return d / HF_DIR
        try:
            src = json.loads((d / "config.json").read_text())["checkpoint"]["restore_from"]
        except (OSError, ValueError, KeyError, TypeError):
            return None
        if not src:
            return None
        d = pathlib.Path(src).expanduser().absolute()
        while d != d.parent and not (d / "config.json").is_file():
            d = d.parent  # restore_from may name checkpoints/ or one step inside the run
    return None


def _restore(run, step: int | None, need: str | None = None):
    """(the restored step, its params as numpy, the run's lora.Spec or None where its checkpoint
    holds no adapters). ``need`` (a flag): one line, before any array is read, for a run
    without adapters."""
    import jax

    from model import lora
    from model.decoder import single_device_params
    spec = lora.spec_of(run.config)
    held = run.checkpoints.holds_adapters(step)
    if held and spec is None:
        raise ConversionError(f"--run {run.directory}: its checkpoint holds LoRA adapters but its "
                              f"config.json has train.lora.rank=0; give config.json the train.lora "
                              f"the run trained with")
    abstract = single_device_params(run.config)
    if spec is not None and not held:  # a config asking for adapters its weights do not hold
        abstract, spec = lora.without_adapters(abstract), None
    if spec is None and need:
        raise ConversionError(f"{need}: {run.directory} has no LoRA adapters (train.lora.rank=0, "
                              f"or a checkpoint without them); export it without {need}")
    got = run.restore_params(abstract, step=step)
    return got, jax.device_get(got.params), spec


def _dtype(dtype: str, side: pathlib.Path | None) -> tuple[str, object]:
    """(--dtype resolved: auto is the imported model's, else bfloat16; its numpy dtype)."""
    import ml_dtypes
    if dtype not in DTYPES:
        raise ConversionError(f"--dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    if dtype == "auto":
        base = _read_json(side / "config.json") if side else None
        dtype = (base or {}).get("torch_dtype") or (base or {}).get("dtype") or "bfloat16"
        dtype = dtype if dtype in DTYPES else "bfloat16"
    return dtype, {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16,
                   "float16": np.float16}[dtype]


def export_hf(run_dir: str | pathlib.Path, out: str | pathlib.Path, dtype: str = "auto",
              step: int | None = None, max_shard_gb: float = 5.0,
              log: Callable[[str], None] = print, merge: bool = False) -> pathlib.Path:
    """Writes an HF directory at ``out`` from a run's checkpoint, of the architecture its model
    fields need (hf/config.py ``architecture``: LLaMA, Mistral, Qwen2, Qwen3, Gemma 3, SmolLM3,
    Mixtral, Qwen3-MoE or OLMoE; a combination none of them has is one line, before anything is
    read). A run with LoRA adapters is written merged (hf/peft.py ``merge``), and says so;
    ``merge`` (--merge) asks for that, and is one line for a run without adapters."""
    from checkpoints.rundir import open_run
    from hf import peft
    _dtype(dtype, None)
    out = pathlib.Path(out).expanduser().absolute()
    _fresh(out, "--out")
    run = open_run(run_dir, log=log)
    hf_config.architecture(run.config.model)
    got, params, spec = _restore(run, step, "--merge" if merge else None)
    if spec is not None:  # the HF names have no place for adapters: merged, never dropped
        params = peft.merge(params, spec)
        log(f"merged the LoRA adapters (rank {spec.rank}, scale {spec.scale:g}, on "
            f"{', '.join(spec.targets)}) into the weights"
            + ("" if merge else "; export --adapter writes them apart, in PEFT's format"))
    return _write_hf(run, params, got.step, out, dtype, max_shard_gb, log)


def _write_hf(run, params: dict, step: int, out: pathlib.Path, dtype: str, max_shard_gb: float,
              log, what: str = "") -> pathlib.Path:
    """The HF model directory of ``params`` (a base model's tree: no adapters) at ``out``."""
    from model import lora
    if lora.adapters_only(params):  # the HF names have no place for them: never dropped
        raise AssertionError("_write_hf: LoRA adapters reached the HF export unmerged")
    kind = hf_config.architecture(run.config.model)
    side = _hf_side_dir(run.directory)
    base = _read_json(side / "config.json") if side else None
    dtype, np_dtype = _dtype(dtype, side)
    m = run.config.model
    tensors = weights.hf_from_params(params, m, np_dtype)
    config = _model_config(run, m, dtype, base)
    out.mkdir(parents=True, exist_ok=True)
    safetensors.save_sharded(tensors, out, int(max_shard_gb * 2**30))
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if side and (side / "generation_config.json").is_file():
        shutil.copyfile(side / "generation_config.json", out / "generation_config.json")
    write_tokenizer(run, out, config["max_position_embeddings"])
    n = sum(int(np.prod(a.shape)) for a in tensors.values())
    log(f"exported {what}step {step} of {run.directory} as {hf_config.CONVERTS[kind]}: "
        f"{len(tensors)} tensors, {n / 1e6:.1f}M parameters in {dtype}, rope_theta "
        f"{m.rope_theta:g}, rope scaling {m.rope_scaling.type} -> {out}")
    return out


def _model_config(run, m, dtype: str, base: dict | None) -> dict:
    """The HF config.json an export of ``run`` writes."""
    from data.tokenizer import EOS_NAMES
    tok = run.tokenizer
    eos = next((tok.token_to_id(n) for n in EOS_NAMES if tok.token_to_id(n) is not None), None)
    bos_name = next((n for n in BOS_NAMES if tok.token_to_id(n) is not None), None)
    bos = tok.token_to_id(bos_name) if bos_name else None
    return hf_config.hf_config(m, seq_len=int(run.config.data.seq_len), dtype=dtype, base=base,
                               bos=bos, eos=eos)


# ------------------------------------------------------------------------- LoRA adapters (PEFT)

# base_model_name_or_path when the base's weights are nowhere in Hugging Face's format
NO_BASE = "unknown: export the base too (scripts/convert_hf.py export --adapter --base-out DIR)"


def export_adapter(run_dir: str | pathlib.Path, out: str | pathlib.Path, dtype: str = "auto",
                   step: int | None = None, base_out: str | pathlib.Path | None = None,
                   max_shard_gb: float = 5.0, log: Callable[[str], None] = print) -> pathlib.Path:
    """Writes a run's LoRA adapters as a PEFT adapter directory at ``out`` (hf/peft.py:
    adapter_config.json, adapter_model.safetensors, and the run's tokenizer), which
    ``peft.PeftModel.from_pretrained(base, out)`` loads over the base model. Its
    base_model_name_or_path is ``base_out`` where given (the run's frozen base written there, as
    export writes a model), else the Hugging Face directory the run's base was imported from
    when its weights are still that import's (no full fine-tune since), else ``NO_BASE``.
    ``dtype`` auto: float32 (the adapters train in float32)."""
    from checkpoints.rundir import open_run
    from hf import peft
    from model import lora
    dtype = "float32" if dtype == "auto" else dtype
    _, np_dtype = _dtype(dtype, None)
    out = pathlib.Path(out).expanduser().absolute()
    _fresh(out, "--out")
    if base_out is not None:
        base_out = pathlib.Path(base_out).expanduser().absolute()
        _fresh(base_out, "--base-out")
    run = open_run(run_dir, log=log)
    m = run.config.model
    hf_config.architecture(m)
    spec = lora.spec_of(run.config)
    if spec is not None:
        peft.peft_modules_to_save(spec, m)  # one line, before any array is read
    got, params, spec = _restore(run, step, "--adapter")
    tensors = peft.to_peft(params, spec, m, np_dtype)
    if base_out is not None:
        _write_hf(run, lora.without_adapters(params), got.step, base_out, "auto", max_shard_gb,
                  log, what="the frozen base of ")
        base = str(base_out)
    else:
        base = _base_source(run.directory)
        if base is None:
            log(f"the base of these adapters is not a Hugging Face directory this run knows (a run "
                f"trained in full, or an import whose source moved): base_model_name_or_path is a "
                f"placeholder; --base-out DIR writes the base too")
    held = str(run.config.train.lora.get("base_dtype", "float32"))
    if base is not None and base_out is None and held != "float32":
        log(f"train.lora.base_dtype={held}: the run trained these adapters over {base}'s weights "
            f"rounded to {held}; PEFT over {base} itself differs by that rounding (--base-out DIR "
            f"writes the rounded base)")
    cfg = peft.adapter_config(spec, m, base or NO_BASE)
    out.mkdir(parents=True, exist_ok=True)
    safetensors.save(tensors, out / peft.WEIGHTS)
    (out / peft.CONFIG).write_text(json.dumps(cfg, indent=2) + "\n")
    side = _hf_side_dir(run.directory)
    write_tokenizer(run, out, _model_config(
        run, m, dtype, _read_json(side / "config.json") if side else None)[
        "max_position_embeddings"])
    n = sum(int(np.prod(a.shape)) for a in tensors.values())
    log(f"exported the LoRA adapters of step {got.step} of {run.directory} in PEFT's format: rank "
        f"{spec.rank}, lora_alpha {spec.alpha:g}{' (rslora)' if spec.rslora else ''} on "
        f"{', '.join(spec.targets)}"
        + (f", modules_to_save {', '.join(cfg['modules_to_save'])}" if cfg["modules_to_save"]
           else "")
        + f"; {len(tensors)} tensors, {n / 1e6:.2f}M parameters in {dtype}, base {base or NO_BASE}"
        f" -> {out}")
    return out


def _import_meta(run_dir: pathlib.Path) -> dict:
    """The run metadata of an import's checkpoint (``imported_from``, ...), {} if unreadable."""
    from checkpoints.manager import Checkpoints
    try:
        ckpts = Checkpoints(run_dir / "checkpoints", log=lambda _: None)
        try:
            steps = ckpts.steps()
            return dict(ckpts._meta(steps[0])[0]) if steps else {}
        finally:
            ckpts.close()
    except Exception:  # no metadata: no source to name
        return {}


def _base_source(run_dir: pathlib.Path) -> str | None:
    """The Hugging Face directory whose weights a LoRA run's frozen base still is: the runs it
    started from, back to an import (its ``hf/``), each of them training adapters only; None
    where one trained every weight, the source is not a local directory, or the chain ends."""
    d = run_dir
    for _ in range(8):
        if (d / HF_DIR / "config.json").is_file():
            meta = _import_meta(d)
            src = meta.get("base_model") if "base_model" in meta else meta.get("imported_from")
            return src if src and pathlib.Path(src).is_dir() else None
        try:
            cfg = json.loads((d / "config.json").read_text())
            rank = int(((cfg.get("train") or {}).get("lora") or {}).get("rank", 0) or 0)
            src = cfg["checkpoint"]["restore_from"]
        except (OSError, ValueError, KeyError, TypeError):
            return None
        if not rank or not src:
            return None  # trained in full here (its base moved), or no run before it
        d = pathlib.Path(src).expanduser().absolute()
        while d != d.parent and not (d / "config.json").is_file():
            d = d.parent
    return None


def _check_base(cfg: dict, m, where: str):
    """One line where adapter_config.json's base model, when it is a local HF directory, has
    another shape than the run's model."""
    from checkpoints.compat import model_mismatch
    base = cfg.get("base_model_name_or_path")
    path = pathlib.Path(str(base)).expanduser() if base else None
    if path is None or not (path / "config.json").is_file():
        return
    try:
        base_cfg = json.loads((path / "config.json").read_text())
        arch = (base_cfg.get("architectures") or ["?"])[0]
        fields = hf_config.model_fields(base_cfg)
    except (OSError, ValueError) as e:
        if isinstance(e, ConversionError):
            raise ConversionError(f"{where}: its base model {path} is another architecture "
                                  f"({arch}): {e}") from None
        return
    diff = model_mismatch(fields, m)
    if diff:
        raise ConversionError(f"{where}: its base model {path} ({arch}) is not this run's model: "
                              f"{diff.replace('in the checkpoint', 'there')}")


def import_adapter(adapter: str | pathlib.Path, base_run: str | pathlib.Path,
                   out: str | pathlib.Path, overrides=(),
                   log: Callable[[str], None] = print) -> pathlib.Path:
    """Writes a run directory at ``out``: the run ``base_run``'s config with ``train.lora`` from
    the PEFT adapter directory ``adapter`` (hf/peft.py ``lora_fields``), its tokenizer and side
    files, and a step-0 weights-only checkpoint of its weights with the adapter's (its
    modules_to_save in place of the base's). ``train.py --config configs/sft.py:OUT`` trains the
    adapters on; scripts/generate.py --run OUT evaluates the model with them."""
    import jax

    from checkpoints.rundir import open_run
    from configs.loading import apply_overrides
    from errors import ConfigError
    from hf import peft
    from model import lora
    from model.decoder import single_device_params
    adapter = pathlib.Path(adapter).expanduser().absolute()
    out = pathlib.Path(out).expanduser().absolute()
    _fresh(out, "--out")
    cfg, tensors = peft.read(adapter)
    where = str(adapter / peft.CONFIG)
    run = open_run(base_run, log=log)
    if run.checkpoints.holds_adapters():
        raise ConversionError(f"--run {run.directory} holds LoRA adapters already: give the run "
                              f"of its base, or export --merge it and import that")
    m = run.config.model
    _check_base(cfg, m, where)
    fields, lines = peft.lora_fields(cfg, tensors, m, where)
    config = run.config.copy_and_resolve_references()
    config.train.lora.update(fields)
    apply_overrides(config, overrides)
    try:
        lora.check(config)
    except ConfigError as e:
        raise ConversionError(f"{where}: {e}") from None
    config.data.tokenizer = str(out / "tokenizer.json")
    config.checkpoint.restore_from = ""  # its own checkpoint holds every weight
    config.name = f"{config.name}-{adapter.name}"
    abstract = single_device_params(config)
    got = run.restore_params(lora.without_adapters(single_device_params(run.config)))
    params = peft.from_peft(tensors, fields, config.model, jax.device_get(got.params), abstract)
    want = jax.tree.map(lambda a: tuple(a.shape), abstract)
    if jax.tree.map(lambda a: tuple(np.shape(a)), params) != want:  # a bug, not the user's
        raise AssertionError("hf/peft.py from_peft: not the tree of the run's model")
    for line in lines:
        log(line)
    out.mkdir(parents=True)
    (out / "tokenizer.json").write_text(run.tokenizer.to_str())
    (out / "tokenizer_fingerprint.txt").write_text(run.fingerprint + "\n")
    (out / "config.json").write_text(config.to_json_best_effort(indent=2) + "\n")
    side = _hf_side_dir(run.directory)
    if side:
        (out / HF_DIR).mkdir()
        for file in SIDE_FILES:
            if (side / file).is_file():
                shutil.copyfile(side / file, out / HF_DIR / file)
    if (run.directory / "chat_template.jinja").is_file():  # what a chat run trained with
        shutil.copyfile(run.directory / "chat_template.jinja", out / "chat_template.jinja")
    _save_params(out, params, config, run.fingerprint, str(adapter),
                 base_run=str(run.directory), base_model=_base_source(run.directory) or "")
    spec = lora.spec_of(config)
    log(f"imported the LoRA adapter {adapter.name}: rank {spec.rank}, lora_alpha {spec.alpha:g}"
        f"{' (rslora)' if spec.rslora else ''} on {', '.join(spec.targets)}"
        + (f", modules_to_save {', '.join(spec.modules_to_save)}" if spec.modules_to_save else "")
        + f", over step {got.step} of {run.directory} -> {out} (train on: python train.py "
        f"--config configs/sft.py:{out} --workdir DIR)")
    return out
