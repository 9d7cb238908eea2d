#!/usr/bin/env bash
# The wheel as a user gets it: built from this checkout, installed into a clean virtualenv
# outside it, and run from a temporary directory with no config or tuning log of ours around.
# Fails if a command fails, if a shipped config is not found by name, or if anything is written
# into the installed package or the current directory besides the requested output.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
WORK="$(mktemp -d /tmp/tvm_fusion_wheel.XXXXXX)"
trap 'rm -rf "$WORK"' EXIT

echo "== building the wheel"
"$PYTHON" -m venv "$WORK/venv"
"$WORK/venv/bin/python" -m pip install --quiet --upgrade pip
"$WORK/venv/bin/python" -m pip wheel --quiet --no-deps -w "$WORK/dist" "$ROOT"
echo "== installing $(basename "$WORK"/dist/*.whl) into a clean virtualenv"
"$WORK/venv/bin/python" -m pip install --quiet "$WORK"/dist/*.whl
BIN="$WORK/venv/bin"
RUN="$WORK/run"
mkdir -p "$RUN"
cd "$RUN"
export TVM_FUSION_TUNING_LOGS="$WORK/user_logs"
cp "$ROOT/examples/models/resnet_tiny.onnx" model.onnx
SHAPE=(--input-shape input:1x3x64x64)

PACKAGE="$("$BIN/python" -c 'import pathlib, tvm_fusion; print(pathlib.Path(tvm_fusion.__file__).parent)')"
case "$PACKAGE" in "$ROOT"*) echo "tvm_fusion was imported from the checkout ($PACKAGE)"; exit 1;; esac
before="$(find "$PACKAGE" -type f ! -name '*.pyc' | sort | sha256sum)"

set -x
"$BIN/tvm-fusion" configs
"$BIN/tvm-fusion" -q compile model.onnx "${SHAPE[@]}" -o out
"$BIN/tvm-fusion" -q compile model.onnx "${SHAPE[@]}" --config x86_64-avx2 -o out
"$BIN/tvm-fusion" -q run out/model.x86_64-host --fill random --repeat 3
"$BIN/tvm-fusion" -q inspect model.onnx "${SHAPE[@]}"
"$BIN/tvm-fusion" -q bench model.onnx "${SHAPE[@]}" --repeat 3 --no-stock
"$BIN/tvm-fusion" -q profile out/model.x86_64-host --rounds 3
"$BIN/tvm-fusion" -q demo -o demo_out --repeat 3
"$BIN/tvm-fusion" -q export-runner runner
cmake -S runner -B runner/build -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build runner/build >/dev/null
"$BIN/python" - <<'PY'
import numpy as np, tvm_fusion
from tvm_fusion.targets.emulation import run_with_runner
model = tvm_fusion.load("out/model.x86_64-host")
inputs = model.filled_inputs({}, "random")
got = run_with_runner(["runner/build/vm_runner"], "out/model.x86_64-host/model.so", model.metadata, inputs)
for name, value in model.run(inputs).items():
    np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-6)
print("the CMake-built runner matches the Python runtime")
PY
set +x

after="$(find "$PACKAGE" -type f ! -name '*.pyc' | sort | sha256sum)"
[ "$before" = "$after" ] || { echo "files were written into the installed package $PACKAGE"; exit 1; }
left="$(ls -A "$RUN" | sort | tr '\n' ' ')"
[ "$left" = "demo_out model.onnx out runner " ] || { echo "unexpected files in the working directory: $left"; exit 1; }
[ ! -e "$TVM_FUSION_TUNING_LOGS" ] || [ -z "$(ls -A "$TVM_FUSION_TUNING_LOGS")" ] \
    || { echo "compile wrote into the tuning store"; exit 1; }
echo "wheel check passed"
