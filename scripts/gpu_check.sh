#!/usr/bin/env bash
# The GPU check, prepared on a CPU machine and run on a GPU machine that has no TVM.
#
#   scripts/gpu_check.sh --pack DIR [--config cuda-sm90] [--model M.onnx[:NAME:DIMxDIM,...]]...
#                        [--max-mib 60] [--warmup 20] [--repeat 100] [--torch-weights float16|float32]
#
# writes DIR (at most --max-mib, else refused with exit status 3): the bundled transformers and
# two CNNs built for the config (sm_90 for H100/H200), their inputs, ONNX Runtime's float32
# references, the torch modules' weights, the TVM runtime libraries, a C++ runner built against
# them, and run.sh. On the GPU machine, with python3 and numpy (torch optional):
#
#   DIR/run.sh        # results.json into $OUT if set, else DIR/results/ (docs/gpu-check.md)
#
# --config x86_64-avx2 (any llvm config) writes the CPU twin, which runs the same way here.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
if [ "${1:-}" != "--pack" ] || [ $# -lt 2 ]; then
    sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//' >&2
    exit 2
fi
shift
out=$1
shift
exec "$PY" scripts/gpu_pack/pack.py --out "$out" "$@"
