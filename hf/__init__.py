"""Hugging Face interop: LlamaForCausalLM checkpoints in and out (scripts/convert_hf.py)."""
