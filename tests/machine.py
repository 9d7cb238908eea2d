"""The machine the suite runs on, and "another machine" picked relative to it.

CI and developers land on different CPU classes (Zen 3 with AVX2 only, Zen 4/5 and Emerald
Rapids with AVX-512), so no test names an ``mcpu`` of its own: code a test runs is built for
the host, and a test that needs a foreign machine class takes ``OTHER_MCPU``, which is never
the host's. A test of the CPUs with AVX512-VNNI and no AMX runs on the host less its AMX
features (``host_target_without_amx``).
"""

from __future__ import annotations

from tvm_fusion.config import host_cpu_name

HOST_MCPU = host_cpu_name()
# Real LLVM x86 CPU names; the first that is not this host is "another machine".
OTHER_MCPU = next(cpu for cpu in ("znver4", "sapphirerapids", "znver3", "skylake-avx512") if cpu != HOST_MCPU)


def host_target(num_cores: int = 2) -> dict:
    """A target JSON dict for this machine's CPU: code built for it runs here."""
    return {"kind": "llvm", "mcpu": HOST_MCPU, "num-cores": num_cores}


def host_target_without_amx(num_cores: int = 2) -> dict:
    """This machine's CPU less its AMX tiles, if it has any: where the host has AVX512-VNNI, code
    built for it computes int8 sums with ``vpdpbusd`` as on Zen 4 or Ice Lake, and runs here."""
    return {**host_target(num_cores), "mattr": ["-amx-tile", "-amx-int8", "-amx-bf16"]}


def other_target(num_cores: int = 2) -> dict:
    """A target JSON dict for a CPU class other than this host's."""
    return {"kind": "llvm", "mcpu": OTHER_MCPU, "num-cores": num_cores}


def host_has_avx512() -> bool:
    """Whether AVX-512 code (the x86_64-avx512 config) can run here."""
    from tvm_fusion.targets import host_cpu_flags

    return "avx512f" in host_cpu_flags()
