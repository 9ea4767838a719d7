"""The ONNX backend node tests as a gradient test suite (tests/support/node_audit.py).

The default run audits a fixed sample (a few seconds): the tests that found wrong
gradients, each pinned to its verdict, and a spread of common ops. The whole set
(about 1900 tests, a minute or two) runs with ``pytest -m node_audit``, in CI in both
environments.
"""

from __future__ import annotations

import pytest

node_audit = pytest.importorskip("support.node_audit")
pytest.importorskip("onnxruntime")

from support.node_audit import (  # noqa: E402
    CRASH,
    NOT_DIFFERENTIABLE,
    PASS,
    SKIPPED,
    UNSUPPORTED,
    WRONG,
    Result,
    audit,
    listing,
    node_tests,
    table,
    verdicts_per_test,
)

#: (test, input) -> verdict, for the cases that found a wrong gradient or a crash.
PINNED = {
    # BatchNormalization's mean and var: were 0 (inference) and 0 (running statistics)
    ("test_batchnorm_example", "mean"): PASS,
    ("test_batchnorm_example", "var"): PASS,
    ("test_batchnorm_epsilon_training_mode", "mean"): PASS,
    ("test_batchnorm_epsilon_training_mode", "x"): PASS,
    # Pow at a zero base: was NaN
    ("test_pow", "x"): PASS,
    ("test_pow", "y"): PASS,
    # Clip with min > max: the gradient went to min
    ("test_clip_min_greater_than_max", "min"): PASS,
    ("test_clip_min_greater_than_max", "max"): PASS,
    # a fully masked attention row: was NaN
    ("test_attention_23_boolmask_fullymasked_row_nan_robustness_expanded", "Q"): PASS,
    ("test_attention_23_boolmask_fullymasked_row_nan_robustness_expanded", "K"): PASS,
    # an attention mask that broadcasts over a dim unknown until run time: wrong shape
    ("test_attention_local_window_ext_cache_rank2_mask_expanded", "attn_mask"): PASS,
    # Resize align_corners with a fractional size: onnxruntime and the spec disagree
    ("test_resize_downsample_scales_linear_align_corners", "X"): UNSUPPORTED,
    ("test_resize_downsample_scales_cubic_align_corners", "X"): UNSUPPORTED,
    # Resize scales carry no gradient: a named error (was a silent 0)
    ("test_resize_downsample_scales_linear", "scales"): NOT_DIFFERENTIABLE,
    # class weights and one-hot values: were a silent 0
    ("test_sce_mean_weight", "w"): PASS,
    ("test_onehot_with_axis", "values"): PASS,
    # Reshape of an empty tensor: an invalid gradient graph
    ("test_reshape_allowzero_reordered", "data"): PASS,
    # LayerNormalization's Mean and InvStdDev outputs: were unsupported
    ("test_layer_normalization_4d_axis1", "X"): PASS,
    # Dropout in training mode is random: no finite-difference reference
    ("test_training_dropout_mask", "x"): SKIPPED,
    # rules added for the model-coverage issue (were missing rules or unsupported)
    ("test_det_nd", "x"): PASS,
    ("test_compress_0", "input"): PASS,
    ("test_center_crop_pad_crop_and_pad", "x"): PASS,
    ("test_lppool_2d_pads", "x"): PASS,
    ("test_lrn", "x"): PASS,
    ("test_dequantizelinear_axis", "x_scale"): PASS,
    ("test_scatternd_max", "data"): PASS,
    ("test_scatternd_max", "updates"): PASS,
    ("test_scatter_elements_with_reduction_mul", "updates"): PASS,
    ("test_col2im_pads", "input"): PASS,
    ("test_gridsample_bicubic", "Grid"): PASS,
    ("test_gridsample_reflection_padding", "Grid"): PASS,
    # MaxUnpool with a larger output_shape: onnxruntime and the reference disagree
    ("test_maxunpool_export_with_output_shape", "xT"): UNSUPPORTED,
    # RoiAlign's regions are constants of the sampling, as in torchvision
    ("test_roialign_mode_max", "rois"): NOT_DIFFERENTIABLE,
    # function bodies and rules added for the model-coverage issue (were missing rules)
    ("test_dynamicquantizelinear", "x"): PASS,
    ("test_dft", "x"): PASS,
    ("test_dft_rfft", "x"): PASS,
    ("test_dft_inverse", "x"): PASS,
    ("test_affine_grid_2d", "theta"): PASS,
    ("test_ai_onnx_ml_array_feature_extractor", "x"): PASS,
    ("test_ai_onnx_ml_binarizer", "X"): PASS,
    ("test_optional_get_element_tensor", "optional_input"): PASS,
    # declared not differentiable, with the reason (lossgraph/autodiff/registry.py)
    ("test_unique_sorted_without_axis", "X"): NOT_DIFFERENTIABLE,
    ("test_ai_onnx_ml_tree_ensemble_single_tree", "X"): NOT_DIFFERENTIABLE,
    ("test_momentum", "X"): NOT_DIFFERENTIABLE,
    # Scan and Loop: were missing rules
    ("test_scan9_sum", "x"): PASS,
    ("test_scan9_multi_state", "initial_prod"): PASS,
    ("test_loop11", "y"): PASS,
}

#: more tests, for a spread of common ops
SPREAD = [
    "test_gemm_all_attributes", "test_conv_with_strides_padding", "test_einsum_batch_matmul",
    "test_if", "test_gather_0", "test_slice", "test_softmax_axis_1", "test_matmul_3d",
    "test_cumsum_1d_reverse", "test_where_example", "test_top_k", "test_constant_pad",
    "test_expand_dim_changed", "test_tile", "test_split_equal_parts_1d_opset18",
    "test_concat_2d_axis_0", "test_instancenorm_example", "test_mul_bcast", "test_sign",
    "test_group_normalization_example", "test_reduce_l2_keep_dims_example",
    "test_sce_none_expanded", "test_nllloss_NCd1d2_with_weight", "test_lpnormalization_default",
    "test_argmax_default_axis_example", "test_reversesequence_batch",
    "test_rms_normalization_2d_axis0_expanded", "test_shrink_soft", "test_hardmax_example",
    "test_mod_mixed_sign_float64",
]

MODULES = [
    "batch_normalization", "pow", "clip", "attention", "resize", "softmax_cross_entropy_loss",
    "onehot", "reshape", "layernormalization", "dropout", "gemm", "conv", "einsum", "if_",
    "gather", "slice", "softmax", "matmul", "cumsum", "where", "topk", "pad", "expand", "tile",
    "split", "concat", "instance_normalization", "mul", "sign", "groupnormalization",
    "reducel2", "negativeloglikelihoodloss", "lpnormalization", "argmax", "reversesequence",
    "rmsnormalization", "shrink", "hardmax", "mod",
    "det", "compress", "center_crop_pad", "lppool", "lrn", "dequantizelinear", "scatternd",
    "scatterelements", "col2im", "gridsample", "maxunpool", "roialign", "scan", "loop",
    "dynamicquantizelinear", "dft", "affinegrid", "ai_onnx_ml.array_feature_extractor",
    "ai_onnx_ml.binarizer", "optionalgetelement", "unique", "ai_onnx_ml.tree_ensemble",
    "momentum",
]


@pytest.fixture(scope="module")
def sample():
    names = {test for test, _ in PINNED} | set(SPREAD)
    cases = [c for c in node_tests(MODULES) if c.name in names]
    assert {c.name for c in cases} == names, "the installed onnx lacks a sampled node test"
    return audit(cases)


def test_the_sample_has_no_wrong_gradient_and_no_crash(sample):
    bad = [r for r in sample if r.category in (WRONG, CRASH)]
    assert not bad, listing(bad, WRONG) + "\n" + listing(bad, CRASH)


def test_every_gradient_found_wrong_once_keeps_its_verdict(sample):
    verdicts = {(r.test, r.input): r for r in sample}
    for key, expected in PINNED.items():
        result = verdicts[key]
        assert result.category == expected, (key, result.category, result.detail)


def test_the_sample_compares_most_inputs_with_finite_differences(sample):
    assert sum(r.category == PASS for r in sample) >= 40, table(sample)


@pytest.mark.node_audit
def test_the_whole_node_test_suite_has_no_wrong_gradient_and_no_crash(request):
    if "node_audit" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("the whole audit takes a minute or two: pytest -m node_audit")
    results = audit(node_tests())
    print(table(results))
    bad = [r for r in results if r.category in (WRONG, CRASH)]
    assert not bad, listing(bad, WRONG) + "\n" + listing(bad, CRASH)


def test_a_node_test_is_as_bad_as_its_worst_input_and_passes_beside_inputs_without_gradient():
    results = [Result("t_wrong", "x", PASS), Result("t_wrong", "w", WRONG),
               Result("t_pass", "x", PASS), Result("t_pass", "scales", NOT_DIFFERENTIABLE),
               Result("t_unsupported", "x", UNSUPPORTED), Result("t_unsupported", "w", PASS),
               Result("t_nd", "x", NOT_DIFFERENTIABLE), Result("t_skip", "x", SKIPPED)]
    assert verdicts_per_test(results) == {
        "t_wrong": WRONG, "t_pass": PASS, "t_unsupported": UNSUPPORTED,
        "t_nd": NOT_DIFFERENTIABLE, "t_skip": SKIPPED}
