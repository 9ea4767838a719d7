"""Optimizers and their update graphs: equal step for step to numpy, torch and scikit-learn."""

from __future__ import annotations

import json
import math

import numpy as np
import onnx
import pytest
from onnx import helper

from lossgraph.builder import GraphBuilder
from lossgraph.errors import (
    DTypeMismatchError,
    UnsupportedModelError,
    UnsupportedOptionError,
)
from lossgraph.names import NameAuthority
from lossgraph.optim import (
    SGD,
    Adam,
    AdamW,
    Momentum,
    Optimizer,
    build_update,
    optimizer_from_dict,
    update_graph,
)

STEPS = 5
SHAPES = {"coef": (4, 3), "bias": (3,), "scale": ()}
DTYPES = [np.float32, np.float64]
OPTIMIZERS = [
    SGD(learning_rate=0.1),
    Momentum(learning_rate=0.05, momentum=0.9),
    Momentum(learning_rate=0.05, momentum=0.8, nesterov=True),
    Momentum(learning_rate=0.05, momentum=0.0),
    Adam(learning_rate=0.01),
    Adam(learning_rate=0.02, beta1=0.8, beta2=0.99, epsilon=1e-6),
    AdamW(learning_rate=0.01),
    AdamW(learning_rate=0.02, beta1=0.85, beta2=0.95, epsilon=1e-7, weight_decay=0.1),
]
IDS = [repr(o) for o in OPTIMIZERS]


def tolerance(dtype: type) -> dict[str, float]:
    return {"rtol": 2e-5, "atol": 1e-6} if dtype == np.float32 else {"rtol": 1e-11, "atol": 1e-13}


def problem(dtype: type) -> tuple[dict[str, np.ndarray], list[dict[str, np.ndarray]]]:
    """Initial weights and one gradient per weight per step."""
    rng = np.random.default_rng(42)
    weights = {n: rng.standard_normal(s).astype(dtype) for n, s in SHAPES.items()}
    grads = [{n: rng.standard_normal(s).astype(dtype) for n, s in SHAPES.items()}
             for _ in range(STEPS)]
    return weights, grads


def run_update_graph(run_model, optimizer: Optimizer, weights, grads) -> list[dict]:
    """The weights after each of the steps, the update graph run in onnxruntime."""
    model = update_graph(optimizer, weights)
    dtype = next(iter(weights.values())).dtype
    current = dict(weights)
    states = {n: dict(zip(optimizer.state_names(n), optimizer.initial_state(w)))
              for n, w in weights.items()}
    history = []
    for step, grad in enumerate(grads, start=1):
        feeds = {"learning_rate": np.array(optimizer.schedule(step), dtype),
                 "step": np.array(step, np.int64)}
        for n in weights:
            feeds.update({n: current[n], f"{n}_grad": grad[n], **states[n]})
        out = run_model(model, feeds)
        current = {n: out[f"{n}_new"] for n in weights}
        states = {n: {s: out[f"{s}_new"] for s in states[n]} for n in weights}
        for n in weights:
            assert current[n].dtype == dtype and current[n].shape == weights[n].shape
        history.append(current)
    return history


# -- numpy references (float64) ---------------------------------------------------------


def numpy_reference(optimizer: Optimizer, weights, grads) -> list[dict]:
    w = {n: v.astype(np.float64) for n, v in weights.items()}
    s1 = {n: np.zeros_like(v) for n, v in w.items()}
    s2 = {n: np.zeros_like(v) for n, v in w.items()}
    history = []
    for t, grad in enumerate(grads, start=1):
        lr = optimizer.schedule(t)
        for n in w:
            g = grad[n].astype(np.float64)
            if isinstance(optimizer, Momentum):
                s1[n] = optimizer.momentum * s1[n] + g
                d = g + optimizer.momentum * s1[n] if optimizer.nesterov else s1[n]
                w[n] = w[n] - lr * d
            elif isinstance(optimizer, Adam):
                if isinstance(optimizer, AdamW):
                    w[n] = w[n] * (1 - lr * optimizer.weight_decay)
                b1, b2 = optimizer.beta1, optimizer.beta2
                s1[n] = b1 * s1[n] + (1 - b1) * g
                s2[n] = b2 * s2[n] + (1 - b2) * g * g
                m_hat = s1[n] / (1 - b1**t)
                denom = np.sqrt(s2[n]) / math.sqrt(1 - b2**t) + optimizer.epsilon
                w[n] = w[n] - lr * m_hat / denom
            else:
                w[n] = w[n] - lr * g
        history.append(dict(w))
    return history


# -- torch -----------------------------------------------------------------------------------


def torch_reference(optimizer: Optimizer, weights, grads) -> list[dict]:
    import torch

    params = {n: torch.nn.Parameter(torch.from_numpy(v.copy())) for n, v in weights.items()}
    plist = list(params.values())
    if isinstance(optimizer, Momentum):
        opt = torch.optim.SGD(plist, lr=optimizer.learning_rate, momentum=optimizer.momentum,
                              nesterov=optimizer.nesterov)
    elif isinstance(optimizer, AdamW):
        opt = torch.optim.AdamW(plist, lr=optimizer.learning_rate,
                                betas=(optimizer.beta1, optimizer.beta2), eps=optimizer.epsilon,
                                weight_decay=optimizer.weight_decay)
    elif isinstance(optimizer, Adam):
        opt = torch.optim.Adam(plist, lr=optimizer.learning_rate,
                               betas=(optimizer.beta1, optimizer.beta2), eps=optimizer.epsilon)
    else:
        opt = torch.optim.SGD(plist, lr=optimizer.learning_rate)
    history = []
    for grad in grads:
        for n, p in params.items():
            p.grad = torch.from_numpy(grad[n].copy())
        opt.step()
        history.append({n: p.detach().numpy().copy() for n, p in params.items()})
    return history


@pytest.mark.parametrize("reference", [
    numpy_reference, pytest.param(torch_reference, marks=pytest.mark.torch)],
    ids=["numpy", "torch"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=IDS)
def test_update_graph_matches_the_reference_step_for_step(run_model, optimizer, dtype,
                                                          reference):
    weights, grads = problem(dtype)
    got = run_update_graph(run_model, optimizer, weights, grads)
    expected = reference(optimizer, weights, grads)
    for step, (g, e) in enumerate(zip(got, expected), start=1):
        for n in weights:
            np.testing.assert_allclose(g[n], e[n], **tolerance(dtype), err_msg=f"{n} step {step}")


# -- SGD schedules ------------------------------------------------------------------------------


def sklearn_formula(schedule: str, t: int, eta0: float, power_t: float, alpha: float) -> float:
    """scikit-learn's _sgd_fast.pyx, written out."""
    if schedule == "invscaling":
        return eta0 / t**power_t
    if schedule == "optimal":
        typw = np.sqrt(1.0 / np.sqrt(alpha))
        initial_eta0 = typw / max(1.0, -typw - 1.0)  # squared error: dloss(1, -typw) < 0
        optimal_init = 1.0 / (initial_eta0 * alpha)
        return 1.0 / (alpha * (optimal_init + t - 1))
    return eta0


SCHEDULE_CASES = [
    ("constant", 0.05, 0.25, 1e-4),
    ("invscaling", 0.05, 0.25, 1e-4),
    ("invscaling", 0.2, 0.5, 1e-4),
    ("optimal", 0.05, 0.25, 1e-4),
    ("optimal", 0.05, 0.25, 0.01),
]


@pytest.mark.parametrize(("schedule", "eta0", "power_t", "alpha"), SCHEDULE_CASES)
def test_sgd_schedule_follows_sklearn_formulas(schedule, eta0, power_t, alpha):
    sgd = SGD(learning_rate=eta0, learning_rate_schedule=schedule, power_t=power_t, alpha=alpha)
    for t in range(1, 50):
        assert sgd.schedule(t) == pytest.approx(
            sklearn_formula(schedule, t, eta0, power_t, alpha), rel=1e-14)


@pytest.mark.parametrize("optimizer", [
    *(SGD(learning_rate=eta0, learning_rate_schedule=schedule, power_t=power_t, alpha=alpha)
      for schedule, eta0, power_t, alpha in SCHEDULE_CASES),
    Momentum(0.05, nesterov=True), Adam(0.002)], ids=repr)
def test_schedules_are_the_schedule_of_each_step(optimizer):
    rates = optimizer.schedules(7, 40)  # what an epoch graph is fed, steps 7 to 46
    assert rates.dtype == np.float64
    assert rates.tolist() == [optimizer.schedule(t) for t in range(7, 47)]


def test_sgd_eta0_defaults_to_learning_rate_and_overrides_it():
    assert SGD(learning_rate=0.3, learning_rate_schedule="invscaling").schedule(1) == 0.3
    sgd = SGD(learning_rate=0.3, learning_rate_schedule="invscaling", eta0=0.5, power_t=1.0)
    assert sgd.schedule(1) == 0.5 and sgd.schedule(4) == 0.125


def test_optimal_schedule_starts_at_alpha_to_the_minus_quarter():
    assert SGD(learning_rate_schedule="optimal", alpha=1e-4).schedule(1) == pytest.approx(10.0)


def sklearn_learning_rates(schedule: str, eta0: float, power_t: float, alpha: float) -> list:
    """Rates scikit-learn's SGDRegressor uses, read back from one-sample partial_fit steps.

    With x = 1, y = 1, no intercept and no penalty, w' = w - eta (w - 1), so
    eta = (w' - w) / (1 - w).
    """
    from sklearn.linear_model import SGDRegressor

    reg = SGDRegressor(loss="squared_error", penalty=None, fit_intercept=False,
                       learning_rate=schedule, eta0=eta0, power_t=power_t, alpha=alpha,
                       shuffle=False)
    w, rates = 0.0, []
    for _ in range(STEPS):
        reg.partial_fit(np.ones((1, 1)), np.ones(1))
        new = float(reg.coef_[0])
        rates.append((new - w) / (1.0 - w))
        w = new
    return rates


@pytest.mark.parametrize(("schedule", "eta0", "power_t", "alpha"), SCHEDULE_CASES)
def test_sgd_schedule_equals_sklearn_sgdregressor(schedule, eta0, power_t, alpha):
    pytest.importorskip("sklearn")
    sgd = SGD(learning_rate=eta0, learning_rate_schedule=schedule, power_t=power_t, alpha=alpha)
    expected = sklearn_learning_rates(schedule, eta0, power_t, alpha)
    np.testing.assert_allclose([sgd.schedule(t) for t in range(1, STEPS + 1)], expected,
                               rtol=1e-9)


@pytest.mark.parametrize("schedule", ["invscaling", "optimal"])
def test_scheduled_sgd_update_graph_matches_numpy(run_model, schedule):
    sgd = SGD(learning_rate=0.05, learning_rate_schedule=schedule, alpha=0.1)
    weights, grads = problem(np.float64)
    got = run_update_graph(run_model, sgd, weights, grads)
    expected = numpy_reference(sgd, weights, grads)
    for g, e in zip(got, expected):
        for n in weights:
            np.testing.assert_allclose(g[n], e[n], rtol=1e-12)


def test_schedule_rejects_step_zero():
    with pytest.raises(UnsupportedOptionError, match="step=0"):
        SGD().schedule(0)


# -- graph structure -------------------------------------------------------------------------


@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=IDS)
def test_update_graph_io_names_and_validity(optimizer):
    weights, _ = problem(np.float32)
    model = update_graph(optimizer, weights)
    onnx.checker.check_model(model, full_check=True)
    assert model.ir_version == 10
    assert [(o.domain, o.version) for o in model.opset_import] == [("", 18)]
    expected_inputs = ["learning_rate", "step"]
    expected_outputs = []
    for n in weights:
        states = optimizer.state_names(n)
        expected_inputs += [n, f"{n}_grad", *states]
        expected_outputs += [f"{n}_new", *(f"{s}_new" for s in states)]
    assert [i.name for i in model.graph.input] == expected_inputs
    assert [o.name for o in model.graph.output] == expected_outputs
    assert model.graph.input[1].type.tensor_type.elem_type == onnx.TensorProto.INT64
    assert all(n.op_type != "Where" and n.domain == "" for n in model.graph.node)


def test_state_names_follow_the_weight():
    assert SGD().state_names("coef") == []
    assert Momentum().state_names("coef") == ["coef_velocity"]
    assert Adam().state_names("coef") == ["coef_m", "coef_v"]
    assert AdamW().state_names("coef") == ["coef_m", "coef_v"]
    state = Adam().initial_state(np.ones((2, 3), np.float32))
    assert len(state) == 2 and all(s.dtype == np.float32 and not s.any() for s in state)


@pytest.mark.parametrize("opset", [13, 17, 21])
def test_update_graph_opsets(run_model, opset):
    weights, grads = problem(np.float64)
    optimizer = AdamW(learning_rate=0.01)
    model = update_graph(optimizer, weights, opset=opset)
    assert model.opset_import[0].version == opset
    feeds = {"learning_rate": np.array(0.01), "step": np.array(1, np.int64)}
    for n, w in weights.items():
        zeros = np.zeros_like(w)
        feeds.update({n: w, f"{n}_grad": grads[0][n], f"{n}_m": zeros, f"{n}_v": zeros})
    out = run_model(model, feeds)
    expected = numpy_reference(optimizer, weights, grads[:1])[0]
    for n in weights:
        np.testing.assert_allclose(out[f"{n}_new"], expected[n], rtol=1e-12)


def test_adam_scalars_are_emitted_once_for_all_weights():
    weights, _ = problem(np.float32)
    ops = [n.op_type for n in update_graph(AdamW(), weights).graph.node]
    assert ops.count("Pow") == 2 and ops.count("Cast") == 1
    assert ops.count("Sub") == 2 + 1 + len(weights)  # bias corrections, decay, the updates


def test_shared_scalars_are_re_emitted_for_a_new_graph():
    b = GraphBuilder(NameAuthority(["w", "g", "m", "v", "lr", "t"]), 18)
    Adam().emit_update(b, "w", "g", ["m", "v"], "lr", "t", np.float32)
    b.append_to(helper.make_graph([], "first", [], []))
    Adam().emit_update(b, "w", "g", ["m", "v"], "lr", "t", np.float32)
    assert [n.op_type for n in b.nodes].count("Pow") == 2


def test_sgd_update_is_two_nodes_per_weight():
    weights, _ = problem(np.float32)
    assert len(update_graph(SGD(), weights).graph.node) == 2 * len(weights)


def test_mixed_dtypes_are_rejected():
    with pytest.raises(UnsupportedModelError, match="one float type"):
        update_graph(SGD(), {"a": np.zeros(2, np.float32), "b": np.zeros(2, np.float64)})


def test_integer_weights_are_rejected():
    with pytest.raises(DTypeMismatchError, match="'a'"):
        update_graph(SGD(), {"a": np.zeros(2, np.int64)})


def test_names_the_update_invents_avoid_the_weights_names(run_model):
    """A weight named like a gradient, a state, the learning rate or the step keeps its
    name; the invented one gets a suffix, and the update is the same."""
    weights = {"a": np.array([1.0, 2.0]), "a_grad": np.array([3.0, 4.0]),
               "a_velocity": np.array([5.0, 6.0]), "learning_rate": np.array([7.0, 8.0])}
    built = build_update(Momentum(0.5, momentum=0.9), weights)
    assert [i.name for i in built.model.graph.input] == [
        "learning_rate_1", "step", "a", "a_grad_1", "a_velocity_1", "a_grad", "a_grad_grad",
        "a_grad_velocity", "a_velocity", "a_velocity_grad", "a_velocity_velocity",
        "learning_rate", "learning_rate_grad", "learning_rate_velocity"]
    assert built.gradients["a"] == "a_grad_1" and built.states["a"] == ["a_velocity_1"]
    grads = {w: np.full(2, 0.5) for w in weights}
    feeds = {"learning_rate_1": np.array(0.5), "step": np.array(1, np.int64)}
    for w, value in weights.items():
        feeds.update({w: value, built.gradients[w]: grads[w], built.states[w][0]: np.zeros(2)})
    out = run_model(built.model, feeds)
    for w, value in weights.items():  # Momentum's first step: w - lr * g
        np.testing.assert_allclose(out[built.new[w]], value - 0.25)


def test_bad_update_graph_arguments():
    with pytest.raises(UnsupportedOptionError, match="at least one weight"):
        update_graph(SGD(), {})
    with pytest.raises(UnsupportedOptionError, match="opset=22"):
        update_graph(SGD(), {"a": np.zeros(2)}, opset=22)
    with pytest.raises(UnsupportedOptionError, match="optimizer"):
        update_graph("sgd", {"a": np.zeros(2)})


# -- validation and serialization ---------------------------------------------------------


@pytest.mark.parametrize(("make", "message"), [
    (lambda: SGD(learning_rate=-0.1), "learning_rate=-0.1 must be a finite number >= 0"),
    (lambda: SGD(learning_rate=float("nan")), "learning_rate=nan must be a finite number >= 0"),
    (lambda: SGD(learning_rate="0.1"), "learning_rate='0.1' must be a finite number >= 0"),
    (lambda: SGD(learning_rate_schedule="optimall"), "Did you mean 'optimal'"),
    (lambda: SGD(learning_rate_schedule="optimal", alpha=0), "alpha > 0"),
    (lambda: SGD(eta0=-1.0), "eta0"),
    (lambda: SGD(alpha=-1.0), "alpha"),
    (lambda: Momentum(momentum=1.0), r"momentum=1.0 must lie in \[0, 1\)"),
    (lambda: Momentum(momentum=-0.1), "momentum"),
    (lambda: Momentum(momentum=0.0, nesterov=True), "nesterov=True needs momentum > 0"),
    (lambda: Momentum(nesterov="yes"), "must be a bool"),
    (lambda: Adam(beta1=1.0), "beta1"),
    (lambda: Adam(beta2=-0.5), "beta2"),
    (lambda: Adam(epsilon=-1e-8), "epsilon"),
    (lambda: AdamW(weight_decay=-0.01), "weight_decay"),
    (lambda: AdamW(beta1=1.5), "AdamW: beta1"),
])
def test_invalid_parameters_are_rejected(make, message):
    with pytest.raises(UnsupportedOptionError, match=message):
        make()


def test_optimizer_is_abstract():
    with pytest.raises(TypeError):
        Optimizer()


@pytest.mark.parametrize("optimizer", [*OPTIMIZERS, SGD(learning_rate_schedule="optimal"),
                                       SGD(learning_rate_schedule="invscaling", eta0=0.5)],
                         ids=lambda o: repr(o))
def test_to_dict_round_trips_through_json(optimizer):
    d = optimizer.to_dict()
    assert d["type"] == type(optimizer).__name__
    assert optimizer_from_dict(json.loads(json.dumps(d))) == optimizer


def test_to_dict_lists_the_hyper_parameters():
    assert Momentum(0.1, 0.5, True).to_dict() == {
        "type": "Momentum", "learning_rate": 0.1, "momentum": 0.5, "nesterov": True}


@pytest.mark.parametrize(("d", "message"), [
    ({"type": "Adamm"}, "Did you mean 'Adam'"),
    ({"learning_rate": 0.1}, "'type' key"),
    ({"type": "SGD", "momentum": 0.9}, "SGD has no option 'momentum'"),
    ({"type": "Momentum", "momentum": 2.0}, "momentum"),
])
def test_optimizer_from_dict_rejects_bad_descriptions(d, message):
    with pytest.raises(UnsupportedOptionError, match=message):
        optimizer_from_dict(d)


def test_numpy_scalars_become_python_numbers():
    optimizer = Momentum(learning_rate=np.float32(0.5), momentum=np.float64(0.5),
                         nesterov=np.bool_(True))
    assert json.loads(json.dumps(optimizer.to_dict()))["nesterov"] is True
    assert type(optimizer.learning_rate) is float and optimizer == Momentum(0.5, 0.5, True)
