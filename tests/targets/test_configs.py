"""The five target configs load, map to the right platform, and bad target keys are refused."""

from __future__ import annotations

import pytest
from target_helpers import config

from tvm_fusion import targets
from tvm_fusion.config import parse_config
from tvm_fusion.errors import ConfigError

EXPECTED = {
    "x86_64-avx512": ("x86_64", "x86-64-v4", None, "gcc"),
    "x86_64-avx2": ("x86_64", "x86-64-v3", None, "gcc"),
    "aarch64": ("aarch64", "neoverse-n1", None, "aarch64-linux-gnu-gcc"),
    "cuda-sm80": ("x86_64", "sm_80", "cuda", "gcc"),
    "cuda-sm90": ("x86_64", "sm_90", "cuda", "gcc"),
}


@pytest.mark.parametrize("name", EXPECTED)
def test_config_maps_to_its_platform(name):
    from tvm_fusion.config import load_config

    cfg = load_config(config(name))
    plat = targets.platform_of(cfg.target)
    assert (plat.cpu, plat.arch, plat.device, plat.linker.command) == EXPECTED[name]
    assert (plat.device_compiler is not None) == (plat.device == "cuda")
    cfg.tvm_target()  # TVM accepts it


@pytest.mark.parametrize("target, key", [
    ({"kind": "cuda", "arch": "sm80"}, "target.arch"),
    ({"kind": "cuda", "arch": "sm_90", "host": {"kind": "cuda"}}, "target.host"),
    ({"kind": "llvm", "arch": "sm_90"}, "target.arch"),
    ({"kind": "llvm", "mtriple": "riscv64-linux-gnu"}, "target.mtriple"),
])
def test_bad_target_keys_name_the_key(target, key):
    with pytest.raises(ConfigError) as info:
        parse_config({"target": target}, name="bad", path="bad.toml")
    assert f"bad.toml: key '{key}'" in str(info.value)
