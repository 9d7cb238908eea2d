"""``tvm-fusion export-runner DIR``: the sources of a runner that needs no Python on the host.

vm_runner.cc (also the aarch64 runner under qemu) and a CMakeLists.txt that builds it against
the TVM runtime and tvm-ffi, with this environment's copies of them as defaults (paths.cmake).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import tvm
import tvm_ffi.libinfo

from ..errors import ToolchainError
from ..files import write_file

SOURCES = Path(__file__).resolve().parent
FILES = ("vm_runner.cc", "CMakeLists.txt")


def runtime_paths() -> dict[str, Path]:
    """This environment's TVM runtime library, tvm-ffi library and headers, by CMake variable."""
    return {"TVM_RUNTIME_LIB_DIR": Path(tvm.__file__).resolve().parent / "lib",
            "TVM_FFI_LIB_DIR": Path(tvm_ffi.libinfo.find_libtvm_ffi()).resolve().parent,
            "TVM_FFI_INCLUDE_DIR": Path(tvm_ffi.libinfo.find_include_path()),
            "DLPACK_INCLUDE_DIR": Path(tvm_ffi.libinfo.find_dlpack_include_path())}


def export_runner(directory: str | Path) -> list[Path]:
    """Write the runner's sources and build file into ``directory``; each file atomically."""
    directory = Path(directory)
    written = [write_file(directory / name, lambda staging, name=name: staging.write_bytes(
        (SOURCES / name).read_bytes()), "the runner source", "export-runner") for name in FILES]
    defaults = "".join(f'set({key} "{value}")\n' for key, value in runtime_paths().items())
    written.append(write_file(directory / "paths.cmake", lambda staging: staging.write_text(
        "# Where the TVM runtime and tvm-ffi were when export-runner ran; -D flags override these.\n"
        + defaults), "the runner source", "export-runner"))
    return written


def build_runner(directory: str | Path) -> Path:
    """Export the runner into ``directory`` and build it with CMake; the binary's path."""
    directory = Path(directory)
    export_runner(directory)
    if shutil.which("cmake") is None:
        raise ToolchainError("building the runner needs cmake, which is not installed", "apt-get install cmake")
    for step in (["cmake", "-S", str(directory), "-B", str(directory / "build"), "-DCMAKE_BUILD_TYPE=Release"],
                 ["cmake", "--build", str(directory / "build")]):
        done = subprocess.run(step, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise ToolchainError(f"building the runner failed: {(done.stdout + done.stderr).strip()[-2000:]}",
                                 "check that a C++17 compiler (g++) is installed")
    return directory / "build" / "vm_runner"
