"""Preference losses on packed pairs: per-sequence log-probabilities from per-token ones, DPO
and its variants (Rafailov et al. 2023; IPO, Azar et al. 2023; RPO's SFT term, Pang et al.
2024), as TRL's DPOTrainer defines them (IPO included: on per-token averages).

A row holds pairs packed whole: pair k of a row (k = 1, 2, ...) is the chosen sequence with
segment id 2k - 1 and the rejected one with 2k (0: padding). A sequence's log-probability is
the sum of its response tokens' log-probabilities (the ``loss_mask`` tokens), gathered by
segment over the whole row, so the layout (any permutation of the row) does not matter.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

LOSS_TYPES = ("sigmoid", "ipo", "hinge")


def max_segments(seq_len: int) -> int:
    """A bound on the segments of a row: a sequence has at least 2 tokens (a label needs one
    before it), so at most seq_len / 2 of them, plus segment 0."""
    return seq_len // 2 + 1


def segment_sums(values_BL, segment_ids_BL, num_segments: int):
    """``[B, num_segments]``: per row, the sum of ``values`` over each segment id."""
    B = values_BL.shape[0]
    index = (jnp.arange(B, dtype=jnp.int32)[:, None] * num_segments
             + segment_ids_BL.astype(jnp.int32))
    sums = jax.ops.segment_sum(values_BL.reshape(-1), index.reshape(-1),
                               num_segments=B * num_segments)
    return sums.reshape(B, num_segments)


def pairs(values_BL, segment_ids_BL, seq_len: int):
    """(chosen [B, P], rejected [B, P]) per-sequence sums of ``values`` (P = pairs a row can
    hold)."""
    sums = segment_sums(values_BL, segment_ids_BL, max_segments(seq_len) + 1)
    n = (sums.shape[1] - 1) // 2
    return sums[:, 1:2 * n:2], sums[:, 2:2 * n + 1:2]


def losses(policy_chosen, policy_rejected, ref_chosen, ref_rejected, *, beta: float,
           loss_type: str = "sigmoid", label_smoothing: float = 0.0, tokens=None):
    """Per-pair loss and the implicit rewards ``beta * (policy - reference)`` of each side, from
    per-side sums of log-probabilities. ``tokens``: (chosen, rejected) counts of each side's
    response tokens, which IPO needs."""
    logits = (policy_chosen - policy_rejected) - (ref_chosen - ref_rejected)
    if loss_type == "sigmoid":  # DPO; label smoothing: conservative DPO (cDPO)
        loss = (-jax.nn.log_sigmoid(beta * logits) * (1 - label_smoothing)
                - jax.nn.log_sigmoid(-beta * logits) * label_smoothing)
    elif loss_type == "ipo":
        # TRL's IPO: each side's log-ratio averaged over its response tokens, so the target
        # 1/(2 beta) is per token and does not scale with the responses' lengths (the form the
        # IPO authors confirmed to TRL); the rewards stay sums, as TRL logs them. At least one
        # token: a padding pair's 0/0 is a NaN whose gradient the caller's mask does not stop.
        n_chosen, n_rejected = (jnp.maximum(n, 1) for n in tokens)
        logits = ((policy_chosen - ref_chosen) / n_chosen
                  - (policy_rejected - ref_rejected) / n_rejected)
        loss = (logits - 1 / (2 * beta)) ** 2
    elif loss_type == "hinge":
        loss = jax.nn.relu(1 - beta * logits)
    else:
        raise ValueError(f"dpo.loss_type={loss_type!r} is not one of {', '.join(LOSS_TYPES)}")
    chosen = beta * jax.lax.stop_gradient(policy_chosen - ref_chosen)
    rejected = beta * jax.lax.stop_gradient(policy_rejected - ref_rejected)
    return loss, chosen, rejected
