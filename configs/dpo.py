"""Preference tuning (DPO) at long context: a run's model (an SFT run, an import) learns to prefer
the chosen response of each pair to the rejected one, against its own starting log-probs.

Run:  python train.py --config configs/dpo.py:RUN_DIR --workdir runs/dpo --config.data.path=PAIRS.jsonl
(RUN_DIR: a train.py run such as configs/sft.py's, or an import: its model, tokenizer, chat
template and weights, which are also the reference.) Data: JSONL or an HF dataset of TRL's
preference records: {"prompt": [messages] or "text", "chosen": [assistant messages] or "text",
"rejected": ...}, or chosen/rejected as whole conversations sharing their prompt;
  python scripts/make_chat_data.py pairs --from data/examples/stdlib_qa.jsonl --out PAIRS.jsonl
makes pairs of the real answer against another question's.
Shows: "data: preference pairs, N records read ..., T train / H held out; R rows ...", "reference
log-probabilities of ... pairs computed with the starting weights" (once; a resume reads them),
then per logged step the DPO loss (ln 2 = 0.693 at the start with loss_type=sigmoid), rewards,
reward accuracy and margin, and the same on the held-out pairs, rising. docs/sft.md has the
recipe measured on SmolLM2-135M-Instruct.
"""
from configs.sft import get_config as sft_config


def get_config(run_dir: str = ""):
    c = sft_config(run_dir)
    c.name = "dpo"
    c.data.update(format="preference", path="", too_long="drop")
    c.dpo.update(beta=0.1, loss_type="sigmoid", label_smoothing=0.0, rpo_alpha=0.0)
    # DPO's usual rate for a model already tuned: smaller than SFT's
    c.train.update(steps=50, lr=5e-6, warmup_steps=5, eval_every=10)
    return c
