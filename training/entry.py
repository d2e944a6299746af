"""The user-facing edge of a run: user mistakes become one line and an exit code, not a trace."""
from __future__ import annotations

import atexit
import gc
import sys

# CPython's collector at its defaults (700, 10, 10) runs a full collection every ~70,000 net
# allocations, and a full one walks every object the imports made (jax, flax, optax, orbax, and
# in the tests torch and transformers): tracing a train step allocates millions of short-lived
# objects, so full collections took 10% of a test process's CPU and 8% of a cache-hit tiny
# train.py run. Frozen imports and a gen-0 threshold of 50,000 take that to a third (docs/tests.md).
# The loop itself allocates little per step; device buffers are freed by reference count.
GC_THRESHOLDS = (50_000, 20, 100)


_settled = []


def collect_less() -> None:
    """The thresholds alone: for an entry whose heavy imports come later (the scripts')."""
    gc.set_threshold(*GC_THRESHOLDS)


def settle_gc() -> None:
    """Move what the imports made out of the collector's sight and collect less often, once a
    process has imported its heavy modules. Once per process: what is frozen is never collected
    again, so a later call (an entry point run inside a test process) freezes nothing more."""
    if not _settled:
        gc.collect()  # no garbage of the imports frozen with them
        gc.freeze()
        collect_less()
        # Back in sight at exit, so that the interpreter's last collection finalizes them as
        # before (else nanobind-bound libraries report their objects as leaked).
        atexit.register(gc.unfreeze)
        _settled.append(True)


def user_errors() -> tuple[type[BaseException], ...]:
    """Config, config file, checkpoint, layout, mesh and data mistakes (errors.py)."""
    from errors import UserError
    return (UserError,)


def main_with_errors(config, workdir, place) -> int:
    from parallel.distributed import initialize, is_peer_error
    d = config.distributed
    try:  # a host's GPUs that do not split over its tasks: one line
        line = initialize(place, d.heartbeat_timeout_s, d.init_timeout_s)
    except user_errors() as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if line:
        print(line, flush=True)
    import jax

    from training import supervisor
    from training.loop import Diverged, run
    settle_gc()
    try:
        summary = run(config, workdir)
    except user_errors() as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Diverged as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except Exception as e:
        if jax.process_count() > 1 and is_peer_error(e):
            supervisor.end_for_lost_peer(e, d.heartbeat_timeout_s)  # never returns
        raise
    if jax.process_count() > 1 and summary.get("final_loss") is not None:
        # Every process reports: a launcher (and its test) can check that they agree.
        print(f"process {jax.process_index()}/{jax.process_count()}: final loss "
              f"{summary['final_loss']:.6f}", flush=True)
    return 0


def stderr(msg: str) -> None:
    """Progress and notes of the scripts: stderr, so that stdout holds only their result."""
    print(msg, file=sys.stderr, flush=True)


def script_main(body) -> int:
    """A script's exit code: ``body()``'s, or 2 with one ``error:`` line for a user's mistake
    (absl's backend chatter silenced first)."""
    from absl import logging as absl_logging
    absl_logging.set_verbosity(absl_logging.ERROR)
    collect_less()  # the bodies import jax and the rest themselves, after their device setup
    try:
        return body()
    except user_errors() as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
