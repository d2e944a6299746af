"""Checkpoints: save, resume, restore_from, preemption, and reading a finished run.

manager.py     the orbax CheckpointManager wrapper: what a checkpoint holds, which ones count
compat.py      does a checkpoint fit this config (model shape, tokenizer)
resume.py      where a run starts: its own newest checkpoint, another run's, or step 0
preemption.py  SIGTERM / SIGINT -> finish the step, save, exit 0
rundir.py      a run directory as generate.py / eval.py see it
"""
