"""The training run: build everything from the config, restore or init, step, log, save."""
from __future__ import annotations

import json
import math
import pathlib
import time

import jax
import numpy as np

from checkpoints.manager import Checkpoints
from model.flops import flops_per_token, param_count
from parallel.mesh import make_mesh
from training.logger import MetricsLogger
from training.mfu import peak_flops_total
from training.optim import schedule
from training.state import Trainer
from training.validate import ConfigError, validate


class Diverged(RuntimeError):
    """The loss became NaN or inf."""


def prepare_workdir(workdir: pathlib.Path, config, fingerprint: str):
    """Writes the resolved config and the tokenizer fingerprint; refuses a different tokenizer."""
    workdir.mkdir(parents=True, exist_ok=True)
    fp_file = workdir / "tokenizer_fingerprint.txt"
    if fp_file.exists() and fp_file.read_text().strip() != fingerprint:
        raise ConfigError(
            f"{workdir} was trained with tokenizer {fp_file.read_text().strip()[:16]}..., but this "
            f"config gives {fingerprint[:16]}...; use the same data.tokenizer / data.source / "
            f"model.vocab_size, or a new --workdir")
    if jax.process_index() == 0:
        fp_file.write_text(fingerprint + "\n")
        (workdir / "config.json").write_text(config.to_json_best_effort(indent=2) + "\n")


def evaluate(trainer: Trainer, params, batches) -> dict:
    totals = [trainer.eval_step(params, b) for b in batches]
    loss_sum = sum(float(t["loss_sum"]) for t in totals)
    tokens = sum(float(t["tokens"]) for t in totals)
    loss = loss_sum / max(tokens, 1.0)
    return {"eval_loss": loss, "eval_ppl": math.exp(min(loss, 50.0))}


def run(config, workdir: pathlib.Path) -> dict:
    """Trains ``config`` in ``workdir``; returns a summary (first/last eval loss, paths)."""
    validate(config, jax.device_count())
    from data.pipeline import make_pipeline  # imports datasets/tokenizers: after validation

    mesh = make_mesh(config.mesh)
    pipe = make_pipeline(config, mesh)
    prepare_workdir(workdir, config, pipe.fingerprint)
    trainer = Trainer(config, mesh)
    ckpts = Checkpoints(workdir / "checkpoints", config.checkpoint)
    t = config.train
    log = MetricsLogger(workdir, config, start_step=0)

    start = ckpts.latest_step()
    if start is not None:
        state, data_state = ckpts.restore(trainer.abstract_state, start)
        pipe.train.restore(data_state)
        log.write(f"resuming from step {start} ({ckpts.path(start)})")
    else:
        start = 0
        state = trainer.init(t.seed)
    log.set_start(start)
    m, L = config.model, config.data.seq_len
    tokens_per_step = config.data.batch_size * L
    flops_tok = flops_per_token(m, L)
    peak = peak_flops_total(override_tflops=t.peak_tflops)
    log.write(f"model: {param_count(m) / 1e6:.1f}M params, {flops_tok:.3g} FLOP/token; "
              f"mesh {dict(mesh.shape)}; attention {config.attention.impl}/"
              f"{config.attention.layout}; {tokens_per_step} tokens/step; workdir {workdir}")

    heldout = pipe.heldout_batches(t.eval_batches) if t.eval_batches else []
    evals = []

    def do_eval(step):
        if heldout:
            rec = {"step": step, **evaluate(trainer, state.params, heldout)}
            evals.append(rec)
            log.eval(rec)

    if start == 0:
        do_eval(0)
    lr_at = schedule(t)
    pending, clock, clock_step, t_first = None, None, start, time.perf_counter()

    def flush(pending):
        nonlocal clock, clock_step
        step, metrics = pending
        metrics = jax.device_get(metrics)
        if metrics["bad_step"] >= 0:
            raise Diverged(f"loss became {float(metrics['loss'])} at step "
                           f"{int(metrics['bad_step']) + 1}; lower train.lr or raise "
                           f"train.warmup_steps (last checkpoint: step {ckpts.latest_step()})")
        now = time.perf_counter()
        if step == clock_step:  # the compile step itself: its wall time, compile included
            tps = tokens_per_step / max(clock - t_first, 1e-9)
        else:
            tps = (step - clock_step) * tokens_per_step / max(now - clock, 1e-9)
            clock, clock_step = now, step
        log.train({"step": step, "loss": float(metrics["loss"]),
                   "grad_norm": float(metrics["grad_norm"]), "lr": float(lr_at(step - 1)),
                   "tokens_per_s": tps, "mfu": tps * flops_tok / peak})

    try:
        for step in range(start + 1, t.steps + 1):
            state, metrics = trainer.train_step(state, next(pipe.train))
            if clock is None:  # the first step compiles: keep it out of tokens/s
                jax.block_until_ready(metrics)
                clock, clock_step = time.perf_counter(), step
            elif pending is not None:  # read the previous log step only after dispatching this one
                flush(pending)
                pending = None
            if step % t.log_every == 0 or step == t.steps:
                pending = (step, metrics)
            log.advance()
            if config.checkpoint.every and step % config.checkpoint.every == 0 and step != t.steps:
                ckpts.save(step, state, pipe.train.state())
            if t.eval_every and step % t.eval_every == 0 and step != t.steps:
                do_eval(step)
        if pending is not None:
            flush(pending)
        if t.steps > start:
            do_eval(t.steps)
        ckpts.save(t.steps, state, pipe.train.state(), force=True)
        ckpts.wait()
    finally:
        pipe.train.close()
        ckpts.close()
        log.close()

    summary = {"workdir": str(workdir), "metrics": str(workdir / "metrics.jsonl"),
               "checkpoint": str(ckpts.path(ckpts.latest_step())), "evals": evals}
    if len(evals) >= 2:
        first, last = evals[0]["eval_loss"], evals[-1]["eval_loss"]
        summary["eval_drop"] = 1 - last / first
        log.write(f"held-out loss {first:.3f} -> {last:.3f} ({100 * (1 - last / first):.0f}% lower)")
    log.write(f"run directory: {workdir}\n  metrics:    {summary['metrics']}\n"
              f"  checkpoint: {summary['checkpoint']}")
    return summary
