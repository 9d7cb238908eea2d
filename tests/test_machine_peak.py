"""The peak probe every bench and profile carries: probed once per machine class, read once per process."""

import dataclasses
import json

from tvm_fusion import machine_peak as mp
from tvm_fusion.api import resolve_config


def test_probed_once_then_read_from_disk_then_from_memory(tmp_path, monkeypatch, config_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(mp, "_IN_PROCESS", {})
    probes = []
    monkeypatch.setattr(mp, "probe_fma", lambda cfg: probes.append("fma") or 100.0)
    monkeypatch.setattr(mp, "probe_triad", lambda cfg: probes.append("triad") or 10.0)
    monkeypatch.setattr(mp, "probe_l2", lambda cfg: probes.append("l2") or 40.0)
    monkeypatch.setattr(mp, "probe_amx_bf16", lambda cfg: probes.append("amx") or 900.0)
    cfg = resolve_config(config_path())

    first = mp.machine_peak(cfg)
    assert probes == ["fma", "triad", "l2", "amx"] and first.ridge == 10.0 and first.amx_bf16_gflops == 900.0
    cached = json.loads((tmp_path / "tvm_fusion" / f"peak-{first.target_key}.v{mp.PROBE_VERSION}.json").read_text())
    assert cached["gflops"] == 100.0 and cached["threads"] == cfg.threads

    monkeypatch.setattr(mp, "_IN_PROCESS", {})  # a new process: the disk cache answers, the FMA probed again
    assert mp.machine_peak(cfg) == first and probes == ["fma", "triad", "l2", "amx", "fma"]
    (tmp_path / "tvm_fusion" / f"peak-{first.target_key}.v{mp.PROBE_VERSION}.json").unlink()
    assert mp.machine_peak(cfg) == first and len(probes) == 5  # the same process: no disk read needed
    mp.machine_peak(cfg, refresh=True)
    assert len(probes) == 9


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
        assert mp.machine_peak(cfg).gflops == expected
    cached = json.loads(next((tmp_path / "tvm_fusion").glob("peak-*.json")).read_text())
    assert cached["gflops"] == 465.0 and cached["gbytes_per_s"] == 19.0


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
    from tvm_fusion.kernels.cpu_features import has_amx_bf16
    from tvm_fusion.targets.amx import request_amx_permission

    cfg = resolve_config(config_path())
    amx = mp.probe_amx_bf16(cfg)
    if has_amx_bf16(cfg.tvm_target()) and request_amx_permission():
        assert amx > 4 * mp.probe_fma(cfg)
    else:
        assert amx is None
    avx2 = dataclasses.replace(cfg, target={"kind": "llvm", "mcpu": "haswell"})
    assert mp.probe_amx_bf16(avx2) is None


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
