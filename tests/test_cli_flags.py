"""One flag grammar across commands: the parser of every subcommand is walked and checked."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import pytest

from tvm_fusion import __version__, cli


def subcommands(parser: argparse.ArgumentParser, prefix: str = "") -> dict[str, argparse.ArgumentParser]:
    """Every (nested) subcommand's parser, by its command line (``tuning-log show``)."""
    found = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found[f"{prefix}{name}"] = sub
                found.update(subcommands(sub, f"{prefix}{name} "))
    return found


def options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {flag: action for action in parser._actions for flag in action.option_strings}


PARSERS = subcommands(cli.build_parser())
LEAVES = {name: p for name, p in PARSERS.items() if not any(other.startswith(f"{name} ") for other in PARSERS)}


def test_every_command_is_walked():
    assert {"compile", "run", "inspect", "bench", "profile", "ablate", "tune", "configs", "demo",
            "tuning-log show", "tuning-log merge"} <= set(LEAVES)


@pytest.mark.parametrize("name", sorted(LEAVES))
def test_shared_flags(name):
    flags = options(LEAVES[name])
    assert "-q" in flags and "--quiet" in flags, "-q must work after the command name too"
    assert "--wide" in flags, "--wide must work after the command name too"
    assert "--rounds" not in flags or flags["--rounds"].dest == "repeat", "--rounds is an alias of --repeat"
    if "--json" in flags:
        action = flags["--json"]
        assert action.nargs == "?" and action.const == "-" and action.metavar == "FILE"
    if "--repeat" in flags:
        assert flags["--repeat"].default >= 1
    for flag, action in flags.items():
        assert flag in ("-h", "--help") or action.help, f"{name} {flag} has no help"
    if "--config" in flags:
        assert "configs" in flags["--config"].help  # says where the names come from


def test_quiet_after_the_command(capsys, mlp_artifact):
    assert cli.main(["run", str(mlp_artifact)]) == 0
    assert "no --input given" in capsys.readouterr().err
    assert cli.main(["run", str(mlp_artifact), "-q"]) == 0
    assert capsys.readouterr().err == ""


def test_json_dash_prints_json_alone(capsys, mlp_path, config_path):
    code = cli.main(["inspect", str(mlp_path), "--config", str(config_path()), "--input-shape", "x:4x16", "-q",
                     "--json", "-"])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert report["model"] == "mlp" and report["report"]["fired"]


def test_version_names_every_component(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["--version"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert f"tvm_fusion {__version__}" in out
    for component in ("tvm 0.27", "onnx ", "onnxruntime ", "onnxslim "):
        assert component in out
    assert re.search(r"^target key \(x86_64-host here\) llvm-\S+-\d+c$", out, re.M), out


def test_help_shows_defaults_and_examples(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = capsys.readouterr().out
    assert "examples:" in out and "tvm-fusion demo" in out
    assert "(default: 30)" in " ".join(LEAVES["bench"].format_help().split())


# Output that fits a terminal ----------------------------------------------------------------------

LONG = "fused_relax_nn_conv2d_relax_add_relax_nn_relu_relax_nn_conv2d_relax_add_relax_nn_relu7"


def test_a_table_fits_its_width_cutting_long_names_in_the_middle():
    from tvm_fusion.report import table

    text = table(["kernel", "us"], [[LONG, 1.5], [LONG.replace("relu7", "relu8"), 2.0]], width=40)
    assert max(len(line) for line in text.splitlines()) <= 40
    names = [line.split()[0] for line in text.splitlines()[2:]]
    assert names[0].endswith("relu7") and names[1].endswith("relu8") and "~" in names[0]  # both ends kept
    assert LONG in table(["kernel", "us"], [[LONG, 1.5]], width=None)


def test_tables_fit_the_terminal_unless_wide_or_piped(monkeypatch):
    from tvm_fusion import report

    monkeypatch.setenv("COLUMNS", "50")
    monkeypatch.setattr(report.sys.stdout, "isatty", lambda: True)
    assert report.terminal_width() == 50
    assert max(len(line) for line in report.table(["kernel"], [[LONG * 2]]).splitlines()) <= 50
    monkeypatch.setattr(report, "_wide", True)
    assert report.terminal_width() is None
    monkeypatch.setattr(report, "_wide", False)
    monkeypatch.setattr(report.sys.stdout, "isatty", lambda: False)
    assert report.terminal_width() is None  # piped: every character kept


def test_wide_after_the_command(mlp_artifact, monkeypatch):
    """--wide holds for the command's tables, and only for that command."""
    from tvm_fusion import report

    seen = []
    monkeypatch.setattr(report.sys.stdout, "isatty", lambda: True)
    monkeypatch.setattr(cli.cli_output, "print_run", lambda *_a: seen.append(report.terminal_width()))
    assert cli.main(["-q", "run", str(mlp_artifact), "--wide"]) == 0
    assert cli.main(["-q", "run", str(mlp_artifact)]) == 0
    assert seen[0] is None and seen[1] is not None and not report._wide


def test_errors_name_the_python_parameter_outside_the_cli(capsys):
    from tvm_fusion import api
    from tvm_fusion.errors import ShapeError

    resnet = Path(__file__).resolve().parents[1] / "examples" / "models" / "resnet_tiny.onnx"
    with pytest.raises(ShapeError) as info:
        api.inspect_model(resnet)  # height and width are unbound
    assert "from Python: --input-shape -> input_shapes" in str(info.value)
    assert cli.main(["-q", "inspect", str(resnet)]) == ShapeError.exit_code
    err = capsys.readouterr().err
    assert "--input-shape" in err and "from Python" not in err  # a CLI user gets the flags alone
