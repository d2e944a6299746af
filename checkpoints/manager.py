"""A thin wrapper over ``ocp.CheckpointManager``: train state + data iterator state per step."""
from __future__ import annotations

import pathlib

import jax
import orbax.checkpoint as ocp


class Checkpoints:
    def __init__(self, directory: str | pathlib.Path, ckpt_cfg):
        self.directory = pathlib.Path(directory).absolute()
        options = ocp.CheckpointManagerOptions(
            max_to_keep=ckpt_cfg.keep,
            keep_period=ckpt_cfg.keep_every or None,
            enable_async_checkpointing=ckpt_cfg.async_save,
            create=True,
        )
        self.manager = ocp.CheckpointManager(self.directory, options=options)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state, data_state: dict, force: bool = False) -> bool:
        """Starts a (possibly asynchronous) save; returns whether one was started."""
        return self.manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state)), force=force)

    def restore(self, abstract_state, step: int | None = None):
        """(state, data_state) at ``step`` (newest when None), placed on ``abstract_state``'s
        shardings: a checkpoint written on another mesh restores onto this one."""
        step = self.latest_step() if step is None else step
        out = self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore()))
        return out["state"], out["data"]

    def path(self, step: int) -> pathlib.Path:
        return self.directory / str(step)

    def wait(self):
        self.manager.wait_until_finished()

    def close(self):
        self.manager.close()
