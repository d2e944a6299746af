"""Hugging Face checkpoint directory <-> run directory.

Import writes what ``train.py`` leaves in a run directory: ``config.json`` (the given config,
model fields from HF, ``data.tokenizer`` pointing at the run's tokenizer), ``tokenizer.json``
and its fingerprint, ``checkpoints/0`` holding the parameters only (a weights-only start:
``--config.checkpoint.restore_weights_only=True``), and the HF side files in ``hf/`` for the
export. Parameters keep the checkpoint's dtype on disk (bf16 stays bf16) and become fp32 when
a run restores them. Export reads a run's newest checkpoint (or one step) and writes a
directory ``transformers.AutoModelForCausalLM`` / ``AutoTokenizer.from_pretrained`` load.
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


def _save_params(out: pathlib.Path, params: dict, config, fp: str, source: str):
    import ml_collections

    from checkpoints.manager import Checkpoints
    ckpt = ml_collections.ConfigDict({"keep": 1, "keep_every": 0, "async_save": False})
    ckpts = Checkpoints(out / "checkpoints", ckpt, log=lambda _: None)
    meta = {"config": json.loads(config.to_json_best_effort()), "tokenizer": fp,
            "params_only": True, "imported_from": source}
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


def export_hf(run_dir: str | pathlib.Path, out: str | pathlib.Path, dtype: str = "auto",
              step: int | None = None, max_shard_gb: float = 5.0,
              log: Callable[[str], None] = print) -> pathlib.Path:
    """Writes an HF directory at ``out`` from a run's checkpoint, of the architecture its model
    fields need (hf/config.py ``architecture``: LLaMA, Mistral, Qwen2, Qwen3, Gemma 3, SmolLM3,
    Mixtral, Qwen3-MoE or OLMoE; a combination none of them has is one line, before anything is
    read)."""
    import jax
    import ml_dtypes

    from checkpoints.rundir import open_run
    from data.tokenizer import EOS_NAMES
    from model.decoder import single_device_params
    if dtype not in DTYPES:
        raise ConversionError(f"--dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    out = pathlib.Path(out).expanduser().absolute()
    _fresh(out, "--out")
    run = open_run(run_dir, log=log)
    kind = hf_config.architecture(run.config.model)
    side = _hf_side_dir(run.directory)
    base = _read_json(side / "config.json") if side else None
    if dtype == "auto":
        dtype = (base or {}).get("torch_dtype") or (base or {}).get("dtype") or "bfloat16"
        dtype = dtype if dtype in DTYPES else "bfloat16"
    np_dtype = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}[dtype]
    got = run.restore_params(single_device_params(run.config), step=step)
    params = jax.device_get(got.params)
    m = run.config.model
    tensors = weights.hf_from_params(params, m, np_dtype)
    tok = run.tokenizer
    eos = next((tok.token_to_id(n) for n in EOS_NAMES if tok.token_to_id(n) is not None), None)
    bos_name = next((n for n in BOS_NAMES if tok.token_to_id(n) is not None), None)
    bos = tok.token_to_id(bos_name) if bos_name else None
    config = hf_config.hf_config(m, seq_len=int(run.config.data.seq_len), dtype=dtype, base=base,
                                 bos=bos, eos=eos)
    out.mkdir(parents=True, exist_ok=True)
    safetensors.save_sharded(tensors, out, int(max_shard_gb * 2**30))
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if side and (side / "generation_config.json").is_file():
        shutil.copyfile(side / "generation_config.json", out / "generation_config.json")
    write_tokenizer(run, out, config["max_position_embeddings"])
    n = sum(int(np.prod(a.shape)) for a in tensors.values())
    log(f"exported step {got.step} of {run.directory} as {hf_config.CONVERTS[kind]}: "
        f"{len(tensors)} tensors, {n / 1e6:.1f}M parameters in {dtype}, rope_theta "
        f"{m.rope_theta:g}, rope scaling {m.rope_scaling.type} -> {out}")
    return out
