"""ONNX's own node tests as a peer suite: tvm_fusion must pass every case stock TVM passes.

A fixed, representative subset (the ops CNN and transformer graphs are made of, plus
shape-heavy and broadcasting edge cases, and the non-float32 input types stock TVM takes) runs here in process; the whole suite runs with
``scripts/onnx_node_conformance.py`` (worker processes, crash and timeout isolation).
"""

import importlib.util

import pytest

from helpers import REPO_ROOT

CASES = [
    # convolution family: strides, padding, auto_pad, dilation, groups, transpose
    "test_basic_conv_with_padding", "test_basic_conv_without_padding", "test_conv_with_strides_padding",
    "test_conv_with_strides_no_padding", "test_conv_with_autopad_same", "test_conv_with_strides_and_asymmetric_padding",
    "test_conv_with_strides_padding", "test_convtranspose", "test_convtranspose_pads", "test_convtranspose_dilations",
    # normalization and activations
    "test_batchnorm_example", "test_batchnorm_epsilon", "test_instancenorm_example", "test_layer_normalization_4d_axis1",
    "test_relu", "test_leakyrelu", "test_leakyrelu_default", "test_hardswish", "test_hardsigmoid",
    "test_hardsigmoid_default", "test_sigmoid", "test_clip", "test_clip_default_min", "test_clip_splitbounds",
    "test_elu", "test_selu", "test_softplus", "test_prelu_broadcast", "test_gelu_default_1", "test_gelu_tanh_1",
    "test_softmax_axis_1", "test_logsoftmax_axis_0",
    # pooling and resize
    "test_maxpool_2d_default", "test_maxpool_2d_pads", "test_maxpool_2d_strides", "test_maxpool_2d_dilations",
    "test_maxpool_2d_ceil", "test_averagepool_2d_default", "test_averagepool_2d_pads_count_include_pad",
    "test_averagepool_1d_default", "test_averagepool_3d_default", "test_globalaveragepool",
    "test_globalmaxpool", "test_lppool_2d_default", "test_resize_upsample_scales_nearest",
    "test_resize_upsample_scales_linear", "test_resize_downsample_scales_linear", "test_upsample_nearest",
    # dense algebra and reductions
    "test_gemm_default_single_elem_vector_bias", "test_gemm_alpha", "test_gemm_transposeB", "test_matmul_2d",
    "test_matmul_4d", "test_reduce_mean_default_axes_keepdims_example", "test_reduce_sum_keepdims_example",
    "test_reduce_max_do_not_keepdims_example",
    # elementwise, broadcasting and data movement
    "test_add_bcast", "test_mul_bcast", "test_div_bcast", "test_sub_bcast", "test_pow_bcast_array", "test_where_example",
    "test_concat_2d_axis_1", "test_transpose_all_permutations_0", "test_reshape_negative_dim", "test_flatten_axis1",
    "test_slice", "test_gather_0", "test_expand_dim_changed", "test_tile", "test_constant_pad", "test_edge_pad",
    "test_depthtospace_example",
    # input types stock TVM imports: bfloat16 tensors and optional tensors
    "test_compress_bfloat16", "test_einsum_batch_matmul_bfloat16", "test_einsum_sum_bfloat16",
    "test_einsum_transpose_bfloat16", "test_unique_bfloat16_sorted_without_axis",
    "test_optional_get_element_optional_tensor", "test_optional_has_element_optional_input",
    "test_optional_has_element_tensor_input",
]


def _conformance_module():
    spec = importlib.util.spec_from_file_location("onnx_node_conformance",
                                                  REPO_ROOT / "scripts" / "onnx_node_conformance.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def conformance():
    return _conformance_module()


@pytest.fixture(scope="module")
def cases(conformance):
    found = conformance.node_cases("^(" + "|".join(CASES) + ")$")
    missing = sorted(set(CASES) - set(found))
    assert not missing, f"node test cases missing from the onnx package: {missing}"
    return found


@pytest.mark.parametrize("name", sorted(set(CASES)))
def test_tvm_fusion_passes_what_stock_tvm_passes(conformance, cases, name):
    results = {pipeline: conformance.run_unit(cases[name], pipeline) for pipeline in conformance.PIPELINES}
    assert not conformance.regressed(results), (
        f"{name}: stock TVM passes, tvm_fusion gives {results['tvm_fusion']}")


def test_the_cnn_ops_actually_pass_through_tvm_fusion(conformance, cases):
    """The no-regression check must not be vacuous: the CNN ops pass outright."""
    for name in ("test_basic_conv_with_padding", "test_conv_with_strides_padding", "test_maxpool_2d_pads",
                 "test_batchnorm_example", "test_hardswish", "test_globalaveragepool"):
        assert conformance.run_unit(cases[name], "tvm_fusion")["status"] == conformance.PASSED, name
