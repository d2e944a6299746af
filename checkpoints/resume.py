"""Where a run starts: its own newest complete checkpoint, another run's, or step 0.

Its own checkpoints win over ``checkpoint.restore_from``: a run started from another run's
weights and then preempted must resume its own progress, not start over.
"""
from __future__ import annotations

import json

from checkpoints.compat import checker
from checkpoints.manager import Checkpoints, locate
from errors import CheckpointError, DataError


def run_meta(config, fingerprint: str, mesh) -> dict:
    """What each checkpoint records about the run that wrote it."""
    return {"config": json.loads(config.to_json_best_effort()), "tokenizer": fingerprint,
            "mesh": {k: int(v) for k, v in mesh.shape.items()},
            "layout": config.attention.layout}


def _restore_data(pipe, data_state: dict, where: str):
    try:
        pipe.train.restore(data_state)
    except DataError as e:
        raise CheckpointError(f"{e} ({where}); to take only its weights, add "
                              f"--config.checkpoint.restore_weights_only=True") from None


def start_state(config, trainer, pipe, ckpts: Checkpoints, log) -> tuple[int, object]:
    """(step, TrainState) to continue from; restores the data iterator's position with it."""
    fits = checker(config, pipe.fingerprint)
    steps = int(config.train.steps)

    def check(meta, step, path):  # on metadata only, before any array is read
        fits(meta, step, path)
        if meta.get("params_only"):
            raise CheckpointError(
                f"checkpoint step {step} ({path}) holds weights only (scripts/convert_hf.py "
                f"import): start from it in a new --workdir with "
                f"--config.checkpoint.restore_from=<its run> "
                f"--config.checkpoint.restore_weights_only=True")
        if step > steps:
            raise CheckpointError(f"the checkpoint to continue from is at step {step}, past "
                                  f"train.steps={steps}; raise --config.train.steps to go on")

    k = config.checkpoint
    own = ckpts.restore(trainer.abstract_state, check=check)
    if own is not None:
        if k.restore_from:
            log(f"checkpoint.restore_from={k.restore_from} is ignored: this run resumes from its "
                f"own checkpoints")
        _restore_data(pipe, own.data, str(own.path))
        log(f"resuming from step {own.step} ({own.path})")
        return own.step, own.state
    if not k.restore_from:
        return 0, trainer.init(config.train.seed)

    directory, step = locate(k.restore_from)
    other = Checkpoints(directory, log=log)
    fresh_adapters = False
    try:
        if k.restore_weights_only:
            abstract = trainer.abstract_state.params
            held = other.holds_adapters(step)
            if held and trainer.lora is None:
                raise CheckpointError(
                    f"checkpoint.restore_from={k.restore_from} holds LoRA adapters and this run "
                    f"has none (train.lora.rank=0): give it the same train.lora, or merge them "
                    f"first (scripts/convert_hf.py export --merge, then import)")
            # a base model's weights under new adapters (model/lora.py: B zero, the base's
            # function), or a LoRA run's weights with its adapters
            fresh_adapters = trainer.lora is not None and not held
            if fresh_adapters:
                abstract = trainer.without_adapters(abstract)
            got = other.restore_params(abstract, step=step, check=fits)
        else:
            got = other.restore(trainer.abstract_state, step=step, check=check)
    finally:
        other.close()
    if got is None:
        raise CheckpointError(f"checkpoint.restore_from: no complete checkpoint in {directory}")
    if k.restore_weights_only:
        log(f"starting from the weights of step {got.step} ({got.path}): fresh optimizer, "
            f"step 0, data from the beginning")
        params = got.params
        if fresh_adapters:
            params = trainer.with_adapters(params, trainer.fresh_adapters(config.train.seed))
            log(f"LoRA: new adapters of rank {trainer.lora.rank} on "
                f"{', '.join(trainer.lora.targets)} (B zero: step 0 is these weights' model)")
        return 0, trainer.init_from(params)
    _restore_data(pipe, got.data, str(got.path))
    log(f"starting from step {got.step} of another run ({got.path}): weights, optimizer state "
        f"and data position")
    return got.step, got.state
