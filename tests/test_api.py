"""The Python API's argument handling (the CLI's flags are tested in test_cli.py)."""

import pytest

from tvm_fusion import api
from tvm_fusion.errors import ShapeError


@pytest.mark.parametrize("shapes", ["input:1x3x8x8", ["input:1x3x8x8"], {"input": [1, 3, 8, 8]}])
def test_input_shapes_as_one_flag_a_list_or_a_dict(shapes):
    assert api.parse_input_shapes(shapes) == {"input": (1, 3, 8, 8)}


def test_a_bad_shape_flag_names_itself():
    with pytest.raises(ShapeError, match="input:1xthree"):
        api.parse_input_shapes("input:1xthree")
