#!/usr/bin/env bash
# Every feature a GPU user can reach, each compiled and run for 2 steps on the local GPU: one line
# each, `PASS name (s)` or `FAIL name (exit, s): the error's first line`; exits 1 if any failed.
# Meant for a short GPU window, before any benchmark: the checks (about 25 s each, mostly start-up
# and compilation; 12 minutes one after another on an H100, 2026-11-27; about 8 minutes four at a
# time on an H200, 2026-12-04) run GPU_CHECK_JOBS (4) at a time, each process given
# 1/GPU_CHECK_JOBS of the GPU's memory:
#   bash bench/gpu_check.sh                      # from anywhere
#   GPU_CHECK_ONLY='attention|lora' bash bench/gpu_check.sh   # the checks whose names match
#   GPU_CHECK_JOBS=1 bash bench/gpu_check.sh     # one at a time, all of the GPU's memory each
# Dependencies: a machine whose image has JAX but not hydra/grain/qwix gets them from .whl/,
# which `bash bench/gpu_wheels.sh` fills where pip can download (carry .whl to the machine);
# they are installed into /tmp/site, nothing else is touched. Each check's whole output is in
# $OUT/gpu_check/<name>.log (OUT defaults to bench_results). GPU_CHECK_SCALE=cpu appends tiny
# sizes to every run, to try the script itself on a CPU (JAX_PLATFORMS=cpu).
# Not covered on one GPU: collectives between devices (the gradient reduction in bf16, ZeRO's
# gathers): they need a second GPU.
set -uo pipefail
cd "$(dirname "$0")/.."
if ! python3 -c 'import hydra, grain, qwix, tensorboardX, tokamax' 2>/dev/null; then
  [ -d .whl ] || { echo "hydra/grain/qwix missing and no .whl/: run bench/gpu_wheels.sh"; exit 2; }
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 2
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
jobs_max=${GPU_CHECK_JOBS:-4}
fraction=$(python3 -c "print(round(0.9 / $jobs_max, 3))")
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-$fraction}
logs=${OUT:-bench_results}/gpu_check
runs=$(mktemp -d)/runs
mkdir -p "$logs" "$runs"
limit=${GPU_CHECK_TIMEOUT_S:-120}
results=$runs/results.txt
: > "$results"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null
python3 -c 'import jax; print("jax", jax.__version__, jax.devices())'

check() {  # name, command...: runs it, prints one line
  local name=$1; shift
  if [ -n "${GPU_CHECK_ONLY:-}" ] && ! [[ $name =~ ${GPU_CHECK_ONLY} ]]; then return; fi
  local start=$SECONDS log="$logs/$name.log" rc
  timeout "$limit" "$@" > "$log" 2>&1
  rc=$?
  if [ $rc -eq 0 ]; then
    echo "PASS $name ($((SECONDS - start)) s)" | tee -a "$results"
  else
    local first
    # Our one-sentence errors, else the last exception line, else the last line.
    first=$(grep -m1 'error: ' "$log" || grep -E '^[A-Za-z_.]*(Error|Exception)\b' "$log" \
      | tail -n 1)
    [ -n "$first" ] || first=$(tail -n 1 "$log")
    [ $rc -eq 124 ] && first="timed out after $limit s; last line: $(tail -n 1 "$log")"
    echo "FAIL $name (exit $rc, $((SECONDS - start)) s): ${first:0:300}" | tee -a "$results"
    return 1
  fi
}

together() {  # command...: runs it in the background, GPU_CHECK_JOBS at most at once
  while [ "$(jobs -rp | wc -l)" -ge "$jobs_max" ]; do wait -n; done
  "$@" &
}

small=()  # the sizes a CPU can run, with GPU_CHECK_SCALE=cpu
if [ "${GPU_CHECK_SCALE:-gpu}" = cpu ]; then
  small=(model.num_layers=2 model.embed_dim=64 model.hidden_dim=128 model.head_dim=16
         model.num_heads=2 model.num_kv_heads=1 model.vocab_size=512 model.sliding_window=16
         model.expert_hidden_dim=32)
fi
one=('model.mesh_shape=[[1,1],["fsdp","tp"]]')
train() {  # name, overrides...: compile and 2 steps, bf16, in a run dir of its own
  local name=$1; shift
  check "$name" python3 run_training.py "${one[@]}" training.steps=2 logging.every_steps=1 \
    training.mixed_precision=bf16 checkpoint.every_steps=0 \
    hydra.run.dir="$runs/$name" "$@" "${small[@]}"
  local rc=$?
  # The run's final checkpoint is written and then dropped (the mixtures' are tens of GB, and
  # the machine's /tmp filled up on 2026-12-04), except the one `restore` goes on from.
  [ "$name" = save ] || rm -rf "$runs/$name/checkpoints"
  return $rc
}
seq2k=(data.seq_len=2048 training.micro_batch_size=1)

# The planner first, as it takes longest (it compiles for simulated CPU devices, on any machine).
together check plan python3 -m tunix_train.plan model=llama3_1_8b "${one[@]}" \
  training.micro_batch_size=1 data.seq_len=2048 training.mixed_precision=bf16 lora.rank=16
# The checks that need an earlier one's files run in order, as one background job each.
checkpoints() {  # saved at step 2, then the same run dir goes on to step 3; generate, export
  train save model=gemma3_270m model.num_layers=2 checkpoint.every_steps=1 "${seq2k[@]}"
  check restore python3 run_training.py "${one[@]}" training.steps=3 \
    training.mixed_precision=bf16 model=gemma3_270m model.num_layers=2 "${seq2k[@]}" \
    hydra.run.dir="$runs/save" "${small[@]}"
  check restore-resumed grep -q "resuming from step 2" "$logs/restore.log"
  check generate python3 -m tunix_train.generate checkpoint.resume_from="$runs/save" \
    'generate.prompt="The capital of France is"' generate.max_new_tokens=8
  check export python3 -m tunix_train.export checkpoint.resume_from="$runs/save" \
    export.path="$runs/exported"
}
together checkpoints
post_training() {  # DPO and GRPO on the docs' demo data
  check demo-data python3 -m tunix_train.data.demo "$runs/demo_data"
  train dpo model=gemma3_270m model.num_layers=2 trainer=dpo data=preferences \
    data.path="$runs/demo_data/dpo/pairs.jsonl" data.seq_len=64 training.global_batch_size=8
  train grpo model=gemma3_270m model.num_layers=2 trainer=grpo data=prompts \
    data.path="$runs/demo_data/grpo/sums.jsonl" \
    data.seq_len=16 grpo.max_new_tokens=4 'grpo.rewards=[answer]' "grpo.answer_pattern='^(\d+)'" \
    training.global_batch_size=16 grpo.num_generations=8
}
together post_training
profile() {  # the profiler and the communication report read from the GPU's HLO
  train profile model=gemma3_270m model.num_layers=2 training.profile_communication=true \
    training.steps=4 "${seq2k[@]}"
  check profile-report test -s "$runs/profile/comm_report.json"
}
together profile
# Models at their published widths, 2 layers (what is compiled is a layer's; the stack is a
# loop), so that each check takes seconds. Each family, with the default attention:
together train family-gemma3 model=gemma3_1b model.num_layers=2 "${seq2k[@]}"
together train family-llama3 model=llama3_2_1b model.num_layers=2 "${seq2k[@]}"
together train family-qwen3 model=qwen3_0_6b model.num_layers=2 "${seq2k[@]}"
# The mixtures of experts at their published widths with fewer experts (so that 4 checks share
# the GPU): dropless through the default (our Pallas kernels on one GPU), the blocks (the
# default where tp splits the experts; its overflow loop has a trip count read on the device),
# the tiles, jax.lax.ragged_dot, tokamax's kernels, our own Pallas grouped matmul, a capacity.
moe=(model=qwen3_30b_a3b model.num_layers=2 model.num_experts=16 "${seq2k[@]}")
together train family-qwen3_moe "${moe[@]}"
together train moe-blocks "${moe[@]}" model.moe_matmul=blocks
together train moe-tiles "${moe[@]}" model.moe_matmul=tiles
together train moe-ragged_dot "${moe[@]}" model.moe_matmul=ragged_dot
together train moe-capacity "${moe[@]}" model.moe_capacity_factor=1.25
# tokamax's Pallas kernels; a release whose kernels cannot run on this jax is refused by name
# (models/moe.py), and the check fails with that sentence.
together train moe-tokamax "${moe[@]}" model.moe_matmul=tokamax
together train moe-pallas "${moe[@]}" model.moe_matmul=pallas  # models/grouped_matmul.py
together train family-mixtral model=mixtral_8x7b model.num_layers=1 model.num_experts=4 \
  "${seq2k[@]}"
# Recomputation policies.
for remat in none save_dots full; do
  together train "remat-$remat" model=gemma3_270m model.num_layers=2 training.remat=$remat \
    "${seq2k[@]}"
done
# Attention paths at 2k and 16k tokens (auto = cuDNN where it applies).
for impl in auto cudnn pallas blockwise; do
  for len in 2048 16384; do
    together train "attention-$impl-$len" model=gemma3_270m model.num_layers=2 \
      model.attention_impl=$impl data.seq_len=$len training.micro_batch_size=1
  done
done
# LoRA and QLoRA (4-bit nf4 and int8 bases).
together train lora model=gemma3_270m model.num_layers=2 lora.rank=16 "${seq2k[@]}"
for base in nf4 int8; do
  together train "qlora-$base" model=gemma3_270m model.num_layers=2 lora.rank=16 \
    lora.base_quantization=$base "${seq2k[@]}"
done
# Optimizer state in pinned host memory.
together train offload-optimizer model=gemma3_270m model.num_layers=2 \
  training.offload_optimizer=true "${seq2k[@]}"
# Parameters there too: each layer copied to the device when reached, the update streamed.
together train offload-params model=gemma3_270m model.num_layers=2 \
  training.offload_optimizer=true training.offload_params=true "${seq2k[@]}"
together train offload-params-qlora model=gemma3_270m model.num_layers=2 lora.rank=16 \
  lora.base_quantization=nf4 training.offload_params=true "${seq2k[@]}"
wait
echo "$(grep -c '^PASS' "$results") passed, $(grep -c '^FAIL' "$results") failed in $SECONDS s"
! grep -q '^FAIL' "$results"
