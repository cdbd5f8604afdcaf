#!/usr/bin/env bash
# The GPU checks as one prepared script (docs/gpu.md), for a machine with an NVIDIA GPU and
# onnxruntime-gpu importable (on the lent machines: `source .gpu-b/setup.sh` first). From the
# repository root:   bash benchmarks/gpu_check.sh [MODEL]   (default: gpt2-124m)
#
# In order of what matters most, each phase under its own time limit, everything written under
# $OUT (default out/gpu) as it goes, so a run cut short still leaves what it measured:
#   1. the model exported once into the zoo cache (in the background, while the tests run);
#   2. the GPU tests: the device session and DeviceTrainer on CUDA against the CPU, no Memcpy
#      node, CUDA graphs, a tiny GPT-2 (tests/test_gpu.py), bf16/fp16 on the CUDA EP
#      (test_mixed_precision);
#   3. bench gpu, first part (FIRST): ms/step, losses, peak device memory, CUDA-graph replay,
#      each contender in its own process, bench_gpu.json rewritten after each one;
#   4. with LORA_SKELETON=DIR (benchmarks/bench_lora_int4.py --write-skeleton DIR, made where
#      onnxruntime-genai is installed): LoRA on the int4 TinyLlama against torch + peft in
#      float32, on the device -> lora_gpu.json;
#   5. bench gpu, the other contenders (REST), appended to the same table and JSON;
#   6. benchmarks/gpu_diagnose.py (DIAGNOSE=0 skips it): the static step's CPU-placed nodes,
#      Memcpy lines, top nodes by host time (eager, profiler on) -> diagnose.txt.
# DEVICE=cpu runs the same on the CPU (a dry run of the script: use a small MODEL, BATCH, SEQ).
# Knobs: LOSSES, TIMED (steps), BATCH, SEQ, FIRST, REST (contenders), WORKER_TIMEOUT, TEST_TIMEOUT,
# LORA_TIMEOUT (s), LORA_SKELETON, DIAGNOSE.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2  # the checkout's root: `python3 -m benchmarks`, tests/, out/
OUT=${OUT:-out/gpu}
MODEL=${1:-gpt2-124m}
DEVICE=${DEVICE:-cuda}
LOSSES=${LOSSES:-6}
TIMED=${TIMED:-8}
FIRST=${FIRST:-session,torch_fp32}
REST=${REST:-session_bf16,torch_bf16,ours,session_nograph}
WORKER_TIMEOUT=${WORKER_TIMEOUT:-100}
TEST_TIMEOUT=${TEST_TIMEOUT:-170}
LORA_TIMEOUT=${LORA_TIMEOUT:-150}
LORA_SKELETON=${LORA_SKELETON:-}
DIAGNOSE=${DIAGNOSE:-1}
SIZES=()
[ -n "${BATCH:-}" ] && SIZES+=(--batch "$BATCH")
[ -n "${SEQ:-}" ] && SIZES+=(--seq "$SEQ")
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
start=$SECONDS
stamp() { echo "[gpu_check +$((SECONDS - start))s] $*"; }
{
  nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv,noheader 2>&1 || echo "no nvidia-smi"
  python3 -c "import onnxruntime as o, os; print('onnxruntime', o.__version__, o.get_available_providers(), os.cpu_count(), 'cpus')"
  python3 -c "import torch; print('torch', torch.__version__, torch.cuda.is_available())" 2>&1 | tail -1
} 2>&1 | tee "$OUT/machine.txt"

# 1. the export every contender reuses (torch -> ONNX takes a while for GPT-2 124M): in the background
stamp "exporting $MODEL into the zoo cache"
python3 -m benchmarks gpu --prepare --models "$MODEL" "${SIZES[@]}" > "$OUT/prepare.log" 2>&1 &
prepare=$!

# 2. correctness first: TrainingSession(device='cuda') and DeviceTrainer on CUDA against the CPU,
#    no Memcpy node, CUDA graph replay (GPT-2 tiny too); the contrib ops and the genai int4 Llama's
#    step on CUDA; bf16/fp16 blocks against torch on the GPU
stamp "GPU tests"
timeout "$TEST_TIMEOUT" python3 -m pytest -q -p no:cacheprovider -rs tests/test_gpu.py tests/test_gpu_contrib.py \
  tests/test_providers.py \
  "tests/test_mixed_precision.py::test_the_block_trains_on_cuda_like_torch_with_every_node_on_the_gpu" \
  2>&1 | tee "$OUT/tests.log"
wait "$prepare"; cat "$OUT/prepare.log"

bench() {  # bench gpu over the contenders $1, appended to bench_gpu.json
  python3 -m benchmarks gpu --device "$DEVICE" --models "$MODEL" "${SIZES[@]}" --losses "$LOSSES" \
    --timed "$TIMED" --contenders "$1" --worker-timeout "$WORKER_TIMEOUT" --json "$OUT/bench_gpu.json" --append \
    2>&1 | tee -a "$OUT/bench_gpu.log"
}
rm -f "$OUT/bench_gpu.json" "$OUT/bench_gpu.log"

# 3. the step times, losses and peak device memory: ours, and torch fp32 for the ratios
stamp "bench gpu: $FIRST"
bench "$FIRST"

# 4. LoRA on the deployed int4 model, on the device, against torch + peft
if [ -n "$LORA_SKELETON" ]; then
  stamp "LoRA int4 bench"
  timeout "$LORA_TIMEOUT" python3 benchmarks/bench_lora_int4.py --device "$DEVICE" --skeleton "$LORA_SKELETON" \
    --rounds 1 --steps 2 --json "$OUT/lora_gpu.json" 2>&1 | tee "$OUT/lora_gpu.log" | tail -20
fi

# 5. the other contenders (bf16, the exported step, no CUDA graph), in the same table
stamp "bench gpu: $REST"
bench "$REST"

# 6. where the session's step time goes
if [ "$DIAGNOSE" != 0 ]; then
  stamp "diagnose"
  timeout 150 python3 benchmarks/gpu_diagnose.py --model "$MODEL" --device "$DEVICE" "${SIZES[@]}" --steps 4 \
    --out "$OUT" 2>&1 | tail -40
fi
stamp "done"
