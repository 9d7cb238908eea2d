"""TVM's native log lines: captured from fd 2, noise dropped, repeats counted once."""

import os
import sys

from tvm_fusion.native_log import captured_native_stderr, summarize


def test_summarize_strips_prefixes_drops_noise_and_counts():
    lines = [
        "[15:42:03] /project/src/runtime/vm/executable.cc:276: Warning: Scope Saving:",
        "[15:42:03] /project/src/runtime/vm/executable.cc:340: Warning: Scope Loaded:",
        "[15:39:11] /project/src/target/llvm/codegen_llvm.cc:12: Warning: an unknown warning",
        "[15:39:12] /project/src/target/llvm/codegen_llvm.cc:12: Warning: an unknown warning",
        "",
    ]
    assert summarize(lines) == ["an unknown warning (x2)"]


def test_messages_a_user_cannot_act_on_are_dropped():
    lines = [
        "[15:39:11] /project/include/tvm/topi/transform.h:1261: Warning: Fast mode segfaults when there are "
        "out-of-bounds indices. Make sure input indices are in bound",
        "[15:39:11] /project/src/arith/x.cc:1: Warning: Detected pow(x, y) where y >= 3, it is recommended to avoid",
        "[15:39:11] /project/src/relax/ir/block_builder.cc:65: Warning: BlockBuilder destroyed with remaining blocks!",
    ]
    assert summarize(lines) == []


def test_fd2_writes_are_captured_and_python_stderr_is_not(capfd):
    lines = []
    with captured_native_stderr(lines):
        os.write(2, b"native line\n")
        print("progress line", file=sys.stderr)
    assert lines == ["native line"]
    assert "progress line" in capfd.readouterr().err


def test_lines_are_kept_when_the_block_raises():
    lines = []
    try:
        with captured_native_stderr(lines):
            os.write(2, b"before the error\n")
            raise RuntimeError("boom")
    except RuntimeError:
        pass
    assert lines == ["before the error"]
