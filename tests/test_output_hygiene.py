"""A compile of the bundled examples prints only tvm_fusion's own lines: none of TVM's raw
warnings (C++ log lines, Python UserWarnings), which say nothing a user can act on."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

import helpers

# What TVM's own output looks like: its C++ logger's "[hh:mm:ss] file.cc:123:" prefix, a
# passed-through "tvm: " message, a Python warning, a traceback.
RAW = re.compile(r"^\[\d\d:\d\d:\d\d\]|\.cc:\d+|^(\[ *[\d.]+s\] )?tvm: |Warning|warnings\.warn|Traceback")
PROGRESS = re.compile(r"^\[ *[\d.]+s\] \S")


@pytest.mark.parametrize("model, shapes", [
    ("bert_tiny", []),                                   # Gather of token ids, attention
    ("gpt2_tiny", []),                                   # tanh-GELU's pow(x, 3), input names TVM renames
    ("dbnet_tiny", ["--input-shape", "input:1x3x64x64"]),  # convs, resize
])
def test_compile_prints_only_our_lines(tmp_path, model, shapes):
    proc = subprocess.run([sys.executable, "-m", "tvm_fusion.cli", "compile", str(helpers.EXAMPLES / f"{model}.onnx"),
                           *shapes, "-o", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    raw = [line for line in (proc.stdout + proc.stderr).splitlines() if RAW.search(line)]
    assert raw == []
    progress = proc.stderr.splitlines()
    assert progress and all(PROGRESS.match(line) for line in progress), progress
    assert any("running the tvm_fusion pipeline" in line for line in progress)
    assert all(len(line) < 200 for line in progress)  # no pattern list of every registered name
