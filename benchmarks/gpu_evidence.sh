#!/bin/bash
# LoopSpec's GPU evidence in one command (the runs benchmarks/RESULTS.md reports), for a GPU host
# with vLLM 0.26 and this package installed:
#   bash benchmarks/gpu_evidence.sh OUTDIR [STEP ...]
# Steps (default: all, in this order; each one writes OUTDIR/STEP.txt, and OUTDIR/phases.txt says
# when each ended and with what exit status, so a run cut short still shows how far it got):
#   speed     Ouro-1.4B shape, agreement 0.001: vLLM's in-tree Ouro, our vanilla and LoopSpec (lanes
#             auto; and with drafts = the lane chain alone, "step_tokens": 0) side by side, medians of
#             3 runs at concurrency 1, 4, 16 (with a profile of lane steps at 1), of 2 at 64 and 128;
#             = speed-low (1, 4, 16) then speed-high (64, 128)
#   random    the same shape with random weights (low acceptance): concurrency 1, 64, 128
#   huginn    Huginn-0125 shape (R=32): 2:8 and the tuner's schedule for the same checkpoint
#             (benchmarks/results/huginn-0125-tune.json, made on a CPU by the command in RESULTS.md),
#             concurrency 1 and 4; a profile of the tuned schedule's lane steps at 1 (the tuned schedule
#             with "step_tokens": 64 is no longer run: 1.028x and 1.002x the default on two H100
#             hosts, where the engine between two lane steps measured 0.63 ms, 0.6 % of the decode);
#             = huginn-1 (concurrency 1 and the profile) then huginn-4
#   kernels   the Triton kernels against PyTorch, then the lane attention's one-pass vs two-pass merge
#             timed = kernel-tests then merge-sweep (a part named twice in a run runs once)
#   identity  fp32 greedy identity: lane graphs on and off, PyTorch and Triton lane attention
#             = identity-ouro then identity-raven (Raven / Huginn layouts)
#   serve     `vllm bench serve` through benchmarks/serve_compare.py: the Ouro-1.4B shape (agreement 0.001),
#             vLLM's in-tree Ouro and LoopSpec, greedy and sampled (T=1, top-p 0.7), concurrency 1, 4, 8,
#             16, a warm-up request set first; TTFT / TPOT / ITL percentiles and the JIT compilations each
#             server logged while serving (OUTDIR/serve-ouro-1.4b/)
#   sampled   the Ouro-1.4B shape sampled (T=1, top-p 0.7, then T=0.7, top-p 0.95): in-tree, LoopSpec with
#             coupled sampling (the default) and with the paper's cascade, concurrency 1, 4, 16, one run
#             = sampled-p07 then sampled-p095
#   trained   the project's trained models as benchmark checkpoints (train_looped.py's h200 preset, 120 s
#             of training each, kept in $VLLM_LOOP_TRAINED, default /tmp/vllm-loop-trained, for the next
#             call on the same host): our vanilla, LoopSpec (lanes auto) and the same engine deciding plain
#             steps only, greedy, held-out prompts, concurrency 1, 4, 16, 64, with the lanes policy's
#             trace; = trained-raven then trained-ouro
#   plain     what a LoopSpec engine's plain steps cost and why, at the trained Raven's sizes (random
#             weights: a plain step's cost does not depend on them; no training), one variable at a
#             time: vanilla on vLLM's V2 runner (its default), on V1, on V1 without torch.compile (full
#             CUDA graphs, a LoopSpec engine's default), the plain-only LoopSpec engine, and the same
#             with torch.compile; concurrency 1, 4, 16, 64
#   no-jit    the GPU test that serves batches of 1-32 requests after start-up and finds no Triton
#             compilation (also part of other-tests)
#   gpu-tests every other GPU test = kernel-tests (the Triton kernels against PyTorch), parity-tests
#             (smoke, Ouro parity, early exit, latent models), raven-parity-tests, nocompile-tests,
#             async-tests, other-tests (mixed rows, sampling distribution, plain decode graphs, and any
#             test no other part names, so none is left out)
# About 5 / 20 / 5 / 8 / 15 / 15 minutes on one H200 with cold compile caches. The parts of speed,
# huginn, identity and gpu-tests are steps of their own, each sized from per-test times on an H100 to
# fit ~10 minutes (the limit of one command on some hosts). As steps on an H100 (benchmarks/RESULTS.md):
# parity-tests 5.4, raven-parity-tests 3.2, nocompile-tests 2.7 (4.1 as a fresh host's first),
# other-tests 3.4 minutes.
set -u
all="kernels speed random huginn identity gpu-tests"
out=${1:?usage: bash benchmarks/gpu_evidence.sh OUTDIR [$all]}
shift
steps=${*:-$all}
# pytest -k expressions of the GPU-test parts; other-tests is what none of the others names
identity_k="greedy_identity_compiled and not async"
kernel_k="lane_attention_on_gpu or norm_add_norm_on_gpu or skinny_gemm_on_gpu or swiglu_down_on_gpu or coupled_sampler_on_gpu"
parity_k="plugin_smoke or ouro_parity or early_exit or latent_cuda_graphs"
raven_parity_k="raven_parity"
nocompile_k="greedy_identity_nocompile"
async_k="async_greedy_identity"
other_k="not (($identity_k) or ($kernel_k) or ($parity_k) or ($raven_parity_k) or ($nocompile_k) or ($async_k))"
# the parts of the composite steps (also what the unknown-step message lists)
speed_parts="speed-low speed-high"
huginn_parts="huginn-1 huginn-4"
identity_parts="identity-ouro identity-raven"
test_parts="kernel-tests parity-tests raven-parity-tests nocompile-tests async-tests other-tests"
kernels_parts="kernel-tests merge-sweep"
parts=""  # speed, huginn, identity, gpu-tests and kernels run as their parts
for step in $steps; do
    case $step in
        speed) parts+=" $speed_parts" ;;
        huginn) parts+=" $huginn_parts" ;;
        identity) parts+=" $identity_parts" ;;
        sampled) parts+=" sampled-p07 sampled-p095" ;;
        trained) parts+=" trained-raven trained-ouro" ;;
        gpu-tests) parts+=" $test_parts" ;;
        kernels) parts+=" $kernels_parts" ;;
        *) parts+=" $step" ;;
    esac
done
steps=""  # each part once, in first-named order: kernels and gpu-tests share kernel-tests
for part in $parts; do
    [[ " $steps " == *" $part "* ]] || steps+=" $part"
done
steps=${steps# }
mkdir -p "$out" && out=$(cd "$out" && pwd)  # absolute: the steps run from the repository root
cd "$(dirname "$0")/.."
# one checkpoint per shape and agreement, shared by the steps (the same weights in every Ouro-1.4B run;
# outside OUTDIR, which a caller copies back)
checkpoints=$(mktemp -d)
trap 'rm -rf "$checkpoints"' EXIT
phase() { echo "$(date +%T) $*" >> "$out/phases.txt"; }
speed() {  # runs shape agreement name systems concurrency...
    local runs=$1 shape=$2 agreement=$3 name=$4 systems=$5; shift 5
    # made by the first step that names it, kept for the next
    python3 benchmarks/loopspec_speed.py --runs "$runs" --shape "$shape" --checkpoint "$checkpoints/$shape-$agreement" \
        --agreement "$agreement" --systems "$systems" --out "$out/loopspec-speed-$name.json" --concurrency "$@"
}
trained_dir=${VLLM_LOOP_TRAINED:-/tmp/vllm-loop-trained}
trained() {  # trained family shape name systems concurrency...: train once per host, then time
    local family=$1 shape=$2 name=$3 systems=$4; shift 4
    [ -f "$trained_dir/$family-h200/config.json" ] || python3 benchmarks/train_looped.py --preset h200 \
        --models "$family" --skip-eval --time-budget 120 --no-progress --out "$out/trained-$family" --ckpt-dir "$trained_dir" || return
    python3 benchmarks/loopspec_speed.py --runs 1 --shape "$shape" --checkpoint "$trained_dir/$family-h200" --prompts heldout \
        --systems "$systems" --policy-trace --out "$out/loopspec-speed-$name.json" --concurrency "$@"
}
gpu_tests() { python3 -m pytest -v -s -p no:cacheprovider tests/test_gpu.py -k "$1"; }  # -v: a cut run names what passed
ouro=in-tree,vanilla,loopspec-auto,loopspec-auto-chain
phase "start: $steps"
for step in $steps; do
    case $step in
        speed-low) speed 3 ouro-1.4b 0.001 ouro-1.4b-low $ouro 1 4 16 --profile ;;
        speed-high) speed 2 ouro-1.4b 0.001 ouro-1.4b-high $ouro 64 128 ;;
        random) speed 1 ouro-1.4b 0 ouro-1.4b-random in-tree,vanilla,loopspec-auto 1 64 128 ;;
        huginn-1) speed 2 huginn-0125 0.001 huginn-0125-c1 vanilla,loopspec,loopspec-tuned 1 --profile \
                      --profile-system loopspec-tuned --tuned benchmarks/results/huginn-0125-tune.json ;;
        huginn-4) speed 2 huginn-0125 0.001 huginn-0125-c4 vanilla,loopspec,loopspec-tuned 4 \
                      --tuned benchmarks/results/huginn-0125-tune.json ;;
        serve) python3 benchmarks/serve_compare.py --shape ouro-1.4b --agreement 0.001 --systems in-tree,loopspec \
                   --concurrency 1 4 8 16 --temperature 0 1 --num-prompts 32 --input-len 128 --output-len 128 \
                   --checkpoint "$checkpoints/ouro-1.4b-0.001" --out "$out/serve-ouro-1.4b" ;;
        trained-raven) trained raven tiny-raven trained-raven vanilla,loopspec-auto,loopspec-auto-plainonly 1 4 16 64 ;;
        trained-ouro) trained ouro tiny-ouro trained-ouro vanilla,loopspec-auto,loopspec-auto-plainonly 1 4 16 64 ;;
        plain) speed 1 raven-32m 0 raven-32m-plain \
                   vanilla,vanilla-v1,vanilla-v1-fullgraphs,loopspec-auto-plainonly,loopspec-auto-plainonly-compiled 1 4 16 64 ;;
        no-jit) gpu_tests "without_triton_compilation" ;;
        sampled-p07) speed 1 ouro-1.4b 0.001 ouro-1.4b-sampled-t1-p07 in-tree,loopspec-auto,loopspec-auto-cascade \
                         1 4 16 --temperature 1.0 --top-p 0.7 ;;
        sampled-p095) speed 1 ouro-1.4b 0.001 ouro-1.4b-sampled-t07-p095 in-tree,loopspec-auto,loopspec-auto-cascade \
                          1 4 16 --temperature 0.7 --top-p 0.95 ;;
        merge-sweep) python3 benchmarks/lane_attention_sweep.py --merge --out "$out/lane-attention-merge.jsonl" ;;
        identity-ouro) gpu_tests "$identity_k and ouro" ;;
        identity-raven) gpu_tests "$identity_k and not ouro" ;;
        kernel-tests) gpu_tests "$kernel_k" ;;
        parity-tests) gpu_tests "$parity_k" ;;
        raven-parity-tests) gpu_tests "$raven_parity_k" ;;
        nocompile-tests) gpu_tests "$nocompile_k" ;;
        async-tests) gpu_tests "$async_k" ;;
        other-tests) gpu_tests "$other_k" ;;
        *) echo "unknown step $step; allowed: $all serve trained plain no-jit sampled sampled-p07 sampled-p095 $speed_parts $huginn_parts $identity_parts trained-raven trained-ouro merge-sweep" \
                "$test_parts"; false ;;
    esac > "$out/$step.txt" 2>&1
    phase "$step rc=$?"
done
phase done
