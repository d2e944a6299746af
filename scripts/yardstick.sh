#!/usr/bin/env bash
# How fast this machine is, for reading the test suite's times (docs/tests.md): the README's
# first training command at the tiny sizes tests/test_readme_commands.py gave it until 2026-12-07
# (512 tokens, batch 8: kept, so that every yardstick quoted reads alike), run four times
# on one fresh JAX compilation cache; the median of the last three is printed (cache hits:
# imports, tracing, two steps, an evaluation and a checkpoint; no XLA compile).
# Usage: bash scripts/yardstick.sh [PYTHON]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-python}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
export JAX_COMPILATION_CACHE_DIR="$tmp/jax-cache" JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
run() {
  "$PY" train.py --config configs/tiny.py --workdir "$tmp/run$1" --config.train.steps=2 \
    --config.train.log_every=1 --config.train.eval_batches=1 --config.data.max_docs=120 \
    --config.model.vocab_size=512 --config.data.cache_dir="$tmp/data" > "$tmp/log$1" 2>&1 \
    || { cat "$tmp/log$1"; exit 1; }
}
run 0
# The median of three cache-hit runs: one run alone varies by a second or more.
times=()
for i in 1 2 3; do
  start=$(date +%s%N)
  run "$i"
  end=$(date +%s%N)
  times+=($(( (end - start) / 1000000 )))
done
ms=$(printf '%s\n' "${times[@]}" | sort -n | sed -n 2p)
printf 'yardstick: a cache-hit tiny train.py run took %d.%d s (median of 3; the slower of our 2-core machines: 11 s, the faster: 6 s)\n' \
  $((ms / 1000)) $(( (ms % 1000) / 100 ))
