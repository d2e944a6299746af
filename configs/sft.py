"""Supervised fine-tuning on conversations: a run's model (an import, or a train.py run) learns to
answer, the loss on the assistant's tokens only, whole conversations packed into long rows.

Run:  python train.py --config configs/sft.py:RUN_DIR --workdir runs/sft [--config.data.path=CHATS.jsonl]
(RUN_DIR: `make smollm2`'s runs/smollm2, a scripts/convert_hf.py import, or a train.py --workdir:
its model, tokenizer, chat template and weights; a fresh optimizer.) Data: JSONL or an HF dataset
(data.source=hf) of {"messages": [{"role": ..., "content": ...}, ...]} records, or ShareGPT's
{"conversations": [{"from": ..., "value": ...}]}; the default is data/examples/stdlib_qa.jsonl
(scripts/make_chat_data.py: questions on the standard library answered from its docstrings).
Shows: "data: chat, N records read ..., T train / H held out; R rows of 4096 (..% filled);
trained tokens ..% of the rows (data.train_on=assistant); chat template ...", the trained-token
count per logged step in metrics.jsonl, and the held-out loss on the assistant's tokens before
and after. Then talk to it, and export it:
  python scripts/generate.py --run runs/sft --chat --prompt "What does textwrap.dedent do?"
  python scripts/convert_hf.py export --run runs/sft --out HF_OUT
docs/sft.md has the recipe measured on SmolLM2-135M-Instruct.
"""
import pathlib

from configs.from_run import from_run

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "data" / "examples" / "stdlib_qa.jsonl"


def get_config(run_dir: str = ""):
    c = from_run(run_dir, "configs/sft.py")
    c.name = "sft"
    c.data.update(format="chat", source="jsonl", path=str(EXAMPLES), text_field="text",
                  train_on="assistant", too_long="drop", seq_len=4096, batch_size=8,
                  heldout_fraction=0.05, max_docs=0, min_doc_tokens=0, long_doc_tokens=0,
                  long_doc_upsample=1, reset_positions_at_doc=True, mixture="",
                  messages_field="")
    # Striped over a ring of 8 (simulated on a CPU): every device holds tokens of every packed
    # conversation, and the segment ids keep each conversation's attention to itself.
    c.attention.update(layout="striped", impl="ring", document_mask=True)
    c.mesh.update(data=1, fsdp=1, sequence=8, tensor=1)
    # A pretrained model: a small rate, short warmup, no decay on what it already knows.
    c.train.update(steps=100, lr=2e-5, warmup_steps=10, min_lr_ratio=0.1, weight_decay=0.0,
                   log_every=5, eval_every=25, eval_batches=2, microbatches=1)
    c.checkpoint.update(every=50, keep=2, restore_weights_only=True)
    return c
