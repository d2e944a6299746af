"""Evaluate a run with EleutherAI's lm-evaluation-harness (lm_eval) through the `stripedjax` model.

    python scripts/eval_harness.py --run RUN [--step N] [--max-length N] [--per-length N]
        [--build-timeout S] -- <lm_eval flags: --tasks ... --metadata ... --output_path ...>

    pip install -r requirements-eval.txt   (make test installs it)

Everything after ``--`` goes to lm_eval's own command line (``lm-eval run``), with
``--model stripedjax --model_args run=RUN,...`` added (evaluation/harness.py; more model
arguments, e.g. ``truncate=true``, may follow in your own ``--model_args``). Before lm_eval
starts, the script:
- simulates the run's devices on a CPU (as train.py does), so rows run on the run's mesh,
  attention and layout;
- writes the run's tokenizer as a Hugging Face tokenizer folder (RUN/eval/hf_tokenizer) and
  adds it to ``--metadata`` as ``tokenizer``: RULER sizes its prompts with the model's own
  tokenizer;
- prepares the offline paths (evaluation/offline.py): HF_HUB_OFFLINE / HF_DATASETS_OFFLINE,
  an empty nltk punkt_tab so that RULER's niah code does not try to download it, and a time
  limit on each task's data build (RULER's vt/cwe generators can loop forever).

``--max-length`` (the longest row, prompt and generation together) defaults to the larger of
the run's data.seq_len and, when ``--metadata`` gives RULER's ``max_seq_lengths``, the longest
of them plus 64: RULER keeps its generation room inside the length, then appends an answer
prefix that runs past it. ``--batch_size`` (rows per pass) defaults to ``auto``: the run's
data.batch_size. RULER's offline tasks: niah_single_1, niah_multikey_2, niah_multikey_3,
ruler_vt, ruler_cwe, ruler_fwe. Each length makes 500 samples and ``--limit`` takes the first
length's only: ``--per-length N`` takes the first N of every length (it writes lm_eval's
``--samples``, e.g. ``'{"niah_single_1": [0, 1, 500, 501]}'`` for N = 2 and two lengths).
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SLACK = 64  # tokens past RULER's nominal length: its answer prefix comes after the length
RULER_SAMPLES = 500  # samples RULER generates per length (lm_eval's tasks/ruler)


def parse_args(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    ours, theirs = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv \
        else (argv, [])
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                usage="%(prog)s --run RUN [options] -- <lm_eval flags>")
    p.add_argument("--run", required=True, help="run directory (train.py --workdir)")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: newest)")
    p.add_argument("--max-length", type=int, default=None,
                   help="longest row, prompt and generation (default: see above)")
    p.add_argument("--build-timeout", type=float, default=600.0,
                   help="seconds a task's data build may take (0: no limit)")
    p.add_argument("--per-length", type=int, default=None,
                   help="RULER: the first N samples of each length of each task (lm_eval's "
                        "--samples; --limit takes the first length's only)")
    args = p.parse_args(ours)
    args.lm_eval = theirs
    return args


def flag_value(flags: list[str], name: str) -> tuple[int, str | None]:
    """(index of the value, value) of ``name VALUE`` or ``name=VALUE`` in lm_eval's flags."""
    for i, f in enumerate(flags):
        if f == name and i + 1 < len(flags):
            return i + 1, flags[i + 1]
        if f.startswith(name + "="):
            return i, f[len(name) + 1:]
    return -1, None


def tasks_of(flags: list[str]) -> list[str]:
    """The task names of ``--tasks a b`` / ``--tasks a,b`` / ``--tasks=a,b``."""
    at, first = flag_value(flags, "--tasks")
    if first is None:
        return []
    names = [first]
    if flags[at] == first:  # separate values, up to the next flag
        for f in flags[at + 1:]:
            if f.startswith("-"):
                break
            names.append(f)
    return [t for name in names for t in name.split(",") if t]


def per_length_samples(flags: list[str], lengths: list[int], n: int) -> dict:
    """lm_eval's --samples for the first ``n`` samples of each RULER length: each length
    generates RULER_SAMPLES of them, one length after the other."""
    from errors import EvalError
    if n < 1 or n > RULER_SAMPLES:
        raise EvalError(f"--per-length={n}: give 1 to {RULER_SAMPLES} (RULER makes "
                        f"{RULER_SAMPLES} samples per length)")
    if flag_value(flags, "--limit")[1] is not None or flag_value(flags, "--samples")[1]:
        raise EvalError("--per-length chooses the samples: leave out --limit and --samples")
    tasks = tasks_of(flags)
    if not tasks or not lengths:
        raise EvalError("--per-length needs --tasks and --metadata's max_seq_lengths")
    index = [k * RULER_SAMPLES + i for k in range(len(lengths)) for i in range(n)]
    return {task: index for task in tasks}


def lm_eval_argv(args, tokenizer_dir: pathlib.Path, seq_len: int,
                 fit=lambda n: n) -> tuple[list[str], int]:
    """(lm_eval's argv, max_length): our model, its arguments and the tokenizer added.
    ``fit(n)``: the row length the run accepts for a default max_length of ``n`` (the layout
    and tile sizes allow only some lengths); a --max-length given is taken as it is."""
    from errors import EvalError
    flags = list(args.lm_eval)
    if not flags:
        raise EvalError("give lm_eval's flags after --, e.g. -- --tasks niah_single_1 "
                        "--metadata '{\"max_seq_lengths\": [512]}'")
    for taken in ("--model", "--pretrained"):
        if flag_value(flags, taken)[1] is not None:
            raise EvalError(f"{taken} is this script's to set (the stripedjax model of --run); "
                            f"leave it out")
    at, raw = flag_value(flags, "--metadata")
    metadata = {}
    if raw is not None:
        try:
            metadata = json.loads(raw)
            assert isinstance(metadata, dict)
        except (ValueError, AssertionError):
            raise EvalError(f"--metadata {raw!r}: give a JSON object, e.g. "
                            f"'{{\"max_seq_lengths\": [512, 1024]}}'") from None
    metadata.setdefault("tokenizer", str(tokenizer_dir))
    lengths = metadata.get("max_seq_lengths") or []
    if not isinstance(lengths, list) or not all(isinstance(n, int) and n > 0 for n in lengths):
        raise EvalError(f"--metadata max_seq_lengths={lengths!r}: give a list of positive "
                        f"token counts, e.g. [512, 1024]")
    max_length = args.max_length or fit(max([seq_len, *(n + SLACK for n in lengths)]))
    if args.per_length is not None:
        flags += ["--samples", json.dumps(per_length_samples(flags, lengths, args.per_length))]
    if max_length < 2:
        raise EvalError(f"--max-length={max_length} must be >= 2")
    if at >= 0:
        flags[at] = json.dumps(metadata) if flags[at] == raw else \
            f"--metadata={json.dumps(metadata)}"
    else:
        flags += ["--metadata", json.dumps(metadata)]
    model_args = {"run": str(args.run), "max_length": max_length}
    if args.step is not None:
        model_args["step"] = args.step
    at, raw = flag_value(flags, "--model_args")
    if raw is not None:  # the user's own (truncate=true, ...) after ours
        if "batch_size" in raw:
            raise EvalError("give the batch as lm_eval's --batch_size N, not in --model_args "
                            "(lm_eval passes its own --batch_size to the model as well)")
        del flags[at - (1 if flags[at] == raw else 0):at + 1]
        if raw.lstrip().startswith("{"):
            try:
                model_args_flag = json.dumps({**model_args, **json.loads(raw)})
            except (ValueError, TypeError):
                raise EvalError(f"--model_args {raw!r}: not a JSON object; give key=value,... "
                                f"or JSON") from None
        else:
            model_args_flag = ",".join(f"{k}={v}" for k, v in model_args.items()) + "," + raw
    else:
        model_args_flag = json.dumps(model_args)
    if flag_value(flags, "--batch_size")[1] is None:  # lm_eval's default is 1 row
        flags += ["--batch_size", "auto"]
    return ["lm-eval", "run", "--model", "stripedjax", "--model_args", model_args_flag, *flags], \
        max_length


def fit_for(run, log):
    """``fit`` for lm_eval_argv: the smallest row length from n up that the run's layout, mesh
    and tiles accept (RULER's length + 64 is rarely one: striped over 8 devices with tiles of
    512 takes multiples of 4,096), said in one line when it moves."""
    def fit(n: int) -> int:
        from evaluation.lengths import next_valid
        from evaluation.setup import eval_setup
        config, mesh = eval_setup(run.config, log)
        got = next_valid(config, mesh, n)
        if got is None:
            return n  # the model's own check names what is wrong
        if got != n:
            log(f"max_length {n} is no row length of the run's layout and mesh; using {got}, "
                f"the next that is (--max-length sets it)")
        return got
    return fit


def main(argv=None) -> int:
    args = parse_args(argv)
    from parallel.cluster import one_process_or_exit
    from parallel.host_devices import simulate_for_run
    from training.entry import script_main, stderr
    one_process_or_exit("scripts/eval_harness.py")
    simulate_for_run(args.run, say=stderr)  # before jax starts

    def run_eval() -> int:
        from checkpoints.rundir import open_run
        from evaluation import offline
        for line in offline.prepare():  # before nltk or lm_eval is imported
            stderr(f"offline: {line}")
        run = open_run(args.run, log=stderr)
        from hf.convert import write_tokenizer
        seq_len = int(run.config.data.seq_len)
        folder = run.directory / "eval" / "hf_tokenizer"
        lm_argv, max_length = lm_eval_argv(args, folder, seq_len, fit=fit_for(run, stderr))
        write_tokenizer(run, folder, max_length)
        import evaluation.harness  # noqa: F401  (registers the stripedjax model)
        from lm_eval.__main__ import cli_evaluate
        offline.limit_task_builds(args.build_timeout)
        stderr(f"lm_eval {' '.join(lm_argv[1:])}")
        sys.argv = lm_argv
        cli_evaluate()
        return 0

    return script_main(run_eval)


if __name__ == "__main__":
    sys.exit(main())
