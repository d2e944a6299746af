"""configs/extend.py's recipe at CPU sizes: extend a tiny passkey model from 128 to 512 tokens.

A tiny model trained here at 128 tokens stands in for the imported Hugging Face model; this
config continues it at 512 tokens (4x) with a larger RoPE base, a constant learning rate and
a striped ring over 4 simulated devices. The whole demonstration (README, "Context extension
on a CPU"), each command as run there:

  python scripts/make_passkey_corpus.py --out runs/passkey_short.jsonl --docs 6000 --min-sentences 1 --max-sentences 12
  python scripts/make_passkey_corpus.py --out runs/passkey_long.jsonl --docs 3000 --min-sentences 1 --max-sentences 90
  python train.py --config configs/tiny.py --workdir runs/passkey_short --config.data.source=jsonl --config.data.path=runs/passkey_short.jsonl --config.model.vocab_size=400 --config.model.num_kv_heads=4 --config.mesh.fsdp=1 --config.data.seq_len=128 --config.data.batch_size=16 --config.train.steps=1500 --config.train.lr=3e-3 --config.train.warmup_steps=30 --config.train.min_lr_ratio=1.0 --config.train.weight_decay=0.0 --config.train.eval_every=0 --config.checkpoint.every=500
  python scripts/eval_passkey.py --run runs/passkey_short --lengths 128,256,512 --trials 50
  python train.py --config configs/extend_tiny.py --workdir runs/extend_theta100k
  python train.py --config configs/extend_tiny.py --workdir runs/extend_theta10k --config.model.rope_theta=10000
  python scripts/eval_passkey.py --run runs/extend_theta100k --lengths 128,256,512 --trials 50
  python scripts/eval_passkey.py --run runs/extend_theta10k --lengths 128,256,512 --trials 50

The model fields below are the short run's (configs/tiny.py with vocab 400 and 4 KV heads);
the RoPE base is not a shape field, so it may change at restore. The learning rate is far
above the 2e-5 of configs/extend.py: that rate suits a converged 7B model over a billion
tokens, while this one is small and trained for minutes.
"""
from configs import tiny


def get_config():
    c = tiny.get_config()
    c.name = "extend_tiny"
    c.model.update(vocab_size=400, num_kv_heads=4, rope_theta=100000.0)
    c.mesh.update(data=1, fsdp=1, sequence=4, tensor=1)
    c.attention.update(layout="striped")
    c.data.update(source="jsonl", path="runs/passkey_long.jsonl",
                  tokenizer="runs/passkey_short/tokenizer.json", seq_len=512, batch_size=4)
    c.train.update(steps=400, lr=1e-3, warmup_steps=10, min_lr_ratio=1.0, weight_decay=0.0,
                   log_every=50, eval_every=0)
    c.checkpoint.update(every=200, keep=2, restore_from="runs/passkey_short",
                        restore_weights_only=True)
    return c
