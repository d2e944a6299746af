"""A llama.cpp GGUF file read as a Hugging Face checkpoint: its config (from the metadata), its
tensors under HF names (dequantized to float32 with llama.cpp's own ``gguf`` package), its
tokenizer rebuilt with ``tokenizers`` alone, and its chat template. hf/convert.import_gguf
writes a run directory from it, as import_hf does from an HF directory.

Two things differ from an HF checkpoint and are undone here:
- llama.cpp stores ``attn_q`` / ``attn_k`` with each head's rows interleaved for its rotary
  kernel (convert_hf_to_gguf.py's ``permute``); ``unpermute`` restores HF's order.
- The tokenizer is a list of tokens, merges and token types plus the name of a pre-tokenizer
  (``tokenizer.ggml.pre``) whose split rule lives in llama.cpp's C++ (llama-vocab.cpp). The
  rules this module knows are in ``PRE_TOKENIZERS``; another name is refused, since a wrong
  split gives other ids silently. ``smollm`` splits each digit off first, as SmolLM's own
  tokenizer.json does (transformers' GGUF tokenizer does not: its ids differ on digits).
  ``llama-bpe`` takes a word found whole in the vocabulary as one token and begins with BOS
  unless the file says otherwise, as llama.cpp and Meta's tokenizer.json do (transformers'
  GGUF tokenizer does neither).

The RoPE scaling is read as llama.cpp reads it: a factor without a type is linear scaling
(transformers' GGUF loader ignores the scaling of a llama file altogether).
"""
from __future__ import annotations

import json
import pathlib

import numpy as np

from errors import ConversionError

# general.architecture values that convert, and what they become.
ARCHITECTURES = {"llama": "LlamaForCausalLM"}
# Tensor types that dequantize (the gguf package's, K-quants included).
QUANT_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
               "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
# Llama 3's pre-tokenizer regex (llama.cpp LLAMA_VOCAB_PRE_TYPE_LLAMA3, tokenizer.json's Split)
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZERS = ("smollm", "llama-bpe")
CONTROL, USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values of special tokens

# GGUF tensor name (after "blk.N.") -> the HF name (after "model.layers.N.")
BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
TOP_NAMES = {"token_embd.weight": "model.embed_tokens.weight",
             "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}


def permute(w: np.ndarray, n: int) -> np.ndarray:
    """llama.cpp's order of a q or k projection [rows, cols] of ``n`` heads (HF -> GGUF)."""
    rows, cols = w.shape
    return w.reshape(n, 2, rows // n // 2, cols).swapaxes(1, 2).reshape(rows, cols)


def unpermute(w: np.ndarray, n: int) -> np.ndarray:
    """HF's order of a q or k projection read from GGUF (the inverse of ``permute``)."""
    rows, cols = w.shape
    return w.reshape(n, rows // n // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


class GGUFFile:
    """One GGUF file: ``config`` (an HF config dict), ``tensors`` (HF names -> float32
    arrays, read on demand), ``tokenizer()`` and ``side_files()``."""

    def __init__(self, path: str | pathlib.Path):
        self.path = pathlib.Path(path).expanduser().absolute()
        if not self.path.is_file():
            raise ConversionError(f"--gguf {self.path}: no such file")
        try:
            import gguf
        except ImportError:
            raise ConversionError("--gguf needs llama.cpp's gguf package: pip install -r "
                                  "requirements-eval.txt") from None
        with open(self.path, "rb") as f:
            magic = f.read(4)
        if magic != b"GGUF":
            raise ConversionError(f"--gguf {self.path}: not a GGUF file (it starts with "
                                  f"{magic!r}, not b'GGUF')")
        try:
            self.reader = gguf.GGUFReader(str(self.path))
        except Exception as e:  # a truncated or damaged file: the reader's own words
            raise ConversionError(f"--gguf {self.path}: cannot be read as GGUF "
                                  f"({type(e).__name__}: {e}); is the file complete?") from None
        self.arch = self._get("general.architecture")
        if self.arch not in ARCHITECTURES:
            raise ConversionError(f"--gguf {self.path}: architecture {self.arch!r} does not "
                                  f"convert; {', '.join(ARCHITECTURES)} does")
        self._by_name = {t.name: t for t in self.reader.tensors}
        for t in self.reader.tensors:
            if t.tensor_type.name not in QUANT_TYPES:
                raise ConversionError(f"--gguf {self.path}: tensor {t.name} is of type "
                                      f"{t.tensor_type.name}, which does not dequantize here; "
                                      f"these do: {', '.join(QUANT_TYPES)}")
        if "rope_freqs.weight" in self._by_name:
            raise ConversionError(f"--gguf {self.path}: per-frequency RoPE factors "
                                  f"(rope_freqs.weight, Llama 3.1's scaling) do not convert")
        self.config = self._config()
        self.tensors = _Tensors(self)

    # -- metadata ----------------------------------------------------------------------------
    def _get(self, key: str, default=None):
        field = self.reader.fields.get(key)
        if field is None:
            return default
        value = field.contents()
        return value

    def _arch(self, key: str, default=None):
        return self._get(f"{self.arch}.{key}", default)

    def _need(self, key: str):
        value = self._arch(key)
        if value is None:
            raise ConversionError(f"--gguf {self.path}: no {self.arch}.{key} in its metadata")
        return value

    def _config(self) -> dict:
        heads = int(self._need("attention.head_count"))
        d = int(self._need("embedding_length"))
        tokens = self._get("tokenizer.ggml.tokens") or []
        cfg = {
            "architectures": [ARCHITECTURES[self.arch]], "model_type": self.arch,
            "hidden_size": d, "intermediate_size": int(self._need("feed_forward_length")),
            "num_hidden_layers": int(self._need("block_count")),
            "num_attention_heads": heads,
            "num_key_value_heads": int(self._arch("attention.head_count_kv", heads)),
            "head_dim": int(self._arch("attention.key_length", 0) or
                            self._arch("rope.dimension_count", 0) or d // heads),
            "rms_norm_eps": float(self._arch("attention.layer_norm_rms_epsilon", 1e-5)),
            "rope_theta": float(self._arch("rope.freq_base", 10000.0)),
            "max_position_embeddings": int(self._arch("context_length", 2048)),
            "vocab_size": int(self._arch("vocab_size", 0) or len(tokens)),
            "tie_word_embeddings": "output.weight" not in self._by_name,
            "hidden_act": "silu", "attention_bias": False,
            "bos_token_id": self._get("tokenizer.ggml.bos_token_id"),
            "eos_token_id": self._get("tokenizer.ggml.eos_token_id"),
            "torch_dtype": "float32",
        }
        scaling = self._rope_scaling(cfg["max_position_embeddings"])
        if scaling:
            cfg["rope_scaling"] = scaling
        return cfg

    def _rope_scaling(self, context: int) -> dict | None:
        """The RoPE scaling as llama.cpp reads it (src/llama-model.cpp ``load_hparams``, the
        ``llama_context`` constructor in src/llama-context.cpp): the type defaults to linear, the
        factor is ``rope.scaling.factor`` or else the older ``rope.scale_linear`` (0 or absent:
        unscaled), type ``none`` never scales, and YaRN's original context defaults to the
        training context. A file that states only a factor is a linear one, so reading the
        type alone would import it unscaled: wrong logits at every position.

        transformers' GGUF loader (modeling_gguf_pytorch_utils.load_gguf_checkpoint) reads no
        rope.scaling key for a llama file (only for gpt-oss), so it loads every scaled llama
        GGUF unscaled; llama.cpp is the reference here. The yarn_beta_* / yarn_ext_factor
        keys are not read for the llama architecture by llama.cpp either (its defaults 32, 1
        and full ramp are transformers' yarn defaults, and its net cos/sin scale is their
        0.1 ln(factor) + 1), so they are not read here."""
        where = f"--gguf {self.path}: {self.arch}.rope"
        kind = self._arch("rope.scaling.type", "linear")
        key = "scaling.factor" if self._arch("rope.scaling.factor") is not None else "scale_linear"
        factor = float(self._arch(f"rope.{key}") or 0.0)
        attn = float(self._arch("rope.scaling.attn_factor", 1.0))
        if kind not in ("none", "linear", "yarn"):
            raise ConversionError(f"{where}.scaling.type={kind!r} does not convert; none, "
                                  f"linear and yarn do")
        if attn != 1.0:  # llama.cpp multiplies every rotation by it; no HF field says that
            raise ConversionError(f"{where}.scaling.attn_factor={attn:g} does not convert; "
                                  f"only 1 (or no such key) does")
        if kind == "none" or factor in (0.0, 1.0):
            return None
        if factor < 1.0:
            raise ConversionError(f"{where}.{key}={factor:g} does not convert; a factor >= 1 "
                                  f"does (0 or no such key: unscaled)")
        if kind == "linear":
            return {"rope_type": "linear", "factor": factor}
        original = int(self._arch("rope.scaling.original_context_length", 0) or 0)
        return {"rope_type": "yarn", "factor": factor,
                "original_max_position_embeddings": original or context}

    # -- tokenizer ---------------------------------------------------------------------------
    def tokenizer(self):
        """The tokenizer as a ``tokenizers.Tokenizer``, ids as in the file."""
        from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
        kind, pre = self._get("tokenizer.ggml.model"), self._get("tokenizer.ggml.pre")
        if kind != "gpt2":
            raise ConversionError(f"--gguf {self.path}: tokenizer.ggml.model {kind!r} does not "
                                  f"convert; gpt2 (byte-level BPE) does")
        if pre not in PRE_TOKENIZERS:
            raise ConversionError(f"--gguf {self.path}: pre-tokenizer {pre!r} is not known "
                                  f"here (its split rule would change the ids); known: "
                                  f"{', '.join(PRE_TOKENIZERS)}")
        tokens = list(self._get("tokenizer.ggml.tokens"))
        types = list(self._get("tokenizer.ggml.token_type") or [1] * len(tokens))
        merges = [tuple(m.split(" ", 1)) for m in self._get("tokenizer.ggml.merges") or []]
        # llama.cpp's llama-bpe takes a piece found whole in the vocabulary as one token before
        # any merge (llama-vocab.cpp: ignore_merges), as Meta's tokenizer.json does; smollm not
        tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                                   fuse_unk=False, byte_fallback=False,
                                   ignore_merges=pre == "llama-bpe"))
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=pre == "smollm")
        if pre == "smollm":  # llama.cpp: "\p{N}" first, then GPT-2's regex
            split = pre_tokenizers.Digits(individual_digits=True)
        else:
            split = pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated", invert=False)
        tok.pre_tokenizer = pre_tokenizers.Sequence([split, byte_level])
        tok.decoder = decoders.ByteLevel()
        special = [AddedToken(t, special=True, normalized=False)
                   for t, k in zip(tokens, types) if k == CONTROL]
        user = [AddedToken(t, special=False, normalized=False)
                for t, k in zip(tokens, types) if k == USER_DEFINED]
        tok.add_special_tokens(special)
        if user:
            tok.add_tokens(user)
        if self._add_bos():
            from tokenizers import processors
            bos_id = self._get("tokenizer.ggml.bos_token_id")
            if bos_id is None or not 0 <= int(bos_id) < len(tokens):
                raise ConversionError(
                    f"--gguf {self.path}: its texts begin with BOS (tokenizer.ggml.add_bos_token"
                    f", or pre-tokenizer {pre}'s default) but tokenizer.ggml.bos_token_id is "
                    f"{'missing' if bos_id is None else bos_id}; a token id below {len(tokens)} "
                    f"is needed")
            bos = tokens[int(bos_id)]
            tok.post_processor = processors.TemplateProcessing(
                single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                special_tokens=[(bos, int(bos_id))])
        return tok

    def _add_bos(self) -> bool:
        """Whether a text's ids begin with BOS: the file's tokenizer.ggml.add_bos_token, else
        llama.cpp's default for the pre-tokenizer (llama-vocab.cpp: llama-bpe adds it, smollm
        does not). transformers' GGUF tokenizer defaults to BOS only for a sentencepiece file,
        so it adds none to a llama-bpe file without the key; llama.cpp is the reference."""
        add = self._get("tokenizer.ggml.add_bos_token")
        return bool(add) if add is not None else self._get("tokenizer.ggml.pre") == "llama-bpe"

    def side_files(self) -> dict[str, dict]:
        """The HF side files of the checkpoint (json contents by file name): its config,
        tokenizer_config.json (end-of-text and begin-of-text tokens, the chat template) and
        generation_config.json."""
        tokens = self._get("tokenizer.ggml.tokens") or []
        name = lambda key: (tokens[int(self._get(key))]  # noqa: E731
                            if self._get(key) is not None and int(self._get(key)) < len(tokens)
                            else None)
        tok_cfg = {"tokenizer_class": "PreTrainedTokenizerFast",
                   "bos_token": name("tokenizer.ggml.bos_token_id"),
                   "eos_token": name("tokenizer.ggml.eos_token_id"),
                   "pad_token": name("tokenizer.ggml.padding_token_id"),
                   "add_bos_token": self._add_bos(),
                   "model_max_length": self.config["max_position_embeddings"]}
        template = self._get("tokenizer.chat_template")
        if template:
            tok_cfg["chat_template"] = template
        gen = {k: self.config[k] for k in ("bos_token_id", "eos_token_id")
               if self.config[k] is not None}
        return {"config.json": self.config,
                "tokenizer_config.json": {k: v for k, v in tok_cfg.items() if v is not None},
                "generation_config.json": gen}

    def write_side_files(self, directory: pathlib.Path):
        for file, content in self.side_files().items():
            (directory / file).write_text(json.dumps(content, indent=2) + "\n")


class _Tensors:
    """HF-named float32 arrays of a GGUFFile, as hf/safetensors.Tensors serves them."""

    def __init__(self, f: GGUFFile):
        self.f = f
        self._names = {}
        for name in f._by_name:
            hf = TOP_NAMES.get(name)
            if hf is None and name.startswith("blk."):
                _, layer, rest = name.split(".", 2)
                if rest in BLOCK_NAMES:
                    hf = f"model.layers.{layer}.{BLOCK_NAMES[rest]}"
            self._names[hf or name] = name  # an unknown one keeps its name: weights.py names it

    def names(self) -> list[str]:
        return list(self._names)

    def __contains__(self, name: str) -> bool:
        return name in self._names

    def __getitem__(self, name: str) -> np.ndarray:
        from gguf import quants
        t = self.f._by_name[self._names[name]]
        try:
            w = np.asarray(quants.dequantize(t.data, t.tensor_type), np.float32)
        except Exception as e:
            raise ConversionError(f"--gguf {self.f.path}: tensor {t.name} "
                                  f"({t.tensor_type.name}) does not dequantize: {e}") from None
        w = w.reshape([int(n) for n in reversed(t.shape)])  # GGUF lists dimensions inner first
        c = self.f.config
        if name.endswith("self_attn.q_proj.weight"):
            w = unpermute(w, c["num_attention_heads"])
        elif name.endswith("self_attn.k_proj.weight"):
            w = unpermute(w, c["num_key_value_heads"])
        return w
