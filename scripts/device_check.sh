#!/usr/bin/env bash
# Checks and times the GPU path on one GPU host, in at most 8 minutes (the stages' time limits
# add up to 8 min 0 s; a stage that ignores its limit is killed 10 s later); installs nothing from the
# network. From the repository root on the GPU host:
#
#     bash scripts/device_check.sh [OUT_DIR]
#
# DEVICE_CHECK_STAGES=2b,3,4 runs only those stages (0 always runs), to redo what failed;
# TRAIN_KERNELS=cudnn trains stage 3 with those kernels only.
#
# 1. the kernel tests with the real kernels, ring of one (one GPU): Pallas GPU (Triton), causal
#    and not, and cudnn (bf16, with a window);
# 2. scripts/bench_kernels.py through the ring API, per round type (diagonal, strictly lower,
#    full): pallas_gpu vs the cudnn round vs bare cuDNN, bf16, head_dim 128, 8k and 32k chunks;
#    then xla's diagonal at 32k with llama_1b's 1,024-position tiles (the planner's xla rows were
#    measured with 512, and llama_1b's xla step ran ~1.9x faster than they predict);
# 3. train.py, configs/llama_1b.py at 32k tokens on one GPU, kernel cudnn then pallas_gpu,
#    model.remat=auto: tokens/s and MFU per logged step (xla's numbers are known: not rerun);
# 4. scripts/profile_step.py on that llama_1b step (kernel auto): where its time goes.
# Every stage has its own time limit and writes its log (and JSON) to OUT_DIR as it goes, so a
# stage that fails or runs out of time costs only itself.
#
# Rehearsal on a CPU (no GPU needed; tiny sizes, Pallas interpret mode), so an API change in
# the JAX a GPU host runs cannot eat a lent GPU's minutes. With that JAX installed (e.g. a
# Python 3.12 venv from requirements-next.txt with jax==0.11.2):
#
#     DEVICE_CHECK_REHEARSE=1 PY=.venv-next/bin/python bash scripts/device_check.sh /tmp/rehearse
#
# Packages the host lacks travel as wheels in .whl/ (make device-wheels, run where pip can
# download); they are installed from there into /tmp/site.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${1:-${OUT:-bench_out/device}}
mkdir -p "$OUT_DIR"
PY=${PY:-python3}
REHEARSE=${DEVICE_CHECK_REHEARSE:-0}
export PYTHONUNBUFFERED=1
unset XLA_FLAGS
if [ "$REHEARSE" = 1 ]; then
  export JAX_PLATFORMS=cpu STRIPEDJAX_PALLAS_INTERPRET=1
  CHUNKS=128 HEADS=2 HEAD_DIM=32 BLOCK=32 REPEATS=1 TEST_LIMIT=300  # interpret mode is slow
  XLA_CHUNK=128 XLA_BLOCK=64
  SEQ=256 MODEL="--config.model.num_layers=2 --config.model.d_model=128 --config.model.ffn_dim=256
    --config.model.num_heads=4 --config.model.num_kv_heads=4 --config.model.vocab_size=512
    --config.model.mlp_chunk=0 --config.attention.block_q=64 --config.attention.block_kv=64
    --config.data.max_docs=4"
else
  export JAX_PLATFORMS=${JAX_PLATFORMS:-cuda} STRIPEDJAX_PALLAS_INTERPRET=0
  CHUNKS=8192,32768 HEADS=16 HEAD_DIM=128 BLOCK=0 REPEATS=5 TEST_LIMIT=80
  XLA_CHUNK=32768 XLA_BLOCK=1024
  SEQ=32768 MODEL=""
fi
if compgen -G ".whl/*.whl" >/dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
STAGES=${DEVICE_CHECK_STAGES:-1,2,2b,3,4}
TRAIN_KERNELS=${TRAIN_KERNELS:-cudnn pallas_gpu}
stage() { echo; echo "== $(date +%T) $*"; }
wanted() { [[ ",$STAGES," == *",$1,"* ]]; }
status=0

stage "0. machine"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader 2>/dev/null || true
$PY -c "import jax, flax, optax; d = jax.devices()[0]
print('jax', jax.__version__, 'flax', flax.__version__, jax.devices(), getattr(d, 'compute_capability', ''))" || exit 1

if wanted 1; then
  stage "1. kernel tests, real kernels (ring of one: one GPU): Pallas GPU and cudnn"
  ids=("tests/test_cudnn.py::test_cudnn_ring_matches_reference[1-(4, 1)-causal-bfloat16]"
       "tests/test_cudnn.py::test_cudnn_ring_with_a_window[1-5-bfloat16]")
  for h in mha gqa4; do for m in causal packed; do for t in float32 bfloat16; do
    ids+=("tests/test_kernels.py::test_fused_ring_matches_reference[pallas_gpu-1-$h-$m-$t]")
  done; done; done
  ids+=("tests/test_kernels.py::test_rows_with_no_visible_key_and_empty_rounds[pallas_gpu]"
        "tests/test_kernels.py::test_non_causal_matches_reference[dense-pallas_gpu-mixed]")
  for g in 3 7; do ids+=("tests/test_kernels.py::test_any_group_with_default_tiles[pallas_gpu-$g]"); done
  STRIPEDJAX_FULL_KERNEL_MATRIX=1 timeout -k 10 $TEST_LIMIT $PY -m pytest -q -p no:cacheprovider "${ids[@]}" \
    > "$OUT_DIR/kernel_tests.log" 2>&1 || status=1
  tail -25 "$OUT_DIR/kernel_tests.log"
  timeout -k 5 30 $PY -c "from parallel.kernels import cudnn; print('cudnn probe:', cudnn.probe())" 2>&1 | tail -1
fi

if wanted 2; then
  stage "2. bench_kernels: one round per type, bf16, $HEADS heads of $HEAD_DIM"
  timeout -k 10 95 $PY scripts/bench_kernels.py --chunks $CHUNKS --heads $HEADS --head-dim $HEAD_DIM \
    --block $BLOCK --repeats $REPEATS --kernels pallas,cudnn,cudnn_bare --cases diagonal,striped,full \
    --json "$OUT_DIR/bench_kernels.json" > "$OUT_DIR/bench_kernels.log" 2>&1 || status=1
  tail -30 "$OUT_DIR/bench_kernels.log"
fi
if wanted 2b; then
  stage "2b. xla, diagonal at $XLA_CHUNK with $XLA_BLOCK-position tiles (llama_1b's)"
  timeout -k 10 40 $PY scripts/bench_kernels.py --chunks $XLA_CHUNK --heads $HEADS --head-dim $HEAD_DIM \
    --repeats 3 --kernels xla --xla-block $XLA_BLOCK --cases diagonal \
    --json "$OUT_DIR/bench_xla_tiles.json" > "$OUT_DIR/bench_xla_tiles.log" 2>&1 || status=1
  tail -4 "$OUT_DIR/bench_xla_tiles.log"
fi

if wanted 3; then
  stage "3. llama_1b at $SEQ tokens on one GPU, kernels $TRAIN_KERNELS, remat auto"
  # Rows of one document each (stdlib files joined into ~100k-token documents), so every step
  # attends the whole causal triangle that MFU counts: short packed documents skip most tiles
  # and make a step's speed depend on which documents it drew. A tokenizer trained on such a
  # file (data/tokenizer.py's cache, carried in .cache) saves training one here.
  docs=/tmp/device_check_long_docs.jsonl
  $PY - "$docs" <<'PYEOF'
import json, pathlib, sys, sysconfig
files = sorted(pathlib.Path(sysconfig.get_paths()["stdlib"]).rglob("*.py"))
with open(sys.argv[1], "w") as out:
    doc, n = "", 0
    for f in files:
        doc += f.read_text(errors="replace")
        if len(doc) >= 400_000:
            out.write(json.dumps({"text": doc}) + "\n")
            doc, n = "", n + 1
            if n == 24:
                break
PYEOF
  tok=""; [ "$REHEARSE" = 1 ] || tok=$(ls .cache/data/tokenizers/bpe-32000-*.json 2>/dev/null | head -1)
  MODEL="$MODEL --config.data.source=jsonl --config.data.path=$docs${tok:+ --config.data.tokenizer=$tok}"
  for kernel in $TRAIN_KERNELS; do
    run="$OUT_DIR/llama_1b_$kernel"
    # shellcheck disable=SC2086  # MODEL is a list of flags
    timeout -k 10 75 $PY train.py --config configs/llama_1b.py --workdir "$run" $MODEL \
      --config.attention.kernel=$kernel --config.model.remat=auto --config.mesh.fsdp=1 --config.mesh.sequence=1 \
      --config.data.seq_len=$SEQ --config.data.batch_size=1 \
      --config.train.steps=8 --config.train.log_every=2 --config.train.warmup_steps=2 \
      --config.train.eval_batches=0 --config.checkpoint.every=0 > "$OUT_DIR/train_$kernel.log" 2>&1 || status=1
    grep -E "model:|remat auto|step|error|Error" "$OUT_DIR/train_$kernel.log" | tail -9
    cp "$run/metrics.jsonl" "$OUT_DIR/metrics_$kernel.jsonl" 2>/dev/null
    rm -rf "$run"  # the final checkpoint of a 1B model is 13 GB: keep the disk for the next run
  done
fi

if wanted 4; then
  stage "4. profile_step: llama_1b at $SEQ tokens, kernel auto, remat auto"
  # shellcheck disable=SC2086
  timeout -k 10 85 $PY scripts/profile_step.py --config configs/llama_1b.py $MODEL --steps 2 --warmup 1 \
    --trace-dir "$OUT_DIR/profile" --json "$OUT_DIR/profile.json" --config.model.remat=auto \
    --config.mesh.fsdp=1 --config.mesh.sequence=1 --config.data.seq_len=$SEQ \
    --config.data.batch_size=1 > "$OUT_DIR/profile.log" 2>&1 || status=1
  tail -40 "$OUT_DIR/profile.log"
  # the raw trace beside the logs, compressed (the trace folder is too deep for some copiers)
  trace=$(ls -t "$OUT_DIR"/profile/plugins/profile/*/*.xplane.pb 2>/dev/null | head -1)
  [ -n "$trace" ] && gzip -c "$trace" > "$OUT_DIR/profile.xplane.pb.gz" && rm -rf "$OUT_DIR/profile"
fi

stage "done (status $status); logs and JSON in $OUT_DIR"
exit $status
