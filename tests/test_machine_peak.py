"""The peak probe every bench and profile carries: probed once per machine class, read once per process."""

import json

from tvm_fusion import machine_peak as mp
from tvm_fusion.api import resolve_config


def test_probed_once_then_read_from_disk_then_from_memory(tmp_path, monkeypatch, config_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(mp, "_IN_PROCESS", {})
    probes = []
    monkeypatch.setattr(mp, "probe_fma", lambda cfg: probes.append("fma") or 100.0)
    monkeypatch.setattr(mp, "probe_triad", lambda cfg: probes.append("triad") or 10.0)
    cfg = resolve_config(config_path())

    first = mp.machine_peak(cfg)
    assert probes == ["fma", "triad"] and first.ridge == 10.0
    cached = json.loads((tmp_path / "tvm_fusion" / f"peak-{first.target_key}.v{mp.PROBE_VERSION}.json").read_text())
    assert cached["gflops"] == 100.0 and cached["threads"] == cfg.threads

    monkeypatch.setattr(mp, "_IN_PROCESS", {})  # a new process: the disk cache answers
    assert mp.machine_peak(cfg) == first and len(probes) == 2
    (tmp_path / "tvm_fusion" / f"peak-{first.target_key}.v{mp.PROBE_VERSION}.json").unlink()
    assert mp.machine_peak(cfg) == first and len(probes) == 2  # the same process: no disk read needed
    mp.machine_peak(cfg, refresh=True)
    assert len(probes) == 4
