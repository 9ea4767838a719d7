"""Gradient rules of Softmax, LogSoftmax and the NLL/cross-entropy losses
(lossgraph/autodiff/rules/softmax.py)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx.reference import ReferenceEvaluator
from support.gradcheck import check_gradients, cotangent, loss_model
from support.models import parse_model

from lossgraph import gradient


# ------------------------------------------------------------- Softmax family
@pytest.mark.parametrize("op", ["Softmax", "LogSoftmax"])
@pytest.mark.parametrize("axis, opset", [(None, 13), (0, 13), (1, 18), (-2, 18), (-1, 13)])
def test_softmax_family_matches_finite_differences_along_each_axis(rng, op, axis, opset):
    attrs = "" if axis is None else f"<axis: int = {axis}>"
    model = f"""
        <ir_version: 8, opset_import: ["" : {opset}]>
        g (double[2, 3, 4] x) => (double[2, 3, 4] y) {{ y = {op}{attrs}(x) }}
    """
    check_gradients(model, {"x": rng.normal(size=(2, 3, 4))}, ort=True)


def test_softmax_of_a_fully_masked_row_has_zero_gradient_not_nan(rng):
    """ONNX attention: a row of -inf gives NaN probabilities, which a Where replaces by 0.
    The forward is finite, and so is the gradient: 0 for the masked row."""
    mask = np.array([[0.0, 0.0, -np.inf, 0.0], [-np.inf] * 4, [0.0, -np.inf, 0.0, 0.0]])
    model = f"""
        <ir_version: 8, opset_import: ["" : 13]>
        g (double[3, 4] x) => (double[3, 4] y)
        <double[3, 4] mask = {{{", ".join(map(str, mask.ravel()))}}}, double zero = {{0}}>
        {{
            s = Add(x, mask)
            p = Softmax(s)
            row_max = ReduceMax <axes = [1]> (mask)
            ninf = Constant <value = double {{-inf}}> ()
            masked = Equal(row_max, ninf)
            y = Where(masked, zero, p)
        }}
    """
    grads = check_gradients(model, {"x": rng.normal(size=(3, 4))}, ort=False)
    assert np.all(np.isfinite(grads["x"]))
    np.testing.assert_array_equal(grads["x"][1], np.zeros(4))


def test_softmax_rule_cleans_nan_only_where_a_where_selects_from_it():
    """The NaN cleaning costs a Where (slow in onnxruntime 1.19): plain softmaxes skip it."""
    plain = """
        <ir_version: 8, opset_import: ["" : 13]>
        g (double[3, 4] x) => (double[3, 4] y) { y = Softmax(x) }
    """
    ops = {n.op_type for n in gradient(loss_model(plain, {"x": np.ones((3, 4))}), weights=["x"],
                                       loss_name="gradcheck_loss").graph.node}
    assert not {"Where", "IsNaN"} & ops
    masked = plain.replace("y = Softmax(x)", "p = Softmax(x)\n c = Cast <to = 11> (p)\n"
                           " m = Greater(x, x)\n y = Where(m, x, c)")
    ops = {n.op_type for n in gradient(loss_model(masked, {"x": np.ones((3, 4))}), weights=["x"],
                                       loss_name="gradcheck_loss").graph.node}
    assert "IsNaN" in ops


@pytest.mark.torch
def test_log_softmax_matches_torch_autograd(rng):
    import torch

    x = rng.normal(size=(3, 5))
    xt = torch.tensor(x, requires_grad=True)
    torch.log_softmax(xt, dim=0).backward(torch.tensor(cotangent((3, 5), np.float64)))
    model = """
        <ir_version: 8, opset_import: ["" : 13]>
        g (double[3, 5] x) => (double[3, 5] y) { y = LogSoftmax<axis: int = 0>(x) }
    """
    check_gradients(model, {"x": x}, reference={"x": xt.grad.numpy()})


def _pick_model(rows: str, picked: str) -> str:
    """x -> LogSoftmax over the classes -> GatherElements of one class a row, as a cross
    entropy picks each row's label; ``rows``/``picked``: the rows of x and of the index."""
    return f"""
        <ir_version: 8, opset_import: ["" : 17]>
        g (double[{rows}, 5] x, int64[{picked}, 1] i) => (double[{picked}, 1] y) {{
            lp = LogSoftmax <axis: int = 2> (x)
            y = GatherElements <axis: int = 2> (lp, i)
        }}
    """


@pytest.mark.parametrize("rows, picked", [("2, 3", "2, 3"), ("N, 3", "N, L")])
def test_a_cross_entropy_pick_is_added_into_the_log_softmax_gradient(rng, rows, picked):
    """LogSoftmax read by a GatherElements of one class a row: its gradient adds the picked
    values into -exp(y) * rows, with no zeros or one-hot of the scores' size (98 MiB each for
    GPT-2's logits at 4 x 128 tokens), where shape inference proves the picked rows cover
    the scores' or not."""
    inputs = {"x": rng.normal(size=(2, 3, 5)), "i": rng.integers(0, 5, size=(2, 3, 1))}
    graph = gradient(loss_model(_pick_model(rows, picked), inputs), weights=["x"],
                     loss_name="gradcheck_loss")
    ops = [n.op_type for n in graph.graph.node]
    assert "Sub" not in ops
    filled = [n.output[0] for n in graph.graph.node if n.op_type == "ConstantOfShape"]
    feeds = {i.name: inputs.get(i.name, np.ones(1)) for i in graph.graph.input}
    made = ReferenceEvaluator(graph).run(filled, feeds) if filled else []
    assert all(array.size < inputs["x"].size for array in made)  # at most a class a row
    check_gradients(_pick_model(rows, picked), inputs, wrt=["x"], ort=True)


def test_a_pick_of_fewer_rows_than_the_scores_has_their_gradient(rng):
    """Rows past the picked ones get -exp(y) * 0: the gradient of rows no pick reads."""
    inputs = {"x": rng.normal(size=(2, 3, 5)), "i": rng.integers(0, 5, size=(2, 2, 1))}
    gradients = check_gradients(_pick_model("N, 3", "N, L"), inputs, wrt=["x"], ort=True)
    assert not gradients["x"][:, 2].any()


# ------------------------------------------------------------------------ losses
def _labels(rng, shape, classes, ignore=None):
    labels = rng.integers(0, classes, size=shape).astype(np.int64)
    if ignore is not None:
        labels.reshape(-1)[::3] = ignore
    return labels


def _loss_model(op: str, reduction: str, spatial: tuple[int, ...], ignore, weighted: bool,
                log_prob: bool = False) -> onnx.ModelProto:
    classes = 4
    scores = ", ".join(map(str, (3, classes, *spatial)))
    labels = ", ".join(map(str, (3, *spatial)))
    out = "double[]" if reduction != "none" else f"double[{labels}]"
    attrs = [f'reduction: string = "{reduction}"']
    if ignore is not None:
        attrs.append(f"ignore_index: int = {ignore}")
    weight_in = f", double[{classes}] w" if weighted else ""
    args = "s, t, w" if weighted else "s, t"
    outs = "loss, lp" if log_prob else "loss"
    out_types = f", double[{scores}] lp" if log_prob else ""
    return parse_model(f"""
        <ir_version: 8, opset_import: ["" : 13]>
        g (double[{scores}] s, int64[{labels}] t{weight_in}) => ({out} loss{out_types}) {{
            {outs} = {op}<{", ".join(attrs)}>({args})
        }}
    """)


LOSS_CASES = [
    # (reduction, spatial dims, ignore_index, weighted)
    ("mean", (), None, False),
    ("sum", (), None, False),
    ("none", (), None, False),
    ("mean", (2,), None, True),
    ("sum", (2, 2), 1, True),
    ("none", (2,), -100, True),
    ("mean", (), 2, False),
    ("mean", (2,), -1, True),
]


@pytest.mark.parametrize("op", ["SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss"])
@pytest.mark.parametrize("reduction, spatial, ignore, weighted", LOSS_CASES)
def test_loss_gradient_wrt_scores_matches_finite_differences(rng, op, reduction, spatial,
                                                            ignore, weighted):
    inputs = {"s": rng.normal(size=(3, 4, *spatial)),
              "t": _labels(rng, (3, *spatial), 4, ignore)}
    if weighted:
        inputs["w"] = rng.uniform(0.5, 2.0, size=4)
    check_gradients(_loss_model(op, reduction, spatial, ignore, weighted), inputs, wrt=["s"])


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_cross_entropy_gradient_through_both_loss_and_log_prob_outputs(rng, reduction):
    model = _loss_model("SoftmaxCrossEntropyLoss", reduction, (2,), None, False, log_prob=True)
    # Differentiate loss + sum(lp * R2) so both outputs carry a gradient.
    inputs = {"s": rng.normal(size=(3, 4, 2)), "t": _labels(rng, (3, 2), 4)}
    helper = onnx.helper
    r2 = helper.make_tensor("r2", onnx.TensorProto.DOUBLE, [3, 4, 2],
                            rng.normal(size=24).tolist())
    model.graph.initializer.append(r2)
    model.graph.node.extend([
        helper.make_node("Mul", ["lp", "r2"], ["lp_r"]),
        helper.make_node("ReduceSum", ["lp_r"], ["lp_sum"], keepdims=0),
        helper.make_node("ReduceSum", ["loss"], ["loss_sum"], keepdims=0),
        helper.make_node("Add", ["loss_sum", "lp_sum"], ["total"]),
    ])
    del model.graph.output[:]
    model.graph.output.append(helper.make_tensor_value_info("total", onnx.TensorProto.DOUBLE, []))
    # onnxruntime-training drops the log_prob output's gradient: no comparison with it
    check_gradients(model, inputs, wrt=["s"], ort=False)


@pytest.mark.torch
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_matches_torch_autograd_with_weights_and_ignore_index(rng, reduction):
    import torch

    inputs = {"s": rng.normal(size=(3, 4, 2)), "t": _labels(rng, (3, 2), 4, ignore=1),
              "w": rng.uniform(0.5, 2.0, size=4)}
    st = torch.tensor(inputs["s"], requires_grad=True)
    out = torch.nn.functional.cross_entropy(st, torch.tensor(inputs["t"]),
                                            weight=torch.tensor(inputs["w"]), ignore_index=1,
                                            reduction=reduction)
    out.backward(torch.tensor(cotangent(tuple(out.shape), np.float64)))
    check_gradients(_loss_model("SoftmaxCrossEntropyLoss", reduction, (2,), 1, True), inputs,
                    wrt=["s"], reference={"s": st.grad.numpy()})


def test_loss_class_weights_are_differentiable_but_never_trained():
    from lossgraph.autodiff.registry import differentiable_inputs

    for op in ("SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss"):
        assert differentiable_inputs(op, "", 3) == [0, 2]
        assert differentiable_inputs(op, "", 3, trainable=True) == [0]


@pytest.mark.parametrize("op", ["SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss"])
@pytest.mark.parametrize("reduction, spatial, ignore, weighted",
                         [c for c in LOSS_CASES if c[3]])
def test_loss_gradient_wrt_class_weights_matches_finite_differences(rng, op, reduction,
                                                                   spatial, ignore, weighted):
    inputs = {"s": rng.normal(size=(3, 4, *spatial)),
              "t": _labels(rng, (3, *spatial), 4, ignore), "w": rng.uniform(0.5, 2.0, size=4)}
    grads = check_gradients(_loss_model(op, reduction, spatial, ignore, weighted), inputs,
                            wrt=["s", "w"])
    if op == "NegativeLogLikelihoodLoss" and reduction == "sum":  # -sum over t_i = c of s
        r = float(cotangent((), np.float64))
        kept = inputs["t"] != ignore
        picked = np.take_along_axis(inputs["s"], inputs["t"].clip(0, 3)[:, None], 1)[:, 0]
        expected = [-r * picked[kept & (inputs["t"] == c)].sum() for c in range(4)]
        np.testing.assert_allclose(grads["w"], expected, rtol=1e-9)


@pytest.mark.parametrize("op", ["SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss"])
def test_loss_gradient_with_symbolic_class_count(rng, op):
    model = parse_model(f"""
        <ir_version: 8, opset_import: ["" : 13]>
        g (double[N, C] s, int64[N] t, double[C] w) => (double[] loss) {{
            loss = {op}<ignore_index: int = 0>(s, t, w)
        }}
    """)
    inputs = {"s": rng.normal(size=(5, 3)), "t": np.array([0, 1, 2, 2, 1]),
              "w": rng.uniform(0.5, 2.0, size=3)}
    check_gradients(model, inputs, wrt=["s"])


@pytest.mark.parametrize("reduction, spatial, ignore, weighted", LOSS_CASES)
def test_cross_entropy_with_log_prob_output_matches_onnxruntime_training(rng, reduction, spatial,
                                                                         ignore, weighted):
    # GradientGraphBuilder handles SoftmaxCrossEntropyLoss only when log_prob is an output
    inputs = {"s": rng.normal(size=(3, 4, *spatial)),
              "t": _labels(rng, (3, *spatial), 4, ignore)}
    if weighted:
        inputs["w"] = rng.uniform(0.5, 2.0, size=4)
    model = _loss_model("SoftmaxCrossEntropyLoss", reduction, spatial, ignore, weighted,
                        log_prob=True)
    check_gradients(model, inputs, wrt=["s"], output="loss", ort=True)
