"""The training run: build everything from the config, restore or init, step, log, save, stop."""
from __future__ import annotations

import json
import math
import pathlib
import time

import jax

from checkpoints.manager import Checkpoints
from checkpoints.preemption import StopOnSignal, should_stop
from checkpoints.resume import run_meta, start_state
from errors import ConfigError
from model.flops import active_param_count, experts, flops_per_token, param_count
from parallel.mesh import make_mesh
from training import watchdog as watchdogs
from training.divergence import Diverged, Divergence  # noqa: F401  (Diverged: entry.py's)
from training.logger import MetricsLogger
from training.mfu import peak_flops_total
from training.state import Trainer
from configs.validate import validate


# What every train step reports; an objective's own metrics (training/objective.py: a preference
# run's rewards, accuracy, margin and pairs) are logged beside them.
STEP_METRICS = ("loss", "grad_norm", "lr", "tokens", "bad_step")


def check_workdir(workdir: pathlib.Path, fingerprint: str):
    """Refuses a run directory trained with another tokenizer, before anything is written."""
    fp_file = workdir / "tokenizer_fingerprint.txt"
    if fp_file.exists() and fp_file.read_text().strip() != fingerprint:
        raise ConfigError(
            f"{workdir} was trained with tokenizer {fp_file.read_text().strip()[:16]}..., but this "
            f"config gives {fingerprint[:16]}...; use the same data.tokenizer / data.source / "
            f"model.vocab_size, or a new --workdir")


def write_run_files(workdir: pathlib.Path, config, tokenizer, fingerprint: str,
                    chat_template: str | None = None):
    """The resolved config, the tokenizer and its fingerprint beside the checkpoints: enough for
    scripts/generate.py and scripts/eval.py to use the run without the data cache; a chat run's
    template too (generate.py --chat, export, and a run started from this one read it)."""
    if jax.process_index() == 0:
        workdir.mkdir(parents=True, exist_ok=True)
        (workdir / "tokenizer_fingerprint.txt").write_text(fingerprint + "\n")
        (workdir / "tokenizer.json").write_text(tokenizer.to_str())
        (workdir / "config.json").write_text(config.to_json_best_effort(indent=2) + "\n")
        if chat_template is not None:
            (workdir / "chat_template.jinja").write_text(chat_template)


def forget_after(workdir: pathlib.Path, step: int):
    """Drops logged records past ``step``: a run killed after its last checkpoint logged steps
    that the resumed run computes again, and the curve must read as if it never stopped."""
    if jax.process_index() != 0:
        return
    for name in ("metrics.jsonl", "eval.jsonl"):
        path = workdir / name
        if not path.exists():
            continue
        lines = path.read_text().splitlines(keepends=True)
        kept = [ln for ln in lines if not ln.strip() or json.loads(ln).get("step", 0) <= step]
        if len(kept) != len(lines):
            path.write_text("".join(kept))


def kernel_note(trainer: Trainer, mesh, config=None) -> str:
    """The per-round attention kernel the model resolved to (and why, for ``auto`` on a GPU),
    whether it is interpreted, and for cudnn which kernel runs which rounds."""
    from parallel import kernels
    kernel = trainer.backend.kernel
    platform = kernels.platform_of(mesh)
    interpreted = kernels.interpret(kernel, platform)
    why = ""
    if config is not None and config.attention.kernel == "auto" and platform != "cpu":
        from model.decoder import compute_dtype
        from model.flops import head_dim
        reason = kernels.auto_reason(platform, compute_dtype(config.model.dtype),
                                     head_dim(config.model))
        why = f" (auto: {reason})"
    if kernel == "cudnn" and config is not None and config.attention.impl == "ring":
        from model.flops import window_counts
        from parallel.kernels import cudnn
        from parallel.layouts import permutation
        a, n = config.attention, mesh.shape["sequence"]
        perm = permutation(a.layout, config.data.seq_len, n, a.stripe)
        # each layer's own window (model.layer_types): one note per window the layers use
        notes = {w: cudnn.startup_note(perm, n, window=w, documents=bool(a.document_mask),
                                       interpreted=interpreted)
                 for w in window_counts(config.model)}
        if len(notes) == 1:
            return kernel + why + " (" + next(iter(notes.values())) + ")"
        return kernel + why + " (" + "; ".join(
            f"{'full' if w == 0 else f'sliding (W={w})'} layers: {note}"
            for w, note in notes.items()) + ")"
    if interpreted:
        mode = "a dense fp32 stand-in for cuDNN" if kernel == "cudnn" else "Pallas interpret mode"
        return kernel + f" ({mode}: exact but slow)"
    if kernel == "pallas_gpu":
        from parallel.kernels import pallas_gpu
        if pallas_gpu.TRITON_DEPRECATED:
            return kernel + why + (f" (JAX {jax.__version__} deprecates Pallas's Triton "
                                   "backend; it still runs here)")
    return kernel + why


def evaluate(trainer: Trainer, params, batches) -> dict:
    """The held-out loss over every batch's count (tokens, or pairs); a preference run's
    rewards, accuracy and margin too, each a mean over the held-out pairs."""
    totals = [jax.device_get(trainer.eval_step(params, b)) for b in batches]
    sums = {k: sum(float(t[k]) for t in totals) for k in totals[0]}
    count = max(sums.pop("count"), 1.0)
    loss = sums.pop("loss_sum") / count
    out = {"eval_loss": loss}
    if trainer.objective.count_key == "tokens":
        out["eval_ppl"] = math.exp(min(loss, 50.0))
    return out | {f"eval_{k}": v / count for k, v in sums.items()}


def run(config, workdir: pathlib.Path) -> dict:
    """Trains ``config`` in ``workdir``; returns a summary (first/last eval loss, paths).

    Resumes from the newest complete checkpoint in ``workdir`` (or starts from
    ``checkpoint.restore_from``); on SIGTERM/SIGINT finishes the step, saves and returns; a
    non-finite loss stops the run or rolls it back (training/divergence.py), never saved."""
    validate(config, jax.device_count())
    from data.pipeline import make_pipeline  # imports datasets/tokenizers: after validation

    mesh = make_mesh(config.mesh)
    pipe = make_pipeline(config, mesh)
    check_workdir(workdir, pipe.fingerprint)
    trainer = Trainer(config, mesh)  # resolves model.remat=auto; the run's config keeps "auto"
    workdir.mkdir(parents=True, exist_ok=True)
    log = MetricsLogger(workdir, config, start_step=0)
    if trainer.remat_line:
        log.write(trainer.remat_line)
    ckpts = None
    try:
        ckpts = Checkpoints(workdir / "checkpoints", config.checkpoint, log=log.write)
        for line in (pipe.plan_line(), pipe.bad_records_line()):
            if line:
                log.write(line)
        start, state = start_state(config, trainer, pipe, ckpts, log.write)
        prepare = getattr(pipe, "prepare", None)  # a preference run's reference log-probs
        if prepare is not None:
            prepare(trainer, state.params, workdir, start, log.write)
        # Only now, with the checkpoint found to fit this config, is the config recorded.
        template = getattr(pipe, "template", None)
        write_run_files(workdir, config, pipe.tokenizer, pipe.fingerprint,
                        template.source if template is not None else None)
        meta = run_meta(config, pipe.fingerprint, mesh)
        if start > 0:
            forget_after(workdir, start)
        summary = _train(config, workdir, trainer, pipe, ckpts, log, mesh, start, state, meta)
    finally:
        pipe.train.close()
        if ckpts is not None:
            ckpts.close()
        log.close()
    return summary


def _train(config, workdir, trainer, pipe, ckpts, log, mesh, start, state, meta) -> dict:
    t = config.train
    log.set_start(start)
    m, L = config.model, config.data.seq_len
    tokens_per_step = config.data.batch_size * L  # all microbatches: the whole global batch
    flops_tok = flops_per_token(m, L)
    peak = peak_flops_total(override_tflops=t.peak_tflops)
    from model import pattern
    layers = f"layers {pattern.describe(m)}; " if m.get("layer_types", "") else ""
    k, n = experts(m)  # a mixture of experts: FLOPs (and MFU) count a token's k experts only
    active = (f" ({active_param_count(m) / 1e6:.1f}M active: {k} of {n} experts a token)"
              if n > 1 else "")
    if trainer.lora is not None:  # what trains of it (model/lora.py)
        active += (f" ({trainer.trained_count / 1e6:.2f}M trained: LoRA rank "
                   f"{trainer.lora.rank}, the rest frozen)")
    log.write(f"model: {param_count(m) / 1e6:.1f}M params{active}, {layers}{flops_tok:.3g} FLOP/token; "
              f"mesh {dict(mesh.shape)}; attention {config.attention.impl}/"
              f"{config.attention.layout}, kernel {kernel_note(trainer, mesh, config)}; "
              f"{tokens_per_step} tokens/step"
              f"{f' in {t.microbatches} microbatches' if t.microbatches > 1 else ''}; workdir {workdir}")

    heldout = pipe.heldout_batches(t.eval_batches) if t.eval_batches else []
    evals = []

    def do_eval(step):
        if heldout:
            rec = {"step": step, **evaluate(trainer, state.params, heldout)}
            evals.append(rec)
            log.eval(rec)

    if start == 0:
        do_eval(0)
    pending, clock, clock_step, t_first = None, None, start, time.perf_counter()
    stopped, latest = None, {}
    divergence = Divergence(config, trainer, pipe, ckpts, log.write)

    def flush(pending) -> int | None:
        """Logs a pending log step; returns the first non-finite step instead, if any."""
        nonlocal clock, clock_step
        step, metrics, now = pending
        metrics = jax.device_get(metrics)
        if metrics["bad_step"] >= 0:
            return int(metrics["bad_step"]) + 1
        if step == clock_step:  # the compile step itself: its wall time, compile included
            tps = tokens_per_step / max(clock - t_first, 1e-9)
        else:
            tps = (step - clock_step) * tokens_per_step / max(now - clock, 1e-9)
            clock, clock_step = now, step
        latest["loss"] = float(metrics["loss"])
        extra = {k: float(v) for k, v in metrics.items() if k not in STEP_METRICS}
        log.train({"step": step, "loss": latest["loss"],
                   "grad_norm": float(metrics["grad_norm"]), "lr": float(metrics["lr"]),
                   "tokens_per_s": tps, "mfu": tps * flops_tok / peak,
                   "trained_tokens": int(metrics["tokens"]), **extra})
        return None

    def first_bad() -> int | None:
        """The state's first non-finite step: read before every save, never only at log time."""
        bad = int(state.bad_step)
        return bad + 1 if bad >= 0 else None

    def save(step, force=False):
        ckpts.save(step, state, pipe.train.state(), meta, force=force)

    step = start
    with StopOnSignal() as stop, watchdogs.for_run(config, workdir) as watchdog:
        while step < t.steps:
            step += 1
            state, metrics = trainer.train_step(state, next(pipe.train))
            watchdog.dispatched(step, metrics["loss"])
            bad = None
            if clock is None:  # the first step compiles: keep it out of tokens/s
                jax.block_until_ready(metrics)
                clock, clock_step = time.perf_counter(), step
            elif pending is not None:  # read the previous log step only after dispatching this one
                bad, pending = flush(pending), None
            if step % t.log_every == 0 or step == t.steps:
                # The clock reads when this step is done, before the next is dispatched: on a
                # GPU a big step's dispatch returns only once most of its kernels are queued,
                # near the end of the step before, so a clock read after the next dispatch
                # counted one step too many (the first log step read half speed, the last
                # twice). The values are read after the next dispatch, as before.
                jax.block_until_ready(metrics)
                pending = (step, metrics, time.perf_counter())
            log.advance()
            stopping = step != t.steps and should_stop(stop, ckpts.manager, step)
            last = stopping or step == t.steps
            if last and pending is not None and bad is None:
                bad, pending = flush(pending), None
            periodic = bool(config.checkpoint.every) and step % config.checkpoint.every == 0
            if bad is None and (last or periodic):
                bad = first_bad()
            if bad is not None:
                with watchdog.paused():
                    step, state = divergence.handle(bad, step)
                watchdog.restart(step)
                forget_after(workdir, step)  # the steps after it are trained again
                pending, clock, t_first = None, None, time.perf_counter()
                continue
            if periodic and step != t.steps:
                with watchdog.paused():  # may wait for the previous save to finish
                    save(step)
            if t.eval_every and step % t.eval_every == 0 and step != t.steps:
                with watchdog.paused():
                    do_eval(step)
            if last:
                stopped = step if stopping else None
                break
        watchdog.disarm()
        if stopped is not None:
            save(stopped, force=True)
            ckpts.wait()
            log.write(f"stopped by {stop.name or 'preemption'} after step {stopped}: saved "
                      f"{ckpts.path(stopped)}; run the same command to resume")
        else:
            if t.steps > start:
                do_eval(t.steps)
            save(t.steps, force=True)
            ckpts.wait()

    summary = {"workdir": str(workdir), "metrics": str(workdir / "metrics.jsonl"),
               "checkpoint": str(ckpts.path(ckpts.latest_step())), "evals": evals,
               "start_step": start, "stopped_at": stopped, "final_loss": latest.get("loss")}
    if len(evals) >= 2:
        first, last = evals[0]["eval_loss"], evals[-1]["eval_loss"]
        summary["eval_drop"] = 1 - last / first
        log.write(f"held-out loss {first:.3f} -> {last:.3f} "
                  f"({100 * (1 - last / first):.0f}% lower)")
    log.write(f"run directory: {workdir}\n  metrics:    {summary['metrics']}\n"
              f"  checkpoint: {summary['checkpoint']}")
    return summary
