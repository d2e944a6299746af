"""Hugging Face LLaMA / Mistral / Qwen2 / Qwen3 / Gemma 3 / SmolLM3 / Mixtral / Qwen3-MoE / OLMoE checkpoints in and out of run directories.

    python scripts/convert_hf.py import --hf HF_DIR --out RUN_DIR [--config configs/X.py] [--config.a.b=v ...]
    python scripts/convert_hf.py import --gguf FILE.gguf --out RUN_DIR [--config configs/X.py] [--config.a.b=v ...]
    python scripts/convert_hf.py export --run RUN_DIR --out HF_DIR [--dtype bfloat16] [--step N]

import reads a local LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM,
Gemma3ForCausalLM, SmolLM3ForCausalLM, MixtralForCausalLM, Qwen3MoeForCausalLM, OlmoeForCausalLM
(mixtures of experts: model.moe) or Gemma3ForConditionalGeneration (its language model; the
vision tower is left out and named) directory (config.json, model.safetensors or shards with
their index, tokenizer.json), without torch, or a llama.cpp GGUF file of a llama-architecture
model (dequantized to float32, its tokenizer rebuilt; hf/gguf_file.py), and writes a run directory: its config (the
--config file's, default configs/base.py, with the model fields from HF), its tokenizer and a
step-0 checkpoint of the weights. Train from it with
    python train.py --config configs/X.py --config.checkpoint.restore_from=RUN_DIR \\
        --config.checkpoint.restore_weights_only=True --config.data.tokenizer=RUN_DIR/tokenizer.json
(and the model fields the import printed), or use it directly with scripts/generate.py,
scripts/eval.py and scripts/eval_passkey.py. export writes a directory that transformers'
AutoModelForCausalLM and AutoTokenizer load, with rope_theta / rope_scaling as trained, of the
architecture the model's fields need (hf/config.py architecture: OlmoeForCausalLM,
Qwen3MoeForCausalLM, MixtralForCausalLM, Gemma3ForCausalLM, SmolLM3ForCausalLM, Qwen3ForCausalLM, Qwen2ForCausalLM,
MistralForCausalLM or LlamaForCausalLM). hf/config.py REFUSED names what the known architectures that do not convert
have.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    imp = sub.add_parser("import", help="HF directory -> run directory")
    src = imp.add_mutually_exclusive_group(required=True)
    src.add_argument("--hf", help="local Hugging Face model directory")
    src.add_argument("--gguf", help="a llama.cpp GGUF file (llama architecture)")
    imp.add_argument("--out", required=True, help="new run directory")
    imp.add_argument("--config", default="configs/base.py",
                     help="config whose non-model fields the run takes (default configs/base.py)")
    exp = sub.add_parser("export", help="run directory -> HF directory")
    exp.add_argument("--run", required=True, help="run directory (train.py --workdir or an import)")
    exp.add_argument("--out", required=True, help="new Hugging Face model directory")
    exp.add_argument("--dtype", default="auto",
                     help="float32 | bfloat16 | float16 | auto (the imported model's, else bfloat16)")
    exp.add_argument("--step", type=int, default=None, help="checkpoint step (default: newest)")
    exp.add_argument("--max-shard-gb", type=float, default=5.0, help="safetensors shard size")
    args, rest = p.parse_known_args(argv)
    overrides = []
    for item in rest:
        if args.command != "import" or not item.startswith("--config."):
            p.error(f"unrecognized argument {item}")
        overrides.append(item[len("--config."):])
    args.overrides = overrides
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    from training.entry import script_main, stderr

    def convert() -> int:
        from hf.convert import export_hf, import_gguf, import_hf
        if args.command == "import":
            if args.gguf:
                out = import_gguf(args.gguf, args.out, args.config, args.overrides, log=stderr)
            else:
                out = import_hf(args.hf, args.out, args.config, args.overrides, log=stderr)
        else:
            out = export_hf(args.run, args.out, args.dtype, args.step, args.max_shard_gb,
                            log=stderr)
        print(out)
        return 0

    return script_main(convert)

if __name__ == "__main__":
    sys.exit(main())
