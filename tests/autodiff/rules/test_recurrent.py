"""Gradients of the recurrent layers LSTM, GRU and RNN (lossgraph/autodiff/rules/recurrent.py).

onnxruntime runs these ops in float32 and layout 0 only, so each gradient is checked

- in float64 against central finite differences of :func:`reference`, a numpy
  transcription of the spec (onnxruntime's reading where the spec is silent: sequences
  of length 0, the order alpha and beta are consumed in), itself checked against
  onnxruntime's float32 forward in every case onnxruntime runs, and against the ONNX
  reference implementation for layout 1;
- in float32 against finite differences of onnxruntime's own forward (gradcheck);
- against torch autograd (nn.LSTM, nn.GRU, nn.RNN with copied weights; packed sequences
  for sequence_lens), and end to end: an exported LSTM and GRU trained by Trainer move
  like torch.optim.SGD, step for step.

onnxruntime-training's GradientGraphBuilder has no gradient for these ops (a test pins
it). The gradient graphs run without their forward node, which the gradient does not
read (it recomputes the states): onnxruntime could not run it in float64 or layout 1.
"""

from __future__ import annotations

import io
import warnings
from dataclasses import dataclass, replace

import numpy as np
import onnx
import pytest
from onnx import helper
from support.gradcheck import check_gradients, cotangent
from support.models import model_of_graph
from support.torch_steps import assert_sgd_steps_like_torch

import lossgraph
from lossgraph.errors import MissingGradientError, UnsupportedModelError
from lossgraph.graphs import outer_references, subgraphs
from lossgraph.runtime.session import create_session, quiet_session_options

T, N, I, H = 3, 3, 2, 2  # time steps, batch, input size, hidden size
GATES = {"RNN": 1, "GRU": 3, "LSTM": 4}
INPUTS = ("X", "W", "R", "B", "L", "h0", "c0", "P")  # the node's inputs, by position
OUTPUTS = {"RNN": ("Y", "Y_h"), "GRU": ("Y", "Y_h"), "LSTM": ("Y", "Y_h", "Y_c")}


@dataclass(frozen=True)
class Case:
    """One recurrent node: its op, attributes, the inputs it has and the outputs it uses."""

    op: str
    direction: str = "forward"
    layout: int = 0
    inputs: tuple[str, ...] = INPUTS
    outputs: tuple[str, ...] | None = None  # default: all of the op's
    attrs: tuple[tuple[str, object], ...] = ()
    lens: tuple[int, ...] = (3, 1, 2)
    opset: int = 17

    @property
    def directions(self) -> int:
        return 2 if self.direction == "bidirectional" else 1

    @property
    def present(self) -> list[str]:
        arity = 8 if self.op == "LSTM" else 6
        return [name for name in INPUTS[:arity] if name in self.inputs]

    @property
    def used(self) -> tuple[str, ...]:
        return self.outputs or OUTPUTS[self.op]

    def __str__(self) -> str:
        parts = [self.op, self.direction, f"layout{self.layout}", f"opset{self.opset}",
                 "+".join(self.present), "->" + "+".join(self.used)]
        return "-".join(parts + [f"{k}={v}" for k, v in self.attrs])


# ------------------------------------------------------------------ the reference
def _activation(name: str, alpha: float, beta: float):
    return {
        "relu": lambda x: np.maximum(x, 0),
        "tanh": np.tanh,
        "sigmoid": lambda x: 1 / (1 + np.exp(-x)),
        "affine": lambda x: alpha * x + beta,
        "leakyrelu": lambda x: np.where(x >= 0, x, alpha * x),
        "thresholdedrelu": lambda x: np.where(x > alpha, x, 0),
        "scaledtanh": lambda x: alpha * np.tanh(beta * x),
        "hardsigmoid": lambda x: np.clip(alpha * x + beta, 0, 1),
        "elu": lambda x: np.where(x >= 0, x, alpha * (np.exp(x) - 1)),
        "softsign": lambda x: x / (1 + np.abs(x)),
        "softplus": lambda x: np.log1p(np.exp(x)),
    }[name.lower()]


def _activations(case: Case) -> list[list]:
    """Each direction's activations; alpha and beta consumed in order by those taking them."""
    attrs = dict(case.attrs)
    count = {"RNN": 1, "GRU": 2, "LSTM": 3}[case.op]
    default = {"RNN": ["Tanh"], "GRU": ["Sigmoid", "Tanh"], "LSTM": ["Sigmoid", "Tanh", "Tanh"]}
    names = attrs.get("activations") or default[case.op] * case.directions
    alphas, betas = list(attrs.get("activation_alpha", [])), list(attrs.get("activation_beta", []))
    takes_alpha = {"affine", "leakyrelu", "thresholdedrelu", "scaledtanh", "hardsigmoid", "elu"}
    takes_beta = {"affine", "scaledtanh", "hardsigmoid"}
    defaults = {"leakyrelu": 0.01, "hardsigmoid": 0.2, "elu": 1.0}
    functions = []
    for name in names:
        key = name.lower()
        alpha = (alphas.pop(0) if alphas else defaults[key]) if key in takes_alpha else 0
        beta = (betas.pop(0) if betas else 0.5) if key in takes_beta else 0
        functions.append(_activation(name, alpha, beta))
    return [functions[d * count:(d + 1) * count] for d in range(case.directions)]


def reference(case: Case, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The outputs of the node, by the equations of the spec, one sequence at a time."""
    attrs = dict(case.attrs)
    x = feeds["X"] if case.layout == 0 else feeds["X"].swapaxes(0, 1)
    steps, batch = x.shape[:2]
    gh = GATES[case.op] * H
    clip = attrs.get("clip")
    cut = (lambda a: np.clip(a, -clip, clip)) if clip is not None else (lambda a: a)
    lens = feeds.get("L", np.full(batch, steps))
    y = np.zeros((steps, case.directions, batch, H), dtype=x.dtype)
    y_h = np.zeros((case.directions, batch, H), dtype=x.dtype)
    y_c = np.zeros_like(y_h)

    def state(name: str, d: int, b: int) -> np.ndarray:
        if name not in feeds:
            return np.zeros(H, dtype=x.dtype)
        return feeds[name][d, b] if case.layout == 0 else feeds[name][b, d]

    for d, acts in enumerate(_activations(case)):
        w, r = feeds["W"][d], feeds["R"][d]
        bias = feeds["B"][d] if "B" in feeds else np.zeros(2 * gh, dtype=x.dtype)
        wb, rb = bias[:gh], bias[gh:]
        p = feeds["P"][d] if "P" in feeds else np.zeros(3 * H, dtype=x.dtype)
        for b in range(batch):
            h, c = state("h0", d, b), state("c0", d, b)
            reverse = case.direction == "reverse" or d == 1
            for t in (range(lens[b] - 1, -1, -1) if reverse else range(lens[b])):
                xw = w @ x[t, b] + wb
                if case.op == "RNN":
                    h = acts[0](cut(xw + r @ h + rb))
                elif case.op == "GRU":
                    blocks = [slice(k * H, (k + 1) * H) for k in range(3)]
                    z = acts[0](cut(xw[blocks[0]] + r[blocks[0]] @ h + rb[blocks[0]]))
                    rr = acts[0](cut(xw[blocks[1]] + r[blocks[1]] @ h + rb[blocks[1]]))
                    if attrs.get("linear_before_reset"):
                        n = acts[1](cut(xw[blocks[2]] + rr * (r[blocks[2]] @ h + rb[blocks[2]])))
                    else:
                        n = acts[1](cut(xw[blocks[2]] + r[blocks[2]] @ (rr * h) + rb[blocks[2]]))
                    h = (1 - z) * n + z * h
                else:
                    a = xw + r @ h + rb
                    i = acts[0](cut(a[:H] + p[:H] * c))
                    f = (1 - i if attrs.get("input_forget")
                         else acts[0](cut(a[2 * H:3 * H] + p[2 * H:] * c)))
                    c = f * c + i * acts[1](cut(a[3 * H:]))
                    o = acts[0](cut(a[H:2 * H] + p[H:2 * H] * c))
                    h = o * acts[2](c)
                y[t, d, b] = h
            y_h[d, b], y_c[d, b] = (0, 0) if lens[b] == 0 else (h, c)  # as onnxruntime
    if case.layout == 1:
        y, y_h, y_c = y.transpose(2, 0, 1, 3), y_h.swapaxes(0, 1), y_c.swapaxes(0, 1)
    return {name: value for name, value in zip(("Y", "Y_h", "Y_c"), (y, y_h, y_c))
            if name in case.used}


# ------------------------------------------------------------------------ models
def _feeds(case: Case, dtype=np.float64, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    d, gh = case.directions, GATES[case.op] * H
    states = (d, N, H) if case.layout == 0 else (N, d, H)
    shapes = {"X": (T, N, I) if case.layout == 0 else (N, T, I), "W": (d, gh, I),
              "R": (d, gh, H), "B": (d, 2 * gh), "h0": states, "c0": states, "P": (d, 3 * H)}
    feeds = {}
    for name in case.present:
        if name == "L":
            feeds[name] = np.array(case.lens, dtype=np.int32)
        else:
            feeds[name] = (rng.normal(size=shapes[name]) * 0.7).astype(dtype)
    return feeds


def build(case: Case, feeds: dict[str, np.ndarray]) -> onnx.ModelProto:
    """The one-node model of ``case``, its inputs the present ones of ``feeds``."""
    present = case.present
    last = max(INPUTS.index(n) for n in present)
    names = [n if n in present else "" for n in INPUTS[:last + 1]]
    outputs = [o if o in case.used else "" for o in OUTPUTS[case.op]]
    while not outputs[-1]:
        outputs.pop()
    attrs = {"hidden_size": H, "direction": case.direction, **dict(case.attrs)}
    if case.opset >= 14:
        attrs["layout"] = case.layout
    node = helper.make_node(case.op, names, outputs, **attrs)
    values = reference(case, feeds)
    elem = helper.np_dtype_to_tensor_dtype(feeds["X"].dtype)
    graph = helper.make_graph(
        [node], "recurrent",
        [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(feeds[n].dtype),
                                       feeds[n].shape) for n in present],
        [helper.make_tensor_value_info(o, elem, values[o].shape) for o in outputs if o])
    return model_of_graph(graph, opset=case.opset)


def _session(model: onnx.ModelProto):
    return create_session(model, session_options=quiet_session_options())


def _only(model: onnx.ModelProto, outputs: list[str]) -> onnx.ModelProto:
    """``model`` computing ``outputs`` alone: the nodes they need, and no others."""
    needed, kept = set(outputs), []
    for node in reversed(model.graph.node):
        if any(o in needed for o in node.output):
            kept.append(node)
            needed.update(i for i in node.input if i)
            needed.update(n for sub in subgraphs(node) for n in outer_references(sub))
    result = onnx.ModelProto()
    result.CopyFrom(model)
    del result.graph.node[:]
    result.graph.node.extend(reversed(kept))
    kept_outputs = [o for o in model.graph.output if o.name in outputs]
    del result.graph.output[:]
    result.graph.output.extend(kept_outputs)
    return result


def vjp(case: Case, feeds: dict[str, np.ndarray], cotangents: dict[str, np.ndarray],
        wrt: list[str]) -> dict[str, np.ndarray]:
    """lossgraph's gradients of sum_k <cotangents_k, output_k>, run in onnxruntime."""
    graph = lossgraph.gradient(build(case, feeds), weights=wrt, outputs=list(cotangents))
    assert not {n.domain for n in graph.graph.node} - {""}, "standard ops only"
    assert all(n.op_type not in GATES for n in _only(graph, [f"{w}_grad" for w in wrt])
               .graph.node), "the gradient recomputes the states: it never reads the node"
    session = _session(_only(graph, [f"{w}_grad" for w in wrt]))
    extra = {f"{name}_grad": value for name, value in cotangents.items()}
    names = [i.name for i in session.get_inputs()]
    values = session.run([f"{w}_grad" for w in wrt],
                         {k: v for k, v in {**feeds, **extra}.items() if k in names})
    return dict(zip(wrt, values))


def _float_inputs(case: Case) -> list[str]:
    return [n for n in case.present if n != "L"]


def check(case: Case, wrt: list[str] | None = None, seed: int = 0) -> dict[str, np.ndarray]:
    """lossgraph's float64 gradients equal central differences of the reference, and the
    reference equals onnxruntime's forward (float32) where onnxruntime runs the case."""
    feeds = _feeds(case, seed=seed)
    wrt = wrt or _float_inputs(case)
    outputs = reference(case, feeds)
    cotangents = {name: cotangent(value.shape, value.dtype) for name, value in outputs.items()}
    grads = vjp(case, feeds, cotangents, wrt)

    def loss(values: dict[str, np.ndarray]) -> float:
        result = reference(case, values)
        return sum(float(np.sum(cotangents[k] * result[k])) for k in cotangents)

    eps = 1e-6
    for name in wrt:
        numeric = np.zeros(feeds[name].shape)
        for index in np.ndindex(feeds[name].shape):
            moved = {k: v.copy() for k, v in feeds.items()}
            moved[name][index] += eps
            plus = loss(moved)
            moved[name][index] -= 2 * eps
            numeric[index] = (plus - loss(moved)) / (2 * eps)
        assert grads[name].shape == feeds[name].shape
        np.testing.assert_allclose(grads[name], numeric, rtol=1e-6, atol=1e-7,
                                   err_msg=f"d/d{name}: lossgraph vs finite differences")
    if _onnxruntime_runs(case):
        _check_reference_against_onnxruntime(case, feeds)
    return grads


def _onnxruntime_runs(case: Case) -> bool:
    """Whether onnxruntime computes ``case`` (in float32) as the spec does: it has no
    layout 1, and before 1.20 its RNN reads outside its buffer (forward) or returns
    initial_h (reverse) for Y_h of a sequence of length 0, where 1.20 and LSTM and GRU
    give 0."""
    import onnxruntime

    old = tuple(int(p) for p in onnxruntime.__version__.split(".")[:2]) < (1, 20)
    return case.layout == 0 and not (old and case.op == "RNN" and 0 in case.lens)


def _check_reference_against_onnxruntime(case: Case, feeds: dict[str, np.ndarray]) -> None:
    singles = {k: v.astype(np.float32) if v.dtype == np.float64 else v for k, v in feeds.items()}
    expected = reference(case, {k: v.astype(np.float64) if v.dtype == np.float32 else v
                                for k, v in singles.items()})
    session = _session(build(case, singles))
    for name, value in zip(expected, session.run(list(expected), singles)):
        np.testing.assert_allclose(value, expected[name], rtol=1e-4, atol=1e-5,
                                   err_msg=f"{name}: the reference vs onnxruntime's forward")


# ---------------------------------------------------------------- float64 checks
DIRECTIONS = ("forward", "reverse", "bidirectional")


@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("op", ["LSTM", "GRU", "RNN"])
def test_every_input_gets_its_gradient_through_every_output(op, direction):
    """X, W, R, B, initial_h (initial_c, P) through Y, Y_h (Y_c), with sequence_lens."""
    check(Case(op, direction))


@pytest.mark.parametrize("op", ["LSTM", "GRU", "RNN"])
def test_layout_1_the_batch_first(op):
    check(Case(op, "bidirectional", layout=1))


@pytest.mark.parametrize("op", ["LSTM", "GRU", "RNN"])
def test_without_optional_inputs_at_the_lowest_and_highest_opsets(op):
    check(Case(op, "bidirectional", inputs=("X", "W", "R"), opset=13))
    check(Case(op, "reverse", inputs=("X", "W", "R", "h0"), opset=21, layout=1))


@pytest.mark.parametrize("case", [
    Case("LSTM", "bidirectional", attrs=(("clip", 0.6),)),
    Case("GRU", "bidirectional", attrs=(("clip", 0.6),)),
    Case("GRU", "bidirectional", attrs=(("linear_before_reset", 1),)),
    Case("GRU", "reverse", attrs=(("linear_before_reset", 1), ("clip", 0.5))),
    Case("RNN", "bidirectional", attrs=(("clip", 0.4),)),
    Case("LSTM", "bidirectional", attrs=(("input_forget", 1),)),
    Case("LSTM", "forward", inputs=("X", "W", "R", "B", "L", "h0", "c0"),
         attrs=(("input_forget", 1), ("clip", 0.5))),
], ids=str)
def test_clip_linear_before_reset_and_input_forget(case):
    check(case)


@pytest.mark.parametrize("case", [
    # every activation of the spec, with alpha and beta where it takes them
    Case("LSTM", "bidirectional", attrs=(
        ("activations", ["HardSigmoid", "Softsign", "Elu", "Sigmoid", "ScaledTanh", "Softplus"]),
        ("activation_alpha", [0.3, 0.8, 1.2]), ("activation_beta", [0.45, 0.9]))),
    Case("GRU", "bidirectional", attrs=(
        ("activations", ["Sigmoid", "Affine", "HardSigmoid", "LeakyRelu"]),
        ("activation_alpha", [0.7, 0.25, 0.1]), ("activation_beta", [0.2, 0.55]))),
    Case("GRU", "forward", attrs=(("activations", ["Sigmoid", "ThresholdedRelu"]),
                                  ("activation_alpha", [0.1]))),
    Case("LSTM", "forward", attrs=(("activations", ["Sigmoid", "Relu", "Tanh"]),)),
    Case("RNN", "bidirectional", attrs=(("activations", ["Relu", "Sigmoid"]),)),
    Case("RNN", "bidirectional", attrs=(("activations", ["LeakyRelu", "Elu"]),
                                        ("activation_alpha", [0.2, 0.9]))),
], ids=str)
def test_the_activations_the_spec_lists(case):
    check(case)


@pytest.mark.parametrize("case", [
    Case("LSTM", "bidirectional", outputs=("Y_h",)),
    Case("LSTM", "forward", outputs=("Y_c",)),
    Case("GRU", "reverse", outputs=("Y",)),
    Case("RNN", "forward", outputs=("Y_h",), inputs=("X", "W", "R", "B", "L")),
], ids=str)
def test_one_output_alone(case):
    check(case)


@pytest.mark.parametrize("op", ["LSTM", "GRU", "RNN"])
def test_some_inputs_only(op):
    check(Case(op, "bidirectional"), wrt=["W"])
    check(Case(op, "reverse"), wrt=["h0", "X"])


@pytest.mark.parametrize("case", [
    Case("LSTM", "bidirectional", lens=(3, 0, 2)),
    Case("GRU", "bidirectional", lens=(0, 3, 1)),
    Case("RNN", "bidirectional", lens=(3, 0, 2)),
], ids=str)
def test_a_sequence_of_length_0(case):
    grads = check(case)
    empty = case.lens.index(0)
    assert not grads["X"][:, empty].any()


# -------------------------------------------------------- the reference, layout 1
@pytest.mark.parametrize("op", ["LSTM", "GRU", "RNN"])
def test_the_reference_follows_the_onnx_reference_implementation_in_layout_1(op):
    from onnx.reference import ReferenceEvaluator

    case = Case(op, "bidirectional", layout=1, inputs=("X", "W", "R", "B", "h0", "c0", "P"))
    feeds = _feeds(case)
    outputs = ReferenceEvaluator(build(case, feeds)).run(list(case.used), feeds)
    for name, value in zip(case.used, outputs):
        np.testing.assert_allclose(value, reference(case, feeds)[name], rtol=1e-12, atol=1e-12)


# ------------------------------------------------------ float32, onnxruntime's forward
@pytest.mark.parametrize("case", [
    Case("LSTM", "bidirectional", lens=(3, 0, 2)),
    Case("GRU", "bidirectional", lens=(1, 3, 0), attrs=(("linear_before_reset", 1),)),
    Case("GRU", "reverse"),
    Case("RNN", "bidirectional", attrs=(("activations", ["Tanh", "Relu"]),)),
    Case("LSTM", "reverse", attrs=(("input_forget", 1),)),
], ids=str)
def test_float32_gradients_match_onnxruntimes_forward(case):
    feeds = _feeds(case, np.float32, seed=1)
    for output in case.used:
        check_gradients(build(case, feeds), feeds, _float_inputs(case), output=output, eps=1e-2)


@pytest.mark.training
def test_gradient_graph_builder_has_no_gradient_for_recurrent_ops():
    """Nothing to compare with: onnxruntime-training 1.19's builder refuses these ops."""
    for op in GATES:
        case = Case(op)
        feeds = _feeds(case, np.float32)
        with pytest.raises(MissingGradientError, match=op):
            lossgraph.gradient(build(case, feeds), weights=["W"], outputs=["Y"], backend="ort")


# ------------------------------------------------------------------ named errors
@pytest.mark.parametrize("attrs, message", [
    ((("activations", ["Sigmoid", "Affine", "Tanh"]),), "default them differently"),
    ((("activations", ["Sigmoid", "Tanh", "ScaledTanh"]), ("activation_alpha", [1.0])),
     "default them differently"),
    ((("activations", ["Sigmoid", "Gelu", "Tanh"]),), "not one of the spec's"),
    ((("activations", ["Sigmoid", "Tanh"]),), "takes 3"),
])
def test_an_unsupported_activation_is_a_named_error(attrs, message):
    case = Case("LSTM", attrs=attrs)
    with pytest.raises(UnsupportedModelError, match=message):
        _gradient_of(case)


def _gradient_of(case: Case) -> onnx.ModelProto:
    """lossgraph's gradient graph of ``case`` (the forward reference is not run: the
    attributes may be ones it rejects)."""
    feeds = _feeds(case)
    plain = build(replace(case, attrs=()), feeds)
    node = plain.graph.node[0]
    node.attribute.extend(helper.make_attribute(k, v) for k, v in case.attrs if v != [])
    return lossgraph.gradient(plain, weights=["W"], outputs=["Y"])


@pytest.mark.parametrize("activations, alpha", [
    (["Tanh", "LeakyRelu"], [0.5]),  # onnxruntime reads alpha[1], the spec alpha[0]
    (["LeakyRelu"], []),  # onnxruntime's default alpha is 0, LeakyRelu's 0.01
])
def test_rnn_alpha_that_onnxruntime_reads_otherwise_is_a_named_error(activations, alpha):
    case = Case("RNN", "bidirectional" if len(activations) == 2 else "forward",
                attrs=(("activations", activations), ("activation_alpha", alpha)))
    with pytest.raises(UnsupportedModelError, match="by direction"):
        _gradient_of(case)


# ------------------------------------------------------------------------- torch
#: torch's gate blocks in ONNX's order: LSTM i, f, g, o -> i, o, f, c; GRU r, z, n -> z, r, h
TORCH_GATES = {"LSTM": [0, 3, 1, 2], "GRU": [1, 0, 2], "RNN": [0]}


def _onnx_gates(op: str, array: np.ndarray) -> np.ndarray:
    """A torch parameter (gates x H, ...) with its gate blocks in ONNX's order."""
    blocks = array.reshape(GATES[op], -1, *array.shape[1:])
    return blocks[TORCH_GATES[op]].reshape(array.shape)


@pytest.mark.torch
@pytest.mark.parametrize("op, bidirectional, batch_first, packed, attrs", [
    ("LSTM", True, True, True, ()),
    ("LSTM", False, False, False, ()),
    ("GRU", True, False, True, (("linear_before_reset", 1),)),
    ("GRU", False, True, False, (("linear_before_reset", 1),)),
    ("RNN", True, False, True, (("activations", ["Relu", "Relu"]),)),
    ("RNN", False, True, False, ()),
])
def test_gradients_match_torch_autograd(op, bidirectional, batch_first, packed, attrs):
    """nn.LSTM, nn.GRU (linear_before_reset) and nn.RNN with copied weights; packed
    sequences for sequence_lens, batch_first for layout 1."""
    import torch

    relu = dict(attrs).get("activations", ["Tanh"])[0] == "Relu"
    inputs = ("X", "W", "R", "B", "L", "h0", "c0") if packed else ("X", "W", "R", "B", "h0", "c0")
    case = Case(op, "bidirectional" if bidirectional else "forward", layout=int(batch_first),
                inputs=inputs, attrs=attrs, lens=(2, 3, 1))
    torch.manual_seed(0)
    kind = getattr(torch.nn, op)
    options = {"nonlinearity": "relu"} if relu else {}
    net = kind(I, H, batch_first=batch_first, bidirectional=bidirectional, **options).double()
    suffixes = ["", "_reverse"][:case.directions]
    param = {name: p for name, p in net.named_parameters()}

    def onnx_stack(*names: str) -> np.ndarray:
        return np.stack([np.concatenate([_onnx_gates(op, param[f"{n}_l0{s}"].detach().numpy())
                                         for n in names]) for s in suffixes])

    feeds = _feeds(case)
    feeds.update(W=onnx_stack("weight_ih"), R=onnx_stack("weight_hh"),
                 B=onnx_stack("bias_ih", "bias_hh"))
    outputs = reference(case, feeds)
    cotangents = {name: cotangent(value.shape, value.dtype) for name, value in outputs.items()}
    grads = vjp(case, feeds, cotangents, _float_inputs(case))

    x = torch.tensor(feeds["X"], requires_grad=True)
    states = [torch.tensor(feeds[n] if not batch_first else feeds[n].swapaxes(0, 1),
                           requires_grad=True) for n in ("h0", "c0")[:2 if op == "LSTM" else 1]]
    sequence = x
    if packed:
        sequence = torch.nn.utils.rnn.pack_padded_sequence(
            x, torch.tensor(case.lens), batch_first=batch_first, enforce_sorted=False)
    out, finals = net(sequence, tuple(states) if op == "LSTM" else states[0])
    if packed:
        out = torch.nn.utils.rnn.pad_packed_sequence(out, batch_first=batch_first,
                                                     total_length=T)[0]
    d = case.directions
    y = out.reshape(N, T, d, H) if batch_first else out.reshape(T, N, d, H).permute(0, 2, 1, 3)
    finals = finals if op == "LSTM" else (finals,)
    ys = {"Y": y, **{name: f.transpose(0, 1) if batch_first else f
                     for name, f in zip(("Y_h", "Y_c"), finals)}}
    np.testing.assert_allclose(ys["Y"].detach().numpy(), outputs["Y"], rtol=1e-12, atol=1e-12)
    sum((ys[k] * torch.from_numpy(v)).sum() for k, v in cotangents.items()).backward()

    def torch_grad(*names: str) -> np.ndarray:
        return np.stack([np.concatenate([_onnx_gates(op, param[f"{n}_l0{s}"].grad.numpy())
                                         for n in names]) for s in suffixes])

    expected = {"X": x.grad.numpy(), "W": torch_grad("weight_ih"), "R": torch_grad("weight_hh"),
                "B": torch_grad("bias_ih", "bias_hh"),
                **{n: s.grad.numpy() if not batch_first else s.grad.numpy().swapaxes(0, 1)
                   for n, s in zip(("h0", "c0"), states)}}
    for name, value in expected.items():
        np.testing.assert_allclose(grads[name], value, rtol=1e-9, atol=1e-12,
                                   err_msg=f"d/d{name}: lossgraph vs torch")


def _exported(net, example) -> onnx.ModelProto:
    """``net`` exported by torch's TorchScript exporter at opset 17, batch axis dynamic."""
    import torch

    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation warning
        torch.onnx.export(net, (example,), buffer, dynamo=False, opset_version=17,
                          input_names=["x"], output_names=["y"],
                          dynamic_axes={"x": {0: "N"}, "y": {0: "N"}})
    return onnx.load_from_string(buffer.getvalue())


@pytest.mark.torch
@pytest.mark.parametrize("fuse", ["step", "epoch"])
@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
def test_an_exported_recurrent_network_trains_like_torch_step_for_step(kind, fuse):
    import torch

    from lossgraph.optim import SGD

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.rnn = getattr(torch.nn, kind)(3, 4, batch_first=True, bidirectional=True)
            self.head = torch.nn.Linear(8, 1)

        def forward(self, x):  # through Y and Y_h
            out, finals = self.rnn(x)
            last = (finals[0] if kind == "LSTM" else finals).permute(1, 0, 2).reshape(-1, 8)
            return self.head(out.mean(dim=1) + last)

    torch.manual_seed(0)
    net = Net()
    with torch.no_grad():  # no two initializers equal: the exporter would merge them
        for p in net.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    rng = np.random.default_rng(0)
    X = rng.normal(size=(32, 5, 3)).astype(np.float32)
    y = np.tanh(X[:, :, 0].sum(axis=1, keepdims=True)).astype(np.float32)
    model = _exported(net, torch.from_numpy(X[:2]))
    assert kind in {n.op_type for n in model.graph.node}
    trainer = lossgraph.Trainer(lossgraph.compile_program(model, optimizer=SGD(0.2), fuse=fuse))
    assert_sgd_steps_like_torch(trainer, net, 0.2, X, y)
    assert abs(trainer.predict(X) - _session(model).run(None, {"x": X})[0]).max() > 1e-3
