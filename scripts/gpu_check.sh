#!/usr/bin/env bash
# One short run on a machine with an NVIDIA GPU: build the bundled models for the CUDA config
# that matches the GPU (sm_80 or sm_90, or ARCH=...), run each artifact on the GPU and compare
# it with ONNX Runtime on the CPU (compile's own verification, now that it can run).
#
#   scripts/gpu_check.sh [MODEL.onnx ...]     (default: examples/models/{bert_tiny,gpt2_tiny}.onnx)
#
# Needs nvcc and the NVIDIA driver; exits non-zero if any artifact fails or disagrees.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-build/gpu_check}
models=("$@")
[ ${#models[@]} -eq 0 ] && models=(examples/models/bert_tiny.onnx examples/models/gpt2_tiny.onnx)

if [ -z "${ARCH:-}" ]; then
    cap=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d ' .')
    ARCH="sm_${cap}"
fi
config="configs/cuda-${ARCH/_/}.toml"
[ -f "$config" ] || { echo "gpu_check: no config for $ARCH ($config)" >&2; exit 2; }
nvidia-smi --query-gpu=name,driver_version,compute_cap --format=csv,noheader

status=0
for model in "${models[@]}"; do
    echo "== $model on $ARCH"
    "$PY" - "$model" "$config" "$OUT" <<'PYEOF' || status=1
import sys, time
from tvm_fusion import api, targets
import tvm_fusion

model, config, out = sys.argv[1:]
(result,) = api.compile_targets(model, [config], None, out, verify=True,
                                progress=lambda m: print("  " + m, flush=True))
if result.error is not None:
    sys.exit(f"FAILED: {result.error}")
meta = result.metadata
assert meta["verification"].get("status") != "not run", meta["verification"]
print(f"  {result.verification}; device code {meta['device_code']}")
for c in meta["verification"]["outputs"]:
    print(f"  {c['name']}: max abs {c['max_abs']:.3e} max rel {c['max_rel']:.3e}")
loaded = tvm_fusion.load(result.artifact)  # the shipped artifact, through the public loader
from tvm_fusion.frontend import onnx as onnx_frontend
specs = [onnx_frontend.TensorSpec(s["name"], tuple(s["shape"]), s["dtype"]) for s in meta["inputs"]]
import onnx
inputs = onnx_frontend.random_inputs(onnx.load(model), specs, seed=1)
tensors = loaded.prepare(inputs)
loaded.run_prepared(tensors)
start = time.perf_counter()
for _ in range(20):
    loaded.run_prepared(tensors)
import tvm
tvm.cuda(0).sync()
print(f"  mean latency over 20 runs: {(time.perf_counter() - start) / 20 * 1e3:.3f} ms")
PYEOF
done
exit $status
