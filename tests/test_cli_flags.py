"""One flag grammar across commands: the parser of every subcommand is walked and checked."""

from __future__ import annotations

import argparse
import json
import re

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
