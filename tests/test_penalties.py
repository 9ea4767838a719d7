"""The penalty formula (lossgraph.penalties) and the standalone penalty graph: value and
gradient against numpy and torch autograd."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from support.environment import GOLDEN_MODELS

import lossgraph
from lossgraph.builder import GraphBuilder
from lossgraph.errors import UnknownNameError, UnsupportedModelError, UnsupportedOptionError
from lossgraph.names import NameAuthority
from lossgraph.penalties import penalty_gradient, penalty_graph, penalty_terms

PENALTIES = [
    {"coef": {"l1": 0.1}},
    {"coef": {"l2": 0.2}},
    {"coef": 0.3},
    {"coef": {"l1": 0.1, "l2": 0.2}, "bias": {"l1": 0.05}},
    {"bias": {"l2": 0.5}, "coef": {"l1": 0.01, "l2": 0.0}},
    {"coef": {"l1": 0.0, "l2": 0.0}},
]


def weights(dtype) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3)
    coef = rng.standard_normal((4, 3)).astype(dtype)
    coef[0, 0] = 0  # sign(0) = 0: the subgradient torch uses too
    return {"coef": coef, "bias": rng.standard_normal(3).astype(dtype),
            "other": rng.standard_normal(2).astype(dtype)}


def numpy_penalty(w, penalty) -> tuple[float, dict[str, np.ndarray]]:
    value, grads = 0.0, {}
    for name, spec in penalty.items():
        spec = spec if isinstance(spec, dict) else {"l2": spec}
        a, b = spec.get("l1", 0.0), spec.get("l2", 0.0)
        x = w[name].astype(np.float64)
        value += a * np.abs(x).sum() + b * (x * x).sum()
        grads[name] = a * np.sign(x) + 2 * b * x
    return value, grads


def tolerance(dtype) -> dict[str, float]:
    return {"rtol": 1e-5, "atol": 1e-6} if dtype == np.float32 else {"rtol": 1e-12, "atol": 0}


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("penalty", PENALTIES, ids=str)
def test_penalty_graph_matches_numpy(run_model, penalty, dtype):
    w = weights(dtype)
    model = penalty_graph(w, penalty)
    out = run_model(model, {name: w[name] for name in penalty})
    value, grads = numpy_penalty(w, penalty)
    assert out["penalty"].shape == () and out["penalty"].dtype == dtype
    np.testing.assert_allclose(out["penalty"], value, **tolerance(dtype))
    for name in penalty:
        assert out[f"{name}_penalty_grad"].dtype == dtype
        np.testing.assert_allclose(out[f"{name}_penalty_grad"], grads[name], **tolerance(dtype))


@pytest.mark.torch
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("penalty", PENALTIES, ids=str)
def test_penalty_graph_matches_torch_autograd(run_model, penalty, dtype):
    import torch

    w = weights(dtype)
    out = run_model(penalty_graph(w, penalty), {name: w[name] for name in penalty})
    params = {name: torch.tensor(w[name], requires_grad=True) for name in penalty}
    total = 0
    for name, spec in penalty.items():
        spec = spec if isinstance(spec, dict) else {"l2": spec}
        p = params[name]
        total = total + spec.get("l1", 0.0) * p.abs().sum() + spec.get("l2", 0.0) * (p**2).sum()
    total.backward()
    np.testing.assert_allclose(out["penalty"], total.item(), **tolerance(dtype))
    for name, p in params.items():
        np.testing.assert_allclose(out[f"{name}_penalty_grad"], p.grad.numpy(), **tolerance(dtype))


def test_penalty_graph_io_and_validity():
    w = weights(np.float32)
    model = penalty_graph(w, {"bias": 0.1, "coef": {"l1": 0.2}})
    onnx.checker.check_model(model, full_check=True)
    assert model.ir_version == 10
    assert [i.name for i in model.graph.input] == ["bias", "coef"]
    assert [o.name for o in model.graph.output] == [
        "penalty", "bias_penalty_grad", "coef_penalty_grad"]
    assert [d.dim_value for d in model.graph.input[1].type.tensor_type.shape.dim] == [4, 3]
    assert all(n.op_type != "Where" for n in model.graph.node)


def test_penalty_names_must_be_weights():
    with pytest.raises(UnknownNameError, match="'coeff'.*Did you mean 'coef'"):
        penalty_graph(weights(np.float32), {"coeff": 0.1})


def test_penalty_must_not_be_empty():
    with pytest.raises(UnsupportedOptionError, match="at least one"):
        penalty_graph(weights(np.float32), {})


def test_penalty_coefficients_are_validated():
    with pytest.raises(UnsupportedOptionError, match="l1=-1"):
        penalty_graph(weights(np.float32), {"coef": {"l1": -1}})
    with pytest.raises(UnsupportedOptionError, match="unknown key 'l3'"):
        penalty_graph(weights(np.float32), {"coef": {"l3": 1}})


def test_penalized_weights_of_mixed_types_are_rejected():
    w = {"a": np.zeros(2, np.float32), "b": np.zeros(2, np.float64)}
    with pytest.raises(UnsupportedModelError, match="one float type"):
        penalty_graph(w, {"a": 0.1, "b": 0.1})
    assert penalty_graph(w, {"a": 0.1}).graph.input[0].name == "a"  # only penalized ones count


def emit_penalty(b: GraphBuilder, weight: str, coefficients: dict, dtype) -> tuple[str, str]:
    terms = penalty_terms(b, weight, coefficients, dtype, hint=weight)
    value = terms[0] if len(terms) == 1 else b.Add(*terms)
    return value, penalty_gradient(b, weight, coefficients, dtype)


def test_the_penalty_formula_leaves_out_zero_terms():
    b = GraphBuilder(NameAuthority(["w"]), 18)
    emit_penalty(b, "w", {"l2": 0.5}, np.float32)
    assert [n.op_type for n in b.nodes] == ["ReduceSumSquare", "Mul", "Mul"]
    b = GraphBuilder(NameAuthority(["w"]), 18)
    emit_penalty(b, "w", {"l1": 0.5}, np.float64)
    assert [n.op_type for n in b.nodes] == ["ReduceL1", "Mul", "Sign", "Mul"]


def test_an_l1_penalty_on_double_weights_before_opset_18_trains_on_every_onnxruntime():
    """Found by the fuzzer (tests/test_fuzz.py): onnxruntime 1.19 has no double ReduceL1
    kernel before opset 18, so the program of a float64 model at opset 17 with an L1
    penalty could not run there; the norm is ReduceSum(Abs(W)) then."""
    path = GOLDEN_MODELS / "hand_mlp_tanh_double.onnx"  # float64, opset 17
    program = lossgraph.compile_program(path, penalty={"W1": {"l1": 0.01}})
    assert "ReduceL1" not in {n.op_type for g in program.graphs.values() for n in g.graph.node}
    rng = np.random.default_rng(0)
    X, y = rng.normal(size=(20, 5)), rng.normal(size=(20, 1))
    trainer = lossgraph.Trainer(program).fit(X, y, epochs=2, batch_size=5, progress=False)
    assert np.isfinite(trainer.train_losses_).all()


@pytest.mark.parametrize("opset", [13, 17])
def test_the_penalty_formula_before_opset_18(run_model, opset):
    """ReduceL1 and ReduceSumSquare took axes as an attribute before opset 18."""
    from onnx import TensorProto, helper

    b = GraphBuilder(NameAuthority(["w"]), opset)
    value, grad = emit_penalty(b, "w", {"l1": 0.5, "l2": 0.25}, np.float32)
    graph = helper.make_graph(
        [], "g", [helper.make_tensor_value_info("w", TensorProto.FLOAT, [3])],
        [helper.make_tensor_value_info(value, TensorProto.FLOAT, []),
         helper.make_tensor_value_info(grad, TensorProto.FLOAT, [3])])
    b.append_to(graph)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)],
                              ir_version=8)
    onnx.checker.check_model(model, full_check=True)
    x = np.array([-1.0, 0.0, 2.0], np.float32)
    out = list(run_model(model, {"w": x}).values())
    np.testing.assert_allclose(out[0], 0.5 * 3 + 0.25 * 5)
    np.testing.assert_allclose(out[1], 0.5 * np.sign(x) + 0.5 * x)
