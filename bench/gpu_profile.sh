#!/usr/bin/env bash
# Where gemma3_1b's and llama3_2_1b's step time goes on the local GPU, and the MFU of the
# variants that could move it (docs/performance.md, MFU): a profile of each step
# (bench/step_profile.py: busy vs. wall time, time by kind, the costliest XLA operations), then
# bench/mfu.py for gemma3_1b at micro-batch 8 with save_dots, with the output head in 16 chunks
# (the default) and in one (the control docs/performance.md asks for), with its layers
# unrolled, with 4 chunks at micro-batch 16, and qwen3_1_7b. Sequences of 2,048 tokens, bf16,
# MFU_ROUNDS=2; about 8 minutes on an H100. Each run has a time limit, so one that hangs or
# compiles too long costs only its own line.
#   bash bench/gpu_profile.sh          # from anywhere; OUT (default bench_results) gets the logs
# Dependencies as bench/gpu_check.sh: from .whl/ (bench/gpu_wheels.sh) where they are missing.
set -uo pipefail
cd "$(dirname "$0")/.."
if ! python3 -c 'import hydra, grain, qwix' 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 2
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.95} MFU_ROUNDS=2
out=${OUT:-bench_results}
mkdir -p "$out"
start=$SECONDS
say() { echo "[$((SECONDS - start)) s] $*"; }
base=(data.seq_len=2048 training.mixed_precision=bf16 'model.mesh_shape=[[-1,1],["fsdp","tp"]]')
profile() {  # model, lines to print
  say "profile $1, micro-batch 16, remat full"
  timeout 150 python3 bench/step_profile.py model="$1" "${base[@]}" training.micro_batch_size=16 \
    training.remat=full > "$out/profile_$1.txt" 2>&1
  grep -v '^{' "$out/profile_$1.txt" | tail -n "$2"
}
mfu() {  # label, overrides...
  local label=$1; shift
  say "mfu $label: $*"
  timeout 110 python3 bench/mfu.py "${base[@]}" "$@" > "$out/mfu_last.txt" 2>&1
  { echo "== $label $*"; cat "$out/mfu_last.txt"; } >> "$out/mfu_all.txt"
  grep -E 'tokens/s/device|Error|error' "$out/mfu_last.txt" | tail -n 2
  tail -n 1 "$out/mfu_last.txt" | grep '^{' >> "$out/gpu_mfu.jsonl"
}
profile gemma3_1b 34
mfu gemma3_1b-mb8-save_dots model=gemma3_1b training.micro_batch_size=8 training.remat=save_dots
mfu gemma3_1b-mb8-save_dots-one-chunk model=gemma3_1b training.micro_batch_size=8 \
  training.remat=save_dots training.loss_vocab_chunk=262144
mfu gemma3_1b-mb16-full-unrolled model=gemma3_1b training.micro_batch_size=16 training.remat=full \
  model.unroll_layers=true
mfu qwen3_1_7b-mb16-full model=qwen3_1_7b training.micro_batch_size=16 training.remat=full
mfu gemma3_1b-mb16-full-4-chunks model=gemma3_1b training.micro_batch_size=16 \
  training.remat=full training.loss_vocab_chunk=65536
profile llama3_2_1b 20
rm -f "$out/mfu_last.txt"
say done
