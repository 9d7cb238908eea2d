#!/usr/bin/env bash
# Runs this GPU-check pack: every artifact on the pack's device (bin/runner, the TVM runtime
# alone), compared with ONNX Runtime's float32 references and timed, then the same models in the
# machine's torch (eager and torch.compile) where torch is installed. Writes results.json into
# $OUT when it is set, else into results/ beside this file (or --out DIR).
#
#   ./run.sh [--only MODEL]... [--no-torch] [--no-compile] [--budget-s S] [--out DIR]
#
# Needs python3 (3.10+) with numpy; nothing else is installed. Stops within $GPU_PACK_TIMEOUT
# seconds (default 470, under 8 minutes) whatever happens; results.json is rewritten after each
# step, so a cut-short run keeps what it measured. Exit status: 0 when every artifact matched.
set -uo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
python=${PYTHON:-python3}
exec timeout -k 10 "${GPU_PACK_TIMEOUT:-470}" "$python" "$here/run.py" --pack "$here" "$@"
