"""The peak probe every bench and profile carries: probed once per machine class, read once per process."""

import dataclasses
import json

from tvm_fusion import machine_peak as mp
from tvm_fusion.api import resolve_config
from tvm_fusion.kernels.cpu_features import has_amx_bf16, has_amx_int8, has_avx512_bf16, has_vnni
from tvm_fusion.targets.amx import request_amx_permission


def test_probed_once_then_read_from_disk_then_from_memory(tmp_path, monkeypatch, config_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(mp, "_IN_PROCESS", {})
    probes = []
    monkeypatch.setattr(mp, "probe_fma", lambda cfg: probes.append("fma") or 100.0)
    monkeypatch.setattr(mp, "probe_triad", lambda cfg: probes.append("triad") or 10.0)
    monkeypatch.setattr(mp, "probe_l2", lambda cfg: probes.append("l2") or 40.0)
    monkeypatch.setattr(mp, "probe_amx_bf16", lambda cfg: probes.append("amx") or 900.0)
    monkeypatch.setattr(mp, "probe_amx_int8", lambda cfg: probes.append("amx int8") or 1800.0)
    monkeypatch.setattr(mp, "probe_vnni_int8", lambda cfg: probes.append("vnni") or 400.0)
    monkeypatch.setattr(mp, "probe_avx512_bf16", lambda cfg: probes.append("avx512 bf16") or 450.0)
    cfg = resolve_config(config_path())

    first = mp.machine_peak(cfg)
    # AMX there: no VNNI nor AVX512_BF16 probe, their roofs would never be used
    assert sorted(probes) == ["amx", "amx int8", "fma", "l2", "triad"] and first.ridge == 10.0
    assert (first.amx_bf16_gflops, first.amx_int8_gops, first.vnni_int8_gops) == (900.0, 1800.0, None)
    cached = json.loads((tmp_path / "tvm_fusion" / f"peak-{first.target_key}.v{mp.PROBE_VERSION}.json").read_text())
    assert cached["gflops"] == 100.0 and cached["threads"] == cfg.threads

    monkeypatch.setattr(mp, "_IN_PROCESS", {})  # a new process: the disk cache answers, the FMA probed again
    assert mp.machine_peak(cfg) == first and probes[5:] == ["fma"]
    (tmp_path / "tvm_fusion" / f"peak-{first.target_key}.v{mp.PROBE_VERSION}.json").unlink()
    assert mp.machine_peak(cfg) == first and len(probes) == 6  # the same process: no disk read needed
    mp.machine_peak(cfg, refresh=True)
    assert len(probes) == 11


def test_without_amx_int8_the_vnni_peak_is_probed_instead(tmp_path, monkeypatch, config_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(mp, "_IN_PROCESS", {})
    for name, value in (("fma", 100.0), ("triad", 10.0), ("l2", 40.0), ("amx_bf16", None), ("amx_int8", None),
                        ("vnni_int8", 400.0)):
        monkeypatch.setattr(mp, f"probe_{name}", lambda _cfg, value=value: value)
    peak = mp.machine_peak(resolve_config(config_path()))
    assert (peak.amx_int8_gops, peak.vnni_int8_gops) == (None, 400.0)
    assert peak.compute_roof("int8") == ("AVX512-VNNI", 400.0)


def test_without_amx_bf16_the_avx512_bf16_peak_is_probed_instead(tmp_path, monkeypatch, config_path):
    """Zen 4: bf16 kernels are vdpbf16ps register tiles, set against that instruction's peak."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(mp, "_IN_PROCESS", {})
    for name, value in (("fma", 100.0), ("triad", 10.0), ("l2", 40.0), ("amx_bf16", None), ("amx_int8", None),
                        ("vnni_int8", 400.0), ("avx512_bf16", 190.0)):
        monkeypatch.setattr(mp, f"probe_{name}", lambda _cfg, value=value: value)
    peak = mp.machine_peak(resolve_config(config_path()))
    assert (peak.amx_bf16_gflops, peak.avx512_bf16_gflops) == (None, 190.0)
    assert peak.compute_roof("bf16") == ("AVX512_BF16", 190.0) and peak.compute_roof("float32") == ("FMA", 100.0)
    assert "190 GFLOP/s AVX512_BF16" in peak.dot_product_roofs()


def test_a_probe_taken_on_a_busy_machine_is_raised_by_a_later_one(tmp_path, monkeypatch, config_path):
    """The cache keeps the best FMA probe: one taken while a test run shared the cores (256)
    gives way to an idle one (465); a slower later probe changes nothing."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    cfg = resolve_config(config_path())
    for fma, expected in ((256.0, 256.0), (465.0, 465.0), (300.0, 465.0)):
        monkeypatch.setattr(mp, "_IN_PROCESS", {})  # each a new process
        monkeypatch.setattr(mp, "probe_fma", lambda _cfg, fma=fma: fma)
        monkeypatch.setattr(mp, "probe_triad", lambda _cfg: 19.0)
        monkeypatch.setattr(mp, "probe_l2", lambda _cfg: 80.0)
        monkeypatch.setattr(mp, "probe_amx_bf16", lambda _cfg: None)
        monkeypatch.setattr(mp, "probe_amx_int8", lambda _cfg: None)
        monkeypatch.setattr(mp, "probe_vnni_int8", lambda _cfg: None)
        monkeypatch.setattr(mp, "probe_avx512_bf16", lambda _cfg: None)
        assert mp.machine_peak(cfg).gflops == expected
    cached = json.loads(next((tmp_path / "tvm_fusion").glob("peak-*.json")).read_text())
    assert cached["gflops"] == 465.0 and cached["gbytes_per_s"] == 19.0


def test_a_much_faster_fma_probe_takes_the_register_dot_probes_again(tmp_path, monkeypatch, config_path):
    """The vdpbf16ps and vpdpbusd peaks cached on a slow host (half speed) rise with the FMA
    peak; each keeps the best of its probes, and a slightly faster FMA probe leaves them."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    cfg = resolve_config(config_path())
    dots = {"avx512_bf16": [230.0, 460.0, 300.0], "vnni_int8": [470.0, 930.0, 600.0]}
    for fma, expected in ((127.0, (230.0, 470.0)), (255.0, (460.0, 930.0)), (270.0, (460.0, 930.0))):
        monkeypatch.setattr(mp, "_IN_PROCESS", {})  # each a new process
        for name, value in (("fma", fma), ("triad", 19.0), ("l2", 80.0), ("amx_bf16", None), ("amx_int8", None)):
            monkeypatch.setattr(mp, f"probe_{name}", lambda _cfg, value=value: value)
        for name, values in dots.items():
            monkeypatch.setattr(mp, f"probe_{name}", lambda _cfg, values=values: values.pop(0))
        peak = mp.machine_peak(cfg)
        assert (peak.gflops, (peak.avx512_bf16_gflops, peak.vnni_int8_gops)) == (fma, expected)
    assert dots == {"avx512_bf16": [300.0], "vnni_int8": [600.0]}  # 270 is not 10 % above 255: no probe


def test_l2_probe_outruns_dram_and_stays_under_the_fma_peak(config_path):
    """The L2 sweep's working set stays in cache: it must beat the 64 MiB triad, which goes to
    DRAM (6.6-9.9x on Zen 1), and it cannot move more than the FMA peak's operands (12 bytes
    per 2 flops of its own multiply-add)."""
    cfg = resolve_config(config_path())
    l2, triad, fma = mp.probe_l2(cfg), mp.probe_triad(cfg), mp.probe_fma(cfg)
    assert 2 * triad < l2 < 6 * fma


def test_amx_bf16_probe_outruns_the_fma_peak_where_the_target_has_it(config_path):
    """A tdpbf16ps does 16x16x32 multiply-adds (16 cycles apart on Sapphire Rapids), a 512-bit
    FMA 16 (two a cycle): the AMX-BF16 roof is far above the float32 one. A target without
    AMX-BF16 has none, and no kernel is compiled or run for it."""
    cfg = resolve_config(config_path())
    amx = mp.probe_amx_bf16(cfg)
    if has_amx_bf16(cfg.tvm_target()) and request_amx_permission():
        assert amx > 4 * mp.probe_fma(cfg)
    else:
        assert amx is None
    avx2 = dataclasses.replace(cfg, target={"kind": "llvm", "mcpu": "haswell"})
    assert mp.probe_amx_bf16(avx2) is None


def test_amx_int8_probe_outruns_the_fma_peak_where_the_target_has_it(config_path):
    """A tdpbusd does 16x16x64 uint8 x int8 products (16 cycles apart on Sapphire Rapids), twice
    a tdpbf16ps's: 2 ops each, the AMX-INT8 roof is tens of times the float32 FMA one. A target
    without AMX-INT8 (Zen 4 has AVX512-VNNI, no AMX) has none, and nothing is compiled for it."""
    cfg = resolve_config(config_path())
    amx = mp.probe_amx_int8(cfg)
    if has_amx_int8(cfg.tvm_target()) and request_amx_permission():
        assert amx > 8 * mp.probe_fma(cfg)
    else:
        assert amx is None
    zen4 = dataclasses.replace(cfg, target={"kind": "llvm", "mcpu": "znver4", "num-cores": 2})
    assert mp.probe_amx_int8(zen4) is None


def test_vnni_probe_is_near_four_fmas_where_the_target_has_it(config_path):
    """A 512-bit vpdpbusd sums 64 uint8 x int8 products (128 ops) where an FMA does 32 FLOPs, on
    the same ports: about 4x the FMA peak, the int8 roof of a target without AMX-INT8. None
    without AVX512-VNNI (Haswell)."""
    cfg = resolve_config(config_path())
    before = mp.probe_fma(cfg)  # an FMA probe on each side: the host's speed may move between probes
    vnni = mp.probe_vnni_int8(cfg)
    if has_vnni(cfg.tvm_target()):
        fma = (before, mp.probe_fma(cfg))
        assert 2 * min(fma) < vnni < 6 * max(fma)
    else:
        assert vnni is None
    haswell = dataclasses.replace(cfg, target={"kind": "llvm", "mcpu": "haswell"})
    assert mp.probe_vnni_int8(haswell) is None


def test_avx512_bf16_probe_is_near_two_fmas_where_the_target_has_it(config_path):
    """A 512-bit vdpbf16ps sums 32 bf16 products (64 FLOPs) where an FMA does 32: up to 2x the
    FMA peak where it issues as often (1.8x on Zen 4); on Emerald Rapids it read 0.46x, with an
    FMA probe on each side. None without AVX512_BF16 (Zen 3)."""
    cfg = resolve_config(config_path())
    before = mp.probe_fma(cfg)  # an FMA probe on each side: the host's speed may move between probes
    bf16 = mp.probe_avx512_bf16(cfg)
    if has_avx512_bf16(cfg.tvm_target()):
        fma = (before, mp.probe_fma(cfg))
        assert 0.35 * min(fma) < bf16 < 2.5 * max(fma)
    else:
        assert bf16 is None
    zen3 = dataclasses.replace(cfg, target={"kind": "llvm", "mcpu": "znver3"})
    assert mp.probe_avx512_bf16(zen3) is None


def test_l2_size_is_read_from_the_os_or_a_default(monkeypatch, tmp_path):
    level2 = tmp_path / "cpu0" / "cache" / "index2"
    level2.mkdir(parents=True)
    (level2 / "level").write_text("2\n")
    (level2 / "size").write_text("1024K\n")
    real_path = mp.Path
    monkeypatch.setattr(mp, "Path", lambda p: real_path(str(p).replace("/sys/devices/system/cpu", str(tmp_path))))
    assert mp.l2_bytes() == 1024 * 1024
    (level2 / "size").write_text("2M\n")
    assert mp.l2_bytes() == 2 * 1024 * 1024
    (level2 / "level").unlink()
    assert mp.l2_bytes() == mp.L2_DEFAULT_BYTES
