"""Per-target toolchains: what links an artifact, what compiles its device code, where it runs.

One model goes to several machines (x86-64 with AVX-512 or AVX2, aarch64, CUDA GPUs). For each
target this module knows which compilers the build needs (and which Debian package brings
each), how ``export_library`` must link (cross compiler for aarch64; nvcc fatbin for CUDA),
how to inspect the result (ELF machine, exported symbols, embedded device code) and whether,
and how, an artifact can run on this machine: natively, under qemu-user, or not at all.

TVM 0.27 exports CUDA kernels as CUDA *source* that the deployment host compiles at load time.
``cuda_fatbin_packer`` instead compiles that source with nvcc for the configured arch when the
library is exported, so the artifact carries device code and its host needs no compiler.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import platform
import re
import shutil
import struct
import subprocess
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np

from .errors import ArtifactError, ToolchainError

REPO_ROOT = Path(__file__).resolve().parent.parent
VM_RUNNER_SOURCE = Path(__file__).with_name("vm_runner.cc")
SETUP_SCRIPT = "scripts/setup_targets.sh"
ELF_MACHINES = {62: "x86_64", 183: "aarch64"}
# x86 CPU flags (/proc/cpuinfo names) the code for a vector width needs.
X86_REQUIRED_FLAGS = {512: ("avx512f", "avx512bw", "avx512dq", "avx512vl", "avx2", "fma"),
                      256: ("avx2", "fma"), 128: ()}
FATBIN_MAGIC = b"\x50\xed\x55\xba"


@dataclasses.dataclass(frozen=True)
class Tool:
    command: str
    package: str  # the Debian package (or pip package, for "pip:..." ) that provides it
    purpose: str

    def path(self) -> str | None:
        if os.sep in self.command:
            return self.command if os.access(self.command, os.X_OK) else None
        return shutil.which(self.command) or _venv_tool(self.command)

    def require(self, target_name: str) -> str:
        found = self.path()
        if found is None:
            install = (f"pip install {self.package.removeprefix('pip:')}" if self.package.startswith("pip:")
                       else f"apt-get install -y {self.package}")
            raise ToolchainError(f"target {target_name}: {self.command} ({self.purpose}) is not installed",
                                 f"{install}, or run {SETUP_SCRIPT} (installs what every target needs)")
        return found


def _venv_tool(command: str) -> str | None:
    """Tools pip installs into the venv (cuobjdump) are found even when the venv is not activated."""
    import sys

    candidate = Path(sys.prefix) / "bin" / command
    return str(candidate) if candidate.is_file() and os.access(candidate, os.X_OK) else None


@dataclasses.dataclass(frozen=True)
class Platform:
    """What an artifact built for a target needs from the machine that runs it."""

    cpu: str                      # ELF machine of the host code: "x86_64" or "aarch64"
    arch: str                     # LLVM mcpu (or "generic"), or the CUDA arch "sm_90"
    cpu_flags: tuple[str, ...]    # x86 features the code uses (/proc/cpuinfo names)
    device: str | None            # "cuda" when kernels run on a GPU
    linker: Tool                  # links model.so
    device_compiler: Tool | None  # compiles device code into the library

    def to_json(self) -> dict:
        return {"cpu": self.cpu, "arch": self.arch, "requires_cpu_flags": list(self.cpu_flags),
                "device": self.device}


GCC = Tool("gcc", "gcc", "links x86-64 libraries")
AARCH64_GCC = Tool("aarch64-linux-gnu-gcc", "gcc-aarch64-linux-gnu", "links aarch64 libraries")
AARCH64_GXX = Tool("aarch64-linux-gnu-g++", "g++-aarch64-linux-gnu", "builds the aarch64 test runner")
QEMU_AARCH64 = Tool("qemu-aarch64", "qemu-user", "runs aarch64 binaries on this machine")
NVCC = Tool("nvcc", "pip:nvidia-cuda-nvcc", "compiles CUDA kernels into a fatbin")
CUOBJDUMP = Tool("cuobjdump", "pip:nvidia-cuda-cuobjdump", "lists the device code in a fatbin")


def platform_of(target: Mapping) -> Platform:
    """The platform a TVM target dict (as in a config or metadata.json) builds for."""
    from tvm.target import Target

    from .schedules.cpu.target_info import simd_bits

    kind = target.get("kind")
    if kind == "cuda":
        host = dict(target.get("host") or {"kind": "llvm"})
        host_platform = platform_of(host)
        return dataclasses.replace(host_platform, arch=str(target["arch"]), device="cuda",
                                   device_compiler=NVCC)
    triple = str(target.get("mtriple", "")) or platform.machine()
    cpu = "aarch64" if triple.startswith(("aarch64", "arm64")) else "x86_64"
    arch = str(target.get("mcpu", "generic"))
    if cpu == "aarch64":
        linker = GCC if platform.machine() == "aarch64" else AARCH64_GCC
        return Platform(cpu, arch, (), None, linker, None)
    bits = simd_bits(Target({k: v for k, v in target.items() if k != "host"}))
    return Platform(cpu, arch, X86_REQUIRED_FLAGS[bits], None, GCC, None)


def check_toolchain(target_name: str, target: Mapping) -> dict[str, str]:
    """Raise ToolchainError (naming the package) unless every build tool is here; else their versions."""
    plat = platform_of(target)
    tools = [plat.linker] + ([plat.device_compiler] if plat.device_compiler else [])
    return {tool.command: tool_version(tool.require(target_name)) for tool in tools}


@functools.cache
def tool_version(path: str) -> str:
    """First line of ``--version`` (nvcc: its last line, the build), for the artifact's metadata."""
    try:
        text = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        return path
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        return path
    return lines[-2] if "nvcc" in Path(path).name and len(lines) > 1 else lines[0]


def export_options(target_name: str, target: Mapping, device_code: dict | None = None) -> dict:
    """Keyword arguments for ``export_library`` that link (and device-compile) for ``target``.

    ``device_code``, when given, receives what was embedded for a CUDA target (see
    ``cuda_fatbin_packer``).
    """
    from tvm.support import cc

    plat = platform_of(target)
    options: dict = {}
    if plat.linker.command != "gcc":
        options["fcompile"] = cc.cross_compiler(plat.linker.require(target_name))
    if plat.device == "cuda":
        options["fpack_imports"] = cuda_fatbin_packer(plat.arch, plat.device_compiler.require(target_name),
                                                      device_code if device_code is not None else {})
    return options


# --- CUDA device code ----------------------------------------------------------------------
# The imports blob that export_library embeds as __tvm_ffi__library_bin (tvm_ffi
# library_module.cc): <nbytes u64> <indptr vec<u64>> <children vec<u64>> then per module
# <kind str> [<payload bytes>], "_lib" having no payload. A CUDA module's payload is
# <fmt str> <function map> <code bytes>; strings and bytes are <u64 length><data>.

def _u64(value: int) -> bytes:
    return struct.pack("<Q", value)


def _read_u64(data: bytes, offset: int) -> tuple[int, int]:
    return struct.unpack_from("<Q", data, offset)[0], offset + 8


def _read_bytes(data: bytes, offset: int) -> tuple[bytes, int]:
    length, offset = _read_u64(data, offset)
    return data[offset:offset + length], offset + length


def _split_blob(blob: bytes) -> tuple[bytes, list[tuple[str, bytes | None]]]:
    """(import tree bytes, [(kind, payload or None for "_lib")]) of an imports blob."""
    total, offset = _read_u64(blob, 0)
    if total != len(blob) - 8:
        raise ValueError(f"imports blob says {total} bytes, holds {len(blob) - 8}")
    tree_start = offset
    for _ in range(2):  # indptr, child indices
        count, offset = _read_u64(blob, offset)
        offset += 8 * count
    tree = blob[tree_start:offset]
    modules = []
    while offset < len(blob):
        kind, offset = _read_bytes(blob, offset)
        payload = None
        if kind != b"_lib":
            payload, offset = _read_bytes(blob, offset)
        modules.append((kind.decode(), payload))
    return tree, modules


def _join_blob(tree: bytes, modules: list[tuple[str, bytes | None]]) -> bytes:
    body = bytearray(tree)
    for kind, payload in modules:
        body += _u64(len(kind)) + kind.encode()
        if payload is not None:
            body += _u64(len(payload)) + payload
    return _u64(len(body)) + bytes(body)


def _cuda_payload_parts(payload: bytes) -> tuple[str, bytes, bytes]:
    """(fmt, function map bytes, code) of a serialized CUDA module; the map stays opaque."""
    fmt, offset = _read_bytes(payload, 0)
    # The code is last: find the split where <u64 n><n bytes> ends the payload exactly.
    for start in range(offset, len(payload) - 7):
        length = struct.unpack_from("<Q", payload, start)[0]
        if start + 8 + length == len(payload):
            return fmt.decode(), payload[offset:start], payload[start + 8:]
    raise ValueError("CUDA module payload has no trailing code section")


def cuda_fatbin_packer(arch: str, nvcc: str, record: dict) -> Callable:
    """An ``fpack_imports`` for export_library that compiles each CUDA source module to a fatbin.

    The fatbin holds SASS for ``arch`` (it runs on GPUs of that major version, e.g. sm_80 code on
    sm_86). ``record`` gets the embedded format, arch, kernel count, size and sha256.
    """

    def pack(module, _is_system_lib: bool, symbol_prefix: str, workspace_dir: str) -> str:
        import hashlib

        import tvm
        from tvm.support import nvcc as tvm_nvcc

        blob = tvm.get_global_func("runtime.ModulePackImportsToTensor")(module).numpy().tobytes()
        tree, modules = _split_blob(blob)
        fatbins = []
        for index, (kind, payload) in enumerate(modules):
            if kind != "cuda":
                continue
            fmt, function_map, code = _cuda_payload_parts(payload)
            if fmt != "cuda":
                raise ArtifactError(f"the CUDA module is already compiled ({fmt}), not CUDA source",
                                    "build with TVM_COMPILE_FORCE_FALLBACK=1 (compile_targets does)")
            with _nvcc_on_path(nvcc), tvm.target.Target({"kind": "cuda", "arch": arch}):
                fatbin = bytes(tvm_nvcc.compile_cuda(code.decode(), target_format="fatbin",
                                                     arch=arch, compiler="nvcc"))
            fatbins.append(fatbin)
            kernels = set(re.findall(r"__global__ void (?:__launch_bounds__\(\d+\) )?(\w+)\(", code.decode()))
            record["kernels"] = record.get("kernels", 0) + len(kernels)
            modules[index] = (kind, _u64(len(b"fatbin")) + b"fatbin" + function_map
                              + _u64(len(fatbin)) + fatbin)
        record.update({"format": "fatbin", "arch": arch, "modules": len(fatbins),
                       "bytes": sum(map(len, fatbins)),
                       "sha256": hashlib.sha256(b"".join(fatbins)).hexdigest()})
        blob_path = Path(workspace_dir) / "devc.bin"
        blob_path.write_bytes(_join_blob(tree, modules))
        # .incbin keeps a multi-megabyte blob out of C source; GNU as accepts it on every target.
        symbol = f"{symbol_prefix}__tvm_ffi__library_bin"
        asm_path = Path(workspace_dir) / "devc.s"
        asm_path.write_text(f'\t.section .rodata\n\t.globl {symbol}\n\t.type {symbol}, %object\n'
                            f'\t.balign 16\n{symbol}:\n\t.incbin "{blob_path}"\n'
                            f'\t.size {symbol}, . - {symbol}\n'
                            '\t.section .note.GNU-stack,"",%progbits\n')
        return str(asm_path)

    return pack


class _nvcc_on_path:
    """tvm.support.nvcc runs plain "nvcc": put the one we checked first on PATH."""

    def __init__(self, nvcc: str):
        self.folder = str(Path(nvcc).parent)

    def __enter__(self):
        self.saved = os.environ.get("PATH", "")
        os.environ["PATH"] = self.folder + os.pathsep + self.saved

    def __exit__(self, *_exc):
        os.environ["PATH"] = self.saved


def embedded_cuda_modules(library: Path) -> list[tuple[str, bytes]]:
    """(fmt, code) of every CUDA module serialized into an exported library, found in the file."""
    data = Path(library).read_bytes()
    marker = _u64(4) + b"cuda"
    found = []
    start = data.find(marker)
    while start >= 0:
        payload_length, offset = _read_u64(data, start + len(marker))
        payload = data[offset:offset + payload_length]
        try:
            fmt, _map, code = _cuda_payload_parts(payload)
        except (ValueError, struct.error, UnicodeDecodeError):
            fmt = None
        if fmt in ("cuda", "fatbin", "cubin", "ptx"):
            found.append((fmt, code))
        start = data.find(marker, start + 1)
    return found


def fatbin_archs(fatbin: bytes) -> list[str]:
    """The sm_XX of each cubin in a fatbin, as cuobjdump lists them."""
    if not fatbin.startswith(FATBIN_MAGIC):
        raise ValueError("not a fatbin (bad magic)")
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "device.fatbin"
        path.write_bytes(fatbin)
        listing = subprocess.run([CUOBJDUMP.require("cuda"), "-lelf", str(path)], capture_output=True,
                                 text=True, timeout=120)
    if listing.returncode != 0:
        raise ValueError(f"cuobjdump failed: {listing.stderr.strip()}")
    return re.findall(r"\.(sm_\d+a?)\.cubin", listing.stdout)


def unscheduled_gpu_kernels(module) -> list[str]:
    """PrimFuncs with no loop bound to a GPU thread: they would silently build as host code."""
    from tvm import s_tir, tirx

    unbound = []
    for gvar, func in module.functions_items():
        if not isinstance(func, tirx.PrimFunc):
            continue
        sch = s_tir.Schedule(func)
        pending, bound = [sch.get_sblock("root")], False
        while pending and not bound:
            block = pending.pop()
            pending.extend(sch.get_child_blocks(block))
            bound = any(sch.get(loop).kind == tirx.ForKind.THREAD_BINDING for loop in sch.get_loops(block))
        if not bound:
            unbound.append(gvar.name_hint)
    return sorted(unbound)


# --- inspecting artifacts ----------------------------------------------------------------------

def elf_machine(library: Path) -> str:
    """"x86_64", "aarch64", or "EM_<n>" for another machine; ArtifactError if not ELF at all."""
    header = Path(library).read_bytes()[:20]
    if header[:4] != b"\x7fELF":
        raise ArtifactError(f"{library} is not an ELF shared library", "rebuild the artifact")
    machine = struct.unpack_from("<H", header, 18)[0]
    return ELF_MACHINES.get(machine, f"EM_{machine}")


def exported_symbols(library: Path) -> set[str]:
    """Defined dynamic symbols (GNU nm reads any ELF machine)."""
    listing = subprocess.run(["nm", "-D", "--defined-only", str(library)], capture_output=True, text=True,
                             check=True, timeout=60)
    return {line.split()[-1] for line in listing.stdout.splitlines() if line.strip()}


# --- where an artifact can run ----------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Execution:
    """How this machine can run an artifact: "native", "qemu" or None; ``reason`` says why not natively."""

    how: str | None
    reason: str = ""


def host_cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.partition(":")[2].split())
    except OSError:
        pass
    return set()


def cuda_available() -> bool:
    import tvm

    try:
        return bool(tvm.cuda(0).exist)
    except Exception:  # no CUDA runtime in this TVM build, or no driver
        return False


def execution_here(target: Mapping) -> Execution:
    """Whether (and how) an artifact for ``target`` runs on this machine, and if not, why."""
    plat = platform_of(target)
    machine = platform.machine()
    if plat.device == "cuda" and not cuda_available():
        return Execution(None, f"it needs a CUDA GPU ({plat.arch}) and this machine has none "
                               "(tvm.cuda(0) does not exist)")
    if plat.cpu == machine or (plat.cpu == "x86_64" and machine == "AMD64"):
        missing = [flag for flag in plat.cpu_flags if flag not in host_cpu_flags()]
        if missing:
            return Execution(None, f"its code uses {', '.join(missing)}, which this CPU lacks")
        return Execution("native")
    if plat.cpu == "aarch64" and plat.device is None:
        missing = [tool for tool in (QEMU_AARCH64, AARCH64_GXX) if tool.path() is None]
        if not aarch64_runtime_dir().joinpath("libtvm_runtime.so").is_file():
            return Execution(None, f"it is an aarch64 library; emulation needs the aarch64 TVM runtime "
                                   f"in {aarch64_runtime_dir()} (run {SETUP_SCRIPT} aarch64)")
        if missing:
            return Execution(None, "it is an aarch64 library; emulation needs "
                                   + ", ".join(f"{t.command} (apt-get install -y {t.package})" for t in missing))
        return Execution("qemu", f"it is an aarch64 library and this machine is {machine}")
    return Execution(None, f"it is a {plat.cpu} library and this machine is {machine}")


def aarch64_runtime_dir() -> Path:
    """Where scripts/setup_targets.sh puts libtvm_runtime.so/libtvm_ffi.so from the aarch64 wheels."""
    import sys

    return Path(os.environ.get("TVM_FUSION_AARCH64_RUNTIME", Path(sys.prefix) / "targets" / "aarch64" / "lib"))


def aarch64_runner() -> Path:
    """vm_runner.cc cross-compiled for aarch64 against the aarch64 runtime (cached by source hash)."""
    import hashlib

    import tvm_ffi.libinfo

    runtime = aarch64_runtime_dir()
    source = VM_RUNNER_SOURCE.read_bytes()
    tag = hashlib.sha256(source + (runtime / "libtvm_runtime.so").read_bytes()[:4096]).hexdigest()[:16]
    binary = runtime.parent / f"vm_runner-{tag}"
    if binary.is_file():
        return binary
    compiler = AARCH64_GXX.require("aarch64")
    staging = binary.with_name(f".{binary.name}.tmp-{os.getpid()}")
    build = subprocess.run(
        [compiler, "-std=c++17", "-O2", f"-I{tvm_ffi.libinfo.find_include_path()}",
         f"-I{tvm_ffi.libinfo.find_dlpack_include_path()}", str(VM_RUNNER_SOURCE), "-o", str(staging),
         "-Wl,--no-as-needed", f"-L{runtime}", "-ltvm_runtime", "-ltvm_ffi"],
        capture_output=True, text=True, timeout=600)
    if build.returncode != 0:
        staging.unlink(missing_ok=True)
        raise ToolchainError(f"cannot build the aarch64 runner: {build.stderr.strip()[-2000:]}",
                             f"re-run {SETUP_SCRIPT} aarch64")
    os.replace(staging, binary)
    return binary


def run_emulated(library: Path, metadata: dict, inputs: Mapping[str, np.ndarray],
                 timeout: float = 600) -> dict[str, np.ndarray]:
    """Run an aarch64 library under qemu-user with the aarch64 TVM runtime; outputs by name.

    Inputs go in the order ``metadata["inputs"]`` lists them; output names come from
    ``metadata["outputs"]``.
    """
    runner = aarch64_runner()
    qemu = QEMU_AARCH64.require("aarch64")
    with tempfile.TemporaryDirectory(prefix="tvm_fusion_qemu_") as folder:
        arguments = []
        for index, spec in enumerate(metadata["inputs"]):
            value = np.ascontiguousarray(inputs[spec["name"]], dtype=spec["dtype"])
            path = Path(folder) / f"input{index}.bin"
            value.tofile(path)
            arguments.append(f"{spec['dtype']}:{'x'.join(map(str, value.shape))}:{path}")
        env = {**os.environ, "QEMU_LD_PREFIX": "/usr/aarch64-linux-gnu",
               "LD_LIBRARY_PATH": str(aarch64_runtime_dir()),
               "TVM_NUM_THREADS": str(metadata.get("threads", 1))}
        try:
            run = subprocess.run([qemu, str(runner), str(Path(library).resolve()), folder, *arguments],
                                 capture_output=True, text=True, env=env, timeout=timeout)
        except subprocess.TimeoutExpired as err:
            raise ArtifactError(f"{library} under qemu-aarch64 did not finish in {timeout:.0f} s",
                                "try a smaller input shape") from err
        if run.returncode != 0:
            errors = [line for line in run.stderr.splitlines() if "Scope Loaded" not in line]
            raise ArtifactError(f"{library} failed under qemu-aarch64 (exit {run.returncode}): "
                                + "\n".join(errors[-20:]), "check the artifact and the aarch64 runtime")
        outputs = {}
        for line in run.stdout.splitlines():
            _, index, dtype, shape = (line.split() + [""])[:4]
            dims = [int(d) for d in shape.split("x") if d]
            name = metadata["outputs"][int(index)]["name"]
            outputs[name] = np.fromfile(Path(folder) / f"output{index}.bin", dtype=dtype).reshape(dims)
    return outputs
