"""CUDA device code: compile the exported CUDA source into a fatbin, and find it in a library.

TVM 0.27 exports CUDA kernels as CUDA *source* that the deployment host compiles at load time.
``cuda_fatbin_packer`` instead compiles that source with nvcc for the configured arch when the
library is exported, so the artifact carries device code and its host needs no compiler.
"""

from __future__ import annotations

import hashlib
import os
import re
import struct
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import tvm
from tvm import s_tir, tirx
from tvm.support import nvcc as tvm_nvcc

from ..errors import ArtifactError
from .toolchain import CUOBJDUMP

FATBIN_MAGIC = b"\x50\xed\x55\xba"

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
