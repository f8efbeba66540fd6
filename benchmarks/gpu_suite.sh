#!/usr/bin/env bash
# Everything that needs the GPU, in few long commands (device time is scarce):
#   bash benchmarks/gpu_suite.sh cpu-tests  # the CPU suite under the GPU machine's torch versions
#   bash benchmarks/gpu_suite.sh tests    # every GPU test but the runtime fuzz (each phase fits one 10-minute command)
#   bash benchmarks/gpu_suite.sh fuzz-tests  # the runtime fuzz on the GPU (tests/serve/test_fuzz_runtime_gpu.py)
#   bash benchmarks/gpu_suite.sh kernel-tests  # GPU tests of the kernels and the kernel tool only (fast)
#   bash benchmarks/gpu_suite.sh runtime-tests # GPU tests of the runtime (builds Qwen2.5 shapes)
#   bash benchmarks/gpu_suite.sh bench    # the bench workloads (cli/bench/workloads.py), compiled_llm vs HF transformers (compiled-llm bench;
#                                         # BENCH_SOURCE, BENCH_WORKLOADS, BENCH_ARGS)
#   bash benchmarks/gpu_suite.sh kernels  # kernel microbenchmarks (kernel_bench.py micro)
#   bash benchmarks/gpu_suite.sh attn     # attention kernels vs SDPA, prefill configs (kernel_bench.py attention)
#   bash benchmarks/gpu_suite.sh sweep    # GEMV launch-config sweep, JSON for launch_configs.py (kernel_bench.py sweep)
#   bash benchmarks/gpu_suite.sh tune     # batch-1 decode launch configs, tuned on the whole graph (TUNE_ARGS)
#   bash benchmarks/gpu_suite.sh profile  # decode graph time vs step wall, PDL A/B, per-kernel times (PROFILE_ARGS)
#   bash benchmarks/gpu_suite.sh agree    # fused kernels + graphs vs eager spec, 16 x 64 bf16 (AGREE_ARGS)
#   bash benchmarks/gpu_suite.sh agree-trained  # the same on Qwen2.5 shapes briefly trained to real
#                                         # logit margins (train_synthetic_lm.py; TRAIN_ARGS, AGREE_ARGS)
#   bash benchmarks/gpu_suite.sh smoke    # every kernel_bench.py subcommand in a reduced mode (~5 minutes)
#   bash benchmarks/gpu_suite.sh megakernel  # --decode-backend megakernel against per-op: its GPU tests, both engines
#                                         # of each of MK_MODELS (dummy weights), the per-SM timeline at MK_CONTEXT,
#                                         # and the latency workload of each, twice, in this one call (~6 minutes)
#   bash benchmarks/gpu_suite.sh megakernel-agree  # the megakernel engine's greedy picks against the per-op engine's
#                                         # on train_synthetic_lm.py's model, fp32 and bf16 (benchmarks/tp_agreement.py)
#   bash benchmarks/gpu_suite.sh megakernel-ab  # this tree's megakernel against other trees' in one call: MK_TREES=
#                                         # "NAME=DIR ..." (each a `git archive BRANCH | tar -x -C .ab/NAME` copy in
#                                         # the git-ignored .ab/, carried to the device); each tree builds its own
#                                         # engines, each tree's kernel file is timed on this tree's engine in one
#                                         # process, then every engine's latency workload, twice (~8 minutes, 3 trees;
#                                         # MK_ROUNDS="1" for one round; MK_KERNELS="this NAME...": only these
#                                         # trees' kernels in the one-process timing, where others' encodings differ;
#                                         # MK_AB_TESTS="NAME...": these trees' megakernel GPU tests beside the builds)
# Logs go to $OUT (or ./gpu_logs) so they come back even when a step fails.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
mkdir -p "${OUT:-gpu_logs}"; LOG=$(cd "${OUT:-gpu_logs}" && pwd)  # absolute: some phases run in other trees
KB="python3 benchmarks/kernel_bench.py"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__)'
# the console script too (tests and the bench phase call it); the machine has every dependency already
pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || echo "note: editable install failed"
for phase in "$@"; do
  echo "=== $phase ($(date -u +%H:%M:%S)) ==="
  case $phase in
    cpu-tests) python3 -m pytest -q -p no:cacheprovider -m "not gpu" -rfE tests 2>&1 | tee "$LOG/cpu_tests.log" | tail -5 ;;
    tests)
      # everything GPU-marked but the runtime fuzz (fuzz-tests: 8-9 minutes alone); the server
      # tests hold no GPU test and need the openai client, which the GPU machine lacks
      python3 -m pytest -q -p no:cacheprovider -m gpu -rfE tests --ignore=tests/serve/openai \
        --deselect tests/serve/test_fuzz_runtime_gpu.py 2>&1 | tee "$LOG/gpu_tests.log" | tail -40 ;;
    fuzz-tests)
      python3 -m pytest -q -s -p no:cacheprovider -rfE tests/serve/test_fuzz_runtime_gpu.py 2>&1 \
        | tee "$LOG/fuzz_tests.log" | grep -v -e Warning -e "Writing model shards" | tail -20 ;;
    kernel-tests)
      timeout 300 python3 -m pytest -q -p no:cacheprovider -rfE -x tests/kernels/test_kernels_gpu.py tests/kernels/test_attention_gpu.py \
        tests/serve/worker/test_sampling_gpu.py tests/benchmarks/test_kernel_bench.py 2>&1 | tee "$LOG/kernel_tests.log" | tail -25 ;;
    runtime-tests)
      timeout 400 python3 -m pytest -q -s -p no:cacheprovider -rfE tests/serve/test_runtime_gpu.py 2>&1 | tee "$LOG/runtime_tests.log" | tail -30 ;;
    bench)
      for w in ${BENCH_WORKLOADS:-latency throughput prefill}; do
        compiled-llm bench "${BENCH_SOURCE:-qwen2.5-0.5b}" --workload "$w" ${BENCH_ARGS:-}
      done 2>&1 | grep -v Warning | tee "$LOG/bench.log" | tail -40 ;;
    kernels) $KB micro 2>&1 | tee "$LOG/micro.log" ;;
    attn) timeout 120 $KB attention 2>&1 | tee "$LOG/attn.log" | tail -40 ;;
    sweep) timeout 240 $KB sweep 2>&1 | tee "$LOG/sweep.log" | tail -60 ;;
    tune) timeout 300 $KB tune ${TUNE_ARGS:-} 2>&1 | tee "$LOG/tune.log" | tail -60 ;;
    profile) timeout 200 $KB profile ${PROFILE_ARGS:-} 2>&1 | grep -v Warning | tee "$LOG/profile.log" | tail -80 ;;
    agree) timeout 300 $KB agree ${AGREE_ARGS:-} 2>&1 | tee "$LOG/agree.log" | tail -5 ;;
    agree-trained)
      # random weights have top-1/top-2 gaps of a few bf16 ulps; train a checkpoint with real margins
      # first, in a temp dir of its own (0.5B in bf16 is 1 GB, not a log), then check on its prompts
      T=${TRAINED_DIR:-$(mktemp -d /tmp/cllm_trained.XXXXXX)}  # a fresh folder: nothing of the caller's is deleted
      { timeout 200 python3 benchmarks/train_synthetic_lm.py --out "$T" ${TRAIN_ARGS:-} \
          && timeout 280 $KB agree --source "$T" --prompts-file "$T/prompts.json" ${AGREE_ARGS:-}
      } 2>&1 | grep -v -e Warning -e "Writing model shards" | tee "$LOG/agree_trained.log" | tail -25 ;;
    smoke)
      # each subcommand once, small: that the tool runs on this GPU, not numbers to keep
      { timeout 120 $KB micro --cases "qwen2.5-0.5b T=1" --no-compile --no-cuda-ext
        timeout 60 $KB attention --no-sweep --layers 2 --reps 5
        timeout 120 $KB sweep --models qwen2.5-0.5b --roles o --tokens 1 2 --budget-s 60 --jobs 4
        timeout 240 $KB tune --tables gemv
        timeout 200 $KB profile --top 8
        timeout 120 $KB agree --prompts 2 --tokens 8
      } 2>&1 | grep -v Warning | tee "$LOG/smoke.log" | tail -120 ;;
    megakernel)
      timeout 200 python3 -m pytest -q -p no:cacheprovider -rfE tests/megakernel/test_triton_kernel_gpu.py \
        -k "${MK_TESTS:-qwen2_5 or captured or under_llm or timed}" 2>&1 | grep -v DEBUG | tee "$LOG/mk_tests.log" | tail -5
      models=${MK_MODELS:-qwen2.5-0.5b llama-3.2-1b}
      for m in $models; do
        timeout 120 compiled-llm build "$m" --load-format dummy -o "/tmp/mk_perop_$m" 2>&1 | tail -1 &
        timeout 120 compiled-llm build "$m" --load-format dummy --decode-backend megakernel -o "/tmp/mk_$m" 2>&1 | tail -1 &
      done
      wait
      for m in $models; do
        timeout 90 python3 benchmarks/megakernel_timeline.py "/tmp/mk_$m" --context "${MK_CONTEXT:-256}" --sms 4 \
          2>&1 | grep -v Warning | tee "$LOG/mk_timeline_$m.log" | head -16
      done
      for round in 1 2; do for m in $models; do for e in "mk_perop_$m" "mk_$m"; do
        echo "round $round $e: $(timeout 90 compiled-llm bench "/tmp/$e" --workload latency --no-hf 2>"$LOG/mk_bench_err_$e.log" \
          | grep decode_tok_s) (CUDA graph capture failures: $(grep -ci 'capture failed' "$LOG/mk_bench_err_$e.log"))"
      done; done; done 2>&1 | tee "$LOG/mk_latency.log" ;;
    megakernel-agree)
      # issue 46: the megakernel's greedy picks against the per-op engine's on a trained model (real
      # logit margins): fp32 must be 100%, bf16 is reported
      T=${TRAINED_DIR:-$(mktemp -d /tmp/cllm_trained.XXXXXX)}  # a fresh folder: nothing of the caller's is deleted
      { timeout 200 python3 benchmarks/train_synthetic_lm.py --out "$T" ${TRAIN_ARGS:-}
        for dt in float32 bfloat16; do
          echo "$dt: $(timeout 150 python3 benchmarks/tp_agreement.py "$T" --decode-backend megakernel --dtype $dt)"
        done
      } 2>&1 | grep -v -e Warning -e "Writing model shards" | tee "$LOG/mk_agree.log" | tail -6 ;;
    megakernel-ab)
      models=${MK_MODELS:-qwen2.5-0.5b llama-3.2-1b}
      trees="this=$PWD ${MK_TREES:-}"
      for t in $trees; do  # MK_AB_TESTS: the trees whose megakernel GPU tests run beside the builds
        [[ " ${MK_AB_TESTS:-} " == *" ${t%%=*} "* ]] && (cd "${t#*=}" && PYTHONPATH=$PWD timeout 300 python3 -m pytest -q \
          -p no:cacheprovider -rfE tests/megakernel/test_triton_kernel_gpu.py -k "${MK_TESTS:-qwen2_5 or captured or under_llm}" \
          >"$LOG/ab_tests_${t%%=*}.log" 2>&1) &
      done
      for m in $models; do  # a wave a model: the per-op engine and each tree's megakernel engine
        timeout 200 compiled-llm build "$m" --load-format dummy -o "/tmp/ab_perop_$m" >"$LOG/ab_build_perop_$m.log" 2>&1 &
        builds=($!)
        for t in $trees; do
          (cd "${t#*=}" && PYTHONPATH=$PWD timeout 200 python3 -m compiled_llm.cli.main build "$m" --load-format dummy \
            --decode-backend megakernel -o "/tmp/ab_${t%%=*}_$m" >"$LOG/ab_build_${t%%=*}_$m.log" 2>&1) &
          builds+=($!)
        done
        wait "${builds[@]}"
      done
      wait  # the tests
      for f in "$LOG"/ab_build_*.log; do echo "$(basename "$f"): $(tail -1 "$f")"; done
      for f in "$LOG"/ab_tests_*.log; do [ -f "$f" ] && echo "$(basename "$f"): $(grep -v DEBUG "$f" | tail -1)"; done
      for m in $models; do  # every tree's kernel file on this tree's engine (the same encoding: see the script)
        kernels=""; for t in $trees; do  # MK_KERNELS: the trees whose kernel can run this tree's encoding
          [[ -z "${MK_KERNELS:-}" || " $MK_KERNELS " == *" ${t%%=*} "* ]] \
            && kernels="$kernels ${t#*=}/compiled_llm/megakernel/triton_kernel.py"
        done
        timeout 240 python3 benchmarks/megakernel_variants.py "/tmp/ab_this_$m" $kernels new --context "${MK_CONTEXT:-256}" \
          2>&1 | grep -v Warning | tee "$LOG/ab_variants_$m.log" | tail -8
      done
      for round in ${MK_ROUNDS:-1 2}; do for m in $models; do for t in "perop=$PWD" $trees; do
        e="/tmp/ab_${t%%=*}_$m"
        r=$(cd "${t#*=}" && PYTHONPATH=$PWD timeout 90 python3 -m compiled_llm.cli.main bench "$e" --workload latency --no-hf \
          2>"$LOG/ab_bench_err.log" | grep decode_tok_s)
        echo "round $round ${t%%=*} $m: $r (CUDA graph capture failures: $(grep -ci 'capture failed' "$LOG/ab_bench_err.log"))"
      done; done; done 2>&1 | tee "$LOG/ab_latency.log" ;;
    *) echo "unknown phase $phase"; exit 2 ;;
  esac
done
