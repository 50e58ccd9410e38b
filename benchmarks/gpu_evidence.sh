#!/bin/bash
# LoopSpec's GPU evidence in one command (the runs benchmarks/RESULTS.md reports), for a GPU host
# with vLLM 0.26 and this package installed:
#   bash benchmarks/gpu_evidence.sh OUTDIR [STEP ...]
# Steps (default: all, in this order; each one writes OUTDIR/STEP.txt, and OUTDIR/phases.txt says
# when each ended and with what exit status, so a run cut short still shows how far it got):
#   speed     Ouro-1.4B shape, agreement 0.001: vanilla vs LoopSpec (lanes auto; and with drafts = the
#             lane chain alone, "step_tokens": 0, side by side), concurrency 1-128;
#             a profile of lane steps at concurrency 1 (the overlap's serial order side by side:
#             add loopspec-auto-serial to --systems)
#   random    the same shape with random weights (low acceptance): concurrency 1, 64, 128
#   huginn    Huginn-0125 shape (R=32): 2:8 and the tuner's schedule for the same checkpoint
#             (benchmarks/results/huginn-0125-tune.json, made on a CPU by the command in RESULTS.md),
#             concurrency 1 and 4; a profile of the tuned schedule's lane steps at 1
#   kernels   the lane attention kernel against PyTorch (compiled), then one-pass vs two-pass merge timed
#   identity  fp32 greedy identity: lane graphs on and off, PyTorch and Triton lane attention
#   gpu-tests every other GPU test (parity, async, mixed rows, sampling distribution, kernels)
# About 2 / 12 / 5 / 8 / 15 / 15 minutes on one H200 with cold compile caches.
set -u
out=${1:?usage: bash benchmarks/gpu_evidence.sh OUTDIR [kernels speed random huginn identity gpu-tests]}
shift
steps=${*:-kernels speed random huginn identity gpu-tests}
mkdir -p "$out" && out=$(cd "$out" && pwd)  # absolute: the steps run from the repository root
cd "$(dirname "$0")/.."
phase() { echo "$(date +%T) $*" >> "$out/phases.txt"; }
speed() {  # shape agreement name systems concurrency...: loopspec_speed.py makes the checkpoint
    local shape=$1 agreement=$2 name=$3 systems=$4; shift 4
    python3 benchmarks/loopspec_speed.py --runs 1 --shape "$shape" --agreement "$agreement" \
        --systems "$systems" --out "$out/loopspec-speed-$name.json" --concurrency "$@"
}
phase "start: $steps"
for step in $steps; do
    case $step in
        speed) speed ouro-1.4b 0.001 ouro-1.4b vanilla,loopspec-auto,loopspec-auto-chain 1 4 16 64 128 --profile ;;
        random) speed ouro-1.4b 0 ouro-1.4b-random vanilla,loopspec-auto 1 64 128 ;;
        huginn) speed huginn-0125 0.001 huginn-0125 vanilla,loopspec,loopspec-tuned 1 4 --profile \
                    --profile-system loopspec-tuned --tuned benchmarks/results/huginn-0125-tune.json ;;
        kernels) python3 -m pytest -q -s -p no:cacheprovider tests/test_gpu.py -k "triton_lane_attention_on_gpu" &&
                 python3 benchmarks/lane_attention_sweep.py --merge --out "$out/lane-attention-merge.jsonl" ;;
        identity) python3 -m pytest -q -s -p no:cacheprovider tests/test_gpu.py -k "greedy_identity_compiled and not async" ;;
        gpu-tests) python3 -m pytest -q -s -p no:cacheprovider tests/test_gpu.py -k "not (greedy_identity_compiled and not async)" ;;
        *) echo "unknown step $step; allowed: kernels speed random huginn identity gpu-tests"; false ;;
    esac > "$out/$step.txt" 2>&1
    phase "$step rc=$?"
done
phase done
