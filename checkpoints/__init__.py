"""Checkpoints: save, resume, restore_from, preemption, and reading a finished run.

manager.py     the orbax CheckpointManager wrapper: what a checkpoint holds, which ones count
compat.py      does a checkpoint fit this config (model shape, tokenizer)
finite.py      is a restored checkpoint finite (a diverged state is never continued from)
storage.py     a save that cannot be written: one line, the partial write removed
resume.py      where a run starts: its own newest checkpoint, another run's, or step 0
preemption.py  SIGTERM / SIGINT -> finish the step, save, exit 0
rundir.py      a run directory as generate.py / eval.py see it
"""
