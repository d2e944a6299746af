"""model/moe.py: the router, the dispatch and the experts against a dense float64 reference
(every expert on every token, weighted by the router), for both scorings and every grouped
matmul, ties, a capacity and gpt-oss's experts (biases, the clamped unit) included; the
load-balancing loss against transformers' own function; gpt-oss's train step on one device,
striped over 8 with the experts split over the ring, and on zigzag usp over fsdp and tensor
with all-to-all, every gradient; 2 microbatches under the rule docs/moe.md states."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model import moe


def reference(x, router, w_gate, w_up, w_down, top_k, kind, renormalize, capacity=0,
              biases=None, clamped=False):
    """float64 numpy: every expert on every token, each token's output the sum over its k
    picks (lowest index first among equal scores) of weight x that expert's gated MLP.
    ``biases`` (router [E], gate [E, F], up [E, F], down [E, D]) and ``clamped`` (gpt-oss's
    unit, as transformers' GptOssExperts writes it): gpt-oss's experts."""
    x, router, w_gate, w_up, w_down = (np.asarray(a, np.float64) for a in
                                       (x, router, w_gate, w_up, w_down))
    b_router, b_gate, b_up, b_down = ([np.asarray(b, np.float64) for b in biases] if biases
                                      else (0.0, 0.0, 0.0, 0.0))
    logits = x @ router + b_router
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
    gate = np.einsum("td,edf->tef", x, w_gate) + b_gate
    up = np.einsum("td,edf->tef", x, w_up) + b_up
    if clamped:
        gate, up = np.minimum(gate, 7.0), np.clip(up, -7.0, 7.0)
        hidden = (up + 1) * gate / (1 + np.exp(-1.702 * gate))
    else:
        hidden = gate / (1 + np.exp(-gate)) * up
    every = np.einsum("tef,efd->ted", hidden, w_down) + b_down
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
    router, w_gate, w_up, w_down = weights_of(rng, D, E, F)
    router[:, 5] = router[:, 2]  # experts 2 and 5 always tie: the lower index wins
    while True:  # no near-tie at the top-K boundary that fp32's logits could order otherwise
        x = rng.normal(0, 1, (T, D))
        top = -np.sort(-(x @ router), axis=1)
        gap = top[:, K - 1] - top[:, K]
        if not np.any((gap > 0) & (gap < 1e-4)):  # 0: the 2-5 tie, exact in fp32 too
            break
    f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    weights, experts, probs = moe.route(f32(x) @ f32(router), K, kind, renormalize)
    got, dropped = moe.experts_forward(f32(x), weights, experts, f32(w_gate), f32(w_up),
                                       f32(w_down), impl=impl)
    want, picks, want_probs = reference(x, router, w_gate, w_up, w_down, K, kind, renormalize)
    assert np.array_equal(np.asarray(experts), picks) and int(dropped) == 0
    assert not np.any((picks == 5) & ~np.any(picks == 2, axis=1, keepdims=True))
    np.testing.assert_allclose(np.asarray(probs), want_probs, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-4, atol=2e-4 * np.abs(want).max())


def gpt_oss_experts(rng, T, D, E, F):
    """Random gpt-oss expert weights whose gate and up projections reach past the clamp at 7."""
    x = rng.normal(0, 1, (T, D))
    router, w_gate, w_up, w_down = weights_of(rng, D, E, F)
    biases = (rng.normal(0, 1, E), rng.normal(0, 2, (E, F)), rng.normal(0, 2, (E, F)),
              rng.normal(0, 1, (E, D)))
    return x, (router, w_gate * 3, w_up * 3, w_down), biases


@pytest.mark.parametrize("impl", ["blocks", "dense", "ragged"])
def test_gpt_oss_experts_biases_and_clamped_unit_are_the_float64_reference(rng, impl):
    """gpt-oss's experts (model.moe.expert_bias, glu=clamped) with its router (top-k logits,
    then a softmax over them, a router bias): every grouped matmul gives the float64
    reference, with gates and ups past the clamp at 7 on both sides."""
    from ml_collections import ConfigDict
    T, D, E, F, K = 300, 16, 8, 12, 3  # the test above's shapes: its compiled ops serve again
    x, w, biases = gpt_oss_experts(rng, T, D, E, F)
    f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    weights, experts, _ = moe.route(f32(x) @ f32(w[0]) + f32(biases[0]), K, "topk_softmax")
    unit = moe.gated_unit(ConfigDict({"glu": "clamped", "glu_limit": 7.0, "glu_alpha": 1.702}))
    got, _ = moe.experts_forward(f32(x), weights, experts, *map(f32, w[1:]), impl=impl,
                                 biases=tuple(map(f32, biases[1:])), unit=unit)
    want, picks, _ = reference(x, *w, K, "topk_softmax", False, biases=biases, clamped=True)
    gate = np.einsum("td,edf->tef", x, w[1]) + biases[1]
    assert (gate > 7).any() and (np.abs(np.einsum("td,edf->tef", x, w[2]) + biases[2]) > 7).any()
    assert np.array_equal(np.asarray(experts), picks)
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-4, atol=2e-4 * np.abs(want).max())


def test_a_capacity_drops_the_later_picks_and_counts_them(rng):
    T, D, E, F, K = 300, 16, 8, 12, 3  # the test above's: its compiled ops serve again (1.7 s)
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
        @jax.jit  # one program, not each operation compiled on its own (1 CPU s less)
        def ours(logits, mask):
            stats = [moe.router_stats(g, jax.nn.softmax(g, -1), jax.lax.top_k(g, K)[1], mask,
                                      jnp.zeros((), jnp.int32)) for g in logits]
            return moe.aux_losses(jax.tree.map(lambda *s: sum(s), *stats), E, K)
        got = ours(jnp.asarray(logits), jnp.asarray(mask.reshape(-1)))
        # (transformers casts its pick counts to float32: its fractions carry fp32 rounding)
        assert abs(float(got["aux_loss"]) - want) < 1e-6 * want
        lse = np.log(np.exp(logits).sum(-1))
        real = np.tile(mask.reshape(-1), (layers, 1))
        assert abs(float(got["z_loss"]) - (lse ** 2 * real).sum() / real.sum()) < 1e-10


# -- expert parallelism: the pairs sent to their experts' devices and back ---------------
def test_the_padded_exchange_is_ragged_all_to_alls_documented_example():
    """jax.lax.ragged_all_to_all's own example (its docstring), by the CPU's padded emulation."""
    from jax.sharding import PartitionSpec as P
    from parallel.experts import padded_ragged_all_to_all
    mesh = jax.make_mesh((2,), ("x",), devices=jax.devices()[:2])
    args = [np.array(a, np.float32 if i < 2 else np.int32) for i, a in enumerate(
        ([[1, 2, 2], [3, 4, 0]], [[0] * 4] * 2, [[0, 1]] * 2, [[1, 2], [1, 1]], [[0, 0], [1, 2]],
         [[1, 1], [2, 1]]))]
    run = jax.jit(jax.shard_map(
        lambda *a: padded_ragged_all_to_all(*(v[0] for v in a), axis_name="x", chunk=2)[None],
        mesh=mesh, in_specs=(P("x"),) * 6, out_specs=P("x")))
    args = [jax.device_put(a, jax.NamedSharding(mesh, P("x"))) for a in args]
    assert np.asarray(run(*args)).tolist() == [[1, 3, 0, 0], [2, 2, 4, 0]]


@pytest.mark.parametrize("buffer,capacity", [(0.0, 0), (0.6, 0), (0.0, 1.0)],
                         ids=["dropless", "small-buffer", "capacity"])
def test_the_experts_all_to_all_are_the_float64_reference(rng, buffer, capacity):
    """8 devices (fsdp 2 x sequence 4), each holding one of 8 experts and routing its own 60
    tokens, a favourite expert overflowing: the outputs equal the dense float64 reference with
    exactly the dropped pairs weighted 0. Dropless drops none; a receive buffer of 0.6 of a
    device's pairs drops, at each expert's device, the pairs past it (later senders first); a
    capacity drops each device's pairs past it (later tokens first), before they travel."""
    from jax.sharding import PartitionSpec as P
    from parallel.experts import experts_all_to_all
    T, D, E, F, K, devices = 60, 8, 8, 6, 2, 8
    x = rng.normal(0, 1, (devices * T, D))
    router, w_gate, w_up, w_down = weights_of(rng, D, E, F)
    router[:, 3] += 0.7
    f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    weights, experts, _ = moe.route(f32(x) @ f32(router), K)
    cap = int(np.ceil(capacity * T * K / E)) if capacity else 0
    mesh = jax.make_mesh((2, 4), ("fsdp", "sequence"), devices=jax.devices()[:devices])
    ep = ("fsdp", "sequence")

    def local(x, w, e, g, u, d):
        y, dropped = experts_all_to_all(
            x, w, e, g, u, d, axis_name=ep, num_experts=E,
            grouped=lambda a, b, n: moe.grouped_matmul(a, b, n, "blocks"), exchange="padded",
            receive_buffer=buffer, capacity=cap)
        return y, jax.lax.psum(dropped, ep)

    run = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(ep),) * 6, out_specs=(P(ep), P())))
    args = [jax.device_put(a, jax.NamedSharding(mesh, P(ep))) for a in
            (f32(x), weights, experts, f32(w_gate), f32(w_up), f32(w_down))]
    got, dropped = run(*args)
    if not buffer and not cap:  # the planner finds the exchange by its scope (step_time.py)
        from parallel.experts import EXCHANGE_SCOPE
        from planning.collectives import collectives
        found = collectives(run.lower(*args).compile().as_text(), devices)
        assert sum(c.kind == "all-to-all" and EXCHANGE_SCOPE in c.op_name for c in found) >= 2

    # the drops as docs/moe.md states them, from the picks
    e_TK = np.asarray(experts).reshape(devices, T, K)
    keep = np.ones_like(e_TK, bool)
    if cap:
        for dev in range(devices):
            taken = np.zeros(E, int)
            for t in range(T):
                for r in range(K):
                    keep[dev, t, r] = taken[e_TK[dev, t, r]] < cap
                    taken[e_TK[dev, t, r]] += 1
    if buffer:
        room = np.full(E, int(buffer * T * K))  # one expert a device here
        for dev in range(devices):
            for ex in range(E):
                at = keep[dev] & (e_TK[dev] == ex)
                n = at.sum()
                taken = min(n, max(room[ex], 0))
                room[ex] -= n
                ranks = np.cumsum(at.reshape(-1)).reshape(T, K) - 1  # token order, then rank
                keep[dev] &= ~(at & (ranks >= taken))
    w64 = np.where(keep.reshape(-1, K), np.asarray(weights, np.float64), 0.0)
    gate = np.einsum("td,edf->tef", x, w_gate)
    every = np.einsum("tef,efd->ted", gate / (1 + np.exp(-gate)) * np.einsum(
        "td,edf->tef", x, w_up), w_down)
    want = np.einsum("tk,tkd->td", w64, np.take_along_axis(
        every, np.asarray(experts)[:, :, None], 1))
    assert int(dropped) == (~keep).sum() and ((~keep).sum() > 0) == bool(buffer or capacity)
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-4, atol=2e-4 * np.abs(want).max())


def test_the_gpu_exchange_exports_for_cuda_as_ragged_all_to_all():
    """A GPU's program (ragged_all_to_all and ragged_dot, which XLA:CPU cannot run): the forward
    and backward of 4 devices' experts export for CUDA, each direction's pairs one
    ragged-all-to-all (2 forward, their 2 transposes backward)."""
    from jax import export
    from jax.sharding import PartitionSpec as P
    from parallel.experts import experts_all_to_all
    T, D, E, F, K = 32, 16, 8, 8, 2
    mesh = jax.make_mesh((4,), ("sequence",), devices=jax.devices()[:4])

    def local(x, w, e, g, u, d, dy):
        def f(x, g, u, d):
            return experts_all_to_all(
                x, w, e, g, u, d, axis_name=("sequence",), num_experts=E,
                grouped=lambda a, b, n: moe.grouped_matmul(a, b, n, "ragged"),
                exchange="ragged")[0]
        y, vjp = jax.vjp(f, x, g, u, d)
        return (y, *vjp(dy))

    split = jax.NamedSharding(mesh, P("sequence"))
    sds = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=split)  # noqa: E731
    x = sds((4 * T, D), jnp.bfloat16)
    args = (x, sds((4 * T, K), jnp.float32), sds((4 * T, K), jnp.int32),
            sds((E, D, F), jnp.bfloat16), sds((E, D, F), jnp.bfloat16),
            sds((E, F, D), jnp.bfloat16), x)
    run = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P("sequence"),) * 7,
                                out_specs=(P("sequence"),) * 5))
    checks = [export.DisabledSafetyCheck.custom_call("ragged_all_to_all")]
    text = export.export(run, platforms=["cuda"], disabled_checks=checks)(*args).mlir_module()
    assert text.count("custom_call @ragged_all_to_all(") == 4
    assert "ragged_dot" in text


# -- the step on any mesh -----------------------------------------------------------------
SEQ, BATCH = 64, 4


def moe_config(mesh=None, impl="dense", layout="contiguous", microbatches=1, dispatch="gather"):
    from configs import tiny
    c = tiny.get_config()
    c.model.update(vocab_size=128, d_model=32, num_layers=2, num_heads=4, num_kv_heads=4,
                   ffn_dim=48, dtype="float32", remat="none")
    c.model.moe.update(num_experts=8, top_k=2, expert_dim=16, aux_loss=0.05, z_loss=0.01,
                       dispatch=dispatch)
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


def step_of(c, params, natural, devices, leaves=False):
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
    out = float(loss), {k: float(v) for k, v in jax.device_get(metrics).items()}, norm, trainer
    return (*out, grads) if leaves else out


def random_params(c, seed):
    """Every weight of ``c``'s model random (matrices N(0, 0.2), vectors N(0, 0.5): each
    matters), from its shapes alone: no init program compiled (1-2 CPU s)."""
    from parallel.mesh import make_mesh
    from training.state import Trainer
    shapes = jax.eval_shape(Trainer(c, make_mesh(c.mesh, jax.devices()[:1]))._init, 0).params
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda p: rng.normal(0, 0.2 if p.ndim > 1 else 0.5, p.shape)
                        .astype(np.float32), shapes)


@pytest.fixture(scope="module")
def one_device():
    """moe_config's model on one device, every weight random, and the batch: (the config, the
    params, the batch, the model's forward jitted: token losses and router statistics, one
    compile per batch shape for every test here, whatever model.moe.balance, which only the
    step's loss reads)."""
    from parallel.mesh import make_mesh
    from training.state import Trainer
    c = moe_config()
    forward = jax.jit(Trainer(c, make_mesh(c.mesh, jax.devices()[:1])).forward)
    return c, random_params(c, 12), batch_of(np.random.default_rng(7)), forward


def gpt_oss_config(mesh=None, impl="dense", layout="contiguous", dispatch="gather"):
    """moe_config with gpt-oss's blocks (configs/llama.py gpt_oss_layers, as
    configs/gpt_oss_20b.py has them): sinks, biases on q, k, v and o, a 16-token window on
    layer 0 and full attention on layer 1, its router and experts; the z-loss kept on."""
    from configs.llama import gpt_oss_layers
    c = moe_config(mesh, impl, layout, 1, dispatch)
    e = c.model.moe
    c = gpt_oss_layers(c, experts=e.num_experts, top_k=e.top_k, expert_dim=e.expert_dim,
                       window=16, aux_loss=e.aux_loss)
    c.model.moe.z_loss = 0.01
    return c


@pytest.fixture(scope="module")
def gpt_oss_one_device(one_device):
    """gpt-oss's step on one device, every weight random (the sinks' and biases' larger, so
    that each matters): (params, the batch, the step with its gradients)."""
    _, _, natural, _ = one_device
    c = gpt_oss_config()
    params = random_params(c, 11)
    return params, natural, step_of(c, params, natural, jax.devices()[:1], leaves=True)


MESHES = [  # (impl, layout, mesh, dispatch)
    ("ring", "striped", {"data": 1, "fsdp": 1, "sequence": 8, "tensor": 1}, "gather"),
    ("usp", "zigzag", {"data": 1, "fsdp": 2, "sequence": 2, "tensor": 2}, "all_to_all"),
]


@pytest.mark.parametrize("impl,layout,mesh,dispatch", MESHES,
                         ids=[f"{i}-{lay}-{'x'.join(map(str, m.values()))}-{d}"
                              for i, lay, m, d in MESHES])
def test_the_same_step_with_the_experts_split_over_the_ring_or_fsdp(gpt_oss_one_device, impl,
                                                                    layout, mesh, dispatch):
    """gpt-oss's blocks (sinks, q/k/v/o biases, a window on layer 0, its router and experts with
    biases and the clamped unit), every weight random, striped over a ring of 8 with the
    experts split over it (gathered to the tokens), and zigzag usp over fsdp 2 x sequence 2 x
    tensor 2 with the experts split over fsdp x sequence, each one's width (its gate and up
    biases too) over tensor, and the tokens sent to them by all-to-all: the loss (LM + aux +
    z), the aux loss, the load and every parameter's gradient of one device, within fp32
    noise. (The plain SwiGLU experts and softmax-then-top-k router step on a mesh in the
    per-sequence test below, and in test_sft's and test_preference's MoE steps.)"""
    params, natural, one = gpt_oss_one_device
    got = step_of(gpt_oss_config(mesh, impl, layout, dispatch), params, natural,
                  jax.devices()[:8], leaves=True)
    spec = got[3].param_shardings["blocks"]["mlp"]["w_gate"].spec
    assert spec[1] is not None  # the experts' axis is split over the devices
    assert abs(got[0] - one[0]) < 1e-5 * one[0]
    for key in ("aux_loss", "z_loss", "expert_load"):
        assert abs(got[1][key] - one[1][key]) < 1e-5 * one[1][key], key
    flat = jax.tree_util.tree_flatten_with_path(one[4])[0]
    assert {jax.tree_util.keystr(k) for k, _ in flat} >= {
        "['blocks']['attn']['sinks']", "['blocks']['attn']['bo']", "['blocks']['mlp']['b_down']"}
    for (path, want), g in zip(flat, jax.tree.leaves(got[4])):
        scale = np.abs(want).max()
        assert scale > 0, jax.tree_util.keystr(path)
        np.testing.assert_allclose(g, want, atol=2e-4 * scale, err_msg=jax.tree_util.keystr(path))


def test_two_microbatches_weight_each_ones_aux_loss_by_its_real_tokens(one_device):
    """docs/moe.md's rule: with microbatches, the aux loss is the mean of each microbatch's own
    (its statistics alone), weighted by its share of the step's real tokens; the language
    model's loss is the whole step's either way (the mean over the whole batch's trained tokens
    of the forward's token losses)."""
    c, params, natural, forward = one_device
    loss, metrics, _, _ = step_of(moe_config(microbatches=2), params, natural,
                                  jax.devices()[:1])
    token_losses, stats = jax.device_get(forward(params, natural))  # the whole batch
    lm = float(token_losses.sum() / natural["loss_mask"].sum())
    whole_aux = float(moe.aux_losses(stats, 8, 2)["aux_loss"])
    expected_aux = expected_z = 0.0
    real = (natural["segment_ids"] > 0).sum()
    for i in range(2):  # row j * 2 + i goes to microbatch i (training/state.py)
        micro = {k: v[i::2] for k, v in natural.items()}
        _, stats = forward(params, micro)
        got = moe.aux_losses(jax.device_get(stats), 8, 2)
        share = (micro["segment_ids"] > 0).sum() / real
        expected_aux += share * float(got["aux_loss"])
        expected_z += share * float(got["z_loss"])
    assert abs(metrics["aux_loss"] - expected_aux) < 1e-5 * expected_aux
    assert abs(metrics["aux_loss"] - whole_aux) > 1e-4  # not the whole batch's
    want = lm + c.model.moe.aux_loss * expected_aux + c.model.moe.z_loss * expected_z
    assert abs(loss - want) < 2e-5 * want


# -- the per-sequence balance loss (model.moe.balance=sequence) ---------------------------
def sequence_reference(logits, mask, E, K):
    """float64 numpy, DeepSeek-V3's sequence-wise loss at the default's scale: per layer and
    per row with real tokens, E * sum_e f_e P_e over the row's real tokens (f_e: picks per
    token, summing to K; P_e: mean probability); the mean over layers and those rows."""
    losses = []
    for g in logits:  # [B, L, E] per layer
        probs = np.exp(g - g.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        picks = np.argsort(-g, axis=-1, kind="stable")[..., :K]
        for b in range(g.shape[0]):
            real = mask[b] > 0
            if real.any():
                f = np.bincount(picks[b][real].reshape(-1), minlength=E) / real.sum()
                losses.append(E * np.sum(f * probs[b][real].mean(0)))
    return float(np.mean(losses))


def test_the_per_sequence_balance_loss_is_the_float64_reference_on_any_split_of_the_rows(rng):
    """router_stats' per-row sums give sequence_reference's loss with padding and a row of
    padding only (not counted); on a mesh, each device's rows placed at their offset and
    summed over fsdp 2 x sequence 4 (pool_stats) give the same per-row totals and loss."""
    from jax.sharding import NamedSharding, PartitionSpec as P
    from model.chunks import TOKEN_AXES
    from parallel.mesh import BATCH_AXES, make_mesh
    layers, B, L, E, K = 3, 4, 16, 6, 2
    logits = rng.normal(0, 2, (layers, B, L, E))
    mask = np.ones((B, L), int)
    mask[1, 11:] = 0  # padding
    mask[2] = 0  # a row of padding only
    want = sequence_reference(logits, mask, E, K)

    def stats_of(g, m):
        g = g.reshape(-1, E)
        return moe.router_stats(g, jax.nn.softmax(g, -1), jax.lax.top_k(g, K)[1], m,
                                jnp.zeros((), jnp.int32))

    with jax.enable_x64(True):
        @jax.jit  # one program, not each operation compiled on its own
        def ours(logits, mask):
            total = jax.tree.map(lambda *s: sum(s), *[stats_of(g, mask) for g in logits])
            return total, moe.aux_losses(total, E, K)
        total, got = ours(jnp.asarray(logits), jnp.asarray(mask))
        assert float(total["seq_rows"]) == 3 * layers
        # (the pick counts are float32, as in the step: the fractions carry fp32 rounding)
        assert abs(float(got["seq_aux_loss"]) - want) < 1e-6 * want
        assert abs(float(got["seq_aux_loss"]) - float(got["aux_loss"])) > 1e-3  # not the batch's
    mesh = make_mesh({"data": 1, "fsdp": 2, "sequence": 4, "tensor": 1}, jax.devices()[:8])
    tokens = P(BATCH_AXES, "sequence")
    split = jax.jit(jax.shard_map(lambda g, m: moe.pool_stats(stats_of(g, m), TOKEN_AXES,
                                                              BATCH_AXES),
                                  mesh=mesh, in_specs=(P(*tokens, None), tokens), out_specs=P()))
    f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    whole = jax.jit(stats_of)
    on_mesh = [split(jax.device_put(f32(g), NamedSharding(mesh, P(*tokens, None))),
                     jax.device_put(f32(mask), NamedSharding(mesh, tokens))) for g in logits]
    for g, pooled in zip(logits, on_mesh):
        one = whole(f32(g), f32(mask))
        for key in ("row_picks", "row_probs", "row_tokens", "seq_loss", "seq_rows", "picks"):
            np.testing.assert_allclose(np.asarray(pooled[key]), np.asarray(one[key]),
                                       rtol=1e-5, atol=1e-5, err_msg=key)
    pooled = jax.jit(lambda stats: moe.aux_losses(jax.tree.map(lambda *s: sum(s), *stats), E, K))
    assert abs(float(pooled(on_mesh)["seq_aux_loss"]) - want) < 1e-5 * want


def sequence_config(mesh=None, impl="dense", layout="contiguous", microbatches=1):
    c = moe_config(mesh, impl, layout, microbatches)
    c.model.moe.balance = "sequence"
    return c


@pytest.fixture(scope="module")
def sequence_one_device(one_device):
    """The step with model.moe.balance=sequence on one device, on the batch with its second
    row all padding; the language model's token losses and the router statistics of the batch
    (the model's forward, which model.moe.balance leaves alone: one_device's, compiled for this
    batch's shape by the microbatch test too)."""
    _, params, natural, forward = one_device
    natural = {k: v.copy() for k, v in natural.items()}
    natural["segment_ids"][1] = 0
    natural["loss_mask"][1] = 0
    c = sequence_config()
    step = step_of(c, params, natural, jax.devices()[:1])
    token_losses, stats = jax.device_get(forward(params, natural))
    return c, params, natural, step, token_losses, stats


def test_the_per_sequence_loss_is_the_steps_and_exact_over_8_devices_and_microbatches(
        sequence_one_device):
    """model.moe.balance=sequence: the step's loss is the language model's + aux x the mean
    per-row loss over the layers and the rows with real tokens + z x the z-loss; fsdp 2 x a
    striped ring of 4 with 2 microbatches (each microbatch's rows over the whole step's row
    count) gives the same loss, aux loss and gradient norm within fp32 noise: exact."""
    c, params, natural, (want_loss, want_metrics, want_norm, _), token_losses, stats = \
        sequence_one_device
    e = c.model.moe
    rows = int((natural["segment_ids"] > 0).any(1).sum())
    assert rows == BATCH - 1
    aux = float(stats["seq_loss"]) / (c.model.num_layers * rows)
    assert abs(want_metrics["aux_loss"] - aux) < 1e-6 * aux
    pooled = moe.aux_losses(stats, 8, 2)
    assert abs(want_metrics["aux_loss"] - float(pooled["aux_loss"])) > 1e-4  # not the batch's
    lm = float(token_losses.sum() / natural["loss_mask"].sum())
    want = lm + e.aux_loss * aux + e.z_loss * float(pooled["z_loss"])
    assert abs(want_loss - want) < 2e-6 * want
    mesh = {"data": 1, "fsdp": 2, "sequence": 4, "tensor": 1}
    loss, metrics, norm, _ = step_of(sequence_config(mesh, "ring", "striped", 2), params, natural,
                                     jax.devices()[:8])
    assert abs(loss - want_loss) < 1e-5 * want_loss
    assert abs(metrics["aux_loss"] - want_metrics["aux_loss"]) < 1e-5 * want_metrics["aux_loss"]
    assert abs(norm - want_norm) < 1e-4 * want_norm
