"""LoRA adapters (model/lora.py, train.lora) in the model and the trainer: step 0 is the base
model, the same step on any mesh, layout, strategy and microbatching, a frozen base with no
gradient or optimizer state, the refusals. PEFT's format and PEFT's numbers:
tests/test_lora_peft.py; SFT and DPO runs with adapters: tests/test_sft.py, test_preference.py."""
import jax
import numpy as np
import pytest

from configs import tiny
from configs.validate import validate
from errors import ConfigError
from model import lora
from parallel import layouts
from parallel.mesh import make_mesh
from test_moe import BATCH, SEQ, batch_of  # rows of packed documents, the last one padded
from training.state import Trainer

STEP = 3  # the optimizer step whose dropout masks the mesh test draws


def lora_config(mesh=None, impl="dense", layout="contiguous", microbatches=1, rank=4, **more):
    c = tiny.get_config()
    c.model.update(vocab_size=128, d_model=64, num_layers=2, num_heads=8, num_kv_heads=4,
                   ffn_dim=48, dtype="float32", remat="none", mlp_chunk=0)
    c.data.update(seq_len=SEQ, batch_size=BATCH)
    c.mesh.update(mesh or {"data": 1, "fsdp": 1, "sequence": 1, "tensor": 1})
    c.attention.update(impl=impl, layout=layout, ulysses=2, block_q=8, block_kv=8)
    c.train.update(microbatches=microbatches, loss_chunk=0, warmup_steps=0, lr=1e-2)
    c.train.lora.update(rank=rank, alpha=8.0, modules_to_save="norm,embed_tokens",
                        **{"dropout": 0.25, **more})
    return c


def gradients_of(c, params, natural, devices):
    """(loss, gradients of the trained parameters, the trainer) of one step on ``devices``."""
    mesh = make_mesh(c.mesh, devices)
    trainer = Trainer(c, mesh)
    perm = layouts.permutation(c.attention.layout, SEQ, int(mesh.shape["sequence"]), 1)
    batch = jax.device_put({k: v[:, perm] for k, v in natural.items()}, trainer.batch_shardings)
    params = jax.device_put(params, trainer.param_shardings)
    loss, _, grads, _ = jax.jit(trainer.gradients)(params, batch, STEP)
    return float(loss), jax.device_get(grads), trainer


@pytest.fixture(scope="module")
def one_device():
    """The step on one device, every weight random and every B nonzero (so that A's
    gradients are too): (params, the natural batch, loss, gradients, trainer)."""
    c = lora_config()
    rng = np.random.default_rng(3)
    trainer = Trainer(c, make_mesh(c.mesh, jax.devices()[:1]))
    shapes = jax.eval_shape(trainer._init, 0).params
    params = jax.tree.map(lambda p: rng.normal(0, 0.3, p.shape).astype(np.float32), shapes)
    natural = batch_of(rng)
    loss, grads, trainer = gradients_of(c, params, natural, jax.devices()[:1])
    return params, natural, loss, grads, trainer


def test_step_0_is_the_base_model_and_the_base_weights_do_not_depend_on_the_adapters():
    """B starts at zero and A in PEFT's range; the adapters draw from their own stream, so
    the seed gives the base the same weights with them as without; the losses are the base's
    to the bit."""
    natural = batch_of(np.random.default_rng(5))
    c, plain = lora_config(), lora_config(rank=0)
    mesh = make_mesh(c.mesh, jax.devices()[:1])
    ours, base = Trainer(c, mesh), Trainer(plain, mesh)
    # both initialisations in one program, and both forwards in another (each side its own
    # computation there, as in a program of its own): two compiles, not four
    with_adapters, without = jax.device_get(jax.jit(
        lambda seed: (ours.initial_params(seed), base.initial_params(seed)))(0))
    assert jax.tree.structure(lora.without_adapters(with_adapters)) == jax.tree.structure(without)
    for a, b in zip(jax.tree.leaves(lora.without_adapters(with_adapters)), jax.tree.leaves(without)):
        assert np.array_equal(a, b)
    adapters = lora.adapters_only(with_adapters)
    assert set(adapters["blocks"]["attn"]) == {"lora_q", "lora_k", "lora_v", "lora_o"}
    assert set(adapters["blocks"]["mlp"]) == {"lora_gate", "lora_up", "lora_down"}
    for name, pair in {**adapters["blocks"]["attn"], **adapters["blocks"]["mlp"]}.items():
        fan_in = int(np.prod(pair["a"].shape[1:-1]))
        assert not pair["b"].any() and pair["a"].std() > 0.3 / np.sqrt(fan_in), name
        assert np.abs(pair["a"]).max() <= 1 / np.sqrt(fan_in), name
    batch = jax.device_put(natural, ours.batch_shardings)
    got, want = jax.jit(lambda a, b, x: (ours.token_losses(a, x), base.token_losses(b, x)))(
        with_adapters, without, batch)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


# The adapters are projections, outside attention: one mesh that splits everything they touch
# (fsdp, tensor, the sequence in a permuted layout, microbatches, the chunked MLP's shard_map).
# (test_sft's LoRA run trains them striped over a ring of 8, its first step one device's.)
MESHES = [  # (impl, layout, mesh, microbatches, mlp_chunk)
    ("usp", "zigzag", {"data": 1, "fsdp": 2, "sequence": 2, "tensor": 2}, 2, 8),
]


@pytest.mark.parametrize("impl,layout,mesh,microbatches,chunk", MESHES,
                         ids=[f"{i}-{lay}-{'x'.join(map(str, m.values()))}-mb{k}"
                              for i, lay, m, k, _ in MESHES])
def test_the_same_step_on_any_mesh_layout_strategy_and_microbatching(
        one_device, impl, layout, mesh, microbatches, chunk):
    """Zigzag usp over fsdp 2 x sequence 2 x tensor 2 in 2 microbatches with the MLP in
    chunks (its adapters inside the chunks' shard_map; each adapter split as its projection:
    A along the input's axis, B along the output's), with dropout 0.25 on the adapters' inputs
    (its masks a hash of the token, not of where a mesh, layout or microbatch puts it): one
    device's loss and every trained parameter's gradient, within fp32 noise."""
    params, natural, want_loss, want, _ = one_device
    c = lora_config(mesh, impl, layout, microbatches)
    c.model.mlp_chunk = chunk
    loss, grads, trainer = gradients_of(c, params, natural, jax.devices()[:8])
    if mesh["tensor"] > 1:  # B of q splits over tensor as q's heads do; A of o as its input
        shardings = trainer.param_shardings["blocks"]["attn"]
        assert shardings["lora_q"]["b"].spec[2] == "tensor" == shardings["wq"].spec[2]
        assert shardings["lora_o"]["a"].spec[1] == "tensor"
    assert abs(loss - want_loss) < 1e-5 * want_loss
    flat = jax.tree_util.tree_flatten_with_path(want)[0]
    names = {jax.tree_util.keystr(k) for k, _ in flat}
    assert "['blocks']['attn']['lora_o']['a']" in names and "['embed']" in names
    assert not any("'wq'" in n or "'w_down'" in n for n in names)  # frozen: no gradient
    for (path, w), g in zip(flat, jax.tree.leaves(grads)):
        scale = np.abs(w).max()
        assert scale > 0, jax.tree_util.keystr(path)
        np.testing.assert_allclose(g, w, atol=1e-4 * scale, err_msg=jax.tree_util.keystr(path))


def test_training_leaves_the_base_bitwise_and_keeps_state_for_the_trained_only(one_device):
    """Three steps: every adapter, norm and the embedding move, the frozen weights are the
    same bits; the optimizer's moments hold the trained parameters alone; a bf16 base
    (train.lora.base_dtype) is held in bf16 beside fp32 adapters."""
    params, natural, _, _, trainer = one_device
    state = trainer.init_from(jax.device_put(params, trainer.param_shardings))
    batch = jax.device_put(natural, trainer.batch_shardings)
    losses = []
    for _ in range(3):
        state, metrics = trainer.train_step(state, batch)
        losses.append(float(metrics["loss"]))
    assert int(metrics["bad_step"]) == -1
    after = jax.device_get(state.params)
    trained, frozen = lora.split(after, trainer.trained)
    start_trained, start_frozen = lora.split(params, trainer.trained)
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(frozen)[0],
                            jax.tree.leaves(start_frozen)):
        assert np.array_equal(a, b), jax.tree_util.keystr(path)
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(trained)[0],
                            jax.tree.leaves(start_trained)):
        assert not np.array_equal(a, b), jax.tree_util.keystr(path)
    mu = state.opt_state[1][0].mu  # clip, then adamw's scale_by_adam
    assert jax.tree.structure(mu) == jax.tree.structure(trained)
    paths = [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_flatten_with_path(mu)[0]]
    assert all("lora_" in p or "norm" in p or p == "['embed']" for p in paths), paths
    c = lora_config(base_dtype="bfloat16")
    bf16 = Trainer(c, make_mesh(c.mesh, jax.devices()[:1]))
    state = bf16.init_from(jax.device_put(params, bf16.param_shardings))
    held = state.params
    assert held["blocks"]["attn"]["wq"].dtype == np.dtype("bfloat16")
    assert held["blocks"]["attn"]["lora_q"]["a"].dtype == np.float32
    assert held["embed"].dtype == np.float32  # modules_to_save train, in fp32
    wq = np.asarray(held["blocks"]["attn"]["wq"])
    state, got = bf16.train_step(state, batch)  # the first step's loss: the base rounded to bf16
    assert abs(float(got["loss"]) - losses[0]) < 1e-2 * losses[0]
    assert np.array_equal(np.asarray(state.params["blocks"]["attn"]["wq"]), wq)


def test_dropout_drops_its_share_scales_the_rest_and_draws_anew_each_step_and_layer():
    """model/lora.py's dropout: a quarter of the inputs zeroed, the rest times 4/3, the masks
    of two steps, two layers, two projections and two rows apart (each pair agreeing on about
    a quarter squared of its zeros, as independent masks do); nothing outside ``dropping``."""
    import jax.numpy as jnp
    x = jnp.ones((4, 256, 64), jnp.float32)
    ids = lora.token_ids(jnp.arange(4), jnp.arange(256))
    assert lora.dropout(x, 0.25, 0, 1) is x  # not in a train step

    def zeros(step, layer, salt, rows=slice(None)):
        with lora.dropping(jnp.uint32(step), ids), lora.in_layer(layer):
            y = np.asarray(lora.dropout(x, 0.25, salt, 1))
        assert set(np.unique(y)) <= {0.0, np.float32(1 / 0.75)}
        return (y == 0)[rows]

    base = zeros(1, 0, 0)
    assert abs(base.mean() - 0.25) < 0.01
    for other in (zeros(2, 0, 0), zeros(1, 1, 0), zeros(1, 0, 1)):
        assert abs((base & other).mean() - 0.25**2) < 0.01
    assert abs((base[0] & base[1]).mean() - 0.25**2) < 0.02  # rows apart
    np.testing.assert_array_equal(zeros(1, 0, 0), base)  # and the same again


@pytest.mark.parametrize("fields,says", [
    ({"targets": "q_proj,qkv_proj"}, "unknown module 'qkv_proj'; name some of q_proj, k_proj"),
    ({"rank": 70}, "train.lora.rank=70 is above q_proj's size 64 x 64: a rank of at most 64"),
    ({"rank": -1}, "train.lora.rank=-1 must be an int >= 0"),
    ({"alpha": 0.0}, "train.lora.alpha=0.0 must be > 0"),
    ({"dropout": 1.0}, "train.lora.dropout=1.0 must be in [0, 1)"),
    ({"modules_to_save": "embed_tokens,layernorm"}, "unknown module 'layernorm'; name some of"),
    ({"base_dtype": "float16"}, "train.lora.base_dtype='float16' is not one of float32, bfloat16"),
])
def test_a_lora_field_the_model_cannot_take_is_one_line(fields, says):
    c = lora_config()
    c.train.lora.update(fields)
    with pytest.raises(ConfigError) as e:
        validate(c, 1)
    assert says in str(e.value) and "\n" not in str(e.value)


def test_adapters_on_a_mixture_of_experts_mlp_are_refused_and_its_attention_takes_them():
    c = lora_config()
    c.model.moe.update(num_experts=4, top_k=2, expert_dim=16)
    with pytest.raises(ConfigError, match="gate_proj, up_proj, down_proj name the MLP, which in "
                                          "this model is a mixture of experts"):
        validate(c, 1)
    c.train.lora.targets = "q_proj,k_proj,v_proj,o_proj"
    validate(c, 1)
    shapes = jax.eval_shape(Trainer(c, make_mesh(c.mesh, jax.devices()[:1]))._init, 0).params
    assert set(lora.adapters_only(shapes)["blocks"]) == {"attn"}
