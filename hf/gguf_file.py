"""A llama.cpp GGUF file read as a Hugging Face checkpoint: its config (from the metadata), its
tensors under HF names (dequantized to float32), its tokenizer rebuilt with ``tokenizers``
alone, and its chat template. hf/convert.import_gguf writes a run directory from it, as
import_hf does from an HF directory.

The file is read here (``read_layout``: struct over one mmap of it) and dequantized here
(``dequantize``: numpy over the whole tensor), each value bit for bit what llama.cpp's own
``gguf`` package (GGUFReader, gguf.quants.dequantize) gives; tests/test_gguf_file.py compares
the two. The package's reader builds a numpy view per string of the vocabulary and merges and
its dequantizer works 16 rows at a time: several seconds for a 135M model, this a fraction.

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
import math
import mmap
import pathlib
import struct
from typing import NamedTuple

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


# -- the file: header, metadata and tensor infos (GGUF v2/v3, gguf/gguf_reader.py's reading) --
# ggml tensor type id -> (name, elements per block, bytes per block): ggml.h, gguf.constants
GGML_TYPES = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 40),
    10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110), 12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74), 18: ("IQ3_XXS", 256, 98),
    19: ("IQ1_S", 256, 50), 20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110),
    22: ("IQ2_S", 256, 82), 23: ("IQ4_XS", 256, 136), 24: ("I8", 1, 1), 25: ("I16", 1, 2),
    26: ("I32", 1, 4), 27: ("I64", 1, 8), 28: ("F64", 1, 8), 29: ("IQ1_M", 256, 56),
    30: ("BF16", 1, 2), 34: ("TQ1_0", 256, 54), 35: ("TQ2_0", 256, 66), 39: ("MXFP4", 32, 17),
    40: ("NVFP4", 64, 36), 41: ("Q1_0", 128, 18),
}
TYPE_IDS = {name: kind for kind, (name, _, _) in GGML_TYPES.items()}
# GGUF metadata value types (gguf.constants.GGUFValueType): the scalars' struct formats
SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
           12: "d"}
STRING, ARRAY, UINT32 = 8, 9, 4
DEFAULT_ALIGNMENT = 32
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")


class TensorInfo(NamedTuple):
    """One tensor of a GGUF file: ``shape`` as GGUF lists it (innermost dimension first),
    ``offset`` and ``n_bytes`` its data's place in the file."""
    name: str
    type: str
    shape: tuple[int, ...]
    offset: int
    n_bytes: int


class Layout(NamedTuple):
    """What a GGUF file's header says: ``metadata`` key -> value, its strings still bytes (an
    array of arrays flattened, as gguf's ReaderField.contents does); ``decode`` turns one into
    what gguf's ``contents()`` gives."""
    version: int
    metadata: dict
    tensors: list[TensorInfo]
    data_offset: int


class BigEndian(ValueError):
    """A big-endian GGUF file (its version reads 0 in the low 16 bits, little-endian)."""


class _Text(bytes):
    """A string value of the metadata, undecoded until asked for (as gguf decodes)."""


def decode(value):
    """A metadata value as gguf's ``ReaderField.contents()`` gives it: str for a string, a
    list for an array, else the Python scalar."""
    if isinstance(value, _Text):
        return str(value, "utf-8")
    if isinstance(value, list):
        return [str(v, "utf-8") if isinstance(v, _Text) else v for v in value]
    return value


def read_layout(buf, size: int) -> Layout:
    """The header, metadata and tensor infos of the GGUF file in ``buf`` (``size`` bytes: a
    bytes object or an mmap). Raises ValueError (or struct.error) where the file is damaged
    or cut short, as gguf's GGUFReader does."""
    def need(pos: int, n: int, what: str):
        if n < 0 or pos + n > size:
            raise ValueError(f"{what} at byte {pos} needs {n} bytes, past the end of the file "
                             f"({size} bytes)")

    def text(pos: int) -> tuple[_Text, int]:
        n = _U64.unpack_from(buf, pos)[0]
        need(pos + 8, n, "a string")
        return _Text(buf[pos + 8:pos + 8 + n]), pos + 8 + n

    def value(kind: int, pos: int):
        fmt = SCALARS.get(kind)
        if fmt is not None:
            return struct.unpack_from("<" + fmt, buf, pos)[0], pos + struct.calcsize(fmt)
        if kind == STRING:
            return text(pos)
        if kind != ARRAY:
            raise ValueError(f"unknown metadata value type {kind} at byte {pos}")
        sub, count = struct.unpack_from("<IQ", buf, pos)
        pos += 12
        fmt = SCALARS.get(sub)
        if fmt is not None:  # one numpy read: tolist() gives gguf's Python values
            n = count * struct.calcsize(fmt)
            need(pos, n, "an array")
            items = np.frombuffer(buf, np.dtype("<" + fmt), int(count), pos).tolist()
            return items, pos + n
        if sub == STRING:  # the vocabulary and merges: [u64 length][bytes] each
            items, unpack = [], _U64.unpack_from
            for _ in range(count):
                n = unpack(buf, pos)[0]
                pos += 8
                items.append(_Text(buf[pos:pos + n]))
                pos += n
            need(pos, 0, "an array of strings")
            return items, pos
        items = []
        for _ in range(count):  # arrays of arrays: flattened, as gguf's contents() does
            v, pos = value(sub, pos)
            items.extend(v if isinstance(v, list) else [v])
        return items, pos

    if size < 24 or bytes(buf[:4]) != b"GGUF":
        raise ValueError("GGUF magic invalid, or the file ends within its first 24 bytes")
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
    if version & 0xFFFF == 0:
        raise BigEndian()
    if version not in (2, 3):
        raise ValueError(f"file appears to be version {version}, which is not 2 or 3")
    pos, metadata, kinds = 24, {}, {}
    for _ in range(n_kv):
        key, pos = text(pos)
        key = str(key, "utf-8")
        if key in metadata:
            raise ValueError(f"duplicate key {key} at byte {pos}")
        kinds[key] = _U32.unpack_from(buf, pos)[0]
        metadata[key], pos = value(kinds[key], pos + 4)
    tensors, names = [], set()
    for _ in range(n_tensors):
        name, pos = text(pos)
        name = str(name, "utf-8")
        if name in names:
            raise ValueError(f"duplicated tensor name {name}")
        names.add(name)
        n_dims = _U32.unpack_from(buf, pos)[0]
        need(pos + 4, 8 * n_dims, f"tensor {name}'s dimensions")
        dims = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
        pos += 4 + 8 * len(dims)
        kind, offset = struct.unpack_from("<IQ", buf, pos)
        pos += 12
        if kind not in GGML_TYPES:
            raise ValueError(f"tensor {name} is of unknown type {kind}")
        type_name, block, type_size = GGML_TYPES[kind]
        if dims and dims[0] % block:
            raise ValueError(f"tensor {name}: its row size ({dims[0]}) is not a multiple of "
                             f"{type_name} block size ({block})")
        tensors.append(TensorInfo(name, type_name, dims, offset,
                                  math.prod(dims) * type_size // block))
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if "general.alignment" in metadata and kinds["general.alignment"] != UINT32:
        raise ValueError("Bad type for general.alignment field")
    if alignment == 0 or alignment & (alignment - 1):
        raise ValueError("Invalid alignment: must be a non-zero power of two")
    data_offset = pos + -pos % alignment
    for t in tensors:
        need(data_offset + t.offset, t.n_bytes, f"tensor {t.name}'s data")
    return Layout(version, metadata, tensors, data_offset)


# -- dequantization: gguf/quants.py's dequantize_blocks, over every block of a tensor at once --
def _blocks(raw: np.ndarray, *fields) -> np.ndarray:
    """``raw`` (uint8 bytes of whole blocks) as a structured array of blocks."""
    return raw.view(np.dtype(list(fields)))


def _f32(half: np.ndarray) -> np.ndarray:
    return half.astype(np.float32)[:, None]


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[n, k] bytes -> [n, 2k]: the k low nibbles, then the k high ones."""
    q = np.empty((qs.shape[0], 2, qs.shape[1]), np.uint8)
    np.bitwise_and(qs, 15, out=q[:, 0])
    np.right_shift(qs, 4, out=q[:, 1])
    return q.reshape(qs.shape[0], -1)


def _q5(b: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1's 5-bit values: the nibbles, bit i of qh on top of value i."""
    high = np.unpackbits(b["qh"], axis=-1, bitorder="little")
    return _nibbles(b["qs"]) | (high << np.uint8(4))


def _scale_min_k4(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 6-bit scales and mins ([n, 12] bytes -> two [n, 8])."""
    s = scales.reshape(-1, 3, 4)
    d, m, m_d = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def _dequantize_blocks(raw: np.ndarray, kind: str) -> np.ndarray:
    n = raw.size // GGML_TYPES[TYPE_IDS[kind]][2]
    if kind == "Q8_0":
        b = _blocks(raw, ("d", "<f2"), ("qs", "i1", 32))
        return np.multiply(b["qs"], _f32(b["d"]), dtype=np.float32)
    if kind in ("Q4_0", "Q4_1"):
        b = _blocks(raw, ("d", "<f2"), *([("m", "<f2")] if kind == "Q4_1" else []),
                    ("qs", "u1", 16))
        q = _nibbles(b["qs"])
        if kind == "Q4_0":  # int8 q - 8, in float32, times d
            return np.multiply((q - np.uint8(8)).view(np.int8), _f32(b["d"]), dtype=np.float32)
        out = np.multiply(q, _f32(b["d"]), dtype=np.float32)  # d * q + m
        out += _f32(b["m"])
        return out
    if kind in ("Q5_0", "Q5_1"):
        b = _blocks(raw, ("d", "<f2"), *([("m", "<f2")] if kind == "Q5_1" else []),
                    ("qh", "u1", 4), ("qs", "u1", 16))
        q = _q5(b)
        if kind == "Q5_0":
            return np.multiply((q - np.uint8(16)).view(np.int8), _f32(b["d"]), dtype=np.float32)
        out = np.multiply(q, _f32(b["d"]), dtype=np.float32)
        out += _f32(b["m"])
        return out
    if kind == "Q2_K":
        b = _blocks(raw, ("scales", "u1", 16), ("qs", "u1", 64), ("d", "<f2"), ("dmin", "<f2"))
        scales = b["scales"]
        dl = (_f32(b["d"]) * (scales & 0xF).astype(np.float32)).reshape(n, 16, 1)
        ml = (_f32(b["dmin"]) * (scales >> 4).astype(np.float32)).reshape(n, 16, 1)
        shift = np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
        q = ((b["qs"].reshape(n, -1, 1, 32) >> shift) & np.uint8(3)).reshape(n, 16, 16)
        return _scale_less_min(dl, q, ml, n)
    if kind == "Q3_K":
        b = _blocks(raw, ("hmask", "u1", 32), ("qs", "u1", 64), ("scales", "u1", 12),
                    ("d", "<f2"))
        low = (b["scales"][:, :8].reshape(n, 1, 8)
               >> np.array([0, 4], np.uint8).reshape(1, 2, 1)).reshape(n, 16)
        high = (b["scales"][:, 8:].reshape(n, 1, 4)
                >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 4, 1)).reshape(n, 16)
        scales = (low & np.uint8(0x0F)) | ((high & np.uint8(0x03)) << np.uint8(4))
        scales = (scales.astype(np.int8) - np.int8(32)).astype(np.float32)
        dl = (_f32(b["d"]) * scales).reshape(n, 16, 1)
        ql = (b["qs"].reshape(n, -1, 1, 32)
              >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)).reshape(n, 16, 16)
        qh = (b["hmask"].reshape(n, -1, 1, 32)
              >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)).reshape(n, 16, 16)
        ql &= np.uint8(3)
        qh &= np.uint8(1)
        qh ^= np.uint8(1)  # the offset is 4 where the mask bit is 0
        q = ql.astype(np.int8) - (qh << np.uint8(2)).astype(np.int8)
        return np.multiply(dl, q, dtype=np.float32).reshape(n, -1)
    if kind in ("Q4_K", "Q5_K"):
        b = _blocks(raw, ("d", "<f2"), ("dmin", "<f2"), ("scales", "u1", 12),
                    *([("qh", "u1", 32)] if kind == "Q5_K" else []), ("qs", "u1", 128))
        sc, mn = _scale_min_k4(b["scales"])
        d = (_f32(b["d"]) * sc.astype(np.float32)).reshape(n, -1, 1)
        dm = (_f32(b["dmin"]) * mn.astype(np.float32)).reshape(n, -1, 1)
        q = (b["qs"].reshape(n, -1, 1, 32)
             >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)).reshape(n, -1, 32)
        q &= np.uint8(0x0F)
        if kind == "Q5_K":
            qh = (b["qh"].reshape(n, -1, 1, 32)
                  >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)).reshape(n, -1, 32)
            q |= (qh & np.uint8(1)) << np.uint8(4)
        return _scale_less_min(d, q, dm, n)
    if kind == "Q6_K":
        b = _blocks(raw, ("ql", "u1", 128), ("qh", "u1", 64), ("scales", "i1", 16),
                    ("d", "<f2"))
        d = (_f32(b["d"]) * b["scales"].astype(np.float32)).reshape(n, 16, 1)
        ql = (b["ql"].reshape(n, -1, 1, 64)
              >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)).reshape(n, -1, 32)
        qh = (b["qh"].reshape(n, -1, 1, 32)
              >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)).reshape(n, -1, 32)
        q = (ql & np.uint8(0x0F)) | ((qh & np.uint8(0x03)) << np.uint8(4))
        q = (q.view(np.int8) - np.int8(32)).reshape(n, 16, 16)
        return np.multiply(d, q, dtype=np.float32).reshape(n, -1)
    raise NotImplementedError(f"dequantization of {kind} is not implemented here")


def _scale_less_min(d, q, m, n: int):
    """The k-quants' ``d * q - m`` per sub-block in float32, in that order (the gguf package's),
    as ``n`` rows."""
    out = np.multiply(d, q, dtype=np.float32)
    out -= m
    return out.reshape(n, -1)


def dequantize(raw: np.ndarray, kind: str) -> np.ndarray:
    """The float32 values (flat) of a tensor's bytes ``raw`` (uint8, whole blocks) of ggml type
    ``kind`` (one of QUANT_TYPES): bit for bit gguf.quants.dequantize's."""
    raw = np.ascontiguousarray(raw, np.uint8).reshape(-1)
    if kind == "F32":
        return raw.view("<f4")
    if kind == "F16":
        return raw.view("<f2").astype(np.float32)
    if kind == "BF16":  # the 16 bits on top of a float32's
        bits = raw.view("<u2").astype(np.uint32)
        bits <<= np.uint32(16)
        return bits.view(np.float32)
    if raw.size % GGML_TYPES[TYPE_IDS[kind]][2]:
        raise ValueError(f"{raw.size} bytes are not whole {kind} blocks")
    return _dequantize_blocks(raw, kind).reshape(-1)


class GGUFFile:
    """One GGUF file: ``config`` (an HF config dict), ``tensors`` (HF names -> float32
    arrays, read on demand), ``tokenizer()`` and ``side_files()``."""

    def __init__(self, path: str | pathlib.Path):
        self.path = pathlib.Path(path).expanduser().absolute()
        if not self.path.is_file():
            raise ConversionError(f"--gguf {self.path}: no such file")
        with open(self.path, "rb") as f:
            magic = f.read(4)
            if magic != b"GGUF":
                raise ConversionError(f"--gguf {self.path}: not a GGUF file (it starts with "
                                      f"{magic!r}, not b'GGUF')")
            # the whole file, mapped once: the tensors' bytes are read from it on demand
            self._buffer = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            self.layout = read_layout(self._buffer, len(self._buffer))
        except BigEndian:
            raise ConversionError(f"--gguf {self.path}: a big-endian GGUF file does not "
                                  f"convert; a little-endian one does") from None
        except Exception as e:  # a truncated or damaged file: the reader's own words
            raise ConversionError(f"--gguf {self.path}: cannot be read as GGUF "
                                  f"({type(e).__name__}: {e}); is the file complete?") from None
        self._values: dict = {}  # decoded metadata values, by key
        self.arch = self._get("general.architecture")
        if self.arch not in ARCHITECTURES:
            raise ConversionError(f"--gguf {self.path}: architecture {self.arch!r} does not "
                                  f"convert; {', '.join(ARCHITECTURES)} does")
        self._by_name = {t.name: t for t in self.layout.tensors}
        for t in self.layout.tensors:
            if t.type not in QUANT_TYPES:
                raise ConversionError(f"--gguf {self.path}: tensor {t.name} is of type "
                                      f"{t.type}, which does not dequantize here; "
                                      f"these do: {', '.join(QUANT_TYPES)}")
        if "rope_freqs.weight" in self._by_name:
            raise ConversionError(f"--gguf {self.path}: per-frequency RoPE factors "
                                  f"(rope_freqs.weight, Llama 3.1's scaling) do not convert")
        self.config = self._config()
        self.tensors = _Tensors(self)

    # -- metadata ----------------------------------------------------------------------------
    def _get(self, key: str, default=None):
        """The metadata value of ``key`` as gguf's ``ReaderField.contents()`` gives it."""
        if key not in self.layout.metadata:
            return default
        if key not in self._values:
            self._values[key] = decode(self.layout.metadata[key])
        value = self._values[key]
        return list(value) if isinstance(value, list) else value

    def raw(self, t: TensorInfo) -> np.ndarray:
        """Tensor ``t``'s bytes in the file (a read-only uint8 view)."""
        return np.frombuffer(self._buffer, np.uint8, t.n_bytes, self.layout.data_offset + t.offset)

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
        t = self.f._by_name[self._names[name]]
        try:
            w = dequantize(self.f.raw(t), t.type)
        except Exception as e:
            raise ConversionError(f"--gguf {self.f.path}: tensor {t.name} "
                                  f"({t.type}) does not dequantize: {e}") from None
        w = w.reshape([int(n) for n in reversed(t.shape)])  # GGUF lists dimensions inner first
        c = self.f.config
        if name.endswith("self_attn.q_proj.weight"):
            w = unpermute(w, c["num_attention_heads"])
        elif name.endswith("self_attn.k_proj.weight"):
            w = unpermute(w, c["num_key_value_heads"])
        return w
