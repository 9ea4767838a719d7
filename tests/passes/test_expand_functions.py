"""Ops defined as ONNX functions, differentiated through their bodies
(lossgraph/passes/expand_functions.py).

Attention, RMSNormalization and Swish (opsets 23-24) load only in onnxruntime 1.20 and
later: with the training build (opset 21 at most) those tests are skipped. Local
functions and DynamicQuantizeLinear run in both environments.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper
from onnx.reference import ReferenceEvaluator
from support.environment import newer_runtime
from support.gradcheck import check_gradients, cotangent, finite_differences, forward, loss_model
from support.models import dims, model, signature

import lossgraph
from lossgraph.names import NameAuthority
from lossgraph.passes.expand_functions import ExpandFunctions, function_body, gradient_view
from lossgraph.runtime.session import create_session
from lossgraph.target import use_target

F64 = np.float64


def _op_model(op: str, feeds: dict, attrs: str = "", opset: int = 23,
              shape: tuple | None = None, domain: str = "") -> onnx.ModelProto:
    """A one-node model ``y = op <attrs> (feeds...)``, y shaped like ``shape`` (default:
    like the first input)."""
    first = next(iter(feeds.values()))
    kind = "double" if first.dtype == F64 else "float"
    call = f"{domain}.{op}" if domain else op
    return model(signature(feeds, f"{kind}[{dims(shape or first.shape)}] y"),
                 f"y = {call} {attrs} ({', '.join(feeds)})", opset=opset,
                 domains={domain: 1} if domain else None)


def _vjp(net: onnx.ModelProto, feeds: dict, wrt: list[str], reference: bool = False
         ) -> tuple[dict[str, np.ndarray], np.ndarray, onnx.ModelProto]:
    """lossgraph's vector-Jacobian product of ``y`` for the fixed cotangent, the forward
    output of the gradient graph, and the graph; run by onnxruntime, or with
    ``reference`` by the ONNX reference implementation (the torch comparisons run in the
    training build's environment, whose onnxruntime loads opsets up to 21 only)."""
    with use_target("onnxruntime"):
        graph = lossgraph.gradient(net, weights=wrt, outputs=["y"])
    if reference:
        run = ReferenceEvaluator(net).run(["y"], feeds)[0]
        y = np.asarray(run)
    else:
        y = forward(net, feeds, "y")
    seed = graph.graph.input[len(net.graph.input)].name
    names = ["y", *(f"{w}_grad" for w in wrt)]
    inputs = {**feeds, seed: cotangent(y.shape, y.dtype)}
    if reference:
        values = ReferenceEvaluator(graph).run(names, inputs)
    else:
        values = create_session(graph).run(names, inputs)
    return dict(zip(wrt, values[1:])), values[0], graph


def _check_local(net: onnx.ModelProto, feeds: dict, reference: dict) -> None:
    """The gradient of sum(y R) against float64 finite differences and ``reference``.
    (gradcheck.check_gradients asserts that every node of the gradient graph is
    standard; here the forward keeps its call of the model's own function.)"""
    with_loss = loss_model(net, feeds)
    graph = lossgraph.gradient(with_loss, weights=list(feeds), loss_name="gradcheck_loss")
    got = create_session(graph).run([f"{w}_grad" for w in feeds], feeds)
    for w, grad in zip(feeds, got):
        numeric = finite_differences(with_loss, feeds, w, 1e-6)
        np.testing.assert_allclose(grad, numeric, rtol=1e-6, atol=1e-7, err_msg=w)
        np.testing.assert_allclose(grad, reference[w], rtol=1e-12, atol=1e-12, err_msg=w)


# -------------------------------------------------------------------- the mechanism
def test_the_forward_keeps_the_op_and_its_exact_values(rng):
    """Swish keeps its own node (onnxruntime's kernel) in the forward; only the
    gradient reads the body's values, recomputed under fresh names."""
    x = rng.normal(size=(3, 4))
    net = _op_model("Swish", {"x": x}, "<alpha: float = 1.5>", opset=24)
    with newer_runtime():
        grads, y, graph = _vjp(net, {"x": x}, ["x"])
    np.testing.assert_array_equal(y, forward(net, {"x": x}))
    swish = [n for n in graph.graph.node if n.op_type == "Swish"]
    assert len(swish) == 1 and list(swish[0].output) == ["y"]
    s = 1 / (1 + np.exp(-1.5 * x))
    expected = cotangent(y.shape, y.dtype) * (s + 1.5 * x * s * (1 - s))
    np.testing.assert_allclose(grads["x"], expected, rtol=1e-12, atol=1e-12)


def test_only_the_body_values_the_gradient_reads_are_recomputed(rng):
    """Swish(x) = x sigmoid(a x): the gradient reads sigmoid(a x) and the constant a,
    not the body's last product (the forward's own output)."""
    x = rng.normal(size=(2, 3))
    net = _op_model("Swish", {"x": x}, opset=24)
    with newer_runtime():
        graph = lossgraph.gradient(net, weights=["x"], outputs=["y"])
    recomputed = [n for n in graph.graph.node if n.name.startswith("Swish_y/")]
    assert "Sigmoid" in [n.op_type for n in recomputed]
    assert all(o != "y" for n in recomputed for o in n.output)
    last = [n for n in recomputed if n.op_type == "Mul" and "y" in n.output]
    assert not last


def test_a_model_without_function_ops_is_differentiated_as_it_is():
    net = model("(double[2] x) => (double[2] y)", "y = Tanh(x)")
    view = gradient_view(net, NameAuthority.for_model(net))
    assert view.model is net and not view.expanded and view.facts is None


@pytest.mark.parametrize("alpha", [1.0, 2.5])
def test_local_function_is_differentiated_through_its_body(rng, alpha):
    x = rng.normal(size=(3, 4))
    text = f"""<ir_version: 8, opset_import: ["" : 18, "local" : 1]>
        g (double[3, 4] x) => (double[3, 4] y) {{ y = local.Scaled <alpha: float = {alpha}> (x) }}
        <domain: "local", opset_import: ["" : 18]>
        Scaled <alpha> (x) => (y) {{
            a = Constant <value_float: float = @alpha> ()
            b = CastLike(a, x)
            ax = Mul(b, x)
            t = Tanh(ax)
            y = Mul(t, x)
        }}"""
    net = onnx.parser.parse_model(text)
    t = np.tanh(alpha * x)
    r = cotangent(x.shape, x.dtype)
    _check_local(net, {"x": x}, {"x": r * (t + x * alpha * (1 - t * t))})
    graph = lossgraph.gradient(net, weights=["x"], outputs=["y"])
    assert [n.op_type for n in graph.graph.node][0] == "Scaled"  # the call itself stays
    assert graph.functions[0].name == "Scaled"


def test_nested_local_functions_and_default_attributes_are_expanded(rng):
    """A function calling another, whose attribute falls back to its declared default."""
    x = rng.normal(size=(2, 3))
    net = onnx.parser.parse_model("""<ir_version: 10, opset_import: ["" : 18, "local" : 1]>
        g (double[2, 3] x) => (double[2, 3] y) { y = local.Outer(x) }
        <domain: "local", opset_import: ["" : 18, "local" : 1]>
        Outer (x) => (y) { s = local.Inner(x) y = Mul(s, s) }
        <domain: "local", opset_import: ["" : 18]>
        Inner <k: float = 3.0> (x) => (y) {
            k = Constant <value_float: float = @k> ()
            kc = CastLike(k, x)
            y = Mul(kc, x)
        }""")
    r = cotangent(x.shape, x.dtype)
    _check_local(net, {"x": x}, {"x": r * 18 * x})


def test_dynamic_quantize_linear_scale_is_differentiated_through_the_body(rng):
    """y_scale = (max(x, 0) - min(x, 0)) / 255: the gradient reaches the extremes (the
    quantized values are integers and carry none, as DequantizeLinear's rule says)."""
    x = rng.normal(size=(2, 5)).astype(np.float32)
    net = model(signature({"x": x}, "float s"), "q, s, z = DynamicQuantizeLinear(x)",
                opset=13)
    grads = check_gradients(net, {"x": x}, eps=1e-3)
    r = float(cotangent((), np.float32))
    expected = np.zeros_like(x)
    expected.flat[np.argmax(x)] = r / 255
    expected.flat[np.argmin(x)] = -r / 255
    np.testing.assert_allclose(grads["x"], expected, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("condition", [True, False])
def test_a_function_op_inside_an_if_branch_is_differentiated_through_its_body(rng, condition):
    """The view expands subgraphs too; the If rule recomputes the (expanded) branch."""
    x = rng.normal(size=(3,))
    net = onnx.parser.parse_model("""<ir_version: 10, opset_import: ["" : 24]>
        g (double[3] x, bool c) => (double[3] y) {
            y = If(c) <then_branch = g1 () => (double[3] t) { t = Swish(x) },
                       else_branch = g2 () => (double[3] e) { e = Neg(x) }>
        }""")
    with newer_runtime():
        graph = lossgraph.gradient(net, weights=["x"], outputs=["y"])
    seed = graph.graph.input[2].name
    r = cotangent(x.shape, x.dtype)
    got = create_session(graph).run(["x_grad"], {"x": x, "c": np.array(condition), seed: r})[0]
    s = 1 / (1 + np.exp(-x))
    expected = r * (s + x * s * (1 - s)) if condition else -r
    np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-12)


def test_a_body_that_uses_an_older_form_of_an_op_is_not_placed():
    """A body written for opset 13 (ReduceMean's axes as an attribute) means something
    else in an opset 18 graph (axes became an input): the node is left as it is, for
    the walker to name. (The ONNX checker rejects such a local function; a schema body
    can be older than the model, as DynamicQuantizeLinear's, opset 11.)"""
    function = onnx.parser.parse_function("""<domain: "local", opset_import: ["" : 13]>
        Centered (x) => (y) { m = ReduceMean <axes = [1]> (x) y = Sub(x, m) }""")
    net = model("(double[2, 3] x) => (double[2, 3] y)", "y = local.Centered(x)",
                domains={"local": 1})
    net.functions.append(function)
    assert function_body(net.graph.node[0], {"": 18, "local": 1},
                         {("local", "Centered", ""): function}) is not None
    view = gradient_view(net, NameAuthority.for_model(net))
    assert not view.expanded and view.model is net


# ------------------------------------------------------------------ the ExpandFunctions pass
def test_expand_functions_replaces_the_forward_and_reports_what_it_expanded(rng):
    x = rng.normal(size=(2, 5)).astype(np.float32)
    net = model(signature({"x": x}, "float s"), "q, s, z = DynamicQuantizeLinear(x)",
                opset=13)
    result = ExpandFunctions()(net)
    assert result.report == {"DynamicQuantizeLinear": 1} and result.changed
    assert "DynamicQuantizeLinear" not in [n.op_type for n in result.model.graph.node]
    np.testing.assert_allclose(forward(result.model, {"x": x}, "s"), forward(net, {"x": x}, "s"))
    unchanged = ExpandFunctions()(model("(float[2] x) => (float[2] y)", "y = Relu(x)"))
    assert unchanged.report == {} and not unchanged.changed


def test_expand_functions_drops_the_local_functions_no_node_calls_any_more():
    net = onnx.parser.parse_model("""<ir_version: 8, opset_import: ["" : 18, "local" : 1]>
        g (float[2] x) => (float[2] y) { y = local.Twice(x) }
        <domain: "local", opset_import: ["" : 18]>
        Twice (x) => (y) { y = Add(x, x) }""")
    expanded = ExpandFunctions()(net).model
    assert not expanded.functions
    assert [n.op_type for n in expanded.graph.node] == ["Add"]


# -------------------------------------------------------------------- ops with bodies
def _sdpa_reference(q, k, v, r, **kwargs):
    """torch's scaled_dot_product_attention and its input gradients for cotangent r."""
    import torch

    tensors = [torch.tensor(a, requires_grad=True) for a in (q, k, v)]
    y = torch.nn.functional.scaled_dot_product_attention(*tensors, **kwargs)
    (y * torch.from_numpy(r)).sum().backward()
    return y.detach().numpy(), {name: t.grad.numpy() for name, t in zip("QKV", tensors)}


ATTENTION_CASES = [
    ({}, {}),
    ({"is_causal": 1}, {"is_causal": True}),
    ({"scale": 0.3}, {"scale": float(np.float32(0.3))}),  # a float attribute is float32
]


@pytest.mark.parametrize("attrs, torch_kwargs", ATTENTION_CASES)
def test_attention_gradients_match_finite_differences(rng, attrs, torch_kwargs):
    q, k, v = (rng.normal(size=(1, 2, 3, 4)) for _ in range(3))
    text = "<" + ", ".join(f"{key} = {value}" for key, value in attrs.items()) + ">" \
        if attrs else ""
    net = _op_model("Attention", {"Q": q, "K": k, "V": v}, text)
    with newer_runtime():
        check_gradients(net, {"Q": q, "K": k, "V": v})


@pytest.mark.torch
@pytest.mark.parametrize("attrs, torch_kwargs", ATTENTION_CASES)
def test_attention_gradients_match_torch_scaled_dot_product_attention(rng, attrs, torch_kwargs):
    q, k, v = (rng.normal(size=(2, 3, 5, 4)) for _ in range(3))
    text = "<" + ", ".join(f"{key} = {value}" for key, value in attrs.items()) + ">" \
        if attrs else ""
    net = _op_model("Attention", {"Q": q, "K": k, "V": v}, text)
    feeds = {"Q": q, "K": k, "V": v}
    grads, y, _ = _vjp(net, feeds, ["Q", "K", "V"], reference=True)
    y_torch, expected = _sdpa_reference(q, k, v, cotangent(y.shape, y.dtype), **torch_kwargs)
    np.testing.assert_allclose(y, y_torch, rtol=1e-7, atol=1e-7)  # sqrt(scale) in float32
    for name in "QKV":  # the standard's body computes the scale in float32: 3e-8 apart
        np.testing.assert_allclose(grads[name], expected[name], rtol=1e-6, atol=1e-7,
                                   err_msg=name)


@pytest.mark.torch
def test_attention_with_an_additive_mask_and_grouped_heads_matches_torch(rng):
    """3 query heads sharing one key/value head, and a float mask added to the scores:
    the mask gets its gradient too (torch: attn_mask with requires_grad)."""
    import torch

    q = rng.normal(size=(1, 3, 4, 2))
    k, v = rng.normal(size=(1, 1, 5, 2)), rng.normal(size=(1, 1, 5, 2))
    mask = rng.normal(size=(4, 5))
    feeds = {"Q": q, "K": k, "V": v, "attn_mask": mask}
    net = _op_model("Attention", feeds)
    grads, y, _ = _vjp(net, feeds, list(feeds), reference=True)
    tensors = {n: torch.tensor(a, requires_grad=True) for n, a in feeds.items()}
    y_torch = torch.nn.functional.scaled_dot_product_attention(
        tensors["Q"], tensors["K"].expand(1, 3, 5, 2), tensors["V"].expand(1, 3, 5, 2),
        attn_mask=tensors["attn_mask"])
    (y_torch * torch.from_numpy(cotangent(y.shape, y.dtype))).sum().backward()
    np.testing.assert_allclose(y, y_torch.detach().numpy(), rtol=1e-7, atol=1e-9)
    for name, tensor in tensors.items():  # the body's scale is float32, as above
        np.testing.assert_allclose(grads[name], tensor.grad.numpy(), rtol=1e-6, atol=1e-7,
                                   err_msg=name)


@pytest.mark.parametrize("axis, shape", [(-1, (2, 3, 4)), (1, (2, 3, 4)), (0, (3, 2))])
def test_rms_normalization_gradients_match_finite_differences(rng, axis, shape):
    x = rng.normal(size=shape)
    scale = rng.normal(size=shape[axis % len(shape):])
    net = _op_model("RMSNormalization", {"x": x, "scale": scale},
                    f"<axis = {axis}, stash_type = 11>")
    with newer_runtime():
        check_gradients(net, {"x": x, "scale": scale})


@pytest.mark.torch
def test_rms_normalization_gradients_match_torch(rng):
    """The ONNX reference implementation (which runs opset 23 without onnxruntime 1.20)
    stashes the statistics in float32 only (stash_type=1): compared to float32 accuracy."""
    import torch

    x, scale = rng.normal(size=(2, 3, 6)), rng.normal(size=(6,))
    feeds = {"x": x, "scale": scale}
    net = _op_model("RMSNormalization", feeds, "<epsilon = 0.001>")
    grads, y, _ = _vjp(net, feeds, ["x", "scale"], reference=True)
    tx, ts = (torch.tensor(a, requires_grad=True) for a in (x, scale))
    y_torch = torch.nn.functional.rms_norm(tx, (6,), weight=ts, eps=float(np.float32(0.001)))
    (y_torch * torch.from_numpy(cotangent(y.shape, y.dtype))).sum().backward()
    np.testing.assert_allclose(y, y_torch.detach().numpy(), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(grads["x"], tx.grad.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(grads["scale"], ts.grad.numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.torch
def test_swish_gradient_matches_torch_silu(rng):
    import torch

    x = rng.normal(size=(4, 5))
    net = _op_model("Swish", {"x": x}, opset=24)
    grads, y, _ = _vjp(net, {"x": x}, ["x"], reference=True)
    tx = torch.tensor(x, requires_grad=True)
    (torch.nn.functional.silu(tx) * torch.from_numpy(cotangent(y.shape, y.dtype))).sum().backward()
    np.testing.assert_allclose(grads["x"], tx.grad.numpy(), rtol=1e-12, atol=1e-12)


def test_flex_attention_without_a_kernel_is_differentiated_and_expandable(rng):
    """FlexAttention (ai.onnx.preview) has no onnxruntime kernel: the gradient keeps the
    node in the forward like any other; ExpandFunctions first gives a model onnxruntime
    runs, whose gradient matches finite differences."""
    q, k, v = (rng.normal(size=(1, 2, 3, 4)) for _ in range(3))
    feeds = {"Q": q, "K": k, "V": v}
    net = _op_model("FlexAttention", feeds, opset=25, domain="ai.onnx.preview")
    with newer_runtime():
        graph = lossgraph.gradient(net, weights=["Q"], outputs=["y"])
        assert "FlexAttention" in [n.op_type for n in graph.graph.node]
        expanded = ExpandFunctions()(net)
        assert expanded.report == {"FlexAttention": 1}
        check_gradients(expanded.model, feeds)


def test_the_view_declares_the_forward_types_of_expanded_outputs(rng):
    """The op's output keeps the type shape inference gave it, so the nodes after it keep
    their static shapes in the view."""
    x = rng.normal(size=(2, 3))
    net = model(signature({"x": x}, "double z"),
                "y = Swish(x) z = ReduceSum <keepdims = 0> (y)", opset=24)
    view = gradient_view(net, NameAuthority.for_model(net), weights=["x"], seeds=["z"])
    assert view.expanded == {"Swish": 1}
    assert view.facts.shapes["y"] == (2, 3)
    assert [n.op_type for n in net.graph.node] == ["Swish", "ReduceSum"]  # not mutated


def test_expansion_follows_the_gradient_path_only():
    """A function op no gradient flows through (a comparison, or a branch the weights do
    not reach) is not expanded."""
    net = model("(double[3] x, double[3] w) => (double[3] y, bool b)",
                "b = GreaterOrEqual(x, w) s = Swish(x) y = Mul(w, s)", opset=24)
    view = gradient_view(net, NameAuthority.for_model(net), weights=["w"], seeds=["y"])
    assert view.expanded == {}
    view = gradient_view(net, NameAuthority.for_model(net), weights=["x"], seeds=["y"])
    assert view.expanded == {"Swish": 1}


def test_function_body_fills_schema_defaults_and_builds_context_dependent_bodies():
    node = helper.make_node("RMSNormalization", ["x", "s"], ["y"])
    types = {"x": helper.make_tensor_type_proto(onnx.TensorProto.DOUBLE, [2, 3]),
             "s": helper.make_tensor_type_proto(onnx.TensorProto.DOUBLE, [3])}
    function, full = function_body(node, {"": 23}, None, types)
    assert {a.name for a in full.attribute} >= {"axis", "epsilon", "stash_type"}
    assert "ReduceMean" in [n.op_type for n in function.node]
    assert function_body(helper.make_node("Relu", ["x"], ["y"]), {"": 13}) is None
