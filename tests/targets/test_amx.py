"""A target with AMX tiles (Sapphire/Emerald Rapids): its artifact requires amx_int8, amx_bf16 and
amx_tile of the machine that runs it, and links in the constructor that asks Linux for the tile
state (the artifact run by plain TVM: tests/schedules/cpu/test_int8_matmul_amx.py)."""

from __future__ import annotations

import pytest

from tvm_fusion.targets import export_options, platform_of
from tvm_fusion.targets.amx import PERMISSION_SOURCE


def test_an_amx_target_requires_amx_of_the_machine_that_runs_it():
    """Its int8 matmul kernels run tdpbusd: on a CPU without AMX (any AMD, Ice Lake) the
    artifact is refused by name instead of dying of an illegal instruction."""
    flags = platform_of({"kind": "llvm", "mcpu": "sapphirerapids"}).cpu_flags
    assert {"amx_int8", "amx_bf16", "amx_tile", "avx512_vnni"} <= set(flags)  # amx_bf16: the bf16 kernels
    for mcpu in ("znver4", "skylake-avx512", "icelake-server"):
        assert not {"amx_int8", "amx_bf16", "amx_tile"} & set(platform_of({"kind": "llvm", "mcpu": mcpu}).cpu_flags), mcpu


@pytest.mark.parametrize("mcpu, linked", [("sapphirerapids", True), ("emeraldrapids", True), ("znver4", False)])
def test_the_permission_constructor_is_linked_for_amx_targets_only(mcpu, linked):
    options = export_options("t", {"kind": "llvm", "mcpu": mcpu})
    assert options.get("addons") == ([str(PERMISSION_SOURCE)] if linked else None)
    assert PERMISSION_SOURCE.is_file()
    # a new list on each call: export_library appends its object files to the one it is given
    if linked:
        assert options["addons"] is not export_options("t", {"kind": "llvm", "mcpu": mcpu})["addons"]
