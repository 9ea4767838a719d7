"""Check a model's gradients three ways: finite differences, a reference, onnxruntime-training.

    grads = check_gradients('''
        <ir_version: 8, opset_import: ["" : 18]>
        g (double[3, 4] x, double[4] w) => (double[3, 4] y) { y = Mul(x, w) }
    ''', {"x": x, "w": w})

The output ``y`` is contracted with a fixed random cotangent ``R`` into the scalar
``L = sum(y * R)``, so every element of the vector-Jacobian product is exercised.
Then, for each ``wrt`` input (default: every float input):

1. lossgraph's ``onnx`` backend gradient is run in onnxruntime, and its graph must
   hold standard-domain ops only;
2. it must equal central finite differences of ``L`` (float64 models: tight);
3. it must equal ``reference[name]`` when given (numpy or torch autograd), computed
   for the same cotangent, which the caller gets from :func:`cotangent`;
4. with the training build, it must equal the ``ort`` backend's result when
   ``GradientGraphBuilder`` supports the op (``ort="auto"``: skipped quietly when it
   does not, see :func:`_builder_unsupported`; ``ort=True``: it must). Any other
   failure of that comparison fails the check.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import onnx
from onnx import helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from lossgraph import gradient
from lossgraph.errors import EvaluationError, MissingGradientError, RuntimeUnavailableError
from lossgraph.graphs import all_graphs
from lossgraph.runtime.session import create_session, quiet_session_options
from lossgraph.target import use_target

COTANGENT_SEED = 1234


def _session(model: onnx.ModelProto, basic: bool = False):
    """A CPU session; ``basic`` skips onnxruntime's contrib fusions, some of which (QuickGelu
    for ``x * Sigmoid(x)``) have float32 kernels only."""
    import onnxruntime

    settings = ({"graph_optimization_level": onnxruntime.GraphOptimizationLevel.ORT_ENABLE_BASIC}
                if basic else {})
    return create_session(model, session_options=quiet_session_options(**settings))


def _fresh(inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Copies of the inputs for one run: onnxruntime's training-mode BatchNormalization
    writes its running statistics into its inputs' buffers."""
    return {k: np.array(v, copy=True) for k, v in inputs.items()}


def _as_model(model: onnx.ModelProto | str) -> onnx.ModelProto:
    return onnx.parser.parse_model(model) if isinstance(model, str) else model


def cotangent(shape: Sequence[int], dtype) -> np.ndarray:
    """The fixed random cotangent ``R`` used for an output of this shape."""
    return np.random.default_rng(COTANGENT_SEED).normal(size=tuple(shape)).astype(dtype)


def away_from_zero(rng: np.random.Generator, shape: Sequence[int], dtype=np.float64
                   ) -> np.ndarray:
    """Values with ``|x|`` in [0.2, 2], either sign: away from the kinks and poles at 0."""
    x = rng.uniform(0.2, 2.0, size=shape) * rng.choice([-1.0, 1.0], size=shape)
    return x.astype(dtype)


def reduce_to(grad: np.ndarray, shape: Sequence[int]) -> np.ndarray:
    """``grad`` summed back to ``shape``, the shape an input was broadcast from."""
    grad = grad.sum(axis=tuple(range(grad.ndim - len(shape))))
    return grad.sum(axis=tuple(i for i, d in enumerate(shape) if d == 1), keepdims=True)


def forward(model: onnx.ModelProto | str, inputs: Mapping[str, np.ndarray],
            output: str | None = None, basic: bool = False) -> np.ndarray:
    """The value of ``output`` (default: the first output)."""
    model = _as_model(model)
    output = output or model.graph.output[0].name
    return _session(model, basic).run([output], _fresh(inputs))[0]


def loss_model(model: onnx.ModelProto | str, inputs: Mapping[str, np.ndarray],
               output: str | None = None, basic: bool = False) -> onnx.ModelProto:
    """``model`` with an extra scalar output ``gradcheck_loss = sum(output * R)``."""
    model = _as_model(model)
    output = output or model.graph.output[0].name
    y = forward(model, inputs, output, basic)
    result = onnx.ModelProto()
    result.CopyFrom(model)
    result.graph.initializer.append(
        numpy_helper.from_array(cotangent(y.shape, y.dtype), "gradcheck_cotangent"))
    result.graph.node.extend([
        helper.make_node("Mul", [output, "gradcheck_cotangent"], ["gradcheck_product"]),
        helper.make_node("ReduceSum", ["gradcheck_product"], ["gradcheck_loss"], keepdims=0),
    ])
    elem_type = helper.np_dtype_to_tensor_dtype(y.dtype)
    result.graph.output.insert(0, helper.make_tensor_value_info("gradcheck_loss", elem_type, []))
    return result


def finite_differences(model: onnx.ModelProto, inputs: Mapping[str, np.ndarray], name: str,
                       eps: float, basic: bool = False) -> np.ndarray:
    """Central differences of the first output with respect to ``inputs[name]``."""
    session = _session(model, basic)
    loss = model.graph.output[0].name
    base = {k: np.array(v, copy=True) for k, v in inputs.items()}
    x = base[name]
    grad = np.zeros(x.shape, dtype=np.float64)

    def run() -> float:
        return float(session.run([loss], _fresh(base))[0])

    for index in np.ndindex(x.shape):
        original = x[index]
        x[index] = original + eps
        plus = run()
        x[index] = original - eps
        minus = run()
        x[index] = original
        grad[index] = (plus - minus) / (2 * eps)
    return grad


def vjp(model: onnx.ModelProto | str, inputs: Mapping[str, np.ndarray], wrt: Sequence[str]
        ) -> dict[str, np.ndarray]:
    """lossgraph's gradient of ``L = sum(y * R)`` (the fixed cotangent), run in onnxruntime,
    by input name."""
    graph = gradient(loss_model(model, inputs), weights=list(wrt), loss_name="gradcheck_loss")
    values = create_session(graph).run([f"{w}_grad" for w in wrt], _fresh(inputs))
    return dict(zip(wrt, values))


def reference_vjp(net: onnx.ModelProto, feeds: dict, wrt: list[str], output: str = "y"
                   ) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """lossgraph's vector-Jacobian product for the fixed cotangent, and the forward
    output, both run by the ONNX reference implementation (for ops onnxruntime lacks)."""
    with use_target("onnxruntime"):
        graph = gradient(net, weights=wrt, outputs=[output])
    y = np.asarray(ReferenceEvaluator(net).run([output], feeds)[0])
    seed = graph.graph.input[len(net.graph.input)].name
    values = ReferenceEvaluator(graph).run([f"{w}_grad" for w in wrt],
                                           {**feeds, seed: cotangent(y.shape, y.dtype)})
    return dict(zip(wrt, values)), y


def numeric_vjp(forward, x: np.ndarray, r: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """Central differences of sum(forward(x) r)."""
    grad = np.zeros(x.shape)
    for index in np.ndindex(x.shape):
        plus, minus = x.copy(), x.copy()
        plus[index] += eps
        minus[index] -= eps
        grad[index] = np.sum((forward(plus) - forward(minus)) * r) / (2 * eps)
    return grad


def check_gradients(
    model: onnx.ModelProto | str,
    inputs: Mapping[str, np.ndarray],
    wrt: Sequence[str] | None = None,
    *,
    output: str | None = None,
    reference: Mapping[str, np.ndarray] | None = None,
    ort: bool | str = "auto",
    rtol: float | None = None,
    atol: float | None = None,
    eps: float | None = None,
    basic_optimizations: bool = False,
) -> dict[str, np.ndarray]:
    """Assert the gradients of ``sum(output * R)`` agree three ways; return lossgraph's.

    ``basic_optimizations`` runs every session without onnxruntime's contrib fusions.
    """
    model = _as_model(model)
    inputs = {k: np.asarray(v) for k, v in inputs.items()}
    if wrt is None:
        wrt = [i.name for i in model.graph.input
               if inputs[i.name].dtype in (np.float32, np.float64)]
    double = all(inputs[w].dtype == np.float64 for w in wrt)
    rtol = rtol if rtol is not None else (1e-6 if double else 2e-3)
    atol = atol if atol is not None else (1e-7 if double else 2e-3)
    eps = eps if eps is not None else (1e-6 if double else 1e-2)
    with_loss = loss_model(model, inputs, output, basic_optimizations)

    graph = gradient(with_loss, weights=list(wrt), loss_name="gradcheck_loss")
    foreign = {n.domain for n in graph.graph.node if n.domain not in ("", "ai.onnx")}
    assert not foreign, f"onnx backend emitted non-standard domains {foreign}"
    grad_outputs = [f"{w}_grad" for w in wrt]
    grads = dict(zip(wrt, _session(graph, basic_optimizations).run(grad_outputs,
                                                                   _fresh(inputs))))
    for w in wrt:
        assert grads[w].shape == inputs[w].shape, (w, grads[w].shape, inputs[w].shape)
        assert grads[w].dtype == inputs[w].dtype, (w, grads[w].dtype, inputs[w].dtype)
        numeric = finite_differences(with_loss, inputs, w, eps, basic_optimizations)
        np.testing.assert_allclose(grads[w], numeric, rtol=rtol, atol=atol,
                                   err_msg=f"d/d{w}: lossgraph vs finite differences")
        if reference is not None and w in reference:
            np.testing.assert_allclose(grads[w], reference[w], rtol=rtol, atol=atol,
                                       err_msg=f"d/d{w}: lossgraph vs reference")
    if ort:
        _compare_with_ort(with_loss, inputs, wrt, grads, ort, rtol, atol)
    return grads


def to_float32(model: onnx.ModelProto) -> onnx.ModelProto:
    """The same model computing in float32 (onnxruntime-training's builder needs it),
    subgraphs included."""
    return _retyped(model, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT)


def to_float64(model: onnx.ModelProto) -> onnx.ModelProto:
    """The same model computing in float64 (a float32 export checked against float64
    references), subgraphs included."""
    return _retyped(model, onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE)


def _retyped(model: onnx.ModelProto, source: int, target: int) -> onnx.ModelProto:
    """``model`` with every ``source`` float type (values, initializers, Cast targets,
    tensor attributes) made ``target``."""
    dtype = helper.tensor_dtype_to_np_dtype(target)
    result = onnx.ModelProto()
    result.CopyFrom(model)
    for graph in all_graphs(result.graph):
        for value in (*graph.input, *graph.output, *graph.value_info):
            if value.type.tensor_type.elem_type == source:
                value.type.tensor_type.elem_type = target
        for index, tensor in enumerate(graph.initializer):
            if tensor.data_type == source:
                array = numpy_helper.to_array(tensor).astype(dtype)
                graph.initializer[index].CopyFrom(numpy_helper.from_array(array, tensor.name))
        for node in graph.node:
            for attribute in node.attribute:
                if attribute.name == "to" and attribute.i == source:
                    attribute.i = target
                if attribute.type == onnx.AttributeProto.TENSOR and \
                        attribute.t.data_type == source:
                    array = numpy_helper.to_array(attribute.t).astype(dtype)
                    attribute.t.CopyFrom(numpy_helper.from_array(array, attribute.t.name))
    return result


def _builder_unsupported(exc: Exception) -> bool:
    """Whether ``exc``, raised while differentiating with ``backend="ort"`` or loading its
    graph, means that GradientGraphBuilder does not support the op: it refuses it or
    emits a graph the ONNX checker rejects (MissingGradientError), or one onnxruntime
    cannot load (no kernel for its gradient op, or its own shape inference fails: lossgraph's
    sessions report that as an EvaluationError saying it could not load the graph)."""
    from onnxruntime.capi import onnxruntime_pybind11_state as ort_errors

    if isinstance(exc, MissingGradientError):
        return True
    if isinstance(exc, EvaluationError):
        return "could not load" in str(exc)
    return isinstance(exc, (ort_errors.NotImplemented, ort_errors.Fail))


def _compare_with_ort(with_loss, inputs, wrt, grads, ort, rtol, atol) -> None:
    if any(v.dtype == np.float64 for v in inputs.values()):
        with_loss = to_float32(with_loss)
        inputs = {k: v.astype(np.float32) if v.dtype == np.float64 else v
                  for k, v in inputs.items()}
        rtol, atol = max(rtol, 1e-4), max(atol, 1e-4)
    try:
        graph = gradient(with_loss, weights=list(wrt), loss_name="gradcheck_loss", backend="ort")
        session = _session(graph)
    except RuntimeUnavailableError:
        return  # plain onnxruntime: nothing to compare with
    except Exception as exc:
        if not _builder_unsupported(exc):
            raise
        if ort is True:
            raise AssertionError(f"onnxruntime-training could not differentiate: {exc}") from exc
        return
    expected = dict(zip(wrt, session.run([f"{w}_grad" for w in wrt], _fresh(inputs))))
    for w in wrt:
        np.testing.assert_allclose(grads[w], expected[w].astype(grads[w].dtype), rtol=rtol,
                                   atol=atol,
                                   err_msg=f"d/d{w}: lossgraph vs onnxruntime-training")


def attributes_text(attrs: Mapping[str, object]) -> str:
    """``<k=v, ...>`` in ONNX text syntax (strings quoted, lists bracketed), or ""."""
    def text(value: object) -> str:
        if isinstance(value, str):
            return f'"{value}"'
        if isinstance(value, (list, tuple)):
            return "[" + ",".join(str(i) for i in value) + "]"
        return str(value)

    return "<" + ", ".join(f"{k}={text(v)}" for k, v in attrs.items()) + ">" if attrs else ""


def check_op(op: str, feeds: Mapping[str, np.ndarray], attrs: Mapping[str, object],
             opset: int = 18, **options):
    """:func:`check_gradients` of the one-node model ``y = op<attrs>(feeds...)``, whose
    output has the first input's dtype and rank."""
    from .models import model, signature

    first = next(iter(feeds.values()))
    kind = "double" if first.dtype == np.float64 else "float"
    dims = ",".join(f"d{i}" for i in range(first.ndim))
    body = f"y = {op}{attributes_text(attrs)}({', '.join(feeds)})"
    return check_gradients(model(signature(feeds, f"{kind}[{dims}] y"), body, opset=opset),
                           feeds, **options)
