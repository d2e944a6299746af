"""``model.remat=auto``: the policy with the least recompute whose compiled train step fits the
devices' memory.

The policies, least recompute first: ``none`` (keep every activation), ``attention`` (keep the
projection matmuls), ``offload`` (the same, kept in host memory), ``full`` (keep only each
layer's input), ``offload_input`` (that, in host memory). On a CPU the offload policies are the
others (no separate host memory), so they are not tried. Each candidate's step is compiled for
the run's mesh (no weights made; the planner's fast compile, ``Trainer.step_bytes``) and its
per-device bytes (state + batch + outputs not written in place + temporaries, XLA's own
accounting) compared with the budget: ``train.memory_budget_gib`` when set (the tests force
each choice with it), else 90% of the device's own limit (``memory_stats()["bytes_limit"]``).
Where neither is known (a CPU) ``none`` is chosen without compiling. ``training.state.Trainer``
resolves it, so every script that trains resolves it the same way.
"""
from __future__ import annotations

import copy

from errors import ConfigError

ORDER = ("none", "attention", "offload", "full", "offload_input")
HOST_OFFLOAD = ("offload", "offload_input")
GIB = 2 ** 30
USABLE = 0.9  # of a device's own memory (planning/hardware.py's USABLE_FRACTION)


def budget(config, device) -> tuple[int | None, str]:
    """(bytes per device, where the figure comes from); None: no limit known."""
    gib = float(config.train.get("memory_budget_gib", 0) or 0)
    if gib > 0:
        return int(gib * GIB), f"train.memory_budget_gib={gib:g}"
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    limit = (stats or {}).get("bytes_limit")
    if limit:  # headroom for fragmentation and kernels' workspaces, as the planner leaves
        return int(limit * USABLE), (f"{USABLE:.0%} of the {device.device_kind}'s "
                                     f"{limit / GIB:.1f} GiB")
    return None, "no memory limit known"


ORDER_ON_CPU = tuple(p for p in ORDER if p not in HOST_OFFLOAD)


def candidates(platform: str) -> tuple[str, ...]:
    return ORDER_ON_CPU if platform == "cpu" else ORDER


def with_remat(config, policy: str):
    c = copy.deepcopy(config)
    with c.unlocked():
        c.model.remat = policy
    return c


def choose(config, mesh, measure) -> tuple[str, str]:
    """(policy, one line saying why) for ``config`` (whose ``model.remat`` is ``auto``) on
    ``mesh``; ConfigError in one line when no policy fits. ``measure(config, mesh)``: per-device
    bytes of the config's compiled step."""
    device = mesh.devices.flat[0]
    limit, source = budget(config, device)
    order = candidates(device.platform)
    if limit is None:
        return order[0], f"remat auto: {order[0]} ({source}: the least recompute)"
    needs = {}
    for policy in order:
        needs[policy] = measure(with_remat(config, policy), mesh)
        if needs[policy] <= limit:
            tried = "".join(f"; {p} needs {b / GIB:.2f} GiB" for p, b in needs.items()
                            if p != policy)
            return policy, (f"remat auto: {policy}, the least recompute that fits "
                            f"({needs[policy] / GIB:.2f} GiB per device of {source}{tried})")
    listed = ", ".join(f"{p} {b / GIB:.2f} GiB" for p, b in needs.items())
    raise ConfigError(f"model.remat=auto: no policy fits {source} per device ({listed}); lower "
                      f"data.batch_size or data.seq_len, raise train.microbatches, or shard "
                      f"more (mesh.fsdp, mesh.sequence)")


def resolve(config, mesh, measure):
    """(``config`` with ``model.remat`` resolved, the line saying why or None): unchanged unless
    it is ``auto``. ``measure(config, mesh)``: per-device bytes of its compiled step (the
    trainer's ``step_bytes``, handed in: this module sits below training/state.py)."""
    if config.model.remat != "auto":
        return config, None
    policy, why = choose(config, mesh, measure)
    return with_remat(config, policy), why
