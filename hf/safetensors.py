"""The safetensors file format, read and written with numpy alone (no torch, bf16 included).

A file is an 8-byte little-endian header length, a JSON header naming each tensor's dtype,
shape and byte range, then the bytes. Reading maps the file, so a 7B checkpoint converts one
tensor at a time without holding the whole file in memory.
"""
from __future__ import annotations

import json
import pathlib
import struct

import ml_dtypes
import numpy as np

from errors import ConversionError

DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
          "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
          "BOOL": np.bool_}
NAMES = {np.dtype(v): k for k, v in DTYPES.items()}
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class Tensors:
    """Every tensor of a checkpoint directory (one file, or shards with their index), by name."""

    def __init__(self, directory: pathlib.Path):
        self.directory = directory
        index = directory / INDEX
        if index.is_file():
            weight_map = _json(index).get("weight_map")
            if not isinstance(weight_map, dict):
                raise ConversionError(f"{index} has no weight_map")
            files = sorted(set(weight_map.values()))
        elif (directory / SINGLE).is_file():
            files = [SINGLE]
        else:
            found = sorted(p.name for p in directory.glob("*.safetensors"))
            if not found:
                raise ConversionError(f"{directory}: no *.safetensors weights (a .bin/.pth "
                                      f"checkpoint must be saved as safetensors first)")
            files = found
        self._where: dict[str, tuple[np.memmap, dict, pathlib.Path]] = {}
        for name in files:
            path = directory / name
            if not path.is_file():
                raise ConversionError(f"{index} names {name}, which is not in {directory}")
            header, data = _open(path)
            for key, info in header.items():
                if key == "__metadata__":
                    continue
                if info.get("data_offsets", [0, 0])[1] > len(data):
                    raise ConversionError(f"{path}: tensor {key} ends past the end of the file; "
                                          f"the file is truncated (download or copy it again)")
                self._where[key] = (data, info, path)

    def names(self) -> list[str]:
        return sorted(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def __getitem__(self, name: str) -> np.ndarray:
        data, info, path = self._where[name]
        dtype = DTYPES.get(info.get("dtype"))
        if dtype is None:
            raise ConversionError(f"{path}: tensor {name} has dtype {info.get('dtype')!r}; "
                                  f"supported: {', '.join(DTYPES)}")
        begin, end = info["data_offsets"]
        shape = tuple(info["shape"])
        count = int(np.prod(shape, dtype=np.int64))
        if end - begin != count * np.dtype(dtype).itemsize:
            raise ConversionError(f"{path}: tensor {name} holds {end - begin} bytes, not "
                                  f"{count} x {np.dtype(dtype).itemsize} for shape {shape}")
        return np.frombuffer(data, dtype, count, offset=begin).reshape(shape)


def _json(path: pathlib.Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConversionError(f"{path}: not readable JSON ({e})") from None


def _open(path: pathlib.Path) -> tuple[dict, np.memmap]:
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ConversionError(f"{path}: too short to be a safetensors file")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise ConversionError(f"{path}: header length {n} exceeds the file ({size} bytes); "
                                  f"the file is truncated or not safetensors")
        try:
            header = json.loads(f.read(n))
        except ValueError:
            raise ConversionError(f"{path}: the header is not JSON; not a safetensors file") from None
    data = np.memmap(path, np.uint8, "r", offset=8 + n) if size > 8 + n else np.zeros(0, np.uint8)
    return header, data


def save(tensors: dict[str, np.ndarray], path: pathlib.Path, metadata: dict | None = None):
    """One safetensors file holding ``tensors`` in the given order."""
    header, offset = {"__metadata__": dict(metadata or {"format": "pt"})}, 0
    for name, array in tensors.items():
        nbytes = array.nbytes
        header[name] = {"dtype": NAMES[array.dtype], "shape": list(array.shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the format aligns the data to 8 bytes
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for array in tensors.values():
            f.write(np.ascontiguousarray(array).tobytes())


def save_sharded(tensors: dict[str, np.ndarray], directory: pathlib.Path, max_bytes: int):
    """``model.safetensors``, or shards of at most ``max_bytes`` each with their index."""
    shards, current, size = [], {}, 0
    for name, array in tensors.items():
        if current and size + array.nbytes > max_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = array
        size += array.nbytes
    shards.append(current)
    if len(shards) == 1:
        save(shards[0], directory / SINGLE)
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save(shard, directory / name)
        weight_map.update({k: name for k in shard})
    total = sum(a.nbytes for a in tensors.values())
    (directory / INDEX).write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
