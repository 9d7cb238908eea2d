"""TVM's C++ side logs straight to file descriptor 2; collect it, drop noise, dedupe the rest.

Loading one exported library prints a "Scope Loaded" warning per function, and compiling a
transformer repeats the same few warnings dozens of times. Users should see each real warning
once, through our progress output, and no noise.
"""

from __future__ import annotations

import collections
import contextlib
import os
import re
import sys
import tempfile

# TVM's messages that tell a tvm_fusion user nothing to act on, each with why it is dropped.
NOISE = (
    "Scope Loaded", "Scope Saving",  # one per function, on every library load and save
    # Gather/take compiled without bounds checks. tvm_fusion.load checks every index input
    # against its table (metadata's index_range) before a run, and indices computed inside the
    # model ran against ONNX Runtime at compile time.
    "Fast mode segfaults when there are out-of-bounds indices",
    # pow(x, 3) (tanh-GELU's cube) may be wrong for negative x in some lowerings: compile
    # verifies the outputs against ONNX Runtime, which is the check that matters.
    "Detected pow(x, y) where y >= 3",
    # An importer error unwinding a half-built function; our error names what failed.
    "BlockBuilder destroyed with remaining blocks",
)
PREFIX = re.compile(r"^\[\d\d:\d\d:\d\d\] \S+:\d+: (Warning: )?")


@contextlib.contextmanager
def captured_native_stderr(lines: list[str]):
    """Redirect fd 2 into ``lines`` (appended on exit, also when the block raises).

    Python's own ``sys.stderr`` (progress messages) keeps writing to the real stderr.
    """
    python_stderr = sys.stderr
    python_stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 2)
        if _writes_to_fd2(python_stderr):
            sys.stderr = os.fdopen(os.dup(saved), "w", buffering=1)
        try:
            yield lines
        finally:
            if sys.stderr is not python_stderr:
                sys.stderr.close()
                sys.stderr = python_stderr
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            lines.extend(sink.read().decode(errors="replace").splitlines())


def _writes_to_fd2(stream) -> bool:
    try:
        return stream.fileno() == 2
    except (AttributeError, OSError, ValueError):
        return False


def summarize(lines: list[str]) -> list[str]:
    """Each distinct message once, with its count, without timestamps, source paths or noise."""
    counts = collections.Counter()
    for line in lines:
        message = PREFIX.sub("", line).strip()
        if message and not any(noise in message for noise in NOISE):
            counts[message] += 1
    return [f"{message} (x{count})" if count > 1 else message for message, count in counts.items()]
