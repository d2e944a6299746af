#!/usr/bin/env bash
# Checks and times the GPU path on one GPU host, in under 8 minutes; installs nothing from the
# network. From the repository root on the GPU host:
#
#     bash scripts/device_check.sh [OUT_DIR]
#
# 1. the fused-kernel tests with the real Pallas GPU (Triton) kernels, ring of one (one GPU),
#    causal and not;
# 2. scripts/bench_kernels.py: xla vs pallas_gpu vs cuDNN, bf16, head_dim 128, 4k-32k chunks;
# 3. train.py, configs/llama_1b.py at 32k tokens on one GPU, kernel xla then pallas_gpu:
#    tokens/s and MFU per logged step.
# Packages the host lacks travel as wheels in .whl/ (make device-wheels, run where pip can
# download); they are installed from there into /tmp/site.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${1:-${OUT:-bench_out/device}}
mkdir -p "$OUT_DIR"
PY=${PY:-python3}
export PYTHONUNBUFFERED=1 JAX_PLATFORMS=${JAX_PLATFORMS:-cuda} STRIPEDJAX_PALLAS_INTERPRET=0
unset XLA_FLAGS
if compgen -G ".whl/*.whl" >/dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
stage() { echo; echo "== $(date +%T) $*"; }
status=0

stage "0. machine"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
$PY -c "import jax, flax, optax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())" || exit 1

stage "1. kernel tests, real Pallas GPU kernels (ring of one: one GPU)"
ids=()
for h in mha gqa4; do for m in causal packed; do for t in float32 bfloat16; do
  ids+=("tests/test_kernels.py::test_fused_ring_matches_reference[pallas_gpu-1-$h-$m-$t]")
done; done; done
ids+=("tests/test_kernels.py::test_rows_with_no_visible_key_and_empty_rounds[pallas_gpu]"
      "tests/test_kernels.py::test_dense_impl_uses_the_fused_kernel"
      "tests/test_kernels.py::test_non_causal_matches_reference[dense-pallas_gpu-whole]"
      "tests/test_kernels.py::test_non_causal_matches_reference[dense-pallas_gpu-mixed]")
STRIPEDJAX_FULL_KERNEL_MATRIX=1 timeout 240 $PY -m pytest -q -p no:cacheprovider "${ids[@]}" \
  2>&1 | tee "$OUT_DIR/kernel_tests.log" | tail -25 || status=1

stage "2. bench_kernels: one round, bf16, 16 heads of 128"
timeout 240 $PY scripts/bench_kernels.py --chunks 4096,8192,16384,32768 --heads 16 --head-dim 128 \
  --repeats 5 --json "$OUT_DIR/bench_kernels.json" 2>&1 | tee "$OUT_DIR/bench_kernels.log" | tail -30 || status=1

stage "3. llama_1b at 32k tokens on one GPU, xla then pallas_gpu"
for kernel in xla pallas_gpu; do
  timeout 150 $PY train.py --config configs/llama_1b.py --workdir "$OUT_DIR/llama_1b_32k_$kernel" \
    --config.attention.kernel=$kernel --config.mesh.fsdp=1 --config.mesh.sequence=1 \
    --config.data.seq_len=32768 --config.data.batch_size=1 --config.data.max_docs=2000 \
    --config.train.steps=8 --config.train.log_every=2 --config.train.warmup_steps=2 \
    --config.train.eval_batches=0 --config.checkpoint.every=0 2>&1 \
    | tee "$OUT_DIR/train_$kernel.log" | grep -E "step|tokens|mfu|MFU|error" | tail -8 || status=1
  tail -n 2 "$OUT_DIR/llama_1b_32k_$kernel/metrics.jsonl" 2>/dev/null
done
stage "done (status $status); logs and JSON in $OUT_DIR"
exit $status
