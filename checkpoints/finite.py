"""Is a restored checkpoint finite? A run never continues from a diverged state.

Runs now check the state before every save, so they never write a non-finite one; runs from
before that did (a NaN at step 3 was only noticed at the next log step, after saving steps 3
to 10), so every restore still checks what it read: the state's ``bad_step`` and the
parameters themselves.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


@jax.jit
def _all_finite(tree):
    leaves = [jnp.isfinite(x).all() for x in jax.tree.leaves(tree)]
    return jnp.stack(leaves).all() if leaves else jnp.bool_(True)


def problem(state, params) -> str | None:
    """Why a restored checkpoint must not be continued from, or None when it is finite."""
    bad = getattr(state, "bad_step", None)
    if bad is not None and int(bad) >= 0:
        return (f"its state is not finite (training diverged at step {int(bad) + 1}, before "
                f"this save)")
    if not bool(_all_finite(params)):
        return "its parameters are not finite (NaN or inf)"
    return None
