"""Sharded train state, its creation, and the pure jitted train / eval steps."""
from __future__ import annotations

import contextlib
import math
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from model import lora, moe
from model.decoder import Decoder
from model.sharded import ShardedModel
from parallel.mesh import batch_sharding
from training import objective, remat
from training.optim import decay_mask, make_optimizer, schedule

# For a step compiled only to read its memory (the planner; model.remat=auto): the backend's
# code generation can skip its optimisations (a third less compile time); buffer assignment,
# hence memory, is unchanged. XLA CPU has no bf16 dynamic-slice: it computes the backward's
# slices of the stacked bf16 layer inputs in fp32, and loop-invariant code motion then hoists
# an fp32 copy of the whole [layers, B, L, D] stack out of the backward loop (16 GiB for
# llama_7b at 262k tokens on 64 devices). GPUs and TPUs slice bf16 natively and never make that
# copy, so these compiles run without the hoisting.
FAST_COMPILE = {"xla_backend_optimization_level": 0,
                "xla_llvm_disable_expensive_passes": True,
                "xla_disable_hlo_passes": "while-loop-invariant-code-motion"}
# For the init program, which runs once: on a CPU, LLVM's optimisation level 1 compiles it in
# about half the CPU time of the default level (about 2 s of 4-5 for the tiny model) and gives
# the same parameters to the bit (checked on the tiny, base and extend_tiny models, GQA, biases,
# tied head, a tensor mesh, bf16 compute). Level 0 would be faster still but changes the last
# bit of some weights. Other platforms compile it as they compile everything.
INIT_COMPILE_CPU = {"xla_backend_optimization_level": 1}


@flax.struct.dataclass
class TrainState:
    step: jax.Array  # int32 scalar: optimizer steps taken
    params: Any  # pure nested dict of fp32 arrays (nnx.to_pure_dict layout)
    opt_state: Any
    bad_step: jax.Array  # int32: first step whose loss or gradient norm was not finite, else -1


class Trainer:
    """Builds the model's structure once and holds the jitted, sharded step functions."""

    def __init__(self, config, mesh):
        # model.remat=auto: the policy that fits, compiled per policy (training/remat.py); the
        # line saying which is ``remat_line`` (None when the config names a policy).
        config, self.remat_line = remat.resolve(config, mesh, step_bytes)
        self.config, self.mesh = config, mesh
        self.sharded = ShardedModel(config, mesh)
        self.graphdef, self.backend = self.sharded.graphdef, self.sharded.backend
        self.param_shardings = self.sharded.param_shardings
        abstract_pure = nnx.to_pure_dict(self.sharded.abstract_state)
        # LoRA (model/lora.py): only the adapters and train.lora.modules_to_save train; the
        # frozen rest has no gradient and no optimizer state, and is held in base_dtype.
        self.lora = self.sharded.lora
        self.trained = None if self.lora is None else lora.trained_mask(
            abstract_pure, self.lora, bool(config.model.get("tie_embeddings", False)))
        if self.lora is not None:
            base = lora.BASE_DTYPES[config.train.lora.base_dtype]
            abstract_pure = jax.tree.map(
                lambda a, t: a if t else jax.ShapeDtypeStruct(a.shape, base), abstract_pure,
                self.trained)
        self._base_dtypes = jax.tree.map(lambda a: a.dtype, abstract_pure)
        trained_pure = self._split(abstract_pure)[0]
        self.trained_count = sum(math.prod(a.shape) for a in jax.tree.leaves(trained_pure))
        self.trained_shardings = self._split(self.param_shardings)[0]
        self.optimizer = make_optimizer(config.train, self._split(
            decay_mask(self.sharded.abstract_state))[0])
        self.lr_schedule = schedule(config.train)
        replicated = NamedSharding(mesh, P())
        abstract_opt = jax.eval_shape(self.optimizer.init, trained_pure)
        # Optimizer moments mirror the trained params' shardings; counters are replicated.
        opt_shardings = _like_params(abstract_opt, trained_pure, self.trained_shardings,
                                     replicated)
        self.state_shardings = TrainState(step=replicated, params=self.param_shardings,
                                          opt_state=opt_shardings, bad_step=replicated)
        self.objective = objective.of(config)
        self.batch_shardings = {**self.sharded.batch_shardings, **{
            k: batch_sharding(mesh) for k in self.objective.batch_keys}}
        self._micro_sharding = NamedSharding(mesh, P(None, *batch_sharding(mesh).spec))
        self.abstract_state = jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
            TrainState(step=jax.ShapeDtypeStruct((), jnp.int32), params=abstract_pure,
                       opt_state=abstract_opt, bad_step=jax.ShapeDtypeStruct((), jnp.int32)),
            self.state_shardings)

        on_cpu = mesh.devices.flat[0].platform == "cpu"
        self.init = jax.jit(self._init, out_shardings=self.state_shardings,
                            compiler_options=INIT_COMPILE_CPU if on_cpu else None)
        # The step-0 state around weights already placed (another run's: checkpoints/resume.py):
        # what ``init`` gives them (AdamW's zero moments and counters read only their shapes),
        # without compiling and running the initialiser for weights it would throw away. Donated:
        # the state's params are the given buffers, not a copy beside them.
        self.init_from = jax.jit(self.state_of, out_shardings=self.state_shardings,
                                 donate_argnums=0)
        # LoRA adapters as ``seed`` initialises them, alone (for a base model's weights from
        # elsewhere: checkpoints/resume.py); the rest of the initialiser is never computed.
        self.fresh_adapters = jax.jit(
            lambda seed: lora.adapters_only(self.initial_params(seed)),
            out_shardings=lora.adapters_only(self.param_shardings),
            compiler_options=INIT_COMPILE_CPU if on_cpu else None)
        self.train_step = jax.jit(
            self._train_step, in_shardings=(self.state_shardings, self.batch_shardings),
            out_shardings=(self.state_shardings, replicated), donate_argnums=0)
        self.eval_step = jax.jit(
            self._eval_step, in_shardings=(self.param_shardings, self.batch_shardings),
            out_shardings=replicated)

    def abstract_batch(self, rows: int | None = None, seq_len: int | None = None) -> dict:
        """ShapeDtypeStructs of one [B, L] batch (the config's by default), sharded like the
        real ones."""
        d = self.config.data
        shape = (rows or d.batch_size, seq_len or d.seq_len)
        floats = ("loss_mask", *self.objective.batch_keys)
        return {k: jax.ShapeDtypeStruct(shape, jnp.float32 if k in floats else jnp.int32,
                                        sharding=s)
                for k, s in self.batch_shardings.items()}

    def step_bytes(self) -> int:
        """Per-device bytes of the compiled train step (arguments + outputs not written in place
        + temporaries: XLA's buffer accounting, ``FAST_COMPILE``), compiled without weights."""
        ma = self.train_step.lower(self.abstract_state, self.abstract_batch()).compile(
            compiler_options=FAST_COMPILE).memory_analysis()
        return int(ma.argument_size_in_bytes + ma.output_size_in_bytes
                   - ma.alias_size_in_bytes + ma.temp_size_in_bytes)

    def _init(self, seed):
        return self.state_of(self.initial_params(seed))

    def initial_params(self, seed):
        """The model's parameters as ``seed`` initialises them (adapters included)."""
        model = Decoder(self.config.model, self.backend, nnx.Rngs(jax.random.key(seed)),
                        self.lora)
        return nnx.to_pure_dict(nnx.state(model, nnx.Param))

    def state_of(self, params) -> TrainState:
        """The step-0 state around ``params``: the optimizer's initial state (for the trained
        parameters), no bad step; a frozen base in its ``train.lora.base_dtype``."""
        params = jax.tree.map(lambda p, d: p.astype(d), params, self._base_dtypes)
        return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                          opt_state=self.optimizer.init(self._split(params)[0]),
                          bad_step=jnp.full((), -1, jnp.int32))

    def reference_params(self, params):
        """DPO's reference model of ``params``: with LoRA the base, adapters off (B at zero),
        as TRL's DPO with PEFT (the starting weights themselves under new adapters); else
        ``params``."""
        return params if self.lora is None else lora.switched_off(params)

    @staticmethod
    def without_adapters(params):
        """A params-shaped tree less its LoRA adapters: the base model's."""
        return lora.without_adapters(params)

    @staticmethod
    def with_adapters(base, adapters):
        """A base model's params with ``adapters`` (``fresh_adapters``') joined in."""
        return lora.join(base, adapters)

    def _split(self, tree) -> tuple:
        """(the trained part of a params-shaped ``tree``, the frozen part: {} without LoRA)."""
        return (tree, {}) if self.trained is None else lora.split(tree, self.trained)

    def _join(self, trained, frozen):
        return trained if self.trained is None else lora.join(trained, frozen)

    def token_losses(self, params, batch):
        """Next-token cross-entropy per token ``[B, L]`` in the batch's layout, 0 where masked."""
        return self.forward(params, batch)[0]

    def forward(self, params, batch):
        """(``token_losses``, a mixture of experts' router statistics summed over its layers,
        or None: model/moe.py)."""
        model = nnx.merge(self.graphdef, params)
        return model.token_losses_routed(batch["tokens"], batch["positions"],
                                         batch["segment_ids"], batch["labels"],
                                         batch["loss_mask"], chunk=self.config.train.loss_chunk)

    def loss(self, params, batch):
        """The objective's loss (training/objective.py: the mean over trained tokens, or over
        pairs; order-free, so any layout works) and that count."""
        loss, counts, _ = self.loss_and_sums(params, batch)
        return loss, counts[self.objective.count_key]

    def counts(self, batch) -> dict:
        """The objective's counts of the whole batch, and a mixture of experts' counts of its
        real tokens and of its rows that hold one (what the router statistics, and the
        per-sequence balance loss, are over)."""
        counts = self.objective.counts(batch)
        if moe.experts_of(self.config.model):
            counts["router_tokens"] = moe.real_tokens(batch["segment_ids"])
            counts["router_rows"] = moe.real_rows(batch["segment_ids"])
        return counts

    def loss_and_sums(self, params, batch, counts=None):
        """(loss contribution of ``batch`` given the counts of the whole batch it belongs to
        (its own by default), those counts, the objective's sums to report)."""
        counts = self.counts(batch) if counts is None else counts
        token_losses, router = self.forward(params, batch)
        loss, sums = self.objective.contribution(token_losses, batch, counts)
        if router is not None:  # a mixture of experts' auxiliary losses (model/moe.py)
            extra, aux_sums = moe.step_aux(router, counts, self.config.model)
            loss, sums = loss + extra, sums | aux_sums
        return loss, counts, sums

    def gradients(self, params, batch, step=None):
        """(loss, the objective's count, gradients, metrics) of one global batch.

        With ``train.microbatches=k`` the batch runs as k sequential microbatches (a scan):
        each adds the gradient of its loss sum over the whole batch's count (tokens, pairs),
        so the result is the one-batch loss and gradient, with 1/k of the activations.
        ``step``: the optimizer step, which draws LoRA's dropout masks (none when None)."""
        k = self.config.train.microbatches
        key = self.objective.count_key
        # differentiated with respect to the trained parameters only (all of them without LoRA)
        params, frozen = self._split(params)
        drops = step is not None and self.lora is not None and self.lora.dropout > 0
        if drops:  # each token's id, made before the split: a microbatch keeps its rows' ids
            B, L = batch["tokens"].shape
            ids = lora.token_ids(jnp.arange(B), self.backend.natural_index(L))
            batch = {**batch, "lora_ids": jax.lax.with_sharding_constraint(
                ids, batch_sharding(self.mesh))}
            seed = (jnp.uint32(self.config.train.seed) * jnp.uint32(0x9E3779B1)
                    + jnp.asarray(step).astype(jnp.uint32))

        def dropping(b):
            return lora.dropping(seed, b["lora_ids"]) if drops else contextlib.nullcontext()

        if k <= 1:
            def whole(p):
                with dropping(batch):
                    loss, counts, sums = self.loss_and_sums(self._join(p, frozen), batch)
                return loss, (counts, sums)
            (loss, (counts, sums)), grads = jax.value_and_grad(whole, has_aux=True)(params)
            return loss, counts[key], grads, self._metrics(sums, counts)
        counts = self.counts(batch)

        def split(x_BL):
            # Row j*k + i goes to microbatch i: each device's contiguous block of rows splits
            # into k local pieces, so no microbatch moves data between devices.
            B = x_BL.shape[0]
            x_kBL = jnp.swapaxes(x_BL.reshape(B // k, k, *x_BL.shape[1:]), 0, 1)
            return jax.lax.with_sharding_constraint(x_kBL, self._micro_sharding)

        def micro_loss(params, micro):
            with dropping(micro):
                loss, _, sums = self.loss_and_sums(self._join(params, frozen), micro, counts)
            return loss, sums

        def body(carry, micro):
            loss_sum, sums_sum, grads = carry
            (loss, sums), g = jax.value_and_grad(micro_loss, has_aux=True)(params, micro)
            grads = jax.tree.map(jnp.add, grads, g)
            grads = jax.lax.with_sharding_constraint(grads, self.trained_shardings)
            return (loss_sum + loss, jax.tree.map(jnp.add, sums_sum, sums), grads), None

        zeros = jax.lax.with_sharding_constraint(jax.tree.map(jnp.zeros_like, params),
                                                 self.trained_shardings)
        micro = {name: split(v) for name, v in batch.items()}
        sums0 = jax.tree.map(jnp.zeros_like, jax.eval_shape(
            micro_loss, params, jax.tree.map(lambda x: x[0], micro))[1])
        (loss, sums, grads), _ = jax.lax.scan(body, (jnp.zeros((), jnp.float32), sums0, zeros),
                                              micro)
        return loss, counts[key], grads, self._metrics(sums, counts)

    def _metrics(self, sums, counts) -> dict:
        """The objective's metrics, the step's trained tokens, a mixture of experts' (its sums
        are already the step's values: model/moe.py ``step_aux``)."""
        return self.objective.metrics(sums, counts) | {"tokens": counts["tokens"]} | {
            k: sums[k] for k in moe.MOE_METRICS if k in sums}

    def _train_step(self, state: TrainState, batch):
        loss, _, grads, extra = self.gradients(state.params, batch, state.step)
        with jax.named_scope("optimizer"):  # training/profile.py's row
            trained, frozen = self._split(state.params)
            updates, opt_state = self.optimizer.update(grads, state.opt_state, trained)
            params = self._join(optax.apply_updates(trained, updates), frozen)
            grad_norm = optax.tree.norm(grads)
        # An inf gradient with a finite loss poisons the parameters just the same.
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        bad_step = jnp.where((state.bad_step < 0) & ~finite, state.step, state.bad_step)
        # The step's learning rate travels with its metrics: computed on the host at log time,
        # a jitted op would queue behind the step dispatched after it and stall the device.
        metrics = {"loss": loss, "grad_norm": grad_norm, "bad_step": bad_step,
                   "lr": self.lr_schedule(state.step), **extra}
        return TrainState(step=state.step + 1, params=params, opt_state=opt_state,
                          bad_step=bad_step), metrics

    def _eval_step(self, params, batch):
        """Sums over the batch: the loss times its count, the count, the objective's sums."""
        loss, counts, sums = self.loss_and_sums(params, batch)
        count = counts[self.objective.count_key]
        # a mixture of experts' values are the batch's: as sums over its count, like the rest
        sums = {k: v * count if k in moe.MOE_METRICS else v for k, v in sums.items()}
        return {"loss_sum": loss * count, "count": count, **sums}


def step_bytes(config, mesh) -> int:
    """Per-device bytes of ``config``'s compiled train step on ``mesh`` (model.remat=auto's
    measure)."""
    return Trainer(config, mesh).step_bytes()


def _like_params(abstract_opt, abstract_params, param_shardings, replicated):
    """Shardings for an optax state: any subtree shaped like the params gets their shardings."""
    params_def = jax.tree.structure(abstract_params)

    def visit(node):
        if jax.tree.structure(node) == params_def:
            return param_shardings
        if isinstance(node, jax.ShapeDtypeStruct):
            return replicated
        return None

    return jax.tree.map(visit, abstract_opt,
                        is_leaf=lambda n: isinstance(n, jax.ShapeDtypeStruct) or
                        jax.tree.structure(n) == params_def)
