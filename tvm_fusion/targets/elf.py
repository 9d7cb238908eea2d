"""Inspecting a built library: its ELF machine and the symbols it exports."""

from __future__ import annotations

import struct
import subprocess
from pathlib import Path

from ..errors import ArtifactError

ELF_MACHINES = {62: "x86_64", 183: "aarch64"}


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
