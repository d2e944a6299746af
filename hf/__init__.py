"""Hugging Face interop: LlamaForCausalLM / MistralForCausalLM / Qwen2ForCausalLM checkpoints in
and out (scripts/convert_hf.py)."""
