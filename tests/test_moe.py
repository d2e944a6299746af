"""model/moe.py: the router, the dispatch and the experts against a dense float64 reference
(every expert on every token, weighted by the router), for both scorings and both grouped
matmuls, ties and a capacity included; the load-balancing loss against transformers' own
function; the same train step on one device, striped over 8 with the experts split over the
ring, on zigzag usp over fsdp, and in 2 microbatches under the rule docs/moe.md states."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model import moe


def reference(x, router, w_gate, w_up, w_down, top_k, kind, renormalize, capacity=0):
    """float64 numpy: every expert on every token, each token's output the sum over its k
    picks (lowest index first among equal scores) of weight x that expert's gated MLP."""
    x, router, w_gate, w_up, w_down = (np.asarray(a, np.float64) for a in
                                       (x, router, w_gate, w_up, w_down))
    logits = x @ router
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    score = probs if kind == "softmax_topk" else logits
    picks = np.argsort(-score, axis=-1, kind="stable")[:, :top_k]
    weights = np.take_along_axis(score, picks, -1)
    if kind == "topk_softmax":
        weights = np.exp(weights - weights.max(-1, keepdims=True))
        weights /= weights.sum(-1, keepdims=True)
    elif renormalize:
        weights = weights / weights.sum(-1, keepdims=True)
    gate = np.einsum("td,edf->tef", x, w_gate)
    every = np.einsum("tef,efd->ted", gate / (1 + np.exp(-gate)) * np.einsum(
        "td,edf->tef", x, w_up), w_down)
    if capacity:  # each expert keeps its first `capacity` picks in (token, rank) order
        taken = np.zeros(router.shape[1], int)
        for t in range(x.shape[0]):
            for r in range(top_k):
                e = picks[t, r]
                if taken[e] >= capacity:
                    weights[t, r] = 0.0
                taken[e] += 1
    out = np.einsum("tk,tkd->td", weights, np.take_along_axis(every, picks[:, :, None], 1))
    return out, picks, probs


def weights_of(rng, D, E, F):
    return (rng.normal(0, 1, (D, E)), rng.normal(0, 0.5, (E, D, F)),
            rng.normal(0, 0.5, (E, D, F)), rng.normal(0, 0.5, (E, F, D)))


@pytest.mark.parametrize("kind,renormalize,impl", [("softmax_topk", True, "blocks"),
                                                   ("softmax_topk", False, "ragged"),
                                                   ("topk_softmax", False, "blocks"),
                                                   ("softmax_topk", True, "dense")])
def test_router_dispatch_and_experts_are_the_dense_float64_reference(rng, kind, renormalize,
                                                                     impl):
    T, D, E, F, K = 300, 16, 8, 12, 3
    x = rng.normal(0, 1, (T, D))
    router, w_gate, w_up, w_down = weights_of(rng, D, E, F)
    router[:, 5] = router[:, 2]  # experts 2 and 5 always tie: the lower index wins
    f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    weights, experts, probs = moe.route(f32(x) @ f32(router), K, kind, renormalize)
    got, dropped = moe.experts_forward(f32(x), weights, experts, f32(w_gate), f32(w_up),
                                       f32(w_down), impl=impl)
    want, picks, want_probs = reference(x, router, w_gate, w_up, w_down, K, kind, renormalize)
    assert np.array_equal(np.asarray(experts), picks) and int(dropped) == 0
    assert not np.any((picks == 5) & ~np.any(picks == 2, axis=1, keepdims=True))
    np.testing.assert_allclose(np.asarray(probs), want_probs, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-4, atol=2e-4 * np.abs(want).max())


def test_a_capacity_drops_the_later_picks_and_counts_them(rng):
    T, D, E, F, K = 200, 8, 4, 8, 2
    x = rng.normal(0, 1, (T, D))
    router, w_gate, w_up, w_down = weights_of(rng, D, E, F)
    router[:, 0] += 0.8  # a favourite expert, which overflows
    capacity = int(np.ceil(1.0 * T * K / E))
    f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    weights, experts, _ = moe.route(f32(x) @ f32(router), K)
    got, dropped = moe.experts_forward(f32(x), weights, experts, f32(w_gate), f32(w_up),
                                       f32(w_down), capacity=capacity)
    want, picks, _ = reference(x, router, w_gate, w_up, w_down, K, "softmax_topk", True,
                               capacity)
    over = np.bincount(picks.reshape(-1), minlength=E) - capacity
    assert int(dropped) == over.clip(0).sum() > 0
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-4, atol=2e-4 * np.abs(want).max())


def test_the_load_balancing_loss_is_transformers_pooled_over_layers_without_padding(rng):
    """transformers' load_balancing_loss_func (Mixtral's, which Qwen3-MoE and OLMoE share) on
    the concatenated layers' logits with an attention mask, against ours from per-layer
    statistics summed over layers, in float64."""
    import torch
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func
    layers, B, L, E, K = 3, 2, 20, 6, 2
    logits = rng.normal(0, 2, (layers, B * L, E))
    mask = np.ones((B, L), int)
    mask[1, 13:] = 0  # padding
    want = float(load_balancing_loss_func(tuple(torch.tensor(g) for g in logits), E, K,
                                          torch.tensor(mask)))
    with jax.enable_x64(True):
        stats = [moe.router_stats(jnp.asarray(g), jax.nn.softmax(jnp.asarray(g), -1),
                                  jax.lax.top_k(jnp.asarray(g), K)[1], jnp.asarray(mask.reshape(-1)),
                                  jnp.zeros((), jnp.int32)) for g in logits]
        total = jax.tree.map(lambda *s: sum(s), *stats)
        got = moe.aux_losses(total, E, K)
        # (transformers casts its pick counts to float32: its fractions carry fp32 rounding)
        assert abs(float(got["aux_loss"]) - want) < 1e-6 * want
        lse = np.log(np.exp(logits).sum(-1))
        real = np.tile(mask.reshape(-1), (layers, 1))
        assert abs(float(got["z_loss"]) - (lse ** 2 * real).sum() / real.sum()) < 1e-10


# -- the step on any mesh -----------------------------------------------------------------
SEQ, BATCH = 64, 4


def moe_config(mesh=None, impl="dense", layout="contiguous", microbatches=1):
    from configs import tiny
    c = tiny.get_config()
    c.model.update(vocab_size=128, d_model=32, num_layers=2, num_heads=4, num_kv_heads=4,
                   ffn_dim=48, dtype="float32", remat="none")
    c.model.moe.update(num_experts=8, top_k=2, expert_dim=16, aux_loss=0.05, z_loss=0.01)
    c.data.update(seq_len=SEQ, batch_size=BATCH)
    c.mesh.update(mesh or {"data": 1, "fsdp": 1, "sequence": 1, "tensor": 1})
    c.attention.update(impl=impl, layout=layout, ulysses=2, block_q=8, block_kv=8)
    c.train.update(microbatches=microbatches, loss_chunk=0)
    return c


def batch_of(rng):
    """Natural order: rows of packed documents, the last row's tail padding (segment 0)."""
    tokens = rng.integers(0, 128, (BATCH, SEQ)).astype(np.int32)
    segments = np.ones((BATCH, SEQ), np.int32)
    segments[:, SEQ // 3:] = 2
    segments[-1, SEQ - 11:] = 0
    positions = np.zeros((BATCH, SEQ), np.int32)
    for r in range(BATCH):
        for s in (1, 2):
            at = segments[r] == s
            positions[r, at] = np.arange(at.sum())
    labels = np.roll(tokens, -1, 1)
    mask = ((segments > 0) & (np.roll(segments, -1, 1) == segments)).astype(np.float32)
    return {"tokens": tokens, "labels": labels, "positions": positions,
            "segment_ids": segments, "loss_mask": mask}


def step_of(c, params, natural, devices):
    from parallel import layouts
    from parallel.mesh import make_mesh
    from training.state import Trainer
    mesh = make_mesh(c.mesh, devices)
    trainer = Trainer(c, mesh)
    perm = layouts.permutation(c.attention.layout, SEQ, int(mesh.shape["sequence"]), 1)
    batch = jax.device_put({k: v[:, perm] for k, v in natural.items()}, trainer.batch_shardings)
    params = jax.device_put(params, trainer.param_shardings)
    loss, _, grads, metrics = jax.jit(trainer.gradients)(params, batch)
    grads = jax.device_get(grads)
    norm = float(np.sqrt(sum(np.sum(np.square(g, dtype=np.float64))
                             for g in jax.tree.leaves(grads))))
    return float(loss), {k: float(v) for k, v in jax.device_get(metrics).items()}, norm, trainer


@pytest.fixture(scope="module")
def one_device():
    from parallel.mesh import make_mesh
    from training.state import Trainer
    c = moe_config()
    trainer = Trainer(c, make_mesh(c.mesh, jax.devices()[:1]))
    params = jax.device_get(trainer.init(0).params)
    natural = batch_of(np.random.default_rng(7))
    return c, params, natural, step_of(c, params, natural, jax.devices()[:1])


MESHES = [  # (impl, layout, mesh, microbatches)
    ("ring", "striped", {"data": 1, "fsdp": 1, "sequence": 8, "tensor": 1}, 1),
    ("usp", "zigzag", {"data": 1, "fsdp": 2, "sequence": 2, "tensor": 2}, 1),
]


@pytest.mark.parametrize("impl,layout,mesh,microbatches", MESHES,
                         ids=[f"{i}-{lay}-{'x'.join(map(str, m.values()))}-mb{k}"
                              for i, lay, m, k in MESHES])
def test_the_same_step_with_the_experts_split_over_the_ring_or_fsdp(one_device, impl, layout,
                                                                    mesh, microbatches):
    """Striped over a ring of 8 with the experts split over it, and zigzag usp over fsdp 2 x
    sequence 2 x tensor 2 (the experts split over fsdp x sequence, each one's width over
    tensor): each device routes its own tokens; the loss (LM + aux + z), the aux loss, the load
    and the gradient norm of one device, within fp32 noise."""
    c, params, natural, (want_loss, want_metrics, want_norm, _) = one_device
    cm = moe_config(mesh, impl, layout, microbatches)
    loss, metrics, norm, trainer = step_of(cm, params, natural, jax.devices()[:8])
    spec = trainer.param_shardings["blocks"]["mlp"]["w_gate"].spec
    assert spec[1] is not None  # the experts' axis is split over the devices
    assert abs(loss - want_loss) < 1e-5 * want_loss
    for key in ("aux_loss", "z_loss", "expert_load"):
        assert abs(metrics[key] - want_metrics[key]) < 1e-5 * want_metrics[key], key
    assert abs(norm - want_norm) < 1e-4 * want_norm


def test_two_microbatches_weight_each_ones_aux_loss_by_its_real_tokens(one_device):
    """docs/moe.md's rule: with microbatches, the aux loss is the mean of each microbatch's own
    (its statistics alone), weighted by its share of the step's real tokens; the language
    model's loss is the whole step's either way."""
    from model.decoder import Decoder  # noqa: F401 (the model the trainer builds)
    from parallel.mesh import make_mesh
    from training.state import Trainer
    c, params, natural, (want_loss, want_metrics, _, _) = one_device
    cm = moe_config(microbatches=2)
    loss, metrics, _, trainer = step_of(cm, params, natural, jax.devices()[:1])
    one = Trainer(c, make_mesh(c.mesh, jax.devices()[:1]))
    lm = want_loss - c.model.moe.aux_loss * want_metrics["aux_loss"] - \
        c.model.moe.z_loss * want_metrics["z_loss"]
    expected_aux = expected_z = 0.0
    real = (natural["segment_ids"] > 0).sum()
    for i in range(2):  # row j * 2 + i goes to microbatch i (training/state.py)
        micro = {k: v[i::2] for k, v in natural.items()}
        _, stats = jax.jit(one.forward)(params, micro)
        got = moe.aux_losses(jax.device_get(stats), 8, 2)
        share = (micro["segment_ids"] > 0).sum() / real
        expected_aux += share * float(got["aux_loss"])
        expected_z += share * float(got["z_loss"])
    assert abs(metrics["aux_loss"] - expected_aux) < 1e-5 * expected_aux
    assert abs(metrics["aux_loss"] - want_metrics["aux_loss"]) > 1e-4  # not the whole step's
    want = lm + c.model.moe.aux_loss * expected_aux + c.model.moe.z_loss * expected_z
    assert abs(loss - want) < 2e-5 * want
