"""The plain stack walk gives the TVMScript parser what inspect.stack gives it, and the tensor
intrinsics import through it (TVM's own import of them takes about a minute here)."""

import inspect
import subprocess
import sys

from tvm_fusion.tuning.intrinsics import _frames_with_lines

IMPORT = """
import inspect
from tvm.s_tir._tensor_intrin import TensorIntrin
names, register = [], TensorIntrin.register
TensorIntrin.register = staticmethod(lambda name, *args, **kw: names.append(name) or register(name, *args, **kw))
from tvm_fusion.tuning.intrinsics import import_tensor_intrinsics
import_tensor_intrinsics()
assert inspect.stack.__module__ == "inspect", "inspect.stack was not put back"
assert TensorIntrin.get("dot_4x4_i8i8s32_sdot") is not None
print(len(names))
"""


def test_the_walk_gives_the_frames_names_and_source_lines_inspect_stack_gives():
    def inner():
        return inspect.stack(), _frames_with_lines()

    stock, plain = inner()
    assert len(stock) == len(plain)
    for want, got in zip(stock, plain):
        assert got.frame is want.frame and got.function == want.function and got.lineno == want.lineno
        assert got.code_context == want.code_context


def test_tensor_intrinsics_import_through_it_and_inspect_is_restored():
    run = subprocess.run([sys.executable, "-c", IMPORT], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert int(run.stdout.strip().splitlines()[-1]) > 100
