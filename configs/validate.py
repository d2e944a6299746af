"""Config validation before anything compiles: each mistake is one line naming field and fix."""
from __future__ import annotations

from data.files import POLICIES as BAD_RECORDS
from data.mixture import check_fields as check_long_context_data
from errors import ConfigError, DataError, LayoutError, MeshError
from model import lora, pattern, rope
from model.weights import ACTIVATIONS
from model.decoder import DTYPES, REMAT
from parallel import kernels, strategies
from parallel.cluster import check_timeouts
from parallel.kernels import tiling
from parallel.layouts import LAYOUTS, check as check_layout
from parallel.mesh import mesh_shape

SOURCES = ("stdlib", "text", "jsonl", "parquet", "hf", "tfds")
IMPLS = strategies.IMPLS + ("dense",)
WANDB_MODES = ("disabled", "offline", "online")
ON_NONFINITE = ("stop", "rollback")


def _need(ok: bool, msg: str):
    if not ok:
        raise ConfigError(msg)


def validate(config, num_devices: int, platform: str | None = None) -> dict[str, int]:
    """Checks every field a run depends on; returns the resolved mesh axis sizes.

    ``platform`` (cpu | gpu | tpu; None: the default backend's) decides what ``auto`` kernels
    and their tile sizes resolve to."""
    m, a, d, t, k = config.model, config.attention, config.data, config.train, config.checkpoint
    for name in ("vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads", "ffn_dim"):
        _need(m[name] >= 1, f"model.{name}={m[name]} must be >= 1")
    _need(m.num_heads % m.num_kv_heads == 0,
          f"model.num_kv_heads={m.num_kv_heads} must divide model.num_heads={m.num_heads} (GQA groups)")
    if not m.head_dim:
        _need(m.d_model % m.num_heads == 0,
              f"model.d_model={m.d_model} is not divisible by model.num_heads={m.num_heads}; "
              f"set model.head_dim or pick heads dividing {m.d_model}")
    hd = m.head_dim or m.d_model // m.num_heads
    _need(hd % 2 == 0, f"head dim {hd} must be even for RoPE (model.head_dim / d_model / num_heads)")
    _need(m.dtype in (*DTYPES, "auto"), f"model.dtype={m.dtype!r} is not one of float32, bfloat16, auto")
    _need(m.param_dtype == "float32", f"model.param_dtype={m.param_dtype!r}: only float32 is supported")
    _need(m.mlp_chunk >= 0, f"model.mlp_chunk={m.mlp_chunk} must be >= 0 (tokens per MLP chunk; 0 = whole)")
    window = m.get("sliding_window", 0)
    _need(isinstance(window, int) and window >= 0,
          f"model.sliding_window={window!r} must be an int >= 0 (0: full attention; W: a query "
          f"at position p sees keys p - W < k <= p)")
    problem = pattern.check(m)
    _need(problem is None, problem)
    act = m.get("mlp_activation", "silu")
    _need(act in ACTIVATIONS, f"model.mlp_activation={act!r} is not one of {', '.join(ACTIVATIONS)}")
    for name in ("query_pre_attn_scalar", "final_logit_softcap"):
        value = m.get(name, 0.0)
        _need(isinstance(value, (int, float)) and value >= 0,
              f"model.{name}={value!r} must be a number >= 0 (0: off)")
    _need(m.remat in (*REMAT, "auto"),
          f"model.remat={m.remat!r} is not one of {', '.join((*REMAT, 'auto'))}")
    budget = float(config.train.get("memory_budget_gib", 0) or 0)
    _need(budget >= 0, f"train.memory_budget_gib={budget:g} must be >= 0 (0: the devices' own)")
    problem = rope.check(rope.from_config(m))
    _need(problem is None, f"model.{problem}")
    _check_moe(m)
    scope = m.get("qk_norm_scope", "head")
    _need(scope in ("head", "projection"),
          f"model.qk_norm_scope={scope!r} is not one of head, projection (q and k normed per "
          f"head, or over the whole projection: OLMoE)")

    _need(a.impl in IMPLS, f"attention.impl={a.impl!r} is not one of {', '.join(IMPLS)}")
    _need(a.layout in LAYOUTS, f"attention.layout={a.layout!r} is not one of {', '.join(LAYOUTS)}")
    _need(a.stripe >= 1, f"attention.stripe={a.stripe} must be >= 1")
    _need(a.kernel in kernels.KERNELS,
          f"attention.kernel={a.kernel!r} is not one of {', '.join(kernels.KERNELS)}")
    for field in ("pallas_block_q", "pallas_block_kv"):
        _need(a[field] >= 0, f"attention.{field}={a[field]} must be >= 0 (0: the kernel's default)")

    try:
        sizes = mesh_shape(config.mesh, num_devices)
    except MeshError as e:
        raise ConfigError(str(e)) from None
    for field in ("num_heads", "num_kv_heads"):
        _need(m[field] % sizes["tensor"] == 0,
              f"model.{field}={m[field]} is not divisible by mesh.tensor={sizes['tensor']}; "
              f"use a tensor axis size that divides it")
    _need(m.ffn_dim % sizes["tensor"] == 0,
          f"model.ffn_dim={m.ffn_dim} is not divisible by mesh.tensor={sizes['tensor']}")
    from model.flops import expert_dim, num_experts
    if num_experts(m):  # each expert's width splits over tensor too (model/moe.py's shard_map)
        _need(expert_dim(m) % sizes["tensor"] == 0,
              f"model.moe.expert_dim={m.moe.expert_dim} (each expert's width: "
              f"{expert_dim(m)}) is not divisible by mesh.tensor={sizes['tensor']}")

    _need(d.source in SOURCES, f"data.source={d.source!r} is not one of {', '.join(SOURCES)}")
    _need(d.seq_len >= 1, f"data.seq_len={d.seq_len} must be >= 1")
    rows = sizes["data"] * sizes["fsdp"]
    _need(d.batch_size >= 1 and d.batch_size % rows == 0,
          f"data.batch_size={d.batch_size} must be a positive multiple of mesh data x fsdp = {rows}")
    per_replica = d.batch_size // rows
    _need(t.microbatches >= 1 and per_replica % t.microbatches == 0,
          f"train.microbatches={t.microbatches} must be >= 1 and divide the rows per data x fsdp "
          f"group (data.batch_size {d.batch_size} / {rows} = {per_replica}); valid: "
          f"{', '.join(str(i) for i in range(1, per_replica + 1) if per_replica % i == 0)}")
    n = sizes["sequence"]
    try:
        check_layout(a.layout, d.seq_len, n, a.stripe)
    except LayoutError as e:
        raise ConfigError(f"data.seq_len: {e}") from None
    if platform is None:
        import jax
        platform = jax.devices()[0].platform
    dtype = m.dtype if m.dtype != "auto" else ("float32" if platform == "cpu" else "bfloat16")
    from model.flops import head_dim
    kernel = kernels.resolve(a.kernel, platform, dtype, head_dim(m))
    _need(kernel != "cudnn" or platform == "cpu" or dtype in ("bfloat16", "float16"),
          f"attention.kernel=cudnn runs bf16 or fp16 activations, model.dtype={m.dtype} gives "
          f"{dtype}; set model.dtype=bfloat16 or use attention.kernel=pallas_gpu")
    if a.impl in ("ulysses", "usp"):
        from parallel.strategies.usp import check_heads
        try:
            check_heads(a.impl, m.num_heads // sizes["tensor"], m.num_kv_heads // sizes["tensor"], n,
                        a.ulysses)
        except ValueError as e:
            field = "attention.impl=ulysses" if a.impl == "ulysses" else f"attention.ulysses={a.ulysses}"
            raise ConfigError(f"{field}: {e}") from None
    if a.impl != "dense" or kernel != "xla":
        _check_tiles(kernel, a, m, d.seq_len, n, platform)
    _need(0 < d.heldout_fraction < 1, f"data.heldout_fraction={d.heldout_fraction} must be in (0, 1)")
    _need(d.prefetch >= 0, f"data.prefetch={d.prefetch} must be >= 0")
    _need(d.bad_records in BAD_RECORDS,
          f"data.bad_records={d.bad_records!r} is not one of {', '.join(BAD_RECORDS)}")
    try:
        check_long_context_data(d)
    except DataError as e:
        raise ConfigError(str(e)) from None
    _check_chat_data(d, config.attention)
    if d.get("format", "text") == "preference":
        _check_dpo(config.dpo)

    _need(t.steps >= 1, f"train.steps={t.steps} must be >= 1")
    _need(t.lr > 0, f"train.lr={t.lr} must be > 0")
    _need(t.warmup_steps >= 0, f"train.warmup_steps={t.warmup_steps} must be >= 0")
    _need(0 <= t.min_lr_ratio <= 1, f"train.min_lr_ratio={t.min_lr_ratio} must be in [0, 1]")
    _need(t.log_every >= 1, f"train.log_every={t.log_every} must be >= 1")
    _need(t.eval_every >= 0 and t.eval_batches >= 0, "train.eval_every and train.eval_batches must be >= 0")
    _need(t.grad_clip >= 0, f"train.grad_clip={t.grad_clip} must be >= 0 (0 disables)")
    _need(t.loss_chunk >= 0,
          f"train.loss_chunk={t.loss_chunk} must be >= 0 (tokens per loss chunk; 0 = no chunking)")
    _need(t.peak_tflops >= 0, f"train.peak_tflops={t.peak_tflops} must be >= 0 (0 = device table)")
    _need(t.on_nonfinite in ON_NONFINITE,
          f"train.on_nonfinite={t.on_nonfinite!r} is not one of {', '.join(ON_NONFINITE)}")
    _need(t.max_rollbacks >= 0, f"train.max_rollbacks={t.max_rollbacks} must be >= 0")
    lora.check(config)
    _need(k.every >= 0 and k.keep >= 1,
          f"checkpoint.every={k.every} must be >= 0 and checkpoint.keep={k.keep} >= 1")
    check_timeouts(config.distributed)
    _need(config.wandb.mode in WANDB_MODES,
          f"wandb.mode={config.wandb.mode!r} is not one of {', '.join(WANDB_MODES)}")
    return sizes


# Fields that chat and preference data do not read (the text pipeline's), at their defaults; and
# those that preference data does not read either (a pair's sides are fixed by the record).
CHAT_UNREAD = {"min_doc_tokens": 0, "long_doc_tokens": 0, "long_doc_upsample": 1,
               "reset_positions_at_doc": True}
PAIR_UNREAD = {"train_on": "assistant", "messages_field": ""}


def _check_chat_data(d, attention):
    """data.format and the chat fields (data/sft.py)."""
    from data.chat_template import TRAIN_ON
    from data.sft import FORMATS, TOO_LONG
    fmt = d.get("format", "text")
    _need(fmt in FORMATS, f"data.format={fmt!r} is not one of {', '.join(FORMATS)}")
    if fmt == "text":
        return
    _need(d.source in ("jsonl", "hf"),
          f"data.format={fmt} reads records from data.source=jsonl or hf, not {d.source!r}")
    _need(d.train_on in TRAIN_ON,
          f"data.train_on={d.train_on!r} is not one of {', '.join(TRAIN_ON)}")
    _need(d.too_long in TOO_LONG, f"data.too_long={d.too_long!r} is not one of {', '.join(TOO_LONG)}")
    _need(bool(d.tokenizer), f"data.format={fmt} needs the model's tokenizer and its chat "
                             f"template: set data.tokenizer (configs/sft.py:RUN_DIR sets a run's)")
    what = "a conversation" if fmt == "chat" else "a pair's two sides"
    _need(bool(attention.document_mask),
          f"attention.document_mask=False with data.format={fmt}: packed "
          f"{'conversations' if fmt == 'chat' else 'pairs'} would attend to each other (and "
          f"{what} to its neighbours, the reference pass too); data.format={fmt} needs "
          f"attention.document_mask=True")
    # fields the text pipeline reads and these pipelines do not: set, they would change nothing
    unread = dict(CHAT_UNREAD, **(PAIR_UNREAD if fmt == "preference" else {}))
    for field, default in unread.items():
        value = d.get(field, default)
        _need(value == default,
              f"data.{field}={value!r} is not read with data.format={fmt} (it would change "
              f"nothing); leave it at {default!r}")


def _check_dpo(p):
    """The preference loss's fields (model/preference.py)."""
    from model.preference import LOSS_TYPES
    _need(p.beta > 0, f"dpo.beta={p.beta} must be > 0 (the KL penalty's weight; DPO's usual 0.1)")
    _need(p.loss_type in LOSS_TYPES,
          f"dpo.loss_type={p.loss_type!r} is not one of {', '.join(LOSS_TYPES)}")
    _need(0 <= p.label_smoothing < 0.5,
          f"dpo.label_smoothing={p.label_smoothing} must be in [0, 0.5) (the chance a label is "
          f"flipped; 0: plain DPO)")
    _need(p.rpo_alpha >= 0, f"dpo.rpo_alpha={p.rpo_alpha} must be >= 0 (0: no SFT term)")


def _check_moe(m):
    """A mixture of experts' fields (``model.moe``; model/moe.py). num_experts 0 is the dense
    MLP: the other fields are then not read, and not checked."""
    from model.moe import BALANCES, DISPATCHES, GLUS, GROUPED, ROUTERS
    e = m.get("moe", None)
    if e is None:  # a config from before the field: dense
        return
    n = e.num_experts
    _need(isinstance(n, int) and n >= 0,
          f"model.moe.num_experts={n!r} must be an int >= 0 (0: the dense MLP)")
    if n == 0:
        return
    _need(isinstance(e.top_k, int) and 1 <= e.top_k <= n,
          f"model.moe.top_k={e.top_k!r} must be an int in [1, {n}] (experts per token, at most "
          f"model.moe.num_experts={n})")
    _need(e.expert_dim >= 0,
          f"model.moe.expert_dim={e.expert_dim} must be >= 0 (each expert's hidden width; 0: "
          f"model.ffn_dim)")
    _need(e.router in ROUTERS, f"model.moe.router={e.router!r} is not one of {', '.join(ROUTERS)}")
    _need(e.grouped in GROUPED,
          f"model.moe.grouped={e.grouped!r} is not one of {', '.join(GROUPED)}")
    glu = e.get("glu", "gated")
    _need(glu in GLUS, f"model.moe.glu={glu!r} is not one of {', '.join(GLUS)} (act(gate) * up, "
          f"or gpt-oss's clamped unit)")
    if glu == "clamped":
        _need(e.glu_limit > 0, f"model.moe.glu_limit={e.glu_limit} must be > 0 (gpt-oss: 7)")
    _need(e.capacity >= 0,
          f"model.moe.capacity={e.capacity} must be >= 0 (picks an expert takes as a multiple "
          f"of its even share; 0: dropless)")
    _need(not (e.capacity and e.grouped == "dense"),
          f"model.moe.capacity={e.capacity} with model.moe.grouped=dense: dense computes every "
          f"expert on every token and drops nothing; use capacity 0 or grouped auto, ragged, blocks")
    dispatch = e.get("dispatch", "gather")
    _need(dispatch in DISPATCHES,
          f"model.moe.dispatch={dispatch!r} is not one of {', '.join(DISPATCHES)} (the experts "
          f"gathered to the tokens, or the tokens sent to the experts' devices)")
    _need(e.get("receive_buffer", 0.0) >= 0,
          f"model.moe.receive_buffer={e.get('receive_buffer')} must be >= 0 (a multiple of a "
          f"device's pairs; 0: room for all of them, dropless)")
    _need(not (dispatch == "all_to_all" and e.grouped == "dense"),
          "model.moe.dispatch=all_to_all with model.moe.grouped=dense: dense computes every "
          "expert on every token where it is; use grouped auto, ragged or blocks")
    for name in ("aux_loss", "z_loss"):
        _need(e[name] >= 0, f"model.moe.{name}={e[name]} must be >= 0 (the loss's weight; 0: off)")
    _check_moe_layers(m, e)
    balance = e.get("balance", "batch")
    _need(balance in BALANCES,
          f"model.moe.balance={balance!r} is not one of {', '.join(BALANCES)} (the load-balancing "
          f"loss over the whole batch's tokens, or per row of the batch)")
    _need(not m.mlp_chunk,
          f"model.mlp_chunk={m.mlp_chunk} with model.moe.num_experts={n}: the chunked MLP is "
          f"the dense one; set model.mlp_chunk=0 for a mixture of experts")


def _check_moe_layers(m, e):
    """Which layers are a mixture of experts (model.moe.every, first_dense, dense_layers;
    model/flops.py ``moe_layers``): at least one."""
    from model.flops import moe_layers
    L, whole = m.num_layers, lambda v: isinstance(v, int) and not isinstance(v, bool)  # noqa: E731
    every, first = e.get("every", 1), e.get("first_dense", 0)
    _need(whole(every) and every >= 1,
          f"model.moe.every={every!r} must be an int >= 1 (layer i is a mixture of experts when "
          f"(i + 1) % every == 0: Qwen3-MoE's decoder_sparse_step; 1: every layer)")
    _need(whole(first) and 0 <= first < L,
          f"model.moe.first_dense={first!r} must be an int in [0, {L - 1}] (the first k of "
          f"model.num_layers={L} layers dense: DeepSeek's first_k_dense_replace)")
    given = e.get("dense_layers", "")
    parts = ([p.strip() for p in given.split(",") if p.strip()] if isinstance(given, str)
             else list(given or ()))
    seen = set()
    for p in parts:
        ok = whole(p) or (isinstance(p, str) and p.lstrip("-").isdigit())
        _need(ok, f"model.moe.dense_layers={given!r}: {p!r} is not a layer index (a comma list "
                  f"of layers 0 to {L - 1} that hold the dense MLP: Qwen3-MoE's mlp_only_layers)")
        i = int(p)
        _need(0 <= i < L, f"model.moe.dense_layers={given!r}: layer {i} is out of range for "
                          f"model.num_layers={L} (layers 0 to {L - 1})")
        _need(i not in seen, f"model.moe.dense_layers={given!r} lists layer {i} twice")
        seen.add(i)
    _need(bool(moe_layers(m)),
          f"model.moe.num_experts={e.num_experts} but no layer is a mixture of experts "
          f"(model.moe.every={every}, first_dense={first}, dense_layers={given!r}: all "
          f"{L} layers dense); set model.moe.num_experts=0 for a dense model")


def _check_tiles(kernel, a, m, seq_len, n, platform):
    """The tiles the kernel will run, by its own rules (its module's, through ``tiling.plan``)."""
    chunk, block_q, block_kv = seq_len // n, *kernels.tiles(kernel, a)
    try:
        if kernel == "xla":
            for name, block in (("block_q", block_q), ("block_kv", block_kv)):
                tiling.tile_size(f"attention.{name}", block, chunk, seq_len, n)
        else:
            hd = m.head_dim or m.d_model // m.num_heads
            dtype = {"auto": "float32" if platform == "cpu" else "bfloat16"}.get(m.dtype, m.dtype)
            tiling.plan(kernel, block_q, block_kv, group=m.num_heads // m.num_kv_heads, head_dim=hd,
                        dtype=dtype, chunk=chunk, seq_len=seq_len, shards=n,
                        interpret=kernels.interpret(kernel, platform),
                        names=("attention.pallas_block_q", "attention.pallas_block_kv"))
    except ValueError as e:  # KernelError is one
        raise ConfigError(f"{e} [kernel {kernel}]") from None
