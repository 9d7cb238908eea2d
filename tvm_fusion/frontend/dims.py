"""Input dims that take a range of sizes (``sequence = "1..512"``): parsing and concrete sizes.

A dim given as a range is compiled symbolically: one artifact serves every size in it. The
artifact is verified at the range's low end, a typical size and its high end, because a kernel
whose tail handling is wrong shows it only at some sizes.

A range may have a step (``32..640/32``: the multiples of 32): detectors with an FPN add a
map upsampled 2x to one of half its stride, which agree in size only when the image side is
a multiple of the deepest stride. The dim is then compiled as ``32 * height_div32``, so the
compiler can prove those sizes equal.
"""

from __future__ import annotations

import dataclasses
import math
import re

from ..errors import ShapeError

_RANGE = re.compile(r"(\d+)\.\.(\d+)(?:/(\d+))?")
Range = tuple[int, int, int]  # (low, high, step) as parsed, before the dim has a name


@dataclasses.dataclass(frozen=True)
class DimRange:
    """One symbolic dim: its name (the model's ``dim_param`` or ``<input>_dim<axis>``) and the
    inclusive range of sizes it accepts."""

    name: str
    low: int
    high: int
    step: int = 1

    def __str__(self) -> str:
        return f"{self.low}..{self.high}" + (f"/{self.step}" if self.step > 1 else "")

    @property
    def typical(self) -> int:
        """The geometric middle of the range (1..512 -> 23), on the step: a size between both
        ends' regimes."""
        middle = round(math.sqrt(self.low * self.high) / self.step) * self.step
        return max(self.low, min(self.high, middle))

    @property
    def var_name(self) -> str:
        """The symbolic var it compiles to: the dim itself, or for a step the count of steps."""
        return self.name if self.step == 1 else f"{self.name}_div{self.step}"

    def to_json(self) -> dict:
        return {"name": self.name, "min": self.low, "max": self.high, "step": self.step}


def parse_range(text: str, where: str) -> Range:
    """``"1..512"`` -> (1, 512, 1), ``"32..640/32"`` -> (32, 640, 32); an empty, inverted or zero
    range, or ends off the step, is a ShapeError naming ``where``."""
    match = _RANGE.fullmatch(text.strip())
    if not match:
        raise ShapeError(f"{where} has range {text!r}, which is not LOW..HIGH",
                         "write a range as two sizes, e.g. 1..512 (or 32..640/32 for the multiples of 32)")
    low, high, step = int(match.group(1)), int(match.group(2)), int(match.group(3) or 1)
    if low < 1 or step < 1:
        raise ShapeError(f"{where} has range {text!r}, which starts at 0" if low < 1 else
                         f"{where} has range {text!r}, whose step is 0", "every size and step must be at least 1")
    if low > high:
        raise ShapeError(f"{where} has range {text!r}, which is inverted (empty)",
                         f"write the smaller size first: {high}..{low}")
    if low % step or high % step:
        raise ShapeError(f"{where} has range {text!r}, whose ends are not multiples of its step {step}",
                         f"write ends on the step, e.g. {max(step, low // step * step)}..{high // step * step}/{step}")
    return low, high, step


def parse_dim(text: str, where: str) -> int | Range:
    """One dim of ``--input-shape``: a size, or a ``LOW..HIGH[/STEP]`` range."""
    if ".." in text:
        return parse_range(text, where)
    return int(text)


def is_dynamic(shape) -> bool:
    return any(isinstance(dim, DimRange) for dim in shape)


def var_sizes(ranges: dict[str, DimRange], sizes: dict[str, int]) -> dict[str, int]:
    """Dim sizes of one run -> the sizes of the symbolic vars they compile to."""
    return {r.var_name: sizes[name] // r.step for name, r in ranges.items() if name in sizes}


def ranges_of(specs) -> dict[str, DimRange]:
    """Every distinct symbolic dim of the inputs, by name, in input order."""
    found: dict[str, DimRange] = {}
    for spec in specs:
        for dim in spec.shape:
            if isinstance(dim, DimRange):
                found.setdefault(dim.name, dim)
    return found


def concrete_shape(shape, sizes: dict[str, int]) -> tuple[int, ...]:
    """``shape`` with each range replaced by its size in ``sizes`` (the name -> size of one run)."""
    return tuple(sizes[dim.name] if isinstance(dim, DimRange) else dim for dim in shape)


def size_points(ranges: dict[str, DimRange]) -> list[dict[str, int]]:
    """The sizes to verify at: every range at its low end, then typical, then high end (ranges
    move together, which is how a model's dims are used: longer sequences, larger images)."""
    if not ranges:
        return [{}]
    points = []
    for pick in ("low", "typical", "high"):
        point = {name: getattr(r, pick) for name, r in ranges.items()}
        if point not in points:
            points.append(point)
    return points


def evaluate_dim(dim, sizes: dict[str, int]) -> int:
    """A Relax shape dim (an int, or a PrimExpr over symbolic vars such as ``sequence * 4``) at
    the sizes of one run, by var name."""
    if isinstance(dim, int):
        return dim
    if hasattr(dim, "value"):
        return int(dim.value)
    # deferred: keeps TVM out of --help (the CLI imports this module at start-up, through
    # buckets and runtime; TVM takes seconds to import)
    from tvm.s_tir.dlight.analysis import collect_vars_used_in_prim_expr
    from tvm.sym.analyzer import Analyzer  # deferred: the same

    analyzer = Analyzer()
    for var in collect_vars_used_in_prim_expr(dim):
        analyzer.bind(var, sizes[var.name])
    return int(analyzer.simplify(dim))
