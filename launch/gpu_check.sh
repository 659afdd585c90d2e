#!/usr/bin/env bash
# The check to run wherever a GPU is (DESIGN §11), a few minutes on one: a tiny random-initialised family of real
# architectures (Llama verifier, block-causal Llama drafter, Llama AR drafter; a few seconds of pretraining) through
# every stage on this machine's devices, then (on a GPU) the real pairings' recipes at tiny random size. It exits
# non-zero unless every stage succeeds, training losses stay finite (align train exits 3 otherwise) and every greedy
# output is identical to its reference. A failed stage does not stop the stages that do not need its output (GPU time
# is scarce: one run should say everything that is wrong); the last lines list each stage's outcome.
# Then the real-code parts (docs/gpus.md): bf16 decoding and which methods stay identical to AR greedy, the Hub's
# Dream/LLaDA remote code at tiny size ($ALIGN_REMOTE_CODE or the fixtures), a ZeRO-3 DiffusionGemma step on 2-token
# completions, and `align memory` at 7B width (on a GPU beside torch.cuda.max_memory_allocated of the same shapes).
# Each stage prints PASS/FAIL; ALIGN_GPU_CHECK_STAGES="<stage> ..." runs only those named.
#   bash launch/gpu_check.sh                 # OUT=<a fresh temporary folder> by default
#   ALIGN_PYTHON=python3 bash launch/gpu_check.sh   # your own environment (a CUDA build of torch and align's other
#                                                   # dependencies), from this checkout, instead of .venv
# With 2 or more GPUs trajectories and training run on 2 ranks; training is ZeRO-3 (bf16 on GPUs). Evaluation runs in
# float32, where greedy outputs are comparable token for token. Without a GPU it runs the same stages on the CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
# torch is never reinstalled: without ALIGN_PYTHON and ALIGN_TORCH, a machine whose python3 already has torch and
# align's dependencies (a GPU image's CUDA build) runs with that python3; else launch/setup.sh builds .venv (with
# ALIGN_TORCH, the torch you name).
if [ -z "${ALIGN_PYTHON:-}" ] && [ -z "${ALIGN_TORCH:-}" ] && [ ! -x .venv/bin/python ] && \
   python3 launch/gpu_check_steps.py has-dependencies 2>/dev/null; then
  ALIGN_PYTHON=python3
  echo "gpu_check: the machine's python3 and its torch $(python3 launch/gpu_check_steps.py torch-version)"
fi
if [ -n "${ALIGN_PYTHON:-}" ]; then
  py=$ALIGN_PYTHON
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
else
  bash launch/setup.sh
  py=.venv/bin/python
fi
export HF_HUB_OFFLINE=1
out=${OUT:-$(mktemp -d)/gpu-check}
gpus=$(nvidia-smi -L 2>/dev/null | grep -c GPU || true)
ranks=1
bf16=false
if [ "$gpus" -ge 2 ]; then ranks=2; fi
if [ "$gpus" -ge 1 ]; then bf16=true; else export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}; fi
echo "gpu_check: $gpus GPU(s), $ranks rank(s), bf16 training $bf16 -> $out"
nvidia-smi -L 2>/dev/null || true
A="$py -m align"
ck=$out/ck
data=(data.dir="$out/data")
sizes=()
for part in verifier drafter ar_drafter; do
  for key in hidden_size=64 num_layers=2 num_heads=4 num_kv_heads=2 intermediate_size=128 seq_len=64 batch_size=4 \
             budget_minutes=0.05 eval_tokens=512 warmup_steps=2; do
    sizes+=("bootstrap.$part.$key")
  done
done
outcomes=()
# stage NAME NEEDED CMD...: run CMD unless the stage NEEDED (or "-") did not succeed; remember the outcome.
stage() {
  local name=$1 needed=$2
  shift 2
  if [ -n "${ALIGN_GPU_CHECK_STAGES:-}" ] && [[ " $ALIGN_GPU_CHECK_STAGES " != *" $name "* ]]; then return; fi
  if [ "$needed" != - ] && [[ " ${passed[*]} " != *" $needed "* ]]; then
    outcomes+=("$name: skipped ($needed did not succeed)")
    return
  fi
  echo "gpu_check: -- $name"
  local rc=0
  "$@" || rc=$?
  if [ "$rc" -eq 0 ]; then
    passed+=("$name")
    outcomes+=("$name: ok")
    echo "gpu_check: PASS $name"
  else
    outcomes+=("$name: FAILED (exit $rc)")
    echo "gpu_check: FAIL $name (exit $rc)"
  fi
}
passed=()
stage bootstrap - $A bootstrap recipes/tiny/bootstrap.yaml bootstrap.out="$ck" "${data[@]}" \
  bootstrap.corpus_fraction=0.15 bootstrap.vocab_size=512 "${sizes[@]}"
# bootstrap.out: where the stages find the tiny family's tokenizer, which lets them use its default prompts
models=(verifier.path="$ck/verifier" drafter.path="$ck/drafter-base" ar_drafter.path="$ck/ar-drafter"
        bootstrap.out="$ck")
made=(trajectories.out="$out/trajectories" trajectories.temperature=0.7 trajectories.completions_per_prompt=2
      trajectories.max_new_tokens=24 trajectories.store_topk=8)
stage trajectories bootstrap $A trajectories recipes/tiny/align.yaml --num_gpus "$ranks" "${models[@]}" "${data[@]}" \
  "${made[@]}" trajectories.num_prompts=48 trajectories.batch_size=8
stage train trajectories $A train recipes/tiny/align.yaml --num_gpus "$ranks" "${models[@]}" "${made[@]}" \
  train.out="$out/run" train.zero_stage=3 train.bf16="$bf16" "train.losses={ce_streak: 1.0, fkl: 0.5}" train.gamma=4 \
  train.micro_batch_size=4 train.max_steps=6 train.save_every=3 train.eval_every=3 train.final_eval_prompts=2
aligned=$($A latest "$out/run" 2>/dev/null || true)
fp32=(verifier.dtype=float32 drafter.dtype=float32 ar_drafter.dtype=float32)
stage eval train $A eval recipes/tiny/eval.yaml "${models[@]}" "${fp32[@]}" "${data[@]}" eval.out="$out/eval" \
  eval.num_prompts=4 eval.warmup=1 decode.max_new_tokens=32 eval.sampling_temperature=0.8 \
  "eval.compare_drafters={aligned: $aligned}"
spiffy=(drafter.path="$aligned" bootstrap.out="$ck" drafter.dtype=float32 "${data[@]}" calibrate.block_length=8 calibrate.budget=4
        decode.max_new_tokens=32)
stage calibrate train $A calibrate recipes/tiny/spiffy.yaml "${spiffy[@]}" calibrate.out="$out/spiffy" \
  calibrate.num_prompts=4
stage spiffy_eval calibrate $A eval recipes/tiny/spiffy.yaml "${spiffy[@]}" \
  calibrate.graph="$out/spiffy/draft_graph.json" eval.out="$out/spiffy/eval" eval.num_prompts=3 eval.warmup=0 \
  "eval.spiffy_budgets=[2,4]"
stage exact eval $A exact "$out/eval/eval.json"
stage spiffy_exact spiffy_eval $A exact "$out/spiffy/eval/eval.json"
# The real pairings' recipes (Qwen2.5 + a Dream/DiffuCoder-style remote-code drafter: bf16, ZeRO-2, LoRA; LLaDA-style
# Spiffy; Gemma 4 + DiffusionGemma: ZeRO-3 bf16; a DFlash drafter trained from scratch), with their Hub ids swapped
# for tiny random models of the same architectures, through their stages on the recipes' own devices (auto: this GPU).
# On a CPU the test suite runs the same tests. They need no stage above.
# Each align command in a fresh process, as a user runs them; the Dream/LLaDA ones on the upstream files when
# $ALIGN_REMOTE_CODE names them: a training step of each family, its export reloaded with transformers alone (a fresh
# interpreter that never imports align), and with 2 or more GPUs a 2-rank ZeRO-3 LLaDA run on uneven windows (it hung).
if [ "$gpus" -ge 1 ]; then
  remote_tests=(tests/drafters/test_drafter_families.py)
  if [ "$gpus" -ge 2 ]; then remote_tests+=(tests/stages/test_zero3.py); fi
  stage recipe_tests - "$py" -m pytest -q -p no:cacheprovider tests/test_recipes.py \
    tests/drafters/test_diffusion_gemma.py tests/drafters/test_dflash.py "${remote_tests[@]}" \
    -k "recipe or train_from_scratch or training_step_and_the_export or drops_masks"
  # Not a check but a measurement the GPU is needed for: the verifier's cost curve, which sizes drafts and trees.
  stage verify_costs - $A verify-costs checkpoints/tiny/verifier qwen2.5-7b llama-3.1-8b --out "$out/verify_costs.json"
fi
# Greedy decoding in bf16 (the dtype a GPU serves in), every method: which outputs are token-identical to AR greedy.
# bf16 is identical only up to its numerics (eval.json's exact_match_semantics), so this reports and does not fail.
bf16_models=(verifier.dtype=bfloat16 drafter.dtype=bfloat16 ar_drafter.dtype=bfloat16)
stage eval_bf16 train $A eval recipes/tiny/eval.yaml "${models[@]}" "${bf16_models[@]}" "${data[@]}" eval.out="$out/eval_bf16" \
  eval.num_prompts=4 eval.warmup=0 decode.max_new_tokens=32 "eval.compare_drafters={aligned: $aligned}"
bf16_identical() {
  local said rc=0
  said=$($A exact "$out/eval_bf16/eval.json") || rc=$?
  [ -n "$said" ] || return 1  # no eval.json read: a failure; outputs that differ are only reported
  echo "$said"
  echo "gpu_check: bf16 identical to AR greedy: $(grep 'exact_match 1.00' <<<"$said" | sed 's/.*: \(.*\): exact_match.*/\1/' | paste -sd' ')"
  echo "gpu_check: bf16 not identical (a near-tie flipped in bf16): $(grep -v 'exact_match 1.00' <<<"$said" | grep exact_match | sed 's/.*: \(.*\): exact_match \(.*\)/\1 (\2)/' | paste -sd' ')"
}
stage bf16_identical eval_bf16 bf16_identical

# The real-code parts; they need no stage above.
device=cpu
if [ "$gpus" -ge 1 ]; then device=cuda; fi
# (1) Dream/DiffuCoder and LLaDA as the Hub lays them out (auto_map, their own modelling files) at tiny size, loaded
# through align's loader and its shims, a forward on this machine's device. $ALIGN_REMOTE_CODE/<family>: the real
# files as the Hub ships them; else the repository's fixtures (tests/fixtures/README.md).
remote_code() {
  "$py" launch/gpu_check_steps.py remote-code "$out/remote" "$device"
}
stage remote_code - remote_code

# (2) A DiffusionGemma drafter (Gemma 4 verifier) trained under ZeRO-3 on trajectories whose completions are 40, 3 and
# 2 tokens long (tests/stages/test_zero3.py's): rows that use fewer windows than others, where ranks that made different
# numbers of collective forwards would hang. 2 ranks with 2 or more GPUs, or on the CPU (gloo, as the suite runs
# it); 1 rank on one GPU (two ranks cannot share one GPU under NCCL). A hang is cut off after 300 s (CPU: 900 s).
zero3_ranks=2
if [ "$gpus" -eq 1 ]; then zero3_ranks=1; fi
hang_s=300  # on a GPU; a CPU shared with other work can take minutes over the 3 steps
if [ "$gpus" -eq 0 ]; then hang_s=900; fi
zero3() {
  local z=$out/zero3
  echo "gpu_check: zero3: $zero3_ranks rank(s) ($gpus GPU(s)), ZeRO-3, bf16, completions of 40, 3 and 2 tokens"
  "$py" launch/gpu_check_steps.py zero3-prepare "$z" || return 1
  local args
  mapfile -t args <"$z/args.txt"
  timeout "$hang_s" $A train recipes/gemma4-diffusiongemma.yaml --num_gpus "$zero3_ranks" "${args[@]}" || return $?
  "$py" launch/gpu_check_steps.py zero3-losses "$z/run/metrics.jsonl"
}
stage zero3_diffusion_gemma - zero3

# (4) align memory at Qwen2.5-7B width (recipes/qwen2.5-7b-diffucoder.yaml): the probe measures one layer on the CPU
# and extrapolates; on a GPU the same shapes are measured again on cuda (memory.device=cuda:
# torch.cuda.max_memory_allocated) and the two tables printed side by side. ALIGN_GPU_CHECK_MEMORY: overrides for
# both runs (the suite shortens the prompt on its CPU).
memory() {
  local m=$out/memory more
  read -ra more <<<"${ALIGN_GPU_CHECK_MEMORY:-}"
  $A memory recipes/qwen2.5-7b-diffucoder.yaml "${more[@]}" memory.out="$m/cpu.json" || return 1
  if [ "$device" = cuda ]; then
    $A memory recipes/qwen2.5-7b-diffucoder.yaml "${more[@]}" memory.device=cuda memory.out="$m/cuda.json" || return 1
  fi
  "$py" launch/gpu_check_steps.py memory-table "$m"
}
stage memory - memory
printf 'gpu_check: %s\n' "${outcomes[@]}"
for outcome in "${outcomes[@]}"; do
  if [[ $outcome != *": ok" ]]; then
    echo "gpu_check: FAILED ($out)"
    exit 1
  fi
done
echo "gpu_check: passed ($out)"
