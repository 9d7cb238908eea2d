#!/usr/bin/env bash
# CI for the GPU check, on a machine without a GPU (.ci/run calls this; about 2 minutes):
#  1. the CUDA pack builds within its 60 MiB limit (scripts/gpu_check.sh --pack);
#  2. its CPU twin (the same models, packed for the x86_64-avx2 config) runs through the pack's
#     own run.sh in a fresh virtualenv holding numpy alone (pip install numpy, no apache-tvm), and
#     every artifact matches ONNX Runtime's reference: the runtime-only path the GPU machine takes.
set -euo pipefail
cd "$(dirname "$0")/../.."
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
say() { echo "gpu_pack check: $*"; }

if command -v nvcc >/dev/null; then
    say "building the CUDA pack"
    bash scripts/gpu_check.sh --pack "$work/gpu_pack"
else
    say "nvcc not found: CUDA pack not built (the CPU twin still runs)"
fi
say "building the CPU twin"
bash scripts/gpu_check.sh --pack "$work/twin" --config x86_64-avx2 --warmup 2 --repeat 5

say "fresh virtualenv with numpy only"
python3 -m venv "$work/venv"
"$work/venv/bin/python" -m pip install --quiet numpy
if (cd "$work" && "$work/venv/bin/python" -c "import tvm" 2>/dev/null); then
    say "tvm is importable in the fresh virtualenv"; exit 1
fi
(cd "$work" && PYTHON="$work/venv/bin/python" OUT="$work/results" "$work/twin/run.sh" --no-torch)
"$work/venv/bin/python" - "$work/results/results.json" <<'PYEOF'
import json, sys
results = json.load(open(sys.argv[1]))
for name, entry in results["models"].items():
    print(f"  {name}: {entry['tvm_fusion']['status']}, max abs err {entry['tvm_fusion'].get('max_abs_err')}")
summary = results["summary"]
print(f"gpu_pack check: {summary['passed']} of {summary['artifacts']} artifacts match their references")
sys.exit(0 if summary["all_passed"] and results["machine"]["runner"] == "shipped" else 1)
PYEOF
