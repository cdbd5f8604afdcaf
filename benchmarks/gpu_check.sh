#!/usr/bin/env bash
# The GPU checks as one prepared script (docs/gpu.md), for a machine with an NVIDIA GPU and
# onnxruntime-gpu importable (on the lent machines: `source .gpu-b/setup.sh` first). From the
# repository root:   bash benchmarks/gpu_check.sh [MODELS]   (default: gpt2-124m)
# Writes what it measures under $OUT (default out/gpu) as it goes, so a run cut short still
# leaves its numbers. DEVICE=cpu runs the same commands on the CPU (a dry run of the script).
set -uo pipefail
OUT=${OUT:-out/gpu}
MODELS=${1:-gpt2-124m}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import onnxruntime as o; print('onnxruntime', o.__version__, o.get_available_providers())"
} 2>&1 | tee "$OUT/machine.txt"
# correctness first: TrainingSession(device='cuda') and DeviceTrainer on CUDA against the CPU, no Memcpy
python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py tests/test_providers.py 2>&1 | tee "$OUT/tests.log"
# mixed precision on the CUDA EP: bf16/fp16 against torch's 16-bit matmuls, no Memcpy node
python3 -m pytest -q -p no:cacheprovider tests/test_mixed_precision.py -k cuda 2>&1 | tee "$OUT/tests_mixed.log"
# then the step times, losses and peak memory against torch fp32 and bf16
python3 -m onnx_training_ops bench gpu --device "${DEVICE:-cuda}" --models "$MODELS" --losses 10 --timed 20 \
  --contenders session,session_nograph,session_bf16,ours,ours_bf16,torch_fp32,torch_bf16 --json "$OUT/bench_gpu.json" 2>&1 | tee "$OUT/bench_gpu.log"
