"""lossgraph.torch: an ONNX graph as a torch layer. A torch network with an ONNX layer
trains, step for step, to the weights of the pure-torch network; its gradients are torch
autograd's; the trained layer exports back to ONNX; torch stays optional."""

from __future__ import annotations

import copy
import io
import subprocess
import sys
import warnings

import numpy as np
import onnx
import pytest
from support.environment import GOLDEN_MODELS
from support.models import model

from lossgraph.errors import InvalidDataError, ShapeMismatchError, UnknownNameError

TORCH_ONLY = pytest.mark.torch


# ------------------------------------------------------------------ helpers
def _values(array: np.ndarray) -> str:
    """``{1.5, -2.0, ...}``: the exact values of ``array`` in ONNX text."""
    return "{" + ", ".join(repr(float(v)) for v in np.asarray(array).ravel()) + "}"


def _head_text(head) -> onnx.ModelProto:
    """The torch head ``Linear(8, 6), Tanh, Linear(6, 1)`` written in ONNX text with
    MatMul/Add (not torch's Gemm), its initializers named like the head's parameters."""
    w0, b0, w2, b2 = (p.detach().numpy() for p in head.parameters())
    return model(
        f'(float[N, 8] h) => (float[N, 1] y) <float[6, 8] "0.weight" = {_values(w0)}, '
        f'float[6] "0.bias" = {_values(b0)}, float[1, 6] "2.weight" = {_values(w2)}, '
        f'float[1] "2.bias" = {_values(b2)}>',
        """
        t0 = Transpose <perm = [1, 0]> ("0.weight")
        m0 = MatMul(h, t0)
        z0 = Add(m0, "0.bias")
        a0 = Tanh(z0)
        t2 = Transpose <perm = [1, 0]> ("2.weight")
        m2 = MatMul(a0, t2)
        y = Add(m2, "2.bias")
        """)


def _head_export(head) -> onnx.ModelProto:
    """The torch head exported by ``torch.onnx.export`` (Gemm; initializers named like
    the head's parameters; its random weights are all different, so none is merged)."""
    import torch

    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation warning
        torch.onnx.export(head, (torch.zeros(2, 8),), buffer, dynamo=False, opset_version=18,
                          input_names=["h"], output_names=["y"],
                          dynamic_axes={"h": {0: "N"}, "y": {0: "N"}})
    return onnx.load_from_string(buffer.getvalue())


def _head(seed: int = 0):
    import torch

    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Tanh(), torch.nn.Linear(6, 1))


def _data(rows: int = 64, features: int = 4, dtype=np.float32):
    rng = np.random.default_rng(0)
    X = rng.normal(size=(rows, features)).astype(dtype)
    y = (np.sin(X[:, :1]) + X[:, 1:2] * X[:, 2:3]).astype(dtype)
    return X, y


def _close(actual, expected, rtol=1e-5, atol=1e-6, what=""):
    np.testing.assert_allclose(np.asarray(actual.detach()), np.asarray(expected.detach()),
                               rtol=rtol, atol=atol, err_msg=what)


#: A double model with a float output, an integer output and a scalar output.
THREE_OUTPUTS = model(
    "(double[N, 3] x) => (double[N, 2] p, int64[N] label, double s) "
    "<double[3, 2] w = {0.5, -1.25, 0.75, 0.3, -0.6, 1.1}, double[2] b = {0.1, -0.2}>",
    """
    z = Gemm(x, w, b)
    p = Softmax <axis = 1> (z)
    label = ArgMax <axis = 1, keepdims = 0> (z)
    s = ReduceSum <keepdims = 0> (z)
    """)


def _three_outputs_in_torch(x, w, b):
    import torch

    z = x @ w + b
    return torch.softmax(z, 1), z.argmax(1), z.sum()


# ------------------------------------------------------------------ (1) training
@TORCH_ONLY
@pytest.mark.parametrize("source", [_head_text, _head_export], ids=["onnx-text", "torch-export"])
def test_torch_network_with_an_onnx_layer_trains_like_the_pure_torch_network(source):
    import torch

    from lossgraph.torch import OnnxModule

    head = _head()
    first = torch.nn.Linear(4, 8)
    reference = torch.nn.Sequential(first, torch.nn.ReLU(), head)
    layer = OnnxModule(source(head))
    hybrid = torch.nn.Sequential(copy.deepcopy(first), torch.nn.ReLU(), layer)
    assert sorted(layer.parameter_names) == ["0.bias", "0.weight", "2.bias", "2.weight"]
    # the ONNX layer's weights, and only them, replace the head's
    pairs = [(hybrid[0].weight, first.weight), (hybrid[0].bias, first.bias),
             *((layer.onnx_parameters()[name], p) for name, p in head.named_parameters())]
    assert len(list(hybrid.parameters())) == len(pairs) == 6
    for ours, theirs in pairs:
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)

    X, y = _data()
    optimizers = [torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
                  for net in (reference, hybrid)]
    losses: list[list[float]] = [[], []]
    for step in range(10):
        rows = slice(16 * (step % 4), 16 * (step % 4) + 16)
        xb, yb = torch.from_numpy(X[rows]), torch.from_numpy(y[rows])
        for i, (net, optimizer) in enumerate(zip((reference, hybrid), optimizers)):
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(net(xb), yb)
            loss.backward()
            optimizer.step()
            losses[i].append(loss.item())
        np.testing.assert_allclose(losses[1], losses[0], rtol=1e-5, err_msg=f"step {step}")
        for ours, theirs in pairs:
            _close(ours, theirs, what=f"step {step}")
    assert losses[0][-1] < losses[0][0] * 0.7  # it learned: the comparison is not vacuous
    for name, parameter in layer.onnx_parameters().items():  # the ONNX weights moved
        initial = torch.from_numpy(layer.forward_backward.get_initializer(name).copy())
        assert not torch.equal(parameter.detach(), initial), name


# ------------------------------------------------------------------ (2) gradients
@TORCH_ONLY
def test_gradients_equal_torch_autograd_of_the_equivalent_torch_module():
    import torch

    from lossgraph.torch import OnnxModule

    head = _head(1)
    layer = OnnxModule(_head_text(head))
    h = torch.from_numpy(_data(rows=5, features=8)[0])
    ours_h, theirs_h = h.clone().requires_grad_(), h.clone().requires_grad_()
    weights = torch.linspace(-1, 1, 5)[:, None]
    (layer(ours_h) * weights).sum().backward()
    (head(theirs_h) * weights).sum().backward()
    _close(ours_h.grad, theirs_h.grad, what="input")
    for name, parameter in head.named_parameters():
        _close(layer.onnx_parameters()[name].grad, parameter.grad, what=name)


@TORCH_ONLY
def test_several_forward_passes_are_answered_in_any_order():
    """Each call keeps its own residuals: backward through the first call only, then
    through both, gives torch's gradients (a shared last-in-first-out stack would answer
    the first backward with the second call's residuals)."""
    import torch

    from lossgraph.torch import OnnxModule

    head = _head(2)
    layer = OnnxModule(_head_text(head))
    X = torch.from_numpy(_data(rows=6, features=8)[0])
    x1, x2 = X[:3], X[3:] * 2
    ours1, ours2 = layer(x1), layer(x2)
    theirs1, theirs2 = head(x1), head(x2)
    ours1.sum().backward(retain_graph=True)
    theirs1.sum().backward(retain_graph=True)
    for name, parameter in head.named_parameters():
        _close(layer.onnx_parameters()[name].grad, parameter.grad, what=f"first: {name}")
    (ours1 * ours2).sum().backward()
    (theirs1 * theirs2).sum().backward()
    for name, parameter in head.named_parameters():
        _close(layer.onnx_parameters()[name].grad, parameter.grad, what=f"both: {name}")


@TORCH_ONLY
def test_integer_outputs_are_not_differentiable_and_float_outputs_are():
    import torch

    from lossgraph.torch import OnnxModule

    layer = OnnxModule(THREE_OUTPUTS)
    x = torch.from_numpy(_data(rows=4, features=3, dtype=np.float64)[0])
    ours_x, theirs_x = x.clone().requires_grad_(), x.clone().requires_grad_()
    w, b = (p.detach().clone().requires_grad_() for p in (layer.w, layer.b))
    p, label, s = layer(ours_x)
    tp, tlabel, ts = _three_outputs_in_torch(theirs_x, w, b)
    assert (p.dtype, label.dtype, s.dtype) == (torch.float64, torch.int64, torch.float64)
    assert not label.requires_grad and p.requires_grad and s.shape == ()
    torch.testing.assert_close(label, tlabel, rtol=0, atol=0)
    scale = torch.tensor([[1.0, -3.0]], dtype=torch.float64)
    ((p * scale).sum() + s ** 2).backward()
    ((tp * scale).sum() + ts ** 2).backward()
    for ours, theirs in [(ours_x.grad, theirs_x.grad), (layer.w.grad, w.grad),
                         (layer.b.grad, b.grad)]:
        torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)


@TORCH_ONLY
def test_a_rank_0_weight_is_a_rank_0_parameter_with_a_rank_0_gradient():
    import torch

    from lossgraph.torch import OnnxModule

    layer = OnnxModule(model("(double[N, 2] x) => (double[N, 2] y) <double k = {2.5}>",
                             "y = Mul(x, k)"), weights_to_train=["k"])
    assert layer.k.shape == ()
    x = torch.arange(6, dtype=torch.float64).reshape(3, 2)
    y = layer(x)
    torch.testing.assert_close(y, x * 2.5)
    y.sum().backward()
    assert layer.k.grad.shape == ()
    torch.testing.assert_close(layer.k.grad, x.sum())


@TORCH_ONLY
def test_second_order_gradients_raise():
    import torch

    from lossgraph.torch import OnnxModule

    layer = OnnxModule(_head_text(_head()))
    h = torch.ones(2, 8, requires_grad=True)
    (grad,) = torch.autograd.grad(layer(h).square().sum(), h, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        grad.sum().backward()


@TORCH_ONLY
def test_gradcheck_in_float64_on_a_double_model():
    import torch

    from lossgraph.compat.forward_backward import OrtGradientForwardBackward
    from lossgraph.torch import OnnxFunction, OnnxModule

    onx = onnx.load(GOLDEN_MODELS / "hand_mlp_tanh_double.onnx")
    owner = OrtGradientForwardBackward(onx)
    assert owner.grad_input_names == ["X", "W1", "B1", "W2", "B2"]
    X = torch.from_numpy(_data(rows=3, features=5, dtype=np.float64)[0]).requires_grad_()
    weights = [torch.from_numpy(owner.get_initializer(n).copy()).requires_grad_()
               for n in owner.weights_to_train]
    assert torch.autograd.gradcheck(lambda *t: OnnxFunction.apply(owner, *t), (X, *weights))

    layer = OnnxModule(onx)
    assert torch.autograd.gradcheck(layer, (X,))
    # the module's parameters, through the function, against finite differences too
    assert torch.autograd.gradcheck(
        lambda *w: OnnxFunction.apply(layer.forward_backward, X, *w)[0],
        tuple(layer.onnx_parameters().values()))


@TORCH_ONLY
def test_an_input_changed_in_place_before_backward_is_an_error_not_a_wrong_gradient():
    import torch

    from lossgraph.torch import OnnxModule

    layer = OnnxModule(_head_text(_head()))
    h = torch.ones(2, 8)
    y = layer(h)
    h.mul_(2)  # the backward graph reads h again, from memory h shares
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


@TORCH_ONLY
def test_weights_to_train_makes_only_those_initializers_parameters():
    import torch

    from lossgraph.torch import OnnxModule

    head = _head()
    onx = _head_text(head)
    layer = OnnxModule(onx, weights_to_train=["2.weight"])
    assert [name for name, _ in layer.named_parameters()] == ["2_weight"]
    h = torch.ones(3, 8, requires_grad=True)
    layer(h).sum().backward()
    head(h.detach().requires_grad_()).sum().backward()
    _close(layer.get_parameter("2_weight").grad, head[2].weight.grad)
    assert h.grad is not None and h.grad.abs().sum() > 0
    with torch.no_grad():
        layer.get_parameter("2_weight").add_(1.0)
    exported = {t.name: onnx.numpy_helper.to_array(t) for t in layer.to_onnx().graph.initializer}
    original = {t.name: onnx.numpy_helper.to_array(t) for t in onx.graph.initializer}
    np.testing.assert_array_equal(exported["2.weight"], original["2.weight"] + 1)
    for name in ("0.weight", "0.bias", "2.bias"):
        np.testing.assert_array_equal(exported[name], original[name])
    with pytest.raises(UnknownNameError, match="missing"):
        OnnxModule(onx, weights_to_train=["missing"])


# ------------------------------------------------------------------ (3) export
@TORCH_ONLY
def test_to_onnx_after_training_predicts_like_the_module(ort_session):
    import torch

    from lossgraph.torch import OnnxModule

    head = _head()
    onx = _head_export(head)
    before = onx.SerializeToString()
    layer = OnnxModule(onx)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), layer)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    X, y = (torch.from_numpy(a) for a in _data())
    for _ in range(5):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(net(X), y).backward()
        optimizer.step()

    trained = layer.to_onnx()
    onnx.checker.check_model(trained, full_check=True)
    assert onx.SerializeToString() == before  # the layer's model is not changed
    values = {t.name: onnx.numpy_helper.to_array(t) for t in trained.graph.initializer}
    for name, parameter in layer.onnx_parameters().items():
        np.testing.assert_array_equal(values[name], parameter.detach().numpy())
        assert not np.array_equal(values[name], layer.forward_backward.get_initializer(name))
    with torch.no_grad():
        h = net[1](net[0](X))
        expected = layer(h).numpy()
    (predicted,) = ort_session(trained).run(None, {"h": h.numpy()})
    np.testing.assert_allclose(predicted, expected, rtol=1e-6, atol=1e-7)


# ------------------------------------------------------------------ (4) no_grad / eval
@TORCH_ONLY
def test_no_grad_and_inference_mode_run_the_prediction_graph_and_keep_nothing(monkeypatch):
    import torch

    from lossgraph.runtime.graph_function import GraphFunctionCall
    from lossgraph.torch import OnnxModule

    calls: list[bool] = []
    original = GraphFunctionCall.forward

    def spy(self, inputs, training=False):
        calls.append(training)
        return original(self, inputs, training=training)

    monkeypatch.setattr(GraphFunctionCall, "forward", spy)
    head = _head()
    layer = OnnxModule(_head_text(head))
    h = torch.from_numpy(_data(rows=5, features=8)[0])
    with_grad = layer(h)
    assert calls == [True] and with_grad.grad_fn is not None
    with torch.no_grad():
        without = layer(h)
    with torch.inference_mode():
        inferred = layer(h)
    layer.requires_grad_(False)
    frozen = layer(h)  # nothing requires a gradient
    assert calls == [True, False, False, False]
    for out in (without, inferred, frozen):
        assert out.grad_fn is None and not out.requires_grad
        _close(out, with_grad)  # the prediction graph: the same numbers, other kernels
        _close(out, head(h))


@TORCH_ONLY
def test_eval_mode_still_gives_gradients_like_torch_layers():
    import torch

    from lossgraph.torch import OnnxModule

    head = _head()
    layer = OnnxModule(_head_text(head)).eval()
    head.eval()
    assert not layer.training
    h = torch.ones(2, 8)
    layer(h).sum().backward()
    head(h).sum().backward()
    for name, parameter in head.named_parameters():
        _close(layer.onnx_parameters()[name].grad, parameter.grad, what=name)


# ------------------------------------------------------------------ (5) errors
@TORCH_ONLY
def test_wrong_inputs_raise_lossgraph_errors_that_name_the_input():
    import torch

    from lossgraph.torch import OnnxFunction, OnnxModule

    layer = OnnxModule(_head_text(_head()))
    h = torch.ones(3, 8)
    with pytest.raises(InvalidDataError, match=r"'h' is torch.float64; the ONNX model takes "
                                               r"torch.float32"):
        layer(h.double())
    with pytest.raises(InvalidDataError, match=r"'h' is torch.int64"):
        layer(torch.ones(3, 8, dtype=torch.int64))
    with pytest.raises(InvalidDataError, match=r"takes 1 input\(s\) \(h\), got 2"):
        layer(h, h)
    with pytest.raises(InvalidDataError, match=r"got 0"):
        layer()
    with pytest.raises(ShapeMismatchError, match=r"'h' has shape \[3, 5\]; .* \[\?, 8\]"):
        layer(torch.ones(3, 5))
    with pytest.raises(ShapeMismatchError, match=r"'h' has shape \[8\]"):
        layer(torch.ones(8))
    with pytest.raises(InvalidDataError, match="not a torch.Tensor"):
        layer(np.ones((3, 8), np.float32))
    with pytest.raises(InvalidDataError, match=r"takes 5 tensors \(h, "):
        OnnxFunction.apply(layer.forward_backward, h)
    with pytest.raises(InvalidDataError, match="OrtGradientForwardBackward"):
        OnnxFunction.apply("not a function", h)
    layer.double()  # the parameters no longer have the model's dtype
    with pytest.raises(InvalidDataError, match=r"Weight '0.weight' is torch.float64"):
        layer(h)


@TORCH_ONLY
def test_the_function_takes_a_function_object_for_its_owner():
    import torch

    from lossgraph.compat.forward_backward import OrtGradientForwardBackward
    from lossgraph.torch import OnnxFunction

    head = _head()
    owner = OrtGradientForwardBackward(_head_text(head))
    h = torch.ones(2, 8, requires_grad=True)
    weights = [torch.from_numpy(owner.get_initializer(n).copy())
               for n in owner.weights_to_train]
    (y,) = OnnxFunction.apply(owner.new_instance(), h, *weights)
    y.sum().backward()
    head(h.detach().requires_grad_()).sum().backward()
    _close(y, head(h))
    assert h.grad is not None and h.grad.shape == (2, 8)


# ------------------------------------------------------------------ (6) state_dict
SANITIZED = model(
    '(float[N, 2] x) => (float[N, 2] y) <float[2] "a.b" = {1.5, -2}, float[2] a_b = {0.25, 4}, '
    'float[2] training = {3, 1}, float[2] "layer/0:w" = {-1, 0.5}>',
    """
    m = Mul(x, "a.b")
    p = Add(m, a_b)
    q = Mul(p, training)
    y = Sub(q, "layer/0:w")
    """)


@TORCH_ONLY
def test_parameter_names_follow_torchs_rules_and_the_mapping_is_kept():
    import torch

    from lossgraph.torch import OnnxModule

    layer = OnnxModule(SANITIZED)
    assert layer.parameter_names == {"a.b": "a_b", "a_b": "a_b_1", "training": "training_1",
                                     "layer/0:w": "layer_0_w"}
    assert list(layer.state_dict()) == ["a_b", "a_b_1", "training_1", "layer_0_w"]
    assert layer.training is True  # torch's own attribute is untouched
    for name, parameter in layer.onnx_parameters().items():
        np.testing.assert_array_equal(parameter.detach().numpy(),
                                      layer.forward_backward.get_initializer(name))
    x = torch.tensor([[1.0, 2.0]])
    expected = ((x * torch.tensor([1.5, -2]) + torch.tensor([0.25, 4])) * torch.tensor([3, 1])
                - torch.tensor([-1, 0.5]))
    _close(layer(x), expected)


@TORCH_ONLY
@pytest.mark.parametrize("onx", [SANITIZED, None], ids=["sanitized-names", "torch-export"])
def test_state_dict_round_trip(onx):
    import torch

    from lossgraph.torch import OnnxModule

    onx = onx if onx is not None else _head_export(_head())
    width = onx.graph.input[0].type.tensor_type.shape.dim[1].dim_value
    trained, fresh = OnnxModule(onx), OnnxModule(onx)
    x = torch.from_numpy(_data(rows=7, features=width)[0])
    optimizer = torch.optim.SGD(trained.parameters(), lr=0.1)
    for _ in range(3):
        optimizer.zero_grad()
        trained(x).square().mean().backward()
        optimizer.step()
    with torch.no_grad():
        assert not torch.equal(fresh(x), trained(x))

    buffer = io.BytesIO()
    torch.save(trained.state_dict(), buffer)
    buffer.seek(0)
    fresh.load_state_dict(torch.load(buffer))
    with torch.no_grad():
        torch.testing.assert_close(fresh(x), trained(x), rtol=0, atol=0)
    assert fresh.to_onnx().SerializeToString() == trained.to_onnx().SerializeToString()
    with pytest.raises(RuntimeError, match="size mismatch"):
        fresh.load_state_dict({k: torch.zeros(1, 1, 1) for k in trained.state_dict()})


@TORCH_ONLY
def test_a_deep_copy_trains_on_its_own():
    import torch

    from lossgraph.torch import OnnxModule

    layer = OnnxModule(_head_text(_head()))
    twin = copy.deepcopy(layer)
    x = torch.ones(2, 8)
    twin(x).sum().backward()
    with torch.no_grad():
        for p in twin.parameters():
            p.sub_(p.grad)
        assert not torch.equal(twin(x), layer(x))
    assert all(p.grad is None for p in layer.parameters())


# ------------------------------------------------------------------ torch stays optional
def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)


def test_import_lossgraph_never_imports_torch():
    result = _python("import sys, lossgraph, lossgraph.compat, lossgraph.errors\n"
                     "assert 'torch' not in sys.modules, 'torch imported'")
    assert result.returncode == 0, result.stderr


def test_lossgraph_torch_without_torch_says_what_to_install():
    result = _python(
        "import sys\n"
        "sys.modules['torch'] = None  # as if torch were not installed\n"
        "from lossgraph.errors import RuntimeUnavailableError\n"
        "try:\n"
        "    import lossgraph.torch\n"
        "except RuntimeUnavailableError as exc:\n"
        "    print(exc)\n"
        "else:\n"
        "    raise SystemExit('imported')\n")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "pip install torch==2.13.0" in result.stdout
