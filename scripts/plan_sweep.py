"""The README's planning table: 1B/3B/7B at 32k, 262k and 1M tokens on 8 and 64 devices.

    python scripts/plan_sweep.py [--out bench_out/plan_sweep.md] [--models 1b,3b,7b]

--models takes sizes of configs/llama_<size>.py or config names (llama3_8b: configs/llama3_8b.py).

Runs scripts/plan.py once per row (each in its own process: the simulated device count is
fixed when JAX starts) with the config's remat policy, one sequence per ring, projected on
H100, and writes a Markdown table of memory per device against 80 GB and 141 GB devices.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from planning.hardware import HARDWARE, USABLE_FRACTION  # noqa: E402
from planning.report import sweep_table  # noqa: E402

MESHES = {8: ["sequence=8"], 64: ["fsdp=8,sequence=8", "sequence=64"]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="1b,3b,7b", help="1b,3b,7b (configs/llama_<size>.py) or "
                   "config names, e.g. llama3_1b,llama3_3b,llama3_8b")
    p.add_argument("--seq-lens", default="32768,262144,1048576")
    p.add_argument("--devices", default="8,64")
    p.add_argument("--hardware", default="h100", help="for the projected step time")
    p.add_argument("--out", default="bench_out/plan_sweep.md")
    args = p.parse_args(argv)
    plans, commands = [], []
    started = time.perf_counter()
    for model in args.models.split(","):
        config = f"configs/{model}.py" if "_" in model else f"configs/llama_{model}.py"
        for seq_len in map(int, args.seq_lens.split(",")):
            for devices in map(int, args.devices.split(",")):
                for mesh in MESHES[devices]:
                    cmd = ["scripts/plan.py", "--config", config, "--mesh", mesh,
                           "--seq-len", str(seq_len), "--batch", "1", "--hardware", args.hardware]
                    with tempfile.NamedTemporaryFile(suffix=".json") as f:
                        run = subprocess.run([sys.executable, *cmd, "--json", f.name], cwd=ROOT,
                                             capture_output=True, text=True)
                        if run.returncode:
                            print(f"failed: {' '.join(cmd)}\n{run.stderr[-2000:]}", file=sys.stderr)
                            return run.returncode
                        plans.append(json.load(open(f.name)))
                    commands.append("python " + " ".join(cmd))
                    print(f"{time.perf_counter() - started:6.0f} s  {' '.join(cmd)}", file=sys.stderr)
    memories = {"80 GB": HARDWARE["h100"].memory_bytes, "141 GB": HARDWARE["h200"].memory_bytes}
    text = (f"Made by `python scripts/plan_sweep.py` ({time.perf_counter() - started:.0f} s on this "
            f"machine); each row is `python scripts/plan.py --config configs/<model>.py "
            f"--mesh <mesh> --seq-len <seq_len> --batch 1 --hardware {args.hardware}`. Memory is the "
            f"compiled step's per-device total (bf16 compute, fp32 params and Adam, remat "
            f"{plans[0]['remat']}); fits = at most {USABLE_FRACTION:.0%} of the device. Step times "
            f"are {args.hardware} lower bounds.\n\n" + sweep_table(plans, memories, USABLE_FRACTION))
    os.makedirs(os.path.dirname(os.path.join(ROOT, args.out)) or ".", exist_ok=True)
    with open(os.path.join(ROOT, args.out), "w") as f:
        f.write(text)
    with open(os.path.join(ROOT, os.path.splitext(args.out)[0] + ".json"), "w") as f:
        json.dump({"commands": commands, "plans": plans}, f, indent=1)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
