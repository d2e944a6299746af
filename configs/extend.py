"""Context extension of an imported Hugging Face LLaMA: continued training at a longer length
with a larger RoPE base, then long-context evaluation. A runbook; each step is one command.

1. Import the weights into a run directory (config.json, tokenizer, checkpoints/0):
     python scripts/convert_hf.py import --hf HF_DIR --out runs/base_hf
2. Train at the new length (here 32,768 tokens, striped ring over 8 devices), starting from
   those weights with a fresh optimizer; `:runs/base_hf` takes the imported model (shapes,
   norms, RoPE scaling, tied head), its tokenizer and a weights-only restore from the import:
     python train.py --config configs/extend.py:runs/base_hf --workdir runs/extended --config.data.path=DATA.jsonl
   Without `:RUN_DIR` the model is LLaMA-2-7B's (vocab 32000, d 4096, 32 layers, 32 heads,
   ffn 11008), e.g. to plan the run; a model field that differs from the checkpoint's stops
   the run before it trains, with one line naming each mismatched field and both values.
   The recipe follows Fu et al. 2024 ("Data Engineering for Scaling Language Models to 128K
   Context") and ProLong (Gao et al. 2024): a RoPE base raised to 500,000 (from Llama 2's
   10,000; a base already larger is kept; ProLong goes to millions for 64K-512K), a constant
   learning rate of 2e-5 after a short warmup, and on the order of a billion tokens of long
   documents (steps x batch x seq_len here: 1000 x 8 x 32,768 = 262M; raise train.steps or
   data.batch_size for more). data.min_doc_tokens / data.long_doc_upsample / data.mixture
   select and weight the long documents (README, "Long-context data").
3. Evaluate at the new length and below (passkey retrieval; held-out loss by position):
     python scripts/eval_passkey.py --run runs/extended --lengths 4096,16384,32768 --trials 5
     python scripts/eval.py --run runs/extended
4. Export for Hugging Face tools:
     python scripts/convert_hf.py export --run runs/extended --out HF_OUT

configs/extend_tiny.py is the same recipe at CPU sizes, on a model trained here first.

What a CPU shows and what a GPU adds: on SmolLM2-135M (`make smollm2`, trained at 8k) a scaling
alone, without training, keeps the loss flat to 16k (YaRN x2: 0.93 nats in the last 2k against
6.51 with plain RoPE; docs/huggingface.md). Step 2 of this recipe, training at 32,768 tokens
on a billion tokens of long documents, is a GPU's work: one 4,096-token step of that 135M model
takes about two minutes on 2 CPU cores.
"""
from configs.from_run import start_from
from configs.llama import llama_config


def get_config(run_dir: str = ""):
    c = llama_config("extend", layers=32, d_model=4096, ffn_dim=11008, heads=32)
    if run_dir:
        start_from(c, run_dir, "configs/extend.py")
    # Positions past the base model's training length rotate through angles it never saw;
    # a larger base slows every frequency so that the new length maps into familiar angles.
    c.model.rope_theta = max(float(c.model.rope_theta), 500000.0)
    c.attention.update(layout="striped")
    c.mesh.update(data=1, fsdp=-1, sequence=8, tensor=1)
    c.data.update(source="jsonl", seq_len=32768, batch_size=8)
    # Continued pretraining: the weights are already good, so a small constant rate moves
    # them to the new positions without washing out what they know.
    c.train.update(steps=1000, lr=2e-5, warmup_steps=20, min_lr_ratio=1.0, weight_decay=0.0,
                   log_every=10, eval_every=200)
    c.checkpoint.update(every=200, keep=3)
    return c
