"""Shape buckets (tvm_fusion/dispatch/buckets.py): parsing, checks against the ranges, and the
dispatching ``main``. Compiles with buckets, verified against ONNX Runtime at each bucket,
are in test_dynamic_shapes.py."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

import helpers
from tvm_fusion.dispatch.buckets import bucket_points, parse_bucket, with_buckets
from tvm_fusion.config import parse_config
from tvm_fusion.errors import ConfigError, ShapeError
from tvm_fusion.frontend.dims import DimRange

SEQUENCE = {"sequence": DimRange("sequence", 1, 512)}
IMAGE = {"height": DimRange("height", 32, 640, 32), "width": DimRange("width", 32, 640, 32)}


def test_a_bucket_names_each_dim_with_its_size():
    assert parse_bucket("sequence=128", "--bucket") == (("sequence", 128),)
    assert parse_bucket(" height = 224, width=320", "--bucket") == (("height", 224), ("width", 320))


@pytest.mark.parametrize("text, problem", [
    ("128", "not NAME=SIZE"), ("sequence=", "not NAME=SIZE"), ("sequence=-4", "not NAME=SIZE"),
    ("height=224,height=320", "gives dim 'height' twice")])
def test_a_malformed_bucket_is_named(text, problem):
    with pytest.raises(ShapeError) as info:
        parse_bucket(text, "--bucket")
    assert problem in info.value.message and repr(text) in info.value.message


def test_buckets_inside_the_ranges_become_points():
    buckets = [parse_bucket(text, "--bucket") for text in ("height=224,width=224", "width=320,height=64")]
    assert bucket_points(buckets, IMAGE) == [{"height": 224, "width": 224}, {"width": 320, "height": 64}]


@pytest.mark.parametrize("texts, ranges, problem", [
    (["sequence=600"], SEQUENCE, "bucket sequence=600: sequence=600 is outside the range sequence 1..512"),
    (["height=100,width=64"], IMAGE, "outside the range height 32..640/32"),
    (["height=224"], IMAGE, "gives no size for 'width'"),
    (["batch=2,sequence=8"], SEQUENCE, "names dim 'batch', which is not a range"),
    (["sequence=8", "sequence=8"], SEQUENCE, "is given twice"),
    (["sequence=8"], {}, "no input dim is a range"),
])
def test_a_bucket_off_the_ranges_is_refused(texts, ranges, problem):
    with pytest.raises(ShapeError) as info:
        bucket_points([parse_bucket(text, "--bucket") for text in texts], ranges)
    assert problem in info.value.message


def test_config_buckets_are_parsed_and_checked():
    config = parse_config({"inputs": {"sequence": "1..512"},
                           "buckets": {"sizes": ["sequence=128", "sequence=384"]}}, "t")
    assert config.buckets == ((("sequence", 128),), (("sequence", 384),))
    for sizes, problem in (("sequence=128", "has value 'sequence=128'"), (["sequence:128"], "not NAME=SIZE")):
        with pytest.raises(ConfigError) as info:
            parse_config({"buckets": {"sizes": sizes}}, "t", path="bad.toml")
        assert "bad.toml" in info.value.message and problem in info.value.message


def test_cli_refuses_a_bucket_outside_the_range_before_building(tmp_path, capsys):
    from tvm_fusion.cli import main

    code = main(["-q", "compile", str(helpers.EXAMPLES / "bert_tiny.onnx"), "--input-shape", "input_ids:1x1..64",
                 "--bucket", "sequence=100", "-o", str(tmp_path)])
    assert code == ShapeError.exit_code
    err = capsys.readouterr().err
    assert err.startswith("tvm-fusion: error: bucket sequence=100: sequence=100 is outside the range sequence 1..64")
    assert "fix: give a size inside 1..64" in err
    assert list(tmp_path.iterdir()) == []


# A dynamic module doubling its input, and a static one for n = 8 that triples it (so a test
# can tell which one ran; real buckets compute the same thing).
@I.ir_module
class Dynamic:
    @T.prim_func(s_tir=True)
    def double(var_x: T.handle, var_y: T.handle):
        n = T.int64()
        x = T.match_buffer(var_x, (T.int64(1), n))
        y = T.match_buffer(var_y, (T.int64(1), n))
        for i in range(n):
            with T.sblock("y"):
                vi = T.axis.spatial(n, i)
                y[T.int64(0), vi] = x[T.int64(0), vi] * T.float32(2)

    @R.function
    def main(x: R.Tensor((1, "n"), "float32")) -> R.Tensor((1, "n"), "float32"):
        n = T.int64()
        cls = Dynamic
        y = R.call_tir(cls.double, (x,), out_ty=R.Tensor((1, n), "float32"))
        return y


@I.ir_module
class Static:
    @T.prim_func(s_tir=True)
    def double(x: T.Buffer((T.int64(1), T.int64(8)), "float32"), y: T.Buffer((T.int64(1), T.int64(8)), "float32")):
        for i in range(T.int64(8)):
            with T.sblock("y"):
                vi = T.axis.spatial(T.int64(8), i)
                y[T.int64(0), vi] = x[T.int64(0), vi] * T.float32(3)

    @R.function
    def main(x: R.Tensor((1, 8), "float32")) -> R.Tensor((1, 8), "float32"):
        cls = Static
        y = R.call_tir(cls.double, (x,), out_ty=R.Tensor((1, 8), "float32"))
        return y


def test_main_dispatches_on_the_exact_size_and_every_name_stays_distinct():
    merged = with_buckets(Dynamic, [({"n": 8}, Static)], {"n": DimRange("n", 1, 64)})
    names = sorted(gvar.name_hint for gvar, _ in merged.functions_items())
    assert names == ["double", "double_at_n8", "main", "main_at_n8", "main_dynamic"]
    assert merged["double_at_n8"].attrs["global_symbol"] == "double_at_n8"
    assert merged["main_dynamic"].attrs["global_symbol"] == "main_dynamic"
    relax.analysis.well_formed(merged)

    vm = relax.VirtualMachine(tvm.compile(merged, target="llvm"), tvm.cpu())
    for size, factor in ((8, 3), (7, 2), (9, 2)):
        x = np.arange(size, dtype="float32").reshape(1, size)
        np.testing.assert_allclose(vm["main"](tvm.runtime.tensor(x)).numpy(), x * factor)


def test_the_dispatching_main_is_an_if_on_the_size_with_match_casts():
    merged = with_buckets(Dynamic, [({"n": 8}, Static)], {"n": DimRange("n", 1, 64)})

    @R.function
    def expected(x: R.Tensor((1, "n"), "float32")) -> R.Tensor((1, "n"), "float32"):
        n = T.int64()
        if n == 8:
            x_1 = R.match_cast(x, R.Tensor((1, 8), "float32"))
            result = merged.get_global_var("main_at_n8")(x_1)
            chosen = result
        else:
            result_1 = merged.get_global_var("main_dynamic")(x)
            chosen = result_1
        out = R.match_cast(chosen, R.Tensor((1, n), "float32"))
        return out

    tvm.ir.assert_structural_equal(merged["main"].without_attr("global_symbol"), expected.without_attr("global_symbol"))
