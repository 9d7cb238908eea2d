"""Config loading: the bundled host config resolves, every mistake names file, key and allowed values."""

from __future__ import annotations

import tomllib

import psutil
import pytest
from machine import OTHER_MCPU

from tvm_fusion.config import DEFAULT_CONFIG, load_config, parse_config
from tvm_fusion.errors import ConfigError
from tvm_fusion.patterns import registered_patterns


def write(tmp_path, text: str, name: str = "cfg.toml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def config_error(path) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.exit_code == 2
    return info.value


def test_default_config_resolves_host_values():
    import tvm

    cfg = load_config(None)
    assert cfg.path == str(DEFAULT_CONFIG) and cfg.name == "x86_64-host"
    mcpu = cfg.target["mcpu"]
    assert isinstance(mcpu, str) and mcpu and mcpu != "host"
    assert mcpu == str(tvm.target.Target.from_device(tvm.cpu()).attrs["mcpu"])
    cores = cfg.target["num-cores"]
    assert isinstance(cores, int) and not isinstance(cores, bool) and cores >= 1
    assert cores == (psutil.cpu_count(logical=False) or cores)
    # Everything else is what the file says (read here with tomllib, independently).
    raw = tomllib.loads(DEFAULT_CONFIG.read_text())
    assert (raw["target"]["mcpu"], raw["target"]["num-cores"], raw["runtime"]["threads"]) == ("host", "host", 0)
    assert cfg.threads == cores  # threads = 0 means "num-cores"
    assert raw["pipeline"]["patterns"] == "default" and cfg.patterns == tuple(registered_patterns())
    assert cfg.schedule == raw["pipeline"]["schedule"]
    assert cfg.conv_layout == raw["pipeline"]["conv_layout"]
    assert (cfg.rtol, cfg.atol, cfg.seed) == (raw["verify"]["rtol"], raw["verify"]["atol"], raw["verify"]["seed"])
    assert cfg.dim_defaults == raw["inputs"]
    target = cfg.tvm_target()
    assert target.kind.name == "llvm" and str(target.attrs["mcpu"]) == mcpu


def test_explicit_values_are_kept(tmp_path):
    path = write(tmp_path, f'[target]\nkind = "llvm"\nmcpu = "{OTHER_MCPU}"\nnum-cores = 3\n'
                           '[pipeline]\npatterns = ["gelu_erf"]\nschedule = "none"\n'
                           '[verify]\nrtol = 0\natol = 2\nseed = 7\n[runtime]\nthreads = 2\n'
                           '[inputs]\nbatch = 8\n')
    cfg = load_config(path)
    assert cfg.name == "cfg" and cfg.path == str(path)
    assert cfg.target == {"kind": "llvm", "mcpu": OTHER_MCPU, "num-cores": 3}
    assert cfg.patterns == ("gelu_erf",) and cfg.schedule == "none"
    assert (cfg.rtol, cfg.atol, cfg.seed, cfg.threads) == (0.0, 2.0, 7, 2)
    assert isinstance(cfg.atol, float)
    assert cfg.dim_defaults == {"batch": 8}


def test_threads_default_to_num_cores(tmp_path):
    cfg = load_config(write(tmp_path, '[target]\nkind = "llvm"\nnum-cores = 5\n'))
    assert cfg.threads == 5


def test_empty_file_gives_host_defaults(tmp_path):
    cfg = load_config(write(tmp_path, ""))
    assert cfg.target["kind"] == "llvm" and cfg.target["mcpu"] != "host"
    assert isinstance(cfg.target["num-cores"], int)
    assert cfg.patterns == tuple(registered_patterns()) and cfg.schedule == "default"


def test_missing_file(tmp_path):
    missing = tmp_path / "nope.toml"
    err = config_error(missing)
    assert str(missing) in str(err) and "does not exist" in str(err)
    assert "--config" in str(err)


def test_invalid_toml(tmp_path):
    path = write(tmp_path, "[target\nkind = llvm\n")
    err = config_error(path)
    assert str(path) in str(err) and "not valid TOML" in str(err)
    assert "line 1" in str(err)  # the TOML parser's position survives


def test_binary_file_is_invalid_toml(tmp_path):
    path = tmp_path / "cfg.toml"
    path.write_bytes(b"\xff\xfe\x00garbage")
    err = config_error(path)
    assert str(path) in str(err) and "not valid TOML" in str(err)


BAD_CONFIGS = [
    # (toml, key named in the message, text of the problem, text of what is allowed)
    ("[targets]\nkind = 'llvm'\n", "targets", "not a known section", "target, pipeline, verify, runtime, inputs"),
    ("kind = 'llvm'\n", "kind", "not a known section", "target, pipeline"),
    ("[target]\nkind = 'llvm'\nmcpus = 'host'\n", "target.mcpus", "not a known key",
     "kind, mcpu, mtriple, mattr, num-cores, arch, host"),
    ("[pipeline]\nschedules = 'none'\n", "pipeline.schedules", "not a known key", "patterns, enable, disable, schedule"),
    ("[verify]\ntolerance = 1\n", "verify.tolerance", "not a known key", "rtol, atol, seed"),
    ("[target]\nkind = 'rocm'\n", "target.kind", "'rocm'", "llvm, cuda"),
    ("[target]\nmcpu = 'host'\n", "target.kind", "None", "llvm, cuda"),
    ("[target]\nkind = 'llvm'\nnum-cores = 0\n", "target.num-cores", "0", "positive integer"),
    ("[target]\nkind = 'llvm'\nnum-cores = 'many'\n", "target.num-cores", "'many'", "positive integer"),
    ("[target]\nkind = 'llvm'\nnum-cores = true\n", "target.num-cores", "True", "positive integer"),
    ("[target]\nkind = 'llvm'\nmattr = '+avx2'\n", "target.mattr", "'+avx2'", "list of strings"),
    ("[target]\nkind = 'cuda'\n", "target.arch", "missing for a cuda target", "sm_80"),
    ("[pipeline]\npatterns = ['gelu_erf', 'fused_attention']\n", "pipeline.patterns",
     "unknown pattern 'fused_attention'", "gelu_erf, gelu_tanh"),
    ("[pipeline]\npatterns = ['gelu_erf', 'gelu_erf']\n", "pipeline.patterns", "lists a pattern twice", "at most once"),
    ("[pipeline]\npatterns = 'gelu_erf'\n", "pipeline.patterns", "'gelu_erf'", "list of pattern names"),
    ("[pipeline]\ndisable = ['gelu']\n", "pipeline.disable", "unknown pattern 'gelu'", "gelu_erf"),
    ("[pipeline]\nenable = 'softmax'\n", "pipeline.enable", "'softmax'", "list of pattern names"),
    ("[pipeline]\nenable = ['softmax']\ndisable = ['softmax']\n", "pipeline.enable", "both name ['softmax']",
     "one of them"),
    ("[pipeline]\nschedule = 'tuned'\n", "pipeline.schedule", "'tuned'", "default, none"),
    ("[pipeline]\nconv_layout = 'NHWC'\n", "pipeline.conv_layout", "'NHWC'", "NCHW, NCHWc"),
    ("[pipeline]\nblocked_depthwise = 'yes'\n", "pipeline.blocked_depthwise", "'yes'", "true or false"),
    ("[pipeline]\nwinograd = 1\n", "pipeline.winograd", "1", "true or false"),
    ("[pipeline]\nflush_subnormals = 'no'\n", "pipeline.flush_subnormals", "'no'", "true or false"),
    ("[verify]\nrtol = -1e-3\n", "verify.rtol", "-0.001", "non-negative number"),
    ("[verify]\natol = 'small'\n", "verify.atol", "'small'", "non-negative number"),
    ("[verify]\nseed = 1.5\n", "verify.seed", "1.5", "an integer"),
    ("[pipeline]\nprecision = 'fp16'\n", "pipeline.precision", "'fp16'", '"float32", "bf16", "auto"'),
    ("[pipeline]\nprecision = true\n", "pipeline.precision", "True", '"float32", "bf16", "auto"'),
    ("[verify]\nbf16_atol = -1\n", "verify.bf16_atol", "-1", "non-negative number"),
    ("[verify]\nbf16_min_cosine = 1.5\n", "verify.bf16_min_cosine", "1.5", "from 0 to 1"),
    ("[verify]\nbf16_min_top1 = 'all'\n", "verify.bf16_min_top1", "'all'", "from 0 to 1"),
    ("[runtime]\nthreads = -2\n", "runtime.threads", "-2", "positive integer"),
    ("[inputs]\nbatch = 0\n", "inputs.batch", "0", "positive integer size"),
    ("[inputs]\nsequence = '128'\n", "inputs.sequence", "'128'", "positive integer size"),
    ("[inputs]\nbatch = true\n", "inputs.batch", "True", "positive integer size"),
    ("target = 3\n", "target", "must be a table", "target, pipeline"),
]


@pytest.mark.parametrize("text,key,problem,allowed", BAD_CONFIGS,
                         ids=[case[1] + "-" + str(i) for i, case in enumerate(BAD_CONFIGS)])
def test_bad_config_names_file_key_and_allowed_values(tmp_path, text, key, problem, allowed):
    path = write(tmp_path, text)
    err = config_error(path)
    message = str(err)
    assert message.startswith(f"{path}: key '{key}'"), message
    assert problem in err.message, message
    assert allowed in err.hint, message
    assert message.count("\n") == 1  # one message line, one fix line


def test_default_patterns_are_every_registered_pattern_and_enable_disable_adjust_them(tmp_path):
    assert list(load_config(write(tmp_path, "[pipeline]\npatterns = 'default'\n")).patterns) == registered_patterns()
    assert list(load_config(write(tmp_path, "[target]\nkind = 'llvm'\n")).patterns) == registered_patterns()
    cfg = load_config(write(tmp_path, "[pipeline]\ndisable = ['softmax', 'attention']\n"))
    assert list(cfg.patterns) == [p for p in registered_patterns() if p not in ("softmax", "attention")]
    cfg = load_config(write(tmp_path, "[pipeline]\npatterns = ['gelu_erf']\nenable = ['softmax', 'silu']\n"))
    assert list(cfg.patterns) == ["gelu_erf", "silu", "softmax"]  # enabled ones in the registry's order


def test_bundled_configs_use_the_default_pattern_list():
    for path in sorted(DEFAULT_CONFIG.parent.glob("*.toml")):
        assert list(load_config(path).patterns) == registered_patterns(), path


def test_unknown_pattern_lists_every_registered_pattern(tmp_path):
    err = config_error(write(tmp_path, "[pipeline]\npatterns = ['gelu']\n"))
    for name in registered_patterns():
        assert name in err.hint


def test_parse_config_without_a_file_names_the_placeholder():
    with pytest.raises(ConfigError) as info:
        parse_config({"pipeline": {"schedule": "fast"}}, name="inline")
    assert str(info.value).startswith("<config>: key 'pipeline.schedule'")


def test_directory_is_not_a_config_file(tmp_path):
    err = config_error(tmp_path)
    assert str(tmp_path) in str(err) and "is a directory" in str(err)
