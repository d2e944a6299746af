"""hf/peft.py and scripts/convert_hf.py's LoRA paths against PEFT on transformers, on a random
two-layer Llama: an exported adapter (export --adapter) is what peft.PeftModel.from_pretrained
loads over the exported base, with our logits, its tensors PEFT's own names; export --merge (and
a plain export of a LoRA run) is the same model in transformers alone; a training step's loss
and adapter gradients are PEFT's on the same tokens from the same A and B (B random, and PEFT's
own start, B zero: the base's logits); a PEFT adapter saved by save_pretrained imports
(import --adapter) onto the imported base as a run whose logits are PEFT's, and exports back to
the same tensors; what does not convert is one line."""
import json
import shutil
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict
from transformers import AutoModelForCausalLM, LlamaForCausalLM

from checkpoints.rundir import open_run
from errors import ConversionError
from hf import convert, peft as hf_peft, safetensors
from model import lora
from model.decoder import single_device_model, single_device_params
from scripts import convert_hf

from test_hf_convert import hf_logits, hf_model, import_run, our_logits, relative, run_cli

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
FP32 = 2e-5  # relative: fp32 noise on logits of weights far from init (std 0.3)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A random LlamaForCausalLM (untied: embed_tokens and lm_head apart), its import (the
    base run), and a PEFT adapter of it saved by save_pretrained: rank 4 with rslora on
    q_proj, v_proj, o_proj and down_proj, the norms saved whole, B and the norms random."""
    seed = np.random.SeedSequence().entropy
    rng = np.random.default_rng(seed)
    root = tmp_path_factory.mktemp("lora_peft")
    model = hf_model(rng, root / "hf")
    run = import_run(root / "hf", root / "base")
    torch.manual_seed(int(rng.integers(2**31)))
    theirs = peft_model(root / "hf", r=4, lora_alpha=6, use_rslora=True, lora_dropout=0.05,
                        target_modules=["q_proj", "v_proj", "o_proj", "down_proj"],
                        modules_to_save=["norm"])
    theirs.save_pretrained(root / "adapter")
    return types.SimpleNamespace(root=root, hf=root / "hf", model=model, run=run, rng=rng,
                                 seed=seed, peft=theirs, adapter=root / "adapter")


def peft_model(hf_dir, nonzero: bool = True, **lora_config):
    """PEFT's LoRA model over the HF model at ``hf_dir``; ``nonzero``: every lora_B (and saved
    module) moved from PEFT's start to random values, so that every tensor matters."""
    base = LlamaForCausalLM.from_pretrained(hf_dir).float()
    model = get_peft_model(base, LoraConfig(task_type="CAUSAL_LM", **lora_config))
    if nonzero:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.2)
                elif "modules_to_save" in name:
                    p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


def peft_logits(model, tokens):
    with torch.no_grad():
        return model(input_ids=torch.tensor(tokens)).logits.numpy()


def lora_run(world, out, **fields):
    """A LoRA run of the base (a train.py workdir as a weights-only step 0 holds it): its config
    with ``train.lora`` ``fields``, its adapters random (A and B) and its modules_to_save moved
    from the base's."""
    base = world.run
    config = base.config.copy_and_resolve_references()
    config.train.lora.update(fields)
    config.checkpoint.restore_from = str(base.directory)
    params = jax.device_get(base.restore_params(single_device_params(base.config)).params)
    spec = lora.spec_of(config)
    mask = lora.trained_mask(params, spec, bool(config.model.tie_embeddings))
    moved = jax.tree.map(lambda p, t: p + 0.1 * world.rng.normal(size=p.shape).astype(p.dtype)
                         if t else p, params, mask)
    adapters = jax.tree.map(lambda a: world.rng.normal(0, 0.2, a.shape).astype(np.float32),
                            lora.adapters_only(single_device_params(config)))
    out.mkdir()
    (out / "config.json").write_text(config.to_json_best_effort(indent=2) + "\n")
    (out / "tokenizer.json").write_text(base.tokenizer.to_str())
    (out / "tokenizer_fingerprint.txt").write_text(base.fingerprint + "\n")
    convert._save_params(out, lora.join(moved, adapters), config, base.fingerprint, "a test")
    return open_run(out)


def test_an_exported_adapter_is_peft_s_over_the_base_and_merged_is_transformers_alone(
        world, tmp_path, capsys):
    run = lora_run(world, tmp_path / "run", rank=4, alpha=8.0, targets="all-linear",
                   modules_to_save="embed_tokens,lm_head,norm")
    tokens = world.rng.integers(0, run.config.model.vocab_size, (2, 24))
    ours = our_logits(run, tokens)
    assert relative(ours, hf_logits(world.model, tokens)) > 1e-2  # the adapters matter

    code, _ = run_cli(capsys, "export", "--adapter", "--run", str(run.directory), "--out",
                      str(tmp_path / "adapter"))
    assert code == 0
    cfg = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA" and cfg["task_type"] == "CAUSAL_LM"
    assert (cfg["r"], cfg["lora_alpha"], cfg["use_rslora"], cfg["lora_dropout"]) == (4, 8, False, 0)
    assert cfg["target_modules"] == ALL and cfg["modules_to_save"] == ["embed_tokens", "lm_head",
                                                                       "norm"]
    assert cfg["base_model_name_or_path"] == str(world.hf)  # the import's source, unchanged
    base = AutoModelForCausalLM.from_pretrained(cfg["base_model_name_or_path"]).float()
    theirs = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    # every tensor has PEFT's own name and no other: what PEFT itself saves of this model
    saved = safetensors.Tensors(tmp_path / "adapter")
    state = get_peft_model_state_dict(theirs)
    assert sorted(state) == saved.names()
    for name in saved.names():
        np.testing.assert_array_equal(state[name].numpy(), saved[name])
    assert "base_model.model.model.layers.1.self_attn.o_proj.lora_A.weight" in state
    assert relative(ours, peft_logits(theirs, tokens)) < FP32

    code, _ = run_cli(capsys, "export", "--merge", "--run", str(run.directory), "--out",
                      str(tmp_path / "merged"), "--dtype", "float32")
    assert code == 0
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").float().eval()
    assert relative(ours, hf_logits(merged, tokens)) < FP32
    # a plain export of a LoRA run is the merged one, said in a line, never the base alone
    assert convert_hf.main(["export", "--run", str(run.directory), "--out",
                            str(tmp_path / "plain"), "--dtype", "float32"]) == 0
    assert ("merged the LoRA adapters (rank 4, scale 2, on q_proj, k_proj, v_proj, o_proj, "
            "gate_proj, up_proj, down_proj) into the weights; export --adapter writes them "
            "apart") in capsys.readouterr().err
    a, b = safetensors.Tensors(tmp_path / "merged"), safetensors.Tensors(tmp_path / "plain")
    assert a.names() == b.names() and all(np.array_equal(a[n], b[n]) for n in a.names())
    # --base-out: the frozen base written too, and named as the adapter's base
    assert convert_hf.main(["export", "--adapter", "--run", str(run.directory), "--out",
                            str(tmp_path / "adapter2"), "--base-out", str(tmp_path / "base")]) == 0
    cfg = json.loads((tmp_path / "adapter2" / "adapter_config.json").read_text())
    assert cfg["base_model_name_or_path"] == str(tmp_path / "base")
    again = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tmp_path / "base").float(), tmp_path / "adapter2")
    assert relative(ours, peft_logits(again.eval(), tokens)) < FP32


def test_merge_folds_scale_a_b_into_each_projection(rng):
    spec = lora.Spec(rank=2, alpha=3.0, targets=("q_proj", "o_proj"), rslora=True)
    L, D, H, hd = 2, 8, 2, 4
    params = {"blocks": {"attn": {
        "wq": rng.normal(size=(L, D, H, hd)).astype(np.float32),
        "wo": rng.normal(size=(L, H, hd, D)).astype(np.float32),
        "lora_q": {"a": rng.normal(size=(L, D, 2)), "b": rng.normal(size=(L, 2, H, hd))},
        "lora_o": {"a": rng.normal(size=(L, H, hd, 2)), "b": rng.normal(size=(L, 2, D))}}}}
    got = hf_peft.merge(params, spec)["blocks"]["attn"]
    assert sorted(got) == ["wo", "wq"] and got["wq"].dtype == np.float32
    at = params["blocks"]["attn"]
    x = rng.normal(size=(3, D))
    for i in range(L):
        want = x @ at["wq"][i].reshape(D, -1) + spec.scale * (x @ at["lora_q"]["a"][i]) @ (
            at["lora_q"]["b"][i].reshape(2, -1))
        np.testing.assert_allclose(x @ got["wq"][i].reshape(D, -1), want, rtol=1e-5, atol=1e-5)
        h = rng.normal(size=(3, H, hd))
        want = (np.einsum("bhk,hkd->bd", h, at["wo"][i]) + spec.scale * np.einsum(
            "bhk,hkr->br", h, at["lora_o"]["a"][i]) @ at["lora_o"]["b"][i])
        np.testing.assert_allclose(np.einsum("bhk,hkd->bd", h, got["wo"][i]), want, rtol=1e-5,
                                   atol=1e-5)


def test_a_step_s_loss_and_adapter_gradients_are_peft_s(world):
    """The loss (mean next-token cross-entropy) and the gradients of every A and B: ours (fp32)
    from the Decoder built with the adapters' Spec (the frozen rest apart, as training/state.py
    splits it) against PEFT's LoRA model in torch in float64, from the same A and B: PEFT's own
    start (B zero: the base's logits, A's gradient zero) and B random."""
    fields = {"rank": 4, "alpha": 16.0, "rslora": False, "dropout": 0.0, "targets": "all-linear",
              "modules_to_save": ""}
    base_run = world.run
    config = base_run.config.copy_and_resolve_references()
    config.train.lora.update(fields)
    m, spec = config.model, lora.spec_of(config)
    graphdef, abstract = single_device_model(config)
    base = jax.device_get(base_run.restore_params(single_device_params(base_run.config)).params)
    tokens = world.rng.integers(0, m.vocab_size, (2, 24))
    B, L = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(L), (B, L))

    @jax.jit
    def loss_and_grads(trained, frozen):
        def loss(trained):
            logits = nnx.merge(graphdef, lora.join(trained, frozen))(
                jnp.asarray(tokens), positions, jnp.ones((B, L), jnp.int32))
            logp = jax.nn.log_softmax(logits[:, :-1], -1)
            picked = jnp.take_along_axis(logp, jnp.asarray(tokens)[:, 1:, None], -1)
            return -picked.mean(), logits
        return jax.value_and_grad(loss, has_aux=True)(trained)

    torch.manual_seed(int(world.rng.integers(2**31)))
    for nonzero in (False, True):
        # the reference in float64: PEFT's own weights (fp32 values, exact in float64) run
        # in float64, ours in fp32 from the same values
        theirs = peft_model(world.hf, nonzero, r=4, lora_alpha=16, target_modules=ALL).double()
        named = hf_peft.named({k: v.detach().numpy() for k, v in
                               get_peft_model_state_dict(theirs).items()})
        params = hf_peft.from_peft(named, fields, m, base, abstract)
        trained, frozen = lora.split(params, lora.trained_mask(params, spec, False))
        (loss, logits), grads = loss_and_grads(trained, frozen)
        theirs.train()
        t = torch.tensor(tokens)
        out = theirs(input_ids=t, labels=t)
        out.loss.backward()
        want_loss = float(out.loss.detach())
        assert abs(float(loss) - want_loss) < 1e-5 * want_loss
        assert relative(np.asarray(logits), out.logits.detach().numpy()) < FP32
        if not nonzero:  # PEFT's start: B zero, the base model itself
            assert relative(np.asarray(logits), hf_logits(world.model, tokens)) < FP32
        torch_grads = hf_peft.named({
            name.replace(".default.weight", ".weight"): p.grad.numpy()
            for name, p in theirs.named_parameters() if "lora_" in name})
        want = lora.adapters_only(hf_peft.from_peft(torch_grads, fields, m, base, abstract))
        got = lora.adapters_only(jax.device_get(grads))
        assert jax.tree.structure(got) == jax.tree.structure(want)
        for path, g in jax.tree_util.tree_leaves_with_path(got):
            w = want
            for k in path:
                w = w[k.key]
            if not nonzero and path[-1].key == "a":
                assert np.abs(g).max() == 0 and np.abs(w).max() == 0, path
                continue
            # fp32 noise: up to 1.6e-5 of a leaf's largest entry over seeds (against torch in
            # float64 too), these random weights (std 0.3) making the softmax peaked
            assert np.abs(g - w).max() <= 5e-5 * np.abs(w).max(), (path, world.seed)


def test_a_peft_adapter_imports_onto_the_base_run_with_peft_s_logits(world, tmp_path, capsys):
    code, _ = run_cli(capsys, "import", "--adapter", str(world.adapter), "--run",
                      str(world.run.directory), "--out", str(tmp_path / "run"))
    assert code == 0
    run = open_run(tmp_path / "run")
    lo = run.config.train.lora
    assert (lo.rank, lo.alpha, lo.rslora, lo.dropout, lo.targets, lo.modules_to_save) == (
        4, 6.0, True, 0.05, "q_proj,v_proj,o_proj,down_proj", "norm")
    assert run.checkpoints.holds_adapters()
    tokens = world.rng.integers(0, run.config.model.vocab_size, (2, 24))
    ours = our_logits(run, tokens)
    assert relative(ours, peft_logits(world.peft, tokens)) < FP32
    assert relative(ours, hf_logits(world.model, tokens)) > 1e-2
    # and back: the very tensors PEFT saved, its base named
    assert convert_hf.main(["export", "--adapter", "--run", str(run.directory), "--out",
                            str(tmp_path / "back")]) == 0
    a, b = safetensors.Tensors(world.adapter), safetensors.Tensors(tmp_path / "back")
    assert a.names() == b.names()
    for name in a.names():
        np.testing.assert_array_equal(a[name], b[name])
    cfg = json.loads((tmp_path / "back" / "adapter_config.json").read_text())
    assert cfg["base_model_name_or_path"] == str(world.hf)
    assert sorted(cfg["target_modules"]) == sorted(["q_proj", "v_proj", "o_proj", "down_proj"])
    assert cfg["lora_dropout"] == 0.05


def test_tied_embeddings_are_one_table_as_peft_ties_them(world, tmp_path, capsys):
    """A tied model's head in modules_to_save (PEFT's ensure_weight_tying: embed_tokens, saved
    under both names) imports as the one table that trains, and exports as PEFT writes it."""
    model = hf_model(world.rng, tmp_path / "hf", tied=True)
    base = import_run(tmp_path / "hf", tmp_path / "base")
    theirs = peft_model(tmp_path / "hf", r=2, lora_alpha=4, target_modules=["k_proj", "up_proj"],
                        modules_to_save=["lm_head"], ensure_weight_tying=True)
    theirs.save_pretrained(tmp_path / "adapter")
    assert convert_hf.main(["import", "--adapter", str(tmp_path / "adapter"), "--run",
                            str(base.directory), "--out", str(tmp_path / "run")]) == 0
    run = open_run(tmp_path / "run")
    assert (run.config.train.lora.targets, run.config.train.lora.modules_to_save) == (
        "k_proj,up_proj", "embed_tokens")
    tokens = world.rng.integers(0, run.config.model.vocab_size, (2, 24))
    ours = our_logits(run, tokens)
    assert relative(ours, peft_logits(theirs, tokens)) < FP32
    assert relative(ours, hf_logits(model, tokens)) > 1e-2
    assert convert_hf.main(["export", "--adapter", "--run", str(run.directory), "--out",
                            str(tmp_path / "back")]) == 0
    cfg = json.loads((tmp_path / "back" / "adapter_config.json").read_text())
    assert (cfg["modules_to_save"], cfg["ensure_weight_tying"]) == (["embed_tokens"], True)
    again = PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(tmp_path / "hf").float(),
                                      tmp_path / "back").eval()
    saved = safetensors.Tensors(tmp_path / "back")
    assert sorted(get_peft_model_state_dict(again)) == saved.names()
    assert relative(ours, peft_logits(again, tokens)) < FP32


def rewrite(src, dst, config=None, tensors=None):
    """A copy of the adapter directory ``src`` at ``dst``, adapter_config.json updated with
    ``config`` and the safetensors' tensors replaced by ``tensors`` (a function of them)."""
    shutil.copytree(src, dst)
    if config is not None:
        cfg = json.loads((src / "adapter_config.json").read_text())
        (dst / "adapter_config.json").write_text(json.dumps({**cfg, **config}))
    if tensors is not None:
        found = safetensors.Tensors(src)
        safetensors.save(tensors({n: np.asarray(found[n]) for n in found.names()}),
                         dst / "adapter_model.safetensors")
    return dst


def test_what_does_not_convert_is_one_line(world, tmp_path, capsys):
    base_run, adapter, P = str(world.run.directory), world.adapter, hf_peft.PREFIX

    def refused(*args) -> str:
        """The command's one line (exit 2): its function's ConversionError."""
        code, line = run_cli(capsys, *args)
        assert code == 2 and line.startswith("error: "), line
        a, quiet = convert_hf.parse_args(list(args)), (lambda _: None)
        with pytest.raises(ConversionError) as e:
            if a.command == "import":
                convert.import_adapter(a.adapter, a.run, a.out, log=quiet)
            elif a.adapter:
                convert.export_adapter(a.run, a.out, log=quiet)
            else:
                convert.export_hf(a.run, a.out, merge=a.merge, log=quiet)
        assert line == f"error: {e.value}" and "\n" not in line
        return line

    def imported(src) -> str:
        return refused("import", "--adapter", str(src), "--run", base_run, "--out",
                       str(tmp_path / "never"))

    # a run without adapters: --adapter and --merge refuse before reading its weights
    for flag in ("--adapter", "--merge"):
        line = refused("export", flag, "--run", base_run, "--out", str(tmp_path / "out"))
        assert f"{flag}: {base_run} has no LoRA adapters" in line
    assert not (tmp_path / "out").exists()
    # missing files
    line = imported(tmp_path / "nowhere")
    assert "no such directory" in line
    (tmp_path / "empty").mkdir()
    assert "no adapter_config.json" in imported(tmp_path / "empty")
    bin_only = rewrite(adapter, tmp_path / "bin")
    (bin_only / "adapter_model.safetensors").rename(bin_only / "adapter_model.bin")
    assert "only adapter_model.bin" in imported(bin_only)
    # another PEFT method, or LoRA's variants not built here
    line = imported(rewrite(adapter, tmp_path / "ia3", {"peft_type": "IA3"}))
    assert "peft_type 'IA3'; only LORA adapters convert" in line
    assert "use_dora=True: DoRA" in imported(rewrite(adapter, tmp_path / "dora", {"use_dora": True}))
    # target modules with no adapter here
    line = imported(rewrite(adapter, tmp_path / "embed", {"target_modules": ["q_proj", "lm_head"]}))
    assert "target module 'lm_head' has no adapter here" in line
    # another architecture: GPT-2's names
    gpt2 = rewrite(adapter, tmp_path / "gpt2", {"target_modules": ["q_proj"]}, lambda t: {
        k.replace("model.layers.", "transformer.h."): v for k, v in t.items()})
    assert "adapts a module this model does not have" in imported(gpt2)
    # another shape: a wider model's q_proj, named with both shapes
    name = P + "model.layers.1.self_attn.q_proj.lora_A.weight"
    wide = rewrite(adapter, tmp_path / "wide", tensors=lambda t: {
        **t, name: np.zeros((4, 128), np.float32)})
    line = imported(wide)
    assert f"tensor {name} has shape (4, 128), but this run's q_proj at rank 4 takes (4, 64)" in line
    # a deeper model's layers
    deep = rewrite(adapter, tmp_path / "deep", tensors=lambda t: {
        **t, **{k.replace("layers.1.", "layers.7."): v for k, v in t.items() if "layers.1." in k}})
    assert "is for layer 7, but the run has 2 layers" in imported(deep)
    # some of the norms only
    line = imported(rewrite(adapter, tmp_path / "some", {"modules_to_save": ["input_layernorm"]}))
    assert "saves 2 of the model's 5 norms" in line
    # a base model of another shape, where it is a local directory
    other = tmp_path / "other_base"
    other.mkdir()
    cfg = json.loads((world.hf / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 3}))
    line = imported(rewrite(adapter, tmp_path / "other", {"base_model_name_or_path": str(other)}))
    assert "is not this run's model: model.num_layers=3 there but 2 now" in line
    assert not (tmp_path / "never").exists()
    # a base run that holds adapters already
    assert convert_hf.main(["import", "--adapter", str(adapter), "--run", base_run, "--out",
                            str(tmp_path / "with")]) == 0
    line = refused("import", "--adapter", str(adapter), "--run", str(tmp_path / "with"), "--out",
                   str(tmp_path / "never"))
    assert "holds LoRA adapters already" in line
    with pytest.raises(ConversionError, match="peft_type"):
        hf_peft.lora_fields({"peft_type": "PREFIX_TUNING"}, None, world.run.config.model)
