"""TVM's tensor intrinsics, imported once per tuning process without TVMScript's slow stack walk.

MetaSchedule's TuneContext imports ``tvm.s_tir.tensor_intrin``: some 250 TVMScript functions,
each parsed after an ``inspect.stack()``, which finds the module of every frame on the stack and,
for the frames of the import machinery (no file on disk), scans all of ``sys.modules`` to do so.
That import took 48 s of a 2-core Zen 3 per tuning process. The parser reads only each frame, its
function name and its source line, so during that one import ``inspect.stack`` is replaced by a
walk that gives exactly those (source lines from ``linecache``) and then put back.
"""

from __future__ import annotations

import contextlib
import inspect
import linecache
import sys


def import_tensor_intrinsics() -> None:
    """Import ``tvm.s_tir.tensor_intrin`` (a no-op once imported)."""
    if "tvm.s_tir.tensor_intrin" in sys.modules:
        return
    with _plain_stack():
        import tvm.s_tir.tensor_intrin  # noqa: F401  deferred: registers the intrinsics, under _plain_stack


@contextlib.contextmanager
def _plain_stack():
    original = inspect.stack
    inspect.stack = _frames_with_lines
    try:
        yield
    finally:
        inspect.stack = original


def _frames_with_lines(context: int = 1) -> list[inspect.FrameInfo]:
    """``inspect.stack(context)`` for ``context`` <= 1, without the per-frame module lookup."""
    frames, frame = [], sys._getframe(1)
    while frame is not None:
        filename, lineno = frame.f_code.co_filename, frame.f_lineno
        line = linecache.getline(filename, lineno) if context > 0 else ""
        frames.append(inspect.FrameInfo(frame, filename, lineno, frame.f_code.co_name,
                                        [line] if line else None, 0 if line else None))
        frame = frame.f_back
    return frames
