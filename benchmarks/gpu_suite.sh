#!/usr/bin/env bash
# Everything that needs the GPU, in few long commands (device time is scarce):
#   bash benchmarks/gpu_suite.sh cpu-tests  # the CPU suite under the GPU machine's torch versions
#   bash benchmarks/gpu_suite.sh tests    # every GPU test
#   bash benchmarks/gpu_suite.sh kernels  # kernel microbenchmarks
#   bash benchmarks/gpu_suite.sh bench    # PERF.md workloads, compiled_llm vs HF transformers
#   bash benchmarks/gpu_suite.sh kernel-tests  # GPU tests of the kernels only (fast)
#   bash benchmarks/gpu_suite.sh runtime-tests # GPU tests of the runtime (builds Qwen2.5 shapes)
#   bash benchmarks/gpu_suite.sh profile  # decode graph time vs step wall, per-kernel times
#   bash benchmarks/gpu_suite.sh sweep    # GEMV launch-config sweep (JSON for launch_configs.py)
#   bash benchmarks/gpu_suite.sh attn     # attention kernels vs the old path and SDPA
#   bash benchmarks/gpu_suite.sh agree    # fused kernels + graphs vs eager spec, 16 x 64 bf16
#   bash benchmarks/gpu_suite.sh agree-trained  # the same on Qwen2.5 shapes briefly trained to real
#                                         # logit margins (train_synthetic_lm.py; TRAIN_ARGS, AGREE_ARGS)
#   bash benchmarks/gpu_suite.sh tune     # batch-1 decode launch configs, tuned on the whole graph
#   bash benchmarks/gpu_suite.sh ab       # throughput workload with single changes reverted
#   bash benchmarks/gpu_suite.sh probes   # grid barrier vs PDL kernel boundary; GEMV accumulator layouts
# Logs go to $OUT (or ./gpu_logs) so they come back even when a step fails.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
LOG=${OUT:-gpu_logs}; mkdir -p "$LOG"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__)'
# the console script too (tests call it); the machine has every dependency already
pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || echo "note: editable install failed"
for phase in "$@"; do
  echo "=== $phase ($(date -u +%H:%M:%S)) ==="
  case $phase in
    cpu-tests) python3 -m pytest -q -p no:cacheprovider -m "not gpu" -rfE tests 2>&1 | tee "$LOG/cpu_tests.log" | tail -5 ;;
    tests)
      python3 -m pytest -q -p no:cacheprovider -m gpu -rfE tests 2>&1 | tee "$LOG/gpu_tests.log" | tail -40 ;;
    kernels) python3 benchmarks/microbench_kernels.py 2>&1 | tee "$LOG/microbench.log" ;;
    kernel-tests)
      timeout 300 python3 -m pytest -q -p no:cacheprovider -rfE -x tests/test_kernels_gpu.py tests/test_attention_gpu.py tests/test_sampling_gpu.py 2>&1 \
        | tee "$LOG/kernel_tests.log" | tail -25 ;;
    runtime-tests)
      timeout 400 python3 -m pytest -q -s -p no:cacheprovider -rfE tests/test_runtime_gpu.py 2>&1 | tee "$LOG/runtime_tests.log" | tail -30 ;;
    profile) timeout 200 python3 benchmarks/profile_steps.py ${PROFILE_ARGS:-} 2>&1 | grep -v Warning | tee "$LOG/profile.log" | tail -80 ;;
    sweep) timeout 240 python3 benchmarks/sweep_gemv.py 2>&1 | tee "$LOG/sweep.log" | tail -60 ;;
    attn) timeout 120 python3 benchmarks/bench_attention.py 2>&1 | tee "$LOG/attn.log" | tail -40 ;;
    probes)
      { timeout 100 python3 benchmarks/barrier_probe.py; timeout 200 python3 benchmarks/gemv_layout_probe.py; } 2>&1 \
        | grep -v Warning | tee "$LOG/probes.log" | tail -60 ;;
    ab) timeout 200 python3 benchmarks/ab_throughput.py 2>&1 | grep -v Warning | tee "$LOG/ab.log" | tail -40 ;;
    tune) timeout 300 python3 benchmarks/tune_decode.py ${TUNE_ARGS:-} 2>&1 | tee "$LOG/tune.log" | tail -60 ;;
    agree-trained)
      # random weights have top-1/top-2 gaps of a few bf16 ulps; train a checkpoint with real margins
      # first, in a temp dir of its own (0.5B in bf16 is 1 GB, not a log), then check on its prompts
      T=${TRAINED_DIR:-/tmp/cllm_trained}; rm -rf "$T"
      { timeout 200 python3 benchmarks/train_synthetic_lm.py --out "$T" ${TRAIN_ARGS:-} \
          && timeout 280 python3 benchmarks/agreement_check.py --source "$T" --prompts-file "$T/prompts.json" ${AGREE_ARGS:-}
      } 2>&1 | grep -v -e Warning -e "Writing model shards" | tee "$LOG/agree_trained.log" | tail -25 ;;
    agree) timeout 300 python3 benchmarks/agreement_check.py ${AGREE_ARGS:-} 2>&1 | tee "$LOG/agree.log" | tail -5 ;;
    bench) python3 benchmarks/bench_all.py ${BENCH_ARGS:-} 2>&1 | tee "$LOG/bench.log" | tail -40 ;;
    *) echo "unknown phase $phase"; exit 2 ;;
  esac
done
