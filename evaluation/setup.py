"""Where a trained run is evaluated (scripts/eval.py, scripts/eval_passkey.py): the run's own
mesh, attention and layout when this machine has the devices for them, else one device with
dense attention in the contiguous layout (the parameters depend on neither, and the loss is
the same). On a CPU both scripts simulate the run's devices first
(parallel/host_devices.simulate_for_run), so the run's own mesh is the usual case.
"""
from __future__ import annotations


def eval_setup(config, log):
    """(config, mesh) to evaluate on: the run's when it fits this machine, else one device.
    Only a mesh that does not fit falls back (said in one line); any other mistake in the config
    stops as its own ConfigError. ``model.remat=auto`` becomes ``full``: nothing is
    differentiated, so the policy changes nothing, and choosing one would compile a train step
    per policy."""
    import math

    import jax

    from configs.validate import validate
    from errors import MeshError
    from parallel.mesh import AXES, make_mesh, mesh_shape
    if config.model.remat == "auto":
        config = config.copy_and_resolve_references()
        config.model.remat = "full"
    here = jax.device_count()
    try:
        mesh_shape(config.mesh, here)
    except MeshError as e:
        why = str(e)
    else:
        validate(config, here)
        return config, make_mesh(config.mesh)
    # Every other field checked as on the run's own devices (a mesh axis of -1: one), so that
    # what one device would not mend stops here in its own line, the mesh's too if it is not
    # a mesh at all (an axis of 0, two of -1).
    validate(config, math.prod(max(int(config.mesh[a]), 1) for a in AXES))
    log(f"the run's mesh does not fit {here} device(s) ({why}); evaluating on one device with "
        f"dense attention, contiguous layout")
    config = config.copy_and_resolve_references()
    config.mesh.update(data=1, fsdp=1, sequence=1, tensor=1)
    config.attention.update(impl="dense", layout="contiguous")
    validate(config, 1)
    return config, make_mesh(config.mesh, jax.devices()[:1])
