"""Models exported in training mode (torch.onnx.export(..., training=TrainingMode.TRAINING)).

A training-mode BatchNormalization's running mean and variance are training state
(buffers): updated every step as torch updates them (momentum, unbiased variance), carried
by every fusion mode, saved in checkpoints and written back by the inference export. The
evaluate and predict graphs and the exported model run BatchNormalization and Dropout in
inference mode; a training-mode Dropout's gradient uses the mask its forward pass drew.
"""

from __future__ import annotations

import copy
import io
import warnings

import numpy as np
import onnx
import pytest
from onnx import helper
from support.torch_steps import make_distinct

import lossgraph
from lossgraph.errors import InvalidProgramError, UnsupportedModelError, UnsupportedOptionError
from lossgraph.export import to_inference_model, to_ort_artifacts
from lossgraph.graphs import all_graphs
from lossgraph.manifest import FORMAT, FORMAT_WITH_BUFFERS, check_manifest
from lossgraph.optim import SGD, Adam
from lossgraph.passes import RunningStatistics, WeightsToInputs
from lossgraph.passes.running_stats import buffer_names
from lossgraph.runtime.session import create_session

TORCH = pytest.mark.torch
MODES = ("step", "epoch", "separate")
OPTIMIZERS = {"sgd": (SGD(0.05), lambda torch, p: torch.optim.SGD(p, lr=0.05)),
              "adam": (Adam(0.01), lambda torch, p: torch.optim.Adam(p, lr=0.01))}
BATCH = 8
ROWS = 2 * BATCH + 5  # two full batches, then a smaller one


# -- torch models ------------------------------------------------------------------------------


def _cnn(torch):
    """Conv (no bias: a bias before BatchNorm has no gradient, and Adam would amplify its
    rounding noise), BatchNorm2d, ReLU, Dropout(p=0), Linear."""
    nn = torch.nn
    return nn.Sequential(nn.Conv2d(2, 3, 3, bias=False), nn.BatchNorm2d(3), nn.ReLU(),
                         nn.Dropout(0.0), nn.Flatten(), nn.Linear(3 * 4 * 4, 2))


def _mlp(torch):
    """Linear, BatchNorm1d with torch momentum 0.3 (ONNX momentum 0.7), ReLU, Linear."""
    nn = torch.nn
    return nn.Sequential(nn.Linear(5, 6, bias=False), nn.BatchNorm1d(6, momentum=0.3), nn.ReLU(),
                         nn.Linear(6, 1))


NETS = {"cnn": (_cnn, (2, 6, 6), 2), "mlp": (_mlp, (5,), 1)}


def _net(torch, kind: str):
    """A torch net whose every parameter and buffer differs from every other (the exporter
    would merge equal initializers), running statistics included."""
    torch.manual_seed(0)
    net = NETS[kind][0](torch)
    make_distinct(net)
    net.train()
    return net


def _export(torch, net, kind: str, opset: int = 17) -> onnx.ModelProto:
    buffer = io.BytesIO()
    example = torch.zeros((4, *NETS[kind][1]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation warning
        torch.onnx.export(net, (example,), buffer, dynamo=False, opset_version=opset,
                          training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False,
                          input_names=["x"], output_names=["y"],
                          dynamic_axes={"x": {0: "N"}, "y": {0: "N"}})
    net.train()  # the exporter puts the module back as it found it; make sure
    return onnx.load_from_string(buffer.getvalue())


def _data(kind: str, rows: int = ROWS):
    rng = np.random.default_rng(1)
    shape, outputs = NETS[kind][1], NETS[kind][2]
    X = rng.normal(size=(rows, *shape)).astype(np.float32)
    y = rng.normal(size=(rows, outputs)).astype(np.float32)
    return X, y


def _torch_epoch(torch, net, optimizer, X, y) -> float:
    """One epoch of torch training in order, batches of BATCH rows; the mean loss per row."""
    tx, ty = torch.from_numpy(X), torch.from_numpy(y)
    total = 0.0
    for lo in range(0, len(X), BATCH):
        optimizer.zero_grad()
        loss = ((net(tx[lo:lo + BATCH]) - ty[lo:lo + BATCH]) ** 2).mean()
        loss.backward()
        optimizer.step()
        total += float(loss.detach()) * len(tx[lo:lo + BATCH])
    return total / len(X)


def _assert_state_equals_torch(state, net, what: str) -> None:
    """Every parameter and running statistic of ``net`` equals ``state``'s (by the export's
    initializer names, which are torch's state-dict keys)."""
    compared = 0
    for name, value in net.state_dict().items():
        if name.endswith("num_batches_tracked"):
            continue
        np.testing.assert_allclose(state[name], value.detach().numpy(), rtol=1e-5, atol=1e-6,
                                   err_msg=f"{name} ({what})")
        compared += 1
    assert compared == len([k for k in state if not k.endswith(("_m", "_v"))])


def _run(model: onnx.ModelProto, X: np.ndarray) -> np.ndarray:
    return create_session(model).run(None, {"x": X})[0]


# -- step for step, as torch ---------------------------------------------------------------------


@TORCH
@pytest.mark.parametrize("fuse", MODES)
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("kind", sorted(NETS))
def test_training_equals_torch_weights_and_running_statistics(kind, optimizer, fuse):
    import torch
    net = _net(torch, kind)
    model = _export(torch, net, kind)
    ours, make_theirs = OPTIMIZERS[optimizer]
    program = lossgraph.compile_program(model, optimizer=ours, fuse=fuse)
    means = [name for name in program.buffers if name.endswith("running_mean")]
    assert program.buffers == [b for m in means for b in (m, m.replace("_mean", "_var"))]
    assert not set(program.buffers) & set(program.weights)
    trainer = lossgraph.Trainer(program)
    theirs = make_theirs(torch, net.parameters())
    X, y = _data(kind)
    # the first epoch a step at a time (for fuse="epoch": a Scan of one batch, then the step
    # graph for the last, smaller batch), the second in one fit (a Scan of two batches)
    for step, lo in enumerate(range(0, ROWS, BATCH)):
        rows = slice(lo, lo + BATCH)
        trainer.fit(X[rows], y[rows], epochs=1, batch_size=BATCH, shuffle=False,
                    warm_start=step > 0, progress=False)
        loss = _torch_epoch(torch, net, theirs, X[rows], y[rows])
        assert trainer.train_losses_[-1] == pytest.approx(loss, rel=1e-5)
        _assert_state_equals_torch(trainer.state, net, f"after step {step + 1}")
    trainer.fit(X, y, epochs=1, batch_size=BATCH, shuffle=False, warm_start=True,
                progress=False)
    loss = _torch_epoch(torch, net, theirs, X, y)
    assert trainer.train_losses_[-1] == pytest.approx(loss, rel=1e-5)
    _assert_state_equals_torch(trainer.state, net, "after the second epoch")
    assert trainer.steps_ == 6
    for name in program.buffers:  # the running statistics moved
        assert not np.allclose(trainer.state[name], program.state[name])

    net.eval()
    with torch.no_grad():
        expected = net(torch.from_numpy(X)).numpy()
        eval_loss = float(((net(torch.from_numpy(X)) - torch.from_numpy(y)) ** 2).mean())
    # the inference export predicts like torch's eval-mode model, and so does the trainer
    exported = to_inference_model(trainer)
    np.testing.assert_allclose(_run(exported, X), expected, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(trainer.predict(X), expected, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(_run(trainer.to_inference_model(), X), expected, rtol=1e-4,
                               atol=1e-5)
    # the evaluate graph gives the eval-mode loss
    assert trainer.evaluate(X, y) == pytest.approx(eval_loss, rel=1e-5)


@TORCH
@pytest.mark.parametrize("kind", sorted(NETS))
def test_the_forward_backward_object_updates_running_statistics_as_torch(kind):
    """OrtGradientForwardBackward: each training forward updates the running statistics as
    torch's training step does; an eval forward normalizes with them, as torch's eval."""
    import torch
    net = _net(torch, kind)
    fb = lossgraph.OrtGradientForwardBackward(_export(torch, net, kind))
    assert set(fb.running_statistics) == {name for name, _ in net.named_buffers()
                                          if name.endswith(("running_mean", "running_var"))}
    weights = {name: fb.get_initializer(name) for name in fb.weights_to_train}
    by_onnx = {name: parameter for name, parameter in net.named_parameters()}
    assert set(weights) == set(by_onnx)
    X, y = _data(kind)
    function = fb.new_instance()
    for lo in range(0, ROWS, BATCH):
        batch = slice(lo, lo + BATCH)
        (prediction,) = function.forward([X[batch], *weights.values()], training=True)
        net.zero_grad()
        theirs = net(torch.from_numpy(X[batch]))
        np.testing.assert_allclose(prediction, theirs.detach().numpy(), rtol=1e-5, atol=1e-6)
        ((theirs - torch.from_numpy(y[batch])) ** 2).mean().backward()
        grad_y = 2 * (prediction - y[batch]) / prediction.size
        grads = function.backward([grad_y])[1:]
        for name, grad in zip(weights, grads):
            np.testing.assert_allclose(grad, by_onnx[name].grad.numpy(), rtol=1e-4, atol=1e-6,
                                       err_msg=name)
    for name, value in fb.running_statistics.items():
        buffer = dict(net.named_buffers())[name]
        np.testing.assert_allclose(value, buffer.numpy(), rtol=1e-5, atol=1e-6, err_msg=name)
    net.eval()
    with torch.no_grad():
        expected = net(torch.from_numpy(X)).numpy()
    (predicted,) = function.forward([X, *weights.values()], training=False)
    np.testing.assert_allclose(predicted, expected, rtol=1e-4, atol=1e-5)


@TORCH
@pytest.mark.parametrize("opset", [13, 15])
def test_older_batch_normalization_forms_train_as_torch(opset):
    """Opset 13's training form (five outputs, no training_mode) and opset 15's."""
    import torch
    net = _net(torch, "mlp")
    model = _export(torch, net, "mlp", opset=opset)
    (node,) = [n for n in model.graph.node if n.op_type == "BatchNormalization"]
    assert len(node.output) == (5 if opset == 13 else 3)
    program = lossgraph.compile_program(model, optimizer=SGD(0.05), fuse="step")
    X, y = _data("mlp")
    trainer = lossgraph.Trainer(program).fit(X, y, epochs=2, batch_size=BATCH, shuffle=False,
                                             progress=False)
    theirs = torch.optim.SGD(net.parameters(), lr=0.05)
    for _ in range(2):
        _torch_epoch(torch, net, theirs, X, y)
    _assert_state_equals_torch(trainer.state, net, f"opset {opset}")
    net.eval()
    with torch.no_grad():
        expected = net(torch.from_numpy(X)).numpy()
    np.testing.assert_allclose(_run(to_inference_model(trainer), X), expected, rtol=1e-4,
                               atol=1e-5)


@TORCH
@pytest.mark.parametrize("fuse", MODES)
def test_accumulation_updates_running_statistics_per_micro_batch_as_torch(fuse):
    """Micro-batches of 4 rows, 2 per update (the last update one micro-batch): the running
    statistics move with every micro-batch, the weights with every second, as torch's
    accumulation (loss scaled by the micro-batch's share of its update's rows)."""
    import torch
    net = _net(torch, "mlp")
    program = lossgraph.compile_program(_export(torch, net, "mlp"), optimizer=SGD(0.05),
                                        fuse=fuse, accumulation_steps=2)
    X, y = _data("mlp", rows=20)
    trainer = lossgraph.Trainer(program).fit(X, y, epochs=1, batch_size=4, shuffle=False,
                                             progress=False)
    theirs = torch.optim.SGD(net.parameters(), lr=0.05)
    tx, ty = torch.from_numpy(X), torch.from_numpy(y)
    for group in range(0, 20, 8):
        theirs.zero_grad()
        rows = min(8, 20 - group)
        for lo in range(group, group + rows, 4):
            loss = ((net(tx[lo:lo + 4]) - ty[lo:lo + 4]) ** 2).mean()
            (loss * 4 / rows).backward()
        theirs.step()
    assert trainer.steps_ == 3
    _assert_state_equals_torch(trainer.state, net, "after an epoch of accumulation")


# -- what the graphs are --------------------------------------------------------------------------

BN_DROPOUT = """<ir_version: 10, opset_import: ["" : 17]>
net (float[N, 3] x) => (float[N, 2] y)
<float[3] scale = {1.0, 0.5, 2.0}, float[3] shift = {0.1, -0.2, 0.3},
 float[3] mean = {0.5, -0.5, 1.0}, float[3] var = {1.0, 2.0, 0.5},
 float[3, 2] W = {0.1, 0.2, -0.3, 0.4, -0.5, 0.6}, float[2] B = {0.01, 0.02},
 float ratio = {0.5}, bool training = {1}>
{
  h, running_mean, running_var = BatchNormalization <training_mode: int = 1, momentum: float = 0.8>
      (x, scale, shift, mean, var)
  a = Relu(h)
  d, mask = Dropout(a, ratio, training)
  z = MatMul(d, W)
  y = Add(z, B)
}"""


def _bn_dropout() -> onnx.ModelProto:
    return onnx.parser.parse_model(BN_DROPOUT)


def _training_mode(node: onnx.NodeProto) -> int:
    return next((helper.get_attribute_value(a) for a in node.attribute
                 if a.name == "training_mode"), 0)


def _roles(program, graph: str) -> dict[str, str]:
    entry = program.manifest["graphs"][graph]
    return {v["name"]: v["role"] for v in (*entry["inputs"], *entry["outputs"])}


@pytest.mark.parametrize("fuse", MODES)
def test_buffers_are_inputs_and_outputs_with_their_roles(fuse):
    program = lossgraph.compile_program(_bn_dropout(), fuse=fuse)
    assert program.weights == ["scale", "shift", "W", "B"]
    assert program.buffers == ["mean", "var"]
    assert program.manifest["format"] == FORMAT_WITH_BUFFERS
    assert program.manifest["buffers"] == [{"name": "mean", "new": "mean_new"},
                                           {"name": "var", "new": "var_new"}]
    np.testing.assert_array_equal(program.state["mean"], [0.5, -0.5, 1.0])
    training = {"step": ["train_step"], "epoch": ["train_step", "train_epoch",
                                                  "train_epoch_ordered"],
                "separate": ["gradient"]}[fuse]
    for graph in training:
        roles = _roles(program, graph)
        assert (roles["mean"], roles["var"]) == ("buffer", "buffer")
        assert (roles["mean_new"], roles["var_new"]) == ("new_buffer", "new_buffer")
    for graph in ("evaluate", "predict"):
        roles = _roles(program, graph)
        assert (roles["mean"], roles["var"]) == ("buffer", "buffer")
        assert "mean_new" not in roles
        nodes = program.graphs[graph].graph.node
        norm = next(n for n in nodes if n.op_type == "BatchNormalization")
        assert list(norm.output) == ["h"]
        assert _training_mode(norm) == 0
        assert not any(n.op_type == "Dropout" for n in nodes)  # the identity
    # no training graph runs onnxruntime's training-mode kernel (it writes its inputs): the
    # node is lossgraph's function, whose body normalizes in inference mode
    for graph in training:
        model = program.graphs[graph]
        nodes = [n for g in all_graphs(model.graph) for n in g.node]  # a Scan body too
        assert [n.op_type for n in nodes if n.domain == "lossgraph"] == [
            "BatchNormalizationTraining"]
        for node in [*nodes, *(n for f in model.functions for n in f.node)]:
            if node.op_type == "BatchNormalization":
                assert len(node.output) == 1 and _training_mode(node) == 0


def test_evaluate_and_the_export_are_deterministic_and_training_is_not():
    X = np.random.default_rng(0).normal(size=(32, 3)).astype(np.float32)
    y = np.random.default_rng(1).normal(size=(32, 2)).astype(np.float32)
    program = lossgraph.compile_program(_bn_dropout(), optimizer=SGD(0.0))
    trainer = lossgraph.Trainer(program)
    losses = [trainer.fit(X, y, epochs=1, batch_size=32, shuffle=False,
                          progress=False).train_losses_[-1] for _ in range(3)]
    assert len(set(losses)) > 1  # the dropout mask is drawn again at every step
    assert trainer.evaluate(X, y) == trainer.evaluate(X, y)
    np.testing.assert_array_equal(trainer.predict(X), trainer.predict(X))
    # with a learning rate 0 only the running statistics move: the eval model sees them
    state = trainer.state
    p = {t.name: onnx.numpy_helper.to_array(t) for t in _bn_dropout().graph.initializer}
    h = p["scale"] * (X - state["mean"]) / np.sqrt(state["var"] + 1e-5) + p["shift"]
    expected = np.maximum(h, 0) @ p["W"] + p["B"]
    np.testing.assert_allclose(_run(to_inference_model(trainer), X), expected, rtol=1e-5,
                               atol=1e-6)
    np.testing.assert_allclose(trainer.predict(X), expected, rtol=1e-5, atol=1e-6)
    assert trainer.evaluate(X, y) == pytest.approx(float(np.mean((expected - y) ** 2)), rel=1e-5)


def test_the_running_statistics_update_is_torchs_unbiased_one():
    """m running + (1 - m) batch statistic, with the unbiased variance (n / (n - 1))."""
    X = np.random.default_rng(0).normal(size=(16, 3)).astype(np.float32)
    y = np.zeros((16, 2), np.float32)
    program = lossgraph.compile_program(_bn_dropout(), optimizer=SGD(0.1))
    state = lossgraph.Trainer(program).fit(X, y, epochs=1, batch_size=16, progress=False).state
    m = np.float32(0.8)
    np.testing.assert_allclose(state["mean"], m * program.state["mean"] + (1 - m) * X.mean(0),
                               rtol=1e-6)
    np.testing.assert_allclose(state["var"], m * program.state["var"]
                               + (1 - m) * X.var(0, ddof=1), rtol=1e-6)


def test_a_checkpoint_keeps_the_running_statistics(tmp_path):
    X = np.random.default_rng(0).normal(size=(40, 3)).astype(np.float32)
    y = np.random.default_rng(1).normal(size=(40, 2)).astype(np.float32)
    without_dropout = BN_DROPOUT.replace("float ratio = {0.5}", "float ratio = {0.0}")
    program = lossgraph.compile_program(onnx.parser.parse_model(without_dropout), fuse="epoch")
    trainer = lossgraph.Trainer(program).fit(X, y, epochs=1, batch_size=8, progress=False,
                                             random_state=0)
    trainer.save_checkpoint(tmp_path / "ckpt")
    resumed = lossgraph.Trainer.load_checkpoint(tmp_path / "ckpt")
    assert resumed.program.buffers == ["mean", "var"]
    for name, value in trainer.state.items():
        np.testing.assert_array_equal(resumed.state[name], value, err_msg=name)
    for t in (trainer, resumed):
        t.fit(X, y, epochs=1, batch_size=8, warm_start=True, progress=False)
    for name, value in trainer.state.items():
        np.testing.assert_array_equal(resumed.state[name], value, err_msg=name)
    exported = to_inference_model(tmp_path / "ckpt")
    stored = {t.name: onnx.numpy_helper.to_array(t) for t in exported.graph.initializer}
    assert not np.array_equal(stored["mean"], program.state["mean"])
    # a saved program keeps its buffers and their roles
    program.save(tmp_path / "program")
    loaded = lossgraph.TrainingProgram.load(tmp_path / "program")
    assert loaded.buffers == ["mean", "var"] and loaded.manifest == program.manifest


def test_programs_without_buffers_keep_format_1_and_both_formats_are_checked():
    linear = onnx.parser.parse_model("""<ir_version: 8, opset_import: ["" : 18]>
        g (float[N, 2] x) => (float[N, 1] y) <float[2, 1] w = {1, 2}> { y = MatMul(x, w) }""")
    plain = lossgraph.compile_program(linear)
    assert plain.manifest["format"] == FORMAT and "buffers" not in plain.manifest
    assert plain.buffers == []
    check_manifest(copy.deepcopy(plain.manifest))
    with_buffers = lossgraph.compile_program(_bn_dropout()).manifest
    check_manifest(copy.deepcopy(with_buffers))
    lacking = {k: v for k, v in copy.deepcopy(with_buffers).items() if k != "buffers"}
    with pytest.raises(InvalidProgramError, match="'buffers' is missing"):
        check_manifest(lacking)
    with pytest.raises(InvalidProgramError, match="has the format 'lossgraph-program/2'"):
        check_manifest({**copy.deepcopy(with_buffers), "format": FORMAT})


# -- Dropout's gradient ---------------------------------------------------------------------------

DROPOUT = """<ir_version: 10, opset_import: ["" : 17]>
net (double[N, 4] x) => (double[N, 2] y, bool[N, 3] mask)
<double[4, 3] W1 = {0.3, -0.2, 0.5, 0.1, 0.4, -0.6, -0.3, 0.2, 0.7, 0.5, -0.1, 0.2},
 double[3, 2] W2 = {0.2, -0.4, 0.6, 0.1, -0.5, 0.3}, float ratio = {0.4}, bool on = {1}>
{
  h = MatMul(x, W1)
  a = Tanh(h)
  d, mask = Dropout(a, ratio, on)
  y = MatMul(d, W2)
}"""


def test_dropout_gradient_uses_the_forward_mask_and_equals_finite_differences():
    model = lossgraph.add_loss_output(onnx.parser.parse_model(DROPOUT))
    graph = lossgraph.gradient(model, ["W1", "W2"])
    session = create_session(graph)
    rng = np.random.default_rng(0)
    X, y = rng.normal(size=(6, 4)), rng.normal(size=(6, 2))
    p = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    masks = set()
    for _ in range(3):  # a new mask every run; each run's gradient is the one of its mask
        mask, grad1, grad2 = session.run(["mask", "W1_grad", "W2_grad"], {"x": X, "label": y})
        masks.add(mask.tobytes())
        assert 0 < mask.mean() < 1

        def loss(w1, w2, mask=mask):
            d = np.tanh(X @ w1) * mask / (1 - np.float32(0.4))
            return np.mean((d @ w2 - y) ** 2)

        for name, grad, args in (("W1", grad1, ("W1", "W2")), ("W2", grad2, ("W1", "W2"))):
            numeric = np.zeros_like(p[name])
            for index in np.ndindex(*p[name].shape):
                shifted = {k: p[k].copy() for k in args}
                shifted[name][index] += 1e-6
                up = loss(shifted["W1"], shifted["W2"])
                shifted[name][index] -= 2e-6
                numeric[index] = (up - loss(shifted["W1"], shifted["W2"])) / 2e-6
            np.testing.assert_allclose(grad, numeric, rtol=1e-6, atol=1e-9, err_msg=name)
    assert len(masks) > 1


# -- what is refused ------------------------------------------------------------------------------


def test_a_running_statistic_cannot_be_a_trained_weight():
    with pytest.raises(UnsupportedOptionError, match="'mean', a running statistic"):
        lossgraph.compile_program(_bn_dropout(), weights=["W", "mean"])


@pytest.mark.parametrize("change, message", [
    # two layers sharing one running mean
    (lambda t: t.replace("(x, scale, shift, mean, var)", "(x, scale, shift, mean, var)\n"
                         "  h2, rm2, rv2 = BatchNormalization <training_mode: int = 1> "
                         "(h, scale, shift, mean, shift)").replace("a = Relu(h)", "a = Relu(h2)"),
     "reads 'mean' as its running mean, which node"),
    # another node reading a running statistic
    (lambda t: t.replace("a = Relu(h)", "s = Add(h, var)\n  a = Relu(s)"),
     "reads 'var', a running statistic"),
    # a node reading the node's own running statistics output
    (lambda t: t.replace("a = Relu(h)", "s = Add(h, running_var)\n  a = Relu(s)"),
     "reads 'running_var', a statistics output"),
])
def test_what_lossgraph_cannot_update_is_refused_with_the_node(change, message):
    with pytest.raises(UnsupportedModelError, match=message):
        lossgraph.compile_program(onnx.parser.parse_model(change(BN_DROPOUT)))


def test_a_training_mode_batch_normalization_in_a_subgraph_is_refused():
    model = onnx.parser.parse_model("""<ir_version: 10, opset_import: ["" : 17]>
    net (float[N, 3] x) => (float[N, 3] y)
    <float[3] s = {1, 2, 3}, float[3] b = {0, 1, 2}, float[3] m = {0, 0, 1}, float[3] v = {1, 1, 2},
     float zero = {0}>
    {
      total = ReduceSum <keepdims: int = 0> (x)
      flag = Greater(total, zero)
      y = If(flag) <
        then_branch = t () => (float[N, 3] yt) {
          yt, rm, rv = BatchNormalization <training_mode: int = 1> (x, s, b, m, v) },
        else_branch = e () => (float[N, 3] ye) { ye = Mul(x, s) }>
    }""")
    with pytest.raises(UnsupportedModelError, match="in the subgraph 't' runs in training mode"):
        lossgraph.compile_program(model)


def test_running_statistics_must_be_stored_and_lifted():
    model = onnx.parser.parse_model(BN_DROPOUT.replace("(float[N, 3] x)",
                                                       "(float[N, 3] x, float[3] outside)")
                                    .replace("(x, scale, shift, mean, var)",
                                             "(x, scale, shift, outside, var)"))
    with pytest.raises(UnsupportedModelError, match="'outside' is not an initializer"):
        buffer_names(model)
    with pytest.raises(UnsupportedModelError, match="lift them first"):
        RunningStatistics()(_bn_dropout())
    lifted = WeightsToInputs(["mean", "var"])(_bn_dropout()).model
    assert RunningStatistics()(lifted).report == {"mean": "mean_new", "var": "var_new"}


def test_onnxruntime_training_artifacts_refuse_buffers(tmp_path):
    with pytest.raises(UnsupportedModelError, match="mean, var"):
        to_ort_artifacts(_bn_dropout(), tmp_path / "artifacts")
