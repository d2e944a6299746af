"""Hugging Face LLaMA / Mistral / Qwen2 / Qwen3 / Gemma 3 / SmolLM3 / Mixtral / Qwen3-MoE / OLMoE checkpoints in and out of run directories.

    python scripts/convert_hf.py import --hf HF_DIR --out RUN_DIR [--config configs/X.py] [--config.a.b=v ...]
    python scripts/convert_hf.py import --gguf FILE.gguf --out RUN_DIR [--config configs/X.py] [--config.a.b=v ...]
    python scripts/convert_hf.py export --run RUN_DIR --out HF_DIR [--dtype bfloat16] [--step N] [--merge]
    python scripts/convert_hf.py export --adapter --run RUN_DIR --out ADAPTER_DIR [--base-out HF_DIR]
    python scripts/convert_hf.py import --adapter ADAPTER_DIR --run BASE_RUN --out RUN_DIR [--config.a.b=v ...]

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

LoRA (train.lora, model/lora.py; hf/peft.py has PEFT's names). A run with adapters exports merged
(W + scale * A @ B, said in a line); --merge asks for that and refuses a run without adapters.
export --adapter writes the adapters alone as PEFT writes them (adapter_config.json,
adapter_model.safetensors, the tokenizer): peft.PeftModel.from_pretrained(base, ADAPTER_DIR)
loads them over the base, whose directory base_model_name_or_path names (the HF model the run
was imported from, or --base-out's, where the run's frozen base is written too). import
--adapter reads a PEFT LoRA adapter directory onto the run --run (an import, or a train.py
--workdir, without adapters of its own) and writes a new run directory: --run's config with
train.lora from adapter_config.json, its tokenizer, and a step-0 checkpoint of its weights with
the adapter's. Train the adapters on with
    python train.py --config configs/sft.py:RUN_DIR --workdir runs/next
or evaluate with scripts/generate.py --run RUN_DIR. What does not fit (another PEFT method or
architecture, a tensor of another shape, modules it has no name for) is one line.
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
    src.add_argument("--adapter", help="a PEFT LoRA adapter directory, onto --run's weights")
    imp.add_argument("--run", help="with --adapter: the run directory holding its base model")
    imp.add_argument("--out", required=True, help="new run directory")
    imp.add_argument("--config", default=None,
                     help="config whose non-model fields the run takes (default configs/base.py; "
                          "with --adapter, --run's config)")
    exp = sub.add_parser("export", help="run directory -> HF directory")
    exp.add_argument("--run", required=True, help="run directory (train.py --workdir or an import)")
    exp.add_argument("--out", required=True, help="new Hugging Face model directory")
    exp.add_argument("--dtype", default="auto",
                     help="float32 | bfloat16 | float16 | auto (the imported model's, else bfloat16; "
                          "--adapter: float32)")
    exp.add_argument("--step", type=int, default=None, help="checkpoint step (default: newest)")
    exp.add_argument("--max-shard-gb", type=float, default=5.0, help="safetensors shard size")
    lora = exp.add_mutually_exclusive_group()
    lora.add_argument("--merge", action="store_true",
                      help="the LoRA adapters merged into the weights (a run without: refused)")
    lora.add_argument("--adapter", action="store_true",
                      help="the LoRA adapters alone, as a PEFT adapter directory")
    exp.add_argument("--base-out", default=None,
                     help="with --adapter: also write the run's frozen base here (an HF directory)")
    args, rest = p.parse_known_args(argv)
    if args.command == "import":
        if args.adapter and not args.run:
            p.error("import --adapter needs --run BASE_RUN: the run whose weights are its base")
        if args.run and not args.adapter:
            p.error("import --run goes with --adapter ADAPTER_DIR")
        if args.adapter and args.config:
            p.error("import --adapter takes --run's config; change its fields with --config.a.b=v")
        args.config = args.config or "configs/base.py"
    elif args.base_out and not args.adapter:
        p.error("export --base-out goes with --adapter")
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
        from hf.convert import export_adapter, export_hf, import_adapter, import_gguf, import_hf
        if args.command == "import":
            if args.adapter:
                out = import_adapter(args.adapter, args.run, args.out, args.overrides, log=stderr)
            elif args.gguf:
                out = import_gguf(args.gguf, args.out, args.config, args.overrides, log=stderr)
            else:
                out = import_hf(args.hf, args.out, args.config, args.overrides, log=stderr)
        elif args.adapter:
            out = export_adapter(args.run, args.out, args.dtype, args.step, args.base_out,
                                 args.max_shard_gb, log=stderr)
        else:
            out = export_hf(args.run, args.out, args.dtype, args.step, args.max_shard_gb,
                            log=stderr, merge=args.merge)
        print(out)
        return 0

    return script_main(convert)

if __name__ == "__main__":
    sys.exit(main())
