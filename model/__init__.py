"""LLaMA-style decoder (Flax NNX) whose attention calls the backends in parallel/."""
