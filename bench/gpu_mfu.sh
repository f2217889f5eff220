#!/usr/bin/env bash
# MFU on the local GPU(s): gemma3_270m, gemma3_1b, llama3_2_1b and qwen3_1_7b, sequences of 2048
# tokens, bf16 compute;
# then gemma3_1b at 8,192 and 32,768 tokens (MFU and peak memory), and the attention paths.
#   bash bench/gpu_mfu.sh                   # from anywhere; dependencies must be importable
#   MICRO_270M=8 MICRO_1B=16 REMAT_1B=full bash bench/gpu_mfu.sh      # the defaults
# Attention goes through jax.nn.dot_product_attention: `auto` uses cuDNN's flash attention on
# GPUs where it accepts the shapes; if a run fails under `auto` it is repeated with `xla`, so the
# recipe always reports a number and says which. Each run is repeated with our Pallas kernels
# (model.attention_impl=pallas: packed documents without cuDNN's [B, N, L, L] bias), which `auto`
# will take where they measure faster. Each result's JSON line is appended to
# bench_results/gpu_mfu.jsonl. Micro-batches are per device; the defaults fit 80 GB (the
# 262k-entry vocabulary's logits dominate activation memory at these sizes).
set -uo pipefail
cd "$(dirname "$0")/.."
mkdir -p bench_results
PYTHON=${PYTHON:-python3}
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.95}
run() {  # model micro_batch remat
  for impl in auto xla; do
    echo "== $1: micro_batch $2 × seq 2048, bf16, remat $3, attention $impl"
    "$PYTHON" bench/mfu.py model="$1" data.seq_len=2048 training.mixed_precision=bf16 \
      training.micro_batch_size="$2" training.remat="$3" model.attention_impl="$impl" \
      'model.mesh_shape=[[-1,1],["fsdp","tp"]]' | tee bench_results/last.txt
    if [ "${PIPESTATUS[0]}" -eq 0 ]; then
      tail -1 bench_results/last.txt >> bench_results/gpu_mfu.jsonl
      return 0
    fi
  done
  return 1
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
"$PYTHON" -c 'import jax; print("jax", jax.__version__, jax.devices())'
status=0
run gemma3_270m "${MICRO_270M:-8}" "${REMAT_270M:-none}" || status=1
# Full recomputation buys the micro-batch of 16 that keeps the H100 busiest (measured 2026-11-22).
run gemma3_1b "${MICRO_1B:-16}" "${REMAT_1B:-full}" || status=1
# The other families at the same length, not yet measured on a GPU: micro-batch 16 with full
# recomputation, which the planner puts at 40.5 GB (llama3_2_1b) and 50.2 GB (qwen3_1_7b) on
# one device (2026-11-25).
run llama3_2_1b "${MICRO_LLAMA:-16}" "${REMAT_LLAMA:-full}" || status=1
run qwen3_1_7b "${MICRO_QWEN:-16}" "${REMAT_QWEN:-full}" || status=1
for model in "gemma3_270m ${MICRO_270M:-8} ${REMAT_270M:-none}" \
             "gemma3_1b ${MICRO_1B:-16} ${REMAT_1B:-full}"; do
  set -- $model
  echo "== $1: micro_batch $2 × seq 2048, bf16, remat $3, attention pallas"
  "$PYTHON" bench/mfu.py model="$1" data.seq_len=2048 training.mixed_precision=bf16 \
    training.micro_batch_size="$2" training.remat="$3" model.attention_impl=pallas \
    'model.mesh_shape=[[-1,1],["fsdp","tp"]]' | tee bench_results/last.txt
  [ "${PIPESTATUS[0]}" -eq 0 ] && tail -1 bench_results/last.txt >> bench_results/gpu_mfu.jsonl \
    || status=1
done
# Long context, one sequence per device, real packed data: the planner (docs/performance.md)
# expects 38 GB at 8,192 tokens with save_dots and 30 GB at 32,768 with full recomputation.
# `auto` takes cuDNN (documents as a bias) at 8,192 and the Pallas kernels above it.
for long in "8192 save_dots" "32768 full"; do
  set -- $long
  for impl in auto blockwise pallas; do
    echo "== gemma3_1b: 1 × seq $1, bf16, remat $2, attention $impl"
    "$PYTHON" bench/mfu.py model=gemma3_1b data.seq_len="$1" training.mixed_precision=bf16 \
      training.micro_batch_size=1 training.remat="$2" model.attention_impl="$impl" \
      'model.mesh_shape=[[-1,1],["fsdp","tp"]]' | tee bench_results/last.txt
    [ "${PIPESTATUS[0]}" -eq 0 ] && tail -1 bench_results/last.txt >> bench_results/gpu_mfu.jsonl \
      || status=1
  done
done
# Attention alone, per path (dense, blockwise, the Pallas kernels at two tile sizes, cuDNN)
# and length; tiles of 128 exceed an H200's shared memory (328 KB asked, 232 KB there; 2026-11-26).
"$PYTHON" bench/attention.py --dtype bfloat16 --lengths 2048 8192 32768 --pallas-block 32 64 \
  | tee -a bench_results/gpu_attention.txt || status=1
# The experts' grouped matmul per layout against a dense matmul of the same FLOPs (Qwen3-30B-A3B's
# experts; tokamax's Triton kernels by name too, its Mosaic GPU ones failing on jax 0.11.2).
"$PYTHON" bench/grouped_matmul.py | tee -a bench_results/gpu_grouped_matmul.txt || status=1
exit $status
