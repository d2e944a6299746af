"""An ``ocp.CheckpointManager`` wrapper: train state, data iterator state and run metadata per step.

A step directory holds three items written together, asynchronously:
  state  the TrainState (params, optimizer state, step counter, bad_step), a PyTree
  data   the data iterator's position and identity, JSON
  meta   the run's config and tokenizer fingerprint, JSON, so that a restore can refuse a model
         or tokenizer that does not match before reading any array
There is no RNG key to save: the model has no stochastic layers, parameters come from
``train.seed`` once, and the data order is a function of ``data.shuffle_seed`` and the data
state, so the step counter is the only thing randomness could depend on, and it is saved.

Only complete checkpoints count. Orbax 0.12.8 writes each step into
``<step>.orbax-checkpoint-tmp-*`` and renames it after writing ``commit_success.txt`` into it,
so a process killed mid-save leaves a tmp directory, never a step directory; those are
reported and removed. A step directory that lacks the commit marker, fails to restore
(copied half-way, truncated files) or holds a non-finite state (finite.py) is reported and
skipped, and the next older one is tried; once one restores, the skipped newer ones are moved
to ``skipped/``. At least two checkpoints are kept whatever ``checkpoint.keep`` says: a
divergence noticed after a save can still roll back past it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import pathlib
import re
import sys
import time
from typing import Any, Callable

import jax
import numpy as np
import orbax.checkpoint as ocp

from checkpoints import finite, storage
from checkpoints.compat import check_param_shapes
from checkpoints.storage import COMMIT_MARKER
from errors import CheckpointError
from parallel.distributed import is_peer_error

TMP_MARKER = ".orbax-checkpoint-tmp"
SKIPPED_DIR = "skipped"  # broken step directories are moved here, not deleted: they may be evidence
MIN_KEEP = 2  # the newest finite checkpoint and the one before it survive any divergence
_STEP_NAME = re.compile(r"^(0|[1-9]\d*)$")


@dataclasses.dataclass
class Restored:
    step: int
    path: pathlib.Path
    meta: dict
    state: Any = None  # the full TrainState (restore) or None (restore_params)
    params: Any = None
    data: dict | None = None


def _state_handler(copy_host_arrays: bool = True) -> ocp.PyTreeCheckpointHandler:
    """The train state's handler: orbax's defaults, except that each array shard is written
    from one replica. Replica-parallel writing (orbax's default off GPU) slices replicated
    shards on device, and compiling those slices made the first save stall training for
    seconds (72 programs for the tiny model); orbax itself turns it off for GPUs.
    ``copy_host_arrays`` False: numpy arrays are written as they are, not copied first (orbax
    copies them in case the caller changes them while a background save runs; a save that
    returns only once written needs no copy: SmolLM2's import copied 333 MB for 5 of its 16 s,
    most of it the copy's page faults)."""
    from orbax.checkpoint._src.metadata import array_metadata_store
    th = ocp.type_handlers
    ours = {jax.Array: th.ArrayHandler(use_replica_parallel=False,
                                       array_metadata_store=array_metadata_store.Store())}
    if not copy_host_arrays:
        ours[np.ndarray] = th.NumpyHandler(deepcopy_host_arrays=False)
    handlers = [(ty, ours.get(ty) or th.get_type_handler(ty)) for ty in th.supported_types()]
    return ocp.PyTreeCheckpointHandler(
        type_handler_registry=th.create_type_handler_registry(*handlers))


def _quiet_orphaned_reads():
    """After a failed read, tensorstore still completes the reads orbax had started, and their
    callbacks find orbax's event loop closed; Python would print each as a traceback, even
    before the failure reaches us. They are noise next to the one-line report of the skipped
    checkpoint, so exactly that error is dropped."""
    previous = sys.unraisablehook
    if getattr(previous, "_drops_closed_loop", False):
        return

    def hook(unraisable):
        e = unraisable.exc_value
        if isinstance(e, RuntimeError) and str(e) == "Event loop is closed":
            return
        previous(unraisable)

    hook._drops_closed_loop = True
    sys.unraisablehook = hook
    storage.quiet_orphaned_futures()  # the sibling reads of a failed one, never awaited


def _first_line(e: BaseException, limit: int = 160) -> str:
    text = str(e).strip().splitlines()
    line = text[0] if text else type(e).__name__
    return line if len(line) <= limit else line[:limit - 3] + "..."


class Checkpoints:
    def __init__(self, directory: str | pathlib.Path, ckpt_cfg=None, *,
                 log: Callable[[str], None] = print):
        """``ckpt_cfg`` is ``config.checkpoint`` (keep, keep_every, async_save) for the run that
        writes here; without it the checkpoints are read-only (generate, eval, another run's
        checkpoints) and nothing on disk changes."""
        self.directory = pathlib.Path(directory).absolute()
        self.read_only, self.log = ckpt_cfg is None, log
        self._in_flight: int | None = None  # the step whose (background) write may still fail
        if self.read_only and not self.directory.is_dir():
            raise CheckpointError(f"no checkpoint directory at {self.directory}")
        self._report_interrupted_writes()
        if self.read_only:
            # Not orbax's read_only mode, which warns about every option it overrides: this
            # manager simply never saves, deletes or cleans up.
            options = ocp.CheckpointManagerOptions(create=False, enable_async_checkpointing=False)
        else:
            storage.quiet_background_failures()
            _quiet_orphaned_reads()  # a failed write strands tensorstore callbacks the same way
            options = ocp.CheckpointManagerOptions(
                max_to_keep=max(ckpt_cfg.keep, MIN_KEEP), keep_period=ckpt_cfg.keep_every or None,
                enable_async_checkpointing=bool(ckpt_cfg.async_save), create=True,
                cleanup_tmp_directories=True)
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_handlers={
            "state": _state_handler(copy_host_arrays=not self.read_only
                                    and bool(ckpt_cfg.async_save)),
            "data": ocp.JsonCheckpointHandler(),
            "meta": ocp.JsonCheckpointHandler()})

    # -- what is on disk -------------------------------------------------------------------
    def steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def path(self, step: int) -> pathlib.Path:
        return self.directory / str(step)

    def _report_interrupted_writes(self):
        if not self.directory.is_dir():
            return
        for p in sorted(self.directory.iterdir()):
            if TMP_MARKER in p.name:
                step = p.name.split(".", 1)[0]
                action = "ignoring it" if self.read_only else "removing it"
                self.log(f"checkpoint: skipping step {step}: {p} is a save that never finished "
                         f"(the writer was stopped mid-save); {action}")

    def _incomplete(self, step: int) -> str | None:
        """Why the step directory cannot be a finished checkpoint, or None when it looks whole."""
        path = self.path(step)
        if not (path / COMMIT_MARKER).is_file():
            return f"it has no {COMMIT_MARKER} (the write never committed)"
        # meta is optional: checkpoints from before it existed still restore, unchecked.
        missing = [item for item in ("state", "data") if not (path / item).is_dir()]
        if missing:
            return f"it lacks the {', '.join(missing)} item(s)"
        return None

    # -- save --------------------------------------------------------------------------------
    def save(self, step: int, state, data_state: dict, meta: dict, force: bool = False) -> bool:
        assert not self.read_only, "a read-only Checkpoints never saves"
        """Starts a save (asynchronous when configured); returns whether one was started.

        The call returns once the arrays are copied off the device, so the caller may donate
        ``state`` to the next step; the write to disk continues in the background."""
        if step in self.manager.all_steps():
            return False
        self.wait()  # a failure of the previous (background) save surfaces under its own step
        with self._writing(step):
            started = self.manager.save(step, args=ocp.args.Composite(
                state=ocp.args.PyTreeSave(state), data=ocp.args.JsonSave(data_state),
                meta=ocp.args.JsonSave({**meta, "step": int(step)})), force=force)
        self._in_flight = step if started else None
        return started

    def wait(self):
        with self._writing(self._in_flight):
            self.manager.wait_until_finished()
        self._in_flight = None

    @contextlib.contextmanager
    def _writing(self, step: int | None):
        """A failed write of ``step`` becomes a StorageError, its partial write removed."""
        try:
            yield
        except Exception as e:
            if step is None or is_peer_error(e):  # a lost peer is not the disk's fault
                raise
            self._in_flight = None
            storage.remove_partial(self.directory, step, COMMIT_MARKER)
            newest = self.manager.latest_step()
            raise storage.failed(step, self.path(step), e, newest,
                                 None if newest is None else self.path(newest)) from None

    def close(self):
        self.manager.close()

    # -- restore -----------------------------------------------------------------------------
    def restore(self, abstract_state, *, step: int | None = None, below: int | None = None,
                check: Callable[[dict, int, pathlib.Path], None] | None = None) -> Restored | None:
        """The newest complete, finite checkpoint (or exactly ``step``; or the newest before
        step ``below``), placed on ``abstract_state``'s shardings: one written on another mesh
        or layout restores onto this one. None when there is no checkpoint at all.
        ``check(meta, step, path)`` raises CheckpointError when the checkpoint does not fit
        this run."""

        def load(s: int) -> Restored:
            out = self.manager.restore(s, args=ocp.args.Composite(
                state=ocp.args.PyTreeRestore(
                    item=abstract_state,
                    restore_args=ocp.checkpoint_utils.construct_restore_args(abstract_state)),
                data=ocp.args.JsonRestore()))
            return Restored(step=s, path=self.path(s), meta={}, state=out["state"],
                            params=out["state"].params, data=out["data"])

        return self._newest(load, abstract_state.params, step, check, below)

    def restore_params(self, abstract_params, *, step: int | None = None,
                       check: Callable[[dict, int, pathlib.Path], None] | None = None
                       ) -> Restored | None:
        """Only the parameters of the newest complete checkpoint (or exactly ``step``), on
        ``abstract_params``' shardings; the optimizer state is never read."""

        def load(s: int) -> Restored:
            target = {"params": abstract_params}
            out = _state_handler().restore(self.path(s) / "state", args=ocp.args.PyTreeRestore(
                item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target),
                partial_restore=True))
            return Restored(step=s, path=self.path(s), meta={}, params=out["params"])

        return self._newest(load, abstract_params, step, check)

    def holds_adapters(self, step: int | None = None) -> bool:
        """Whether the parameters of ``step`` (the newest by default) hold LoRA adapters
        (model/lora.py: a key ``lora_*``), read from the tree's metadata alone."""
        steps = self.steps()
        if not steps:
            return False
        try:
            tree = self._meta(steps[-1] if step is None else step)[1]
        except Exception:  # unreadable: the restore that follows says why
            return False
        def holds(node) -> bool:
            return isinstance(node, dict) and any(
                str(k).startswith("lora_") or holds(v) for k, v in node.items())
        return holds(tree.get("params") if isinstance(tree, dict) else None)

    def _meta(self, step: int) -> tuple[dict, Any]:
        """(run metadata, stored tree metadata of the state item) of one step."""
        meta = {}
        if (self.path(step) / "meta").is_dir():
            out = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
            meta = dict(out["meta"] or {})
        tree = _state_handler().metadata(self.path(step) / "state").tree
        return meta, tree

    def _newest(self, load, abstract_params, only: int | None, check,
                below: int | None = None) -> Restored | None:
        steps = [s for s in self.steps() if below is None or s < below]
        if only is not None:
            if only not in steps:
                raise CheckpointError(f"no checkpoint for step {only} in {self.directory} "
                                      f"(steps there: {steps or 'none'})")
            steps = [only]
        if not steps:
            return None
        skipped: list[tuple[int, str]] = []
        _quiet_orphaned_reads()
        for s in reversed(steps):
            reason = self._incomplete(s)
            if reason is None:
                try:
                    meta, tree = self._meta(s)
                except Exception as e:  # unreadable metadata: a damaged directory
                    reason = f"its metadata cannot be read ({_first_line(e)})"
            if reason is None:
                # A mismatch with this run's config is the user's to fix, not damage to skip.
                if check is not None:
                    check(meta, s, self.path(s))
                stored = tree.get("params") if isinstance(tree, dict) else None
                if stored is not None:
                    check_param_shapes(stored, abstract_params, self.path(s))
                try:
                    restored = load(s)
                except Exception as e:
                    reason = f"it cannot be read ({_first_line(e)})"
                else:
                    reason = finite.problem(restored.state, restored.params)
            if reason is not None:
                skipped.append((s, reason))
                self.log(f"checkpoint: skipping step {s} ({self.path(s)}): {reason}")
                continue
            restored.meta = meta
            self._set_aside([s for s, _ in skipped])
            return restored
        raise CheckpointError(
            f"no checkpoint in {self.directory} could be restored: "
            + "; ".join(f"step {s}: {r}" for s, r in skipped)
            + " (move the directory aside to start fresh)")

    def discard_after(self, step: int):
        """Moves every checkpoint newer than ``step`` to ``skipped/``: a rollback to ``step``
        rewrites what follows it, and those step numbers will be saved again."""
        self._set_aside([s for s in self.steps() if s > step])

    def _set_aside(self, steps: list[int]):
        """Moves broken step directories newer than the one restored out of the way, so that
        this run can save those step numbers again and retention never counts them. Only
        once an older checkpoint restored: if every one fails, the cause may be here, not on
        disk, and nothing is moved."""
        if self.read_only or not steps:
            return
        if jax.process_index() == 0:
            aside = self.directory / SKIPPED_DIR
            aside.mkdir(exist_ok=True)
            for s in steps:
                dest = aside / f"{s}-{time.strftime('%Y%m%d-%H%M%S')}"
                self.path(s).rename(dest)
                self.log(f"checkpoint: moved the skipped step {s} to {dest}")
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils
            multihost_utils.sync_global_devices("checkpoints: set aside skipped steps")
        self.manager.reload()


def is_step_dir(path: pathlib.Path) -> bool:
    return bool(_STEP_NAME.match(path.name)) and (path / "state").is_dir()


def locate(path: str | pathlib.Path) -> tuple[pathlib.Path, int | None]:
    """(checkpoint directory, step or None for its newest) for a user-given path: a run
    directory, its ``checkpoints`` directory, or one step directory in it."""
    p = pathlib.Path(path).expanduser().absolute()
    if not p.exists():
        raise CheckpointError(f"checkpoint.restore_from: no such path {p}")
    if is_step_dir(p):
        return p.parent, int(p.name)
    if (p / "checkpoints").is_dir():
        p = p / "checkpoints"
    if not any(_STEP_NAME.match(c.name) for c in p.iterdir() if c.is_dir()):
        raise CheckpointError(f"checkpoint.restore_from: no checkpoints in {p} (give a run "
                              f"directory, its checkpoints/ directory, or one step directory)")
    return p, None
