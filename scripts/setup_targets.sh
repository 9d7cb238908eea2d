#!/usr/bin/env bash
# Install what the non-host targets need, only what is missing; safe to re-run.
#
#   aarch64  Debian's cross compiler (gcc/g++-aarch64-linux-gnu: links the artifact and the
#            runner), qemu-user (runs aarch64 binaries here), and the aarch64 TVM runtime
#            libraries taken from PyPI's aarch64 wheels of the TVM versions in .venv
#            (into .venv/targets/aarch64/lib).
#   cuda     nvcc is part of the machine image (/usr/local/bin/nvcc); cuobjdump, to check the
#            device code in an artifact, comes from PyPI (nvidia-cuda-cuobjdump) into .venv.
#   native   cmake and g++, to build the runner that needs no Python (tvm-fusion export-runner).
#
# Usage: scripts/setup_targets.sh [aarch64] [cuda] [native]   (no argument: all). Needs root for apt.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY="$VENV/bin/python"
targets=("$@")
[ ${#targets[@]} -eq 0 ] && targets=(aarch64 cuda native)

say() { echo "setup_targets: $*" >&2; }

apt_install() {
    local missing=()
    for pkg in "$@"; do
        dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
    done
    [ ${#missing[@]} -eq 0 ] && return 0
    if [ "$(id -u)" -ne 0 ]; then
        say "missing Debian packages: ${missing[*]} (run as root, or: sudo apt-get install -y ${missing[*]})"
        return 1
    fi
    say "apt-get install ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

dist_version() {
    "$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$1"
}

setup_aarch64() {
    apt_install gcc-aarch64-linux-gnu g++-aarch64-linux-gnu qemu-user
    local dest="$VENV/targets/aarch64/lib"
    local tvm_version ffi_version
    tvm_version=$(dist_version apache-tvm)
    ffi_version=$(dist_version apache-tvm-ffi)
    local stamp="$dest/.versions"
    if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$tvm_version $ffi_version" ]; then
        return 0
    fi
    say "fetching the aarch64 TVM runtime (apache-tvm $tvm_version, apache-tvm-ffi $ffi_version wheels)"
    local wheels
    wheels=$(mktemp -d)
    trap 'rm -rf "$wheels"' RETURN
    "$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.11 \
        --platform manylinux_2_28_aarch64 --platform manylinux2014_aarch64 -d "$wheels" \
        "apache-tvm==$tvm_version" "apache-tvm-ffi==$ffi_version"
    mkdir -p "$dest.tmp"
    "$PY" - "$wheels" "$dest.tmp" <<'EOF'
import pathlib, sys, zipfile
wheels, dest = map(pathlib.Path, sys.argv[1:])
wanted = {"tvm/lib/libtvm_runtime.so", "tvm_ffi/lib/libtvm_ffi.so"}
for wheel in wheels.glob("*.whl"):
    with zipfile.ZipFile(wheel) as archive:
        for name in wanted & set(archive.namelist()):
            (dest / pathlib.Path(name).name).write_bytes(archive.read(name))
            wanted.discard(name)
if wanted:
    sys.exit(f"not found in the aarch64 wheels: {sorted(wanted)}")
EOF
    echo "$tvm_version $ffi_version" > "$dest.tmp/.versions"
    rm -rf "$dest"
    mv "$dest.tmp" "$dest"
}

setup_cuda() {
    if ! command -v nvcc >/dev/null; then
        say "nvcc not found: install the CUDA toolkit (pip: nvidia-cuda-nvcc) and put nvcc on PATH"
        return 1
    fi
    [ -x "$VENV/bin/cuobjdump" ] && return 0
    # Same CUDA major as nvcc (PyPI has no cuobjdump for every minor; a newer one reads older fatbins).
    local major
    major=$(nvcc --version | sed -n 's/.*release \([0-9]*\)\..*/\1/p')
    say "installing cuobjdump $major.x (nvidia-cuda-cuobjdump)"
    "$PY" -m pip install --quiet "nvidia-cuda-cuobjdump==$major.*"
    local binary
    binary=$("$PY" - <<'EOF'
import pathlib, nvidia
for root in nvidia.__path__:
    for path in pathlib.Path(root).rglob("cuobjdump"):
        if path.is_file():
            print(path)
            raise SystemExit
EOF
)
    [ -n "$binary" ] || { say "cuobjdump not found in nvidia-cuda-cuobjdump"; return 1; }
    ln -sf "$(realpath "$binary")" "$VENV/bin/cuobjdump"
}

for target in "${targets[@]}"; do
    case "$target" in
        aarch64) setup_aarch64 ;;
        cuda) setup_cuda ;;
        native) apt_install cmake g++ ;;
        *) say "unknown target $target (expected aarch64, cuda or native)"; exit 2 ;;
    esac
done
