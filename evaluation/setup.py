"""Where a trained run is evaluated (scripts/eval.py, scripts/eval_passkey.py): the run's own
mesh, attention and layout when this machine has the devices for them, else one device with
dense attention in the contiguous layout (the parameters depend on neither, and the loss is
the same). On a CPU both scripts simulate the run's devices first
(parallel/host_devices.simulate_for_run), so the run's own mesh is the usual case.
"""
from __future__ import annotations


def eval_setup(config, log):
    """(config, mesh) to evaluate on: the run's when it fits this machine, else one device.
    ``model.remat=auto`` becomes ``full``: nothing is differentiated, so the policy changes
    nothing, and choosing one would compile a train step per policy."""
    import jax

    from errors import ConfigError
    from parallel.mesh import make_mesh
    from configs.validate import validate
    if config.model.remat == "auto":
        config = config.copy_and_resolve_references()
        config.model.remat = "full"
    try:
        validate(config, jax.device_count())
        return config, make_mesh(config.mesh)
    except ConfigError as e:
        log(f"the run's mesh does not fit {jax.device_count()} device(s) ({e}); evaluating on "
            f"one device with dense attention, contiguous layout")
    config = config.copy_and_resolve_references()
    config.mesh.update(data=1, fsdp=1, sequence=1, tensor=1)
    config.attention.update(impl="dense", layout="contiguous")
    return config, make_mesh(config.mesh, jax.devices()[:1])
