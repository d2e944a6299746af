"""What a step minimises, over one global batch: next-token cross-entropy (pretraining, SFT) or a
preference loss on packed pairs (DPO), each a sum over the batch divided by a count over the
whole batch, so that microbatches, meshes and packing give the same number.

An objective gives the batch's counts (``counts``, from the whole batch before it is split into
microbatches), the part of the loss a (micro)batch contributes given those counts
(``contribution``: differentiable, plus sums to report), and what the reported sums mean
(``metrics``).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from model import preference


class LanguageModeling:
    """The mean cross-entropy over the trained (``loss_mask``) tokens."""
    count_key = "tokens"
    batch_keys = ()

    def __init__(self, config):
        self.config = config

    def counts(self, batch) -> dict:
        return {"tokens": jnp.maximum(batch["loss_mask"].sum(), 1.0)}

    def contribution(self, token_losses_BL, batch, counts):
        return token_losses_BL.sum() / counts["tokens"], {}

    def metrics(self, sums: dict, counts: dict) -> dict:
        return {}


class Preference:
    """DPO and its variants on pairs packed whole (model/preference.py): the mean per-pair loss
    over the batch's pairs, plus ``dpo.rpo_alpha`` times the chosen responses' mean
    cross-entropy (RPO). The reference's per-sequence log-probabilities come in the batch
    (``ref_logps``: each sequence's sum at one of its tokens; data/preference.py)."""
    count_key = "pairs"
    batch_keys = ("ref_logps",)

    def __init__(self, config):
        self.config, self.p = config, config.dpo
        self.seq_len = int(config.data.seq_len)

    def _sides(self, values_BL, batch):
        return preference.pairs(values_BL, batch["segment_ids"], self.seq_len)

    def sides_logps(self, token_losses_BL, batch):
        """(chosen [B, P], rejected [B, P]) log-probabilities of each row's pairs' responses."""
        nll_c, nll_r = self._sides(token_losses_BL, batch)
        return -nll_c, -nll_r

    def counts(self, batch) -> dict:
        present_c, _ = self._sides(batch["loss_mask"], batch)
        chosen_tokens = present_c.sum()
        return {"pairs": jnp.maximum((present_c > 0).sum().astype(jnp.float32), 1.0),
                "chosen_tokens": jnp.maximum(chosen_tokens, 1.0),
                "tokens": jnp.maximum(batch["loss_mask"].sum(), 1.0)}

    def contribution(self, token_losses_BL, batch, counts):
        p = self.p
        tokens = self._sides(batch["loss_mask"], batch)  # each side's response tokens (IPO's mean)
        present = tokens[0] > 0
        nll_c, nll_r = self._sides(token_losses_BL, batch)  # token_losses are -log p
        ref_c, ref_r = self._sides(batch["ref_logps"], batch)
        loss, reward_c, reward_r = preference.losses(
            -nll_c, -nll_r, ref_c, ref_r, beta=float(p.beta), loss_type=p.loss_type,
            label_smoothing=float(p.label_smoothing), tokens=tokens)
        total = jnp.where(present, loss, 0.0).sum() / counts["pairs"]
        if p.rpo_alpha:
            total = total + float(p.rpo_alpha) * jnp.where(present, nll_c, 0.0).sum() / counts["chosen_tokens"]
        on = lambda x: jnp.where(present, x, 0.0).sum()  # noqa: E731
        sums = {"reward_chosen": on(reward_c), "reward_rejected": on(reward_r),
                "reward_accuracy": on((reward_c > reward_r).astype(jnp.float32)),
                "reward_margin": on(reward_c - reward_r),
                "dpo_loss": jax.lax.stop_gradient(on(loss))}
        return total, sums

    def metrics(self, sums: dict, counts: dict) -> dict:
        return {k: v / counts["pairs"] for k, v in sums.items()} | {"pairs": counts["pairs"]}


def of(config):
    """The objective ``config.data.format`` trains: preference pairs are DPO, the rest
    language modeling."""
    if config.data.get("format", "text") == "preference":
        return Preference(config)
    return LanguageModeling(config)
