"""Every configuration field, with its default and meaning. Other configs start from this one.

Run:  python train.py --config configs/base.py --workdir runs/base
(the base model is a small 4-layer decoder; real runs pick configs/llama_*.py or tiny.py).
Override any field on the command line: --config.attention.layout=zigzag --config.train.steps=100
"""
import ml_collections


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.name = "base"  # run name: default workdir is runs/<name>-<time>

    c.model = m = ml_collections.ConfigDict()
    m.vocab_size = 32000  # tokenizer vocabulary (a trained BPE gets exactly this many tokens)
    m.d_model = 512  # residual stream width
    m.num_layers = 4  # decoder blocks (scanned: compile time does not grow with depth)
    m.num_heads = 8  # query heads
    m.num_kv_heads = 8  # key/value heads; < num_heads is GQA (must divide num_heads)
    m.head_dim = 0  # per-head width; 0 means d_model // num_heads
    m.ffn_dim = 1376  # SwiGLU hidden width
    m.rope_theta = 10000.0  # RoPE base frequency (context extension raises it, e.g. 500000)
    # RoPE scaling for context extension, as Hugging Face defines each type (model/rope.py).
    m.rope_scaling = s = ml_collections.ConfigDict()
    s.type = "none"  # none | linear (position interpolation) | dynamic (NTK) | yarn | llama3
    s.factor = 1.0  # context multiple the scaling stretches the positions by (>= 1)
    s.original_max_len = 0  # pretraining context (dynamic, yarn, llama3 need it)
    s.low_freq_factor = 1.0  # llama3: wavelengths above original_max_len / this are scaled
    s.high_freq_factor = 4.0  # llama3: wavelengths below original_max_len / this are kept
    s.beta_fast = 32.0  # yarn: rotations above which a frequency extrapolates
    s.beta_slow = 1.0  # yarn: rotations below which a frequency interpolates
    s.attention_factor = 0.0  # yarn: cos/sin scale; 0 means 0.1 * ln(factor) + 1
    s.truncate = True  # yarn: round the ramp's ends to whole dimensions
    m.qkv_bias = False  # biases on the q, k and v projections, none on o (Qwen2 / Qwen2.5)
    m.o_bias = False  # a bias on the attention's output projection (gpt-oss: with qkv_bias)
    # Sliding-window attention (Mistral's convention): a query at position p sees keys with
    # p - W < k_pos <= p; 0 = full causal attention. In the contiguous layout the ring stops
    # after the rounds the window reaches (docs/layouts.md: which layout wins with a window).
    m.sliding_window = 0
    # Attention sinks (gpt-oss): a learned logit per query head that joins every row's softmax
    # denominator and adds nothing to the output, in every kernel, layout and strategy and in
    # the KV cache (docs/layouts.md: attention sinks).
    m.attention_sinks = False
    # Attention chosen per layer (model/pattern.py): a comma-separated list, one kind per layer,
    # each full | sliding | full_nope | sliding_nope (sliding: model.sliding_window; _nope: no
    # RoPE, as SmolLM3's every 4th layer). "" = every layer alike (sliding if sliding_window
    # is set, else full). Gemma 3: five sliding, one full, repeated; the stack is one scan
    # over the layers, each step switching to its layer's kind.
    m.layer_types = ""
    # RoPE base of the sliding layers (Gemma 3's local layers: 10000, unscaled); 0 = the
    # model's own rope_theta and rope_scaling on every layer.
    m.local_rope_theta = 0.0
    m.qk_norm = False  # RMSNorm over each head's dims of q and k before RoPE (Qwen3, Gemma 3)
    # qk_norm's reach: head (each head's dims, one weight shared by the heads: Qwen3, Gemma 3)
    # | projection (the whole q and k projections, all heads together: OLMoE)
    m.qk_norm_scope = "head"
    # The families' other differences from Llama; each default leaves a Llama model unchanged.
    m.norm_unit_offset = False  # every RMSNorm scales by 1 + w, w starting at 0 (Gemma)
    m.sandwich_norms = False  # norms on the attention and MLP outputs too (Gemma's 4 a block)
    m.scale_embeddings = False  # embeddings times sqrt(d_model) (Gemma)
    m.mlp_activation = "silu"  # the gated MLP's activation: silu (SwiGLU) | gelu_tanh (GeGLU)
    # The softmax scale is query_pre_attn_scalar ** -0.5 (Gemma); 0 = head_dim ** -0.5.
    m.query_pre_attn_scalar = 0.0
    m.final_logit_softcap = 0.0  # logits C * tanh(logits / C) (Gemma 2/3's option); 0 = none
    m.tie_embeddings = False  # the output head is the embedding table (as in TinyLlama-like HF models)
    # Mixture of experts in the layers' MLP slot (model/moe.py; docs/moe.md): a router picks
    # top_k of num_experts gated MLPs per token, dropless. 0 experts: the dense MLP.
    m.moe = e = ml_collections.ConfigDict()
    e.num_experts = 0
    # Which layers: layer i (from 0) is a mixture of experts when (i + 1) is a multiple of
    # `every` (Qwen2/3-MoE's decoder_sparse_step, Llama 4's interleave step; 1 = every layer),
    # it is not one of the first `first_dense` (DeepSeek's first_k_dense_replace) and not in
    # `dense_layers` (a comma list of layer indices, "0,5": Qwen3-MoE's mlp_only_layers). The
    # other layers hold the dense gated MLP of model.ffn_dim.
    e.every = 1
    e.first_dense = 0
    e.dense_layers = ""
    e.top_k = 2  # experts per token
    e.expert_dim = 0  # each expert's hidden width; 0 = model.ffn_dim
    # softmax_topk (softmax over all, then the top k: Mixtral, Qwen3-MoE, OLMoE) | topk_softmax
    # (the top k logits, then a softmax over them: gpt-oss)
    e.router = "softmax_topk"
    e.renormalize = True  # softmax_topk: the k weights rescaled to sum 1 (Mixtral, Qwen3's
    # norm_topk_prob); False: the softmax's own (OLMoE)
    e.router_bias = False  # a bias on the router's logits
    e.expert_bias = False  # biases on each expert's gate, up and down projections (gpt-oss)
    # The experts' gated unit: gated (act(gate) * up, act = model.mlp_activation: SwiGLU) |
    # clamped (gpt-oss: gate clamped above at glu_limit, up to [-glu_limit, glu_limit], then
    # (up + 1) * gate * sigmoid(glu_alpha * gate))
    e.glu = "gated"
    e.glu_limit = 7.0
    e.glu_alpha = 1.702
    # The load-balancing loss's weight (transformers' router_aux_loss_coef: its
    # load_balancing_loss_func over the step's real tokens, pooled over layers), and the router
    # z-loss's (the mean squared log-sum-exp of the logits); added to the loss, logged per step.
    e.aux_loss = 0.01
    e.z_loss = 0.0
    # What the load-balancing loss balances: batch (transformers': over the step's real tokens
    # pooled) | sequence (DeepSeek-V3's sequence-wise loss: the same loss per row of the batch,
    # averaged over the rows with real tokens and the layers; exact under microbatches)
    e.balance = "batch"
    e.capacity = 0.0  # picks an expert takes, as a multiple of the even share; 0 = dropless
    # the grouped matmul: auto | ragged (jax.lax.ragged_dot) | blocks (the CPU's) | dense
    # (every expert on every token: a yardstick)
    e.grouped = "auto"
    # Where the work meets the experts, on a mesh: gather (each layer's experts gathered to
    # every device, which runs its own tokens) | all_to_all (expert parallelism: each device
    # keeps its share of the experts and the token-expert pairs travel to them and back;
    # parallel/experts.py)
    e.dispatch = "gather"
    # all_to_all: the rows a device can receive, as a multiple of the pairs it routes (tokens x
    # top_k); the pairs past it are dropped and counted. 0 = room for every device's pairs
    # (dropless, at most the group's size)
    e.receive_buffer = 0.0
    m.norm_eps = 1e-5  # RMSNorm epsilon
    m.init_std = 0.02  # normal init std for weights (output projections scaled by 1/sqrt(2*layers))
    m.dtype = "auto"  # compute dtype: float32 | bfloat16 | auto (bf16 on GPU/TPU, fp32 on CPU)
    m.param_dtype = "float32"  # parameters and optimizer state stay in fp32
    # Activation checkpointing per layer: none | attention | full | offload | offload_input |
    # auto (the least recompute whose compiled step fits the devices' memory, or
    # train.memory_budget_gib: training/remat.py; the startup line says which and why)
    m.remat = "full"
    # The MLP (per token) runs over chunks of this many tokens of each device's slice under
    # remat: its [tokens, ffn_dim] activations are a layer's largest at long context. 0 = whole.
    m.mlp_chunk = 0
    m.scan_layers = True  # lax.scan over layers (False unrolls; only for debugging)

    c.attention = a = ml_collections.ConfigDict()
    # How the sequence axis splits attention (all exact, all read the true positions):
    # ring: K/V blocks travel round the devices (ppermute); allgather: K/V gathered whole,
    # dK/dV reduce-scattered (cheap with GQA); ulysses: all-to-all to head-sharded, full rows
    # per head group (heads must split over the sequence axis); usp: Ulysses inside groups of
    # attention.ulysses neighbouring devices (a node) and a ring across the groups; dense: the
    # single-device reference.
    a.impl = "ring"  # ring | allgather | ulysses | usp | dense
    a.ulysses = 2  # usp: Ulysses degree U (divides mesh.sequence and both head counts per tensor shard)
    a.layout = "striped"  # contiguous (ring baseline) | striped (the paper) | zigzag; drives data too
    a.stripe = 1  # striped layout: consecutive tokens per stripe (1 is the paper)
    a.block_q = 512  # query tile length inside each device's chunk (must divide it)
    a.block_kv = 512  # key/value tile length inside each device's chunk (must divide it)
    # (xla's backward runs tiles of at most 256 of these: parallel/kernels/xla.py XLA_BWD_TILE)
    # Per-round kernel: auto picks cudnn on a GPU where its one-time probe passes and the
    # activations are bf16/fp16, else the platform's fused Pallas kernel (GPU: Triton, TPU:
    # Mosaic), and xla on a CPU; a Pallas value on a CPU runs in interpret mode (exact, slow),
    # cudnn a dense stand-in (exact). cudnn's rounds it cannot mask run pallas_gpu.
    a.kernel = "auto"  # auto | xla | pallas_gpu | pallas_tpu | cudnn
    # Pallas tiles in positions, for the forward and both backward kernels; 0: each kernel's
    # defaults (parallel/kernels/pallas_gpu.py: per arch, head dim and dtype, from
    # scripts/gpu_compile.py; pallas_tpu.py: about 512 q rows, block_q x heads per kv head, and
    # 512 keys), fitted to the chunk by parallel/kernels/tiling.py. block_q/kv are xla's.
    a.pallas_block_q = 0
    a.pallas_block_kv = 0
    # With the mask, a step's work depends on where its documents start, and only a finely
    # interleaved layout (striped) stays balanced for any boundaries; without it every step
    # costs the same (scripts/compare_layouts.py --document-mask shows both).
    a.document_mask = True  # attend within each packed document only; False: whole rows (paper)

    c.mesh = ml_collections.ConfigDict()
    c.mesh.data = 1  # pure data parallelism (params replicated)
    c.mesh.fsdp = -1  # data parallelism with params/optimizer sharded; -1 fills the devices left
    c.mesh.sequence = 1  # context parallelism: the ring's length (sequence split over devices)
    c.mesh.tensor = 1  # tensor parallelism over heads and the MLP hidden dim

    c.data = d = ml_collections.ConfigDict()
    d.source = "stdlib"  # stdlib | text | jsonl | parquet | hf | tfds
    d.path = ""  # text/jsonl/parquet: file, glob or comma list; hf: dataset name or local dir
    d.text_field = "text"  # jsonl/parquet/hf/tfds: the field holding each document's text
    d.hf_config = ""  # hf: dataset config name ("" for none)
    d.split = "train"  # hf/tfds split to read
    d.data_dir = ""  # tfds: data_dir of the prepared dataset
    d.streaming = False  # hf: stream instead of loading in memory (local files always stream)
    # A record of a local file that cannot be read (a torn JSON line, bytes that are not UTF-8):
    # stop, naming file and line or row; or skip: leave it out (invalid UTF-8: replace it),
    # counted in the startup line (data/files.py).
    d.bad_records = "stop"  # stop | skip
    # What a record is: text (documents, packed as one stream) | chat (a conversation: data/sft.py
    # renders it with the run's chat template and trains the assistant's tokens only; whole
    # conversations packed into rows, each its own segment; jsonl or hf sources) | preference
    # (a prompt with a chosen and a rejected response: data/preference.py, the dpo fields)
    d.format = "text"
    d.messages_field = ""  # chat: the field holding the messages; "" = messages, else conversations
    d.chat_template = ""  # chat: a .jinja file (or tokenizer_config.json); "" = the tokenizer's own
    # chat: which tokens train: assistant (every assistant turn, end-of-turn included, headers
    # not) | last_assistant | all (every token of the conversation)
    d.train_on = "assistant"
    d.too_long = "drop"  # chat: a conversation longer than data.seq_len: drop | truncate (counted)
    d.tokenizer = ""  # path to a tokenizer.json; "" trains a byte-level BPE on the source (cached)
    d.cache_dir = ".cache/data"  # where trained tokenizers and token caches live
    d.max_docs = 0  # read at most this many documents (0 = all; with a mixture: from each source)
    d.seq_len = 2048  # tokens per row (global, before the sequence axis splits it)
    d.batch_size = 8  # rows per step, global (split over the data and fsdp axes)
    d.reset_positions_at_doc = True  # position ids restart at each packed document
    d.heldout_fraction = 0.02  # fraction of documents held out for evaluation, never trained on
    d.shuffle_seed = 0  # document order per epoch derives from this seed
    d.prefetch = 2  # batches built ahead in a background thread
    # Long-context data (context extension, Fu et al. 2024; data/mixture.py, data/selection.py).
    # Counts are the tokenizer's tokens of a document, before its EOS. The held-out split is
    # drawn first, per source, so these options never move a document between the sides.
    # Drop documents with fewer tokens, from training and held-out alike (0 keeps all).
    d.min_doc_tokens = 0
    # Documents with at least long_doc_tokens tokens appear long_doc_upsample times per epoch,
    # within their source's share (long_doc_tokens 0 or long_doc_upsample 1: off).
    d.long_doc_tokens = 0
    d.long_doc_upsample = 1
    # "PATH=WEIGHT,PATH=WEIGHT,...": sources of kind data.source (data.path stays ""), each
    # PATH a file, glob or directory (no commas; the weight follows the last "="). A source gets
    # WEIGHT/sum(weights) of each epoch's training tokens (after upsampling), repeated or
    # subsampled by whole documents; the subset is drawn once from shuffle_seed, so every epoch
    # holds the same documents. An epoch has the tokens of one pass over all sources. "" = off.
    d.mixture = ""

    c.train = t = ml_collections.ConfigDict()
    t.steps = 1000  # optimizer steps
    t.lr = 3e-4  # peak learning rate
    t.warmup_steps = 100  # linear warmup from 0 to lr
    t.min_lr_ratio = 0.1  # cosine decays to lr * min_lr_ratio at the last step
    t.weight_decay = 0.1  # AdamW decoupled decay (not applied to norms and biases)
    t.b1 = 0.9  # AdamW beta1
    t.b2 = 0.95  # AdamW beta2
    t.eps = 1e-8  # AdamW epsilon
    t.grad_clip = 1.0  # global-norm clipping (0 disables)
    t.seed = 0  # parameter init and any sampling
    t.log_every = 10  # steps between metric reads (the only host syncs in the loop)
    t.eval_every = 0  # steps between held-out evaluations (0: only at the end)
    t.eval_batches = 4  # held-out batches per evaluation
    # The final norm, head and cross-entropy run over chunks of this many tokens of each
    # device's slice of a row (model/loss.py): the [B, L, V] fp32 logits and their gradient
    # never exist whole. 0 = one chunk (the whole slice); a chunk not dividing the slice is padded.
    t.loss_chunk = 2048
    # Gradient accumulation: each global batch (data.batch_size rows) runs as this many
    # sequential microbatches inside the step, one optimizer update per step; the loss is the
    # token-weighted mean over all of them. Must divide the rows per data x fsdp group.
    t.microbatches = 1
    t.peak_tflops = 0.0  # per-device peak for MFU; 0 looks the device up in a table
    t.memory_budget_gib = 0.0  # per-device memory model.remat=auto fits into; 0: the device's own
    # A loss or gradient norm that is NaN/inf (read at log steps and before every save, so a
    # non-finite state is never saved): stop, naming the newest finite checkpoint, or rollback:
    # restore it, skip the batches up to the bad step and go on (training/divergence.py).
    t.on_nonfinite = "stop"  # stop | rollback
    t.max_rollbacks = 3  # rollback: at most this many per run (resumes included), then stop
    # LoRA (model/lora.py, docs/sft.md): a low-rank scale * (x @ A) @ B beside each targeted
    # projection, A random and B zero (step 0 is the base), as PEFT starts them; only the
    # adapters and modules_to_save train (gradients and optimizer state for them alone), the
    # rest is frozen. scripts/convert_hf.py export --adapter writes PEFT's format, --merge
    # merged weights; import --adapter reads a PEFT adapter onto a run.
    t.lora = lo = ml_collections.ConfigDict()
    lo.rank = 0  # r; 0: no adapters, every weight trains
    lo.alpha = 16.0  # the adapters' scale is alpha / rank (PEFT's lora_alpha)
    lo.rslora = False  # scale by alpha / sqrt(rank) instead (rank-stabilised LoRA)
    # PEFT's lora_dropout on the adapters' input, train steps only; the masks hash the token
    # (row, natural position), so any mesh, layout or microbatching gives the same step
    lo.dropout = 0.0
    # PEFT's module names, comma-separated: q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,
    # down_proj, or all-linear (every one of them)
    lo.targets = "all-linear"
    # what trains in full beside the adapters (LongLoRA: embeddings and norms for context
    # extension): embed_tokens, lm_head (with tied embeddings, both are the one table), norm
    # (every RMSNorm); comma-separated, "" = none
    lo.modules_to_save = ""
    lo.base_dtype = "float32"  # float32 | bfloat16: how the frozen base is held (adapters fp32)

    # Preference tuning (data.format=preference; model/preference.py, as TRL's DPOTrainer):
    # the loss of each packed chosen/rejected pair against the starting model's log-probs.
    c.dpo = p = ml_collections.ConfigDict()
    p.beta = 0.1  # the implicit reward's scale: how far the policy may move from the reference
    # sigmoid (DPO) | ipo (IPO's squared loss on per-token mean log-probs, as TRL) | hinge (SLiC)
    p.loss_type = "sigmoid"
    p.label_smoothing = 0.0  # sigmoid: the chance a preference label is wrong (cDPO); 0 = DPO
    p.rpo_alpha = 0.0  # weight of the chosen responses' cross-entropy added (RPO); 0 = none

    c.checkpoint = k = ml_collections.ConfigDict()
    k.every = 500  # steps between checkpoints (0 disables periodic saves; the last step saves)
    k.keep = 3  # newest checkpoints kept (at least 2: a divergence can roll back past the newest)
    k.keep_every = 0  # also keep every checkpoint whose step is a multiple of this (milestones)
    k.async_save = True  # write in the background while training continues
    k.restore_from = ""  # start from another run's checkpoint dir (its newest step)
    k.restore_weights_only = False  # with restore_from: take params only, fresh optimizer/data

    # Multi-process runs: each process finds its place from the flags (--coordinator,
    # --num_processes, --process_id), JAX_* variables, SLURM, Open MPI or Kubernetes
    # (parallel/cluster.py; docs/clusters.md).
    c.distributed = ml_collections.ConfigDict()
    # A process that sends jax.distributed no heartbeat for this long (dead, frozen,
    # unreachable) ends the run on every host within about this time, with one line naming it;
    # a relaunch of the same command resumes (training/supervisor.py).
    c.distributed.heartbeat_timeout_s = 100
    # How long the processes wait for each other to join at startup (uneven host start-up,
    # image pulls): then one line names the coordinator and where its address came from.
    c.distributed.init_timeout_s = 300
    # A process that is alive but stuck (a deadlock, a hung file system, a collective that
    # never completes) keeps its heartbeat: when no train step finishes for this long, every
    # process ends in one line naming it (training/watchdog.py). 0: the larger of 10 minutes
    # and 20 median step times. The first step (it compiles) gets the larger of 30 minutes and
    # three timeouts, an evaluation or a save three timeouts.
    c.distributed.step_timeout_s = 0.0

    c.wandb = w = ml_collections.ConfigDict()
    w.mode = "disabled"  # disabled | offline | online
    w.project = "stripedjax"  # wandb project
    w.entity = ""  # wandb entity ("" = default)
    return c
