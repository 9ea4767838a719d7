"""Training: lossgraph equals numpy and torch step for step, in every fusion mode."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from support.environment import GOLDEN_MODELS
from support.linear import LINEAR, linear_data

import lossgraph
from lossgraph.optim import SGD, Adam, AdamW, Momentum

MODES = ["separate", "step", "epoch"]
OPTIMIZERS = {
    "sgd": SGD(0.05),
    "sgd_invscaling": SGD(0.05, learning_rate_schedule="invscaling", power_t=0.5),
    "momentum": Momentum(0.02, momentum=0.9),
    "nesterov": Momentum(0.02, momentum=0.9, nesterov=True),
    "adam": Adam(0.05),
    "adamw": AdamW(0.05, weight_decay=0.1),
}
PENALTIES = {"none": None, "elastic": {"coef": {"l1": 0.01, "l2": 0.05}, "intercept": 0.02}}

@pytest.fixture(scope="module")
def data():
    return linear_data(230, seed=7)


# -- a numpy reference trainer for the linear model --------------------------------------------


def _numpy_update(optimizer, step: int, w, g, state):
    lr = optimizer.schedule(step)
    if isinstance(optimizer, Momentum):
        v = optimizer.momentum * state.get("v", 0) + g
        state["v"] = v
        return w - lr * (g + optimizer.momentum * v if optimizer.nesterov else v)
    if isinstance(optimizer, Adam):
        if isinstance(optimizer, AdamW):
            w = w * (1 - lr * optimizer.weight_decay)
        m = optimizer.beta1 * state.get("m", 0) + (1 - optimizer.beta1) * g
        v = optimizer.beta2 * state.get("v", 0) + (1 - optimizer.beta2) * g * g
        state["m"], state["v"] = m, v
        m_hat, v_hat = m / (1 - optimizer.beta1**step), v / (1 - optimizer.beta2**step)
        return w - lr * m_hat / (np.sqrt(v_hat) + optimizer.epsilon)
    return w - lr * g


def numpy_linear_epochs(X, y, optimizer, penalty, batch_size, epochs):
    """Minibatch training of y = X coef + intercept on mean squared error + penalty."""
    params = {"coef": np.array([[0.1], [-0.2], [0.3], [0.0]]), "intercept": np.array([0.5])}
    coefficients = lossgraph.penalties.parse_penalty(penalty)
    states = {name: {} for name in params}
    losses, step = [], 0
    X64, y64 = X.astype(np.float64), y.astype(np.float64).reshape(-1, 1)
    for _ in range(epochs):
        for lo in range(0, len(X), batch_size):
            xb, yb = X64[lo:lo + batch_size], y64[lo:lo + batch_size]
            d = xb @ params["coef"] + params["intercept"] - yb
            loss = float((d**2).mean())
            grads = {"coef": 2 * xb.T @ d / len(xb), "intercept": 2 * d.sum(axis=0) / len(xb)}
            for name, c in coefficients.items():
                w = params[name]
                loss += c["l1"] * np.abs(w).sum() + c["l2"] * (w**2).sum()
                grads[name] = grads[name] + c["l1"] * np.sign(w) + 2 * c["l2"] * w
            step += 1
            for name in params:
                params[name] = _numpy_update(optimizer, step, params[name], grads[name],
                                             states[name])
            losses.append(loss)
    return params, np.array(losses)


def _batch_losses(trainer_losses_per_epoch):
    return np.asarray(trainer_losses_per_epoch)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("penalty", sorted(PENALTIES))
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_linear_training_equals_numpy_step_for_step(data, mode, penalty, optimizer):
    X, y = data
    program = lossgraph.compile_program(onnx.parser.parse_model(LINEAR),
                                        optimizer=OPTIMIZERS[optimizer],
                                        penalty=PENALTIES[penalty], fuse=mode)
    recorded = []
    trainer = lossgraph.Trainer(program)
    trainer.fit(X, y, epochs=2, batch_size=50, shuffle=False, progress=False,
                callbacks=[lambda t, epoch, logs: recorded.append(logs["loss"])])
    expected, expected_losses = numpy_linear_epochs(X, y, OPTIMIZERS[optimizer],
                                                    PENALTIES[penalty], 50, 2)
    for name in ("coef", "intercept"):
        np.testing.assert_allclose(trainer.state[name], expected[name], rtol=2e-4, atol=2e-5,
                                   err_msg=name)
    sizes = np.array([50, 50, 50, 50, 30])
    per_epoch = expected_losses.reshape(2, 5) @ sizes / sizes.sum()
    np.testing.assert_allclose(recorded, per_epoch, rtol=2e-4)
    assert trainer.steps_ == 10 and trainer.epochs_ == 2


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_fusion_modes_give_the_same_weights_with_shuffling(data, optimizer):
    X, y = data
    results = []
    for mode in MODES:
        program = lossgraph.compile_program(onnx.parser.parse_model(LINEAR),
                                    optimizer=OPTIMIZERS[optimizer],
                                    penalty=PENALTIES["elastic"], fuse=mode)
        trainer = lossgraph.Trainer(program).fit(X, y, epochs=3, batch_size=32, shuffle=True,
                                                 random_state=3, progress=False)
        results.append((trainer.state, trainer.train_losses_))
    for state, losses in results[1:]:
        np.testing.assert_allclose(losses, results[0][1], rtol=1e-5)
        for name, value in state.items():
            np.testing.assert_allclose(value, results[0][0][name], rtol=1e-5, atol=1e-6)


# -- torch, on an MLP ----------------------------------------------------------------------------

MLP = """
    <ir_version: 8, opset_import: ["" : 18]>
    mlp (float[N, 5] x) => (float[N, 1] y)
    <float[8, 5] w1 = {W1}, float[8] b1 = {B1}, float[1, 8] w2 = {W2}, float[1] b2 = {B2}>
    {
        h = Gemm <transB = 1> (x, w1, b1)
        r = Relu(h)
        y = Gemm <transB = 1> (r, w2, b2)
    }
"""


def _mlp_model(params):
    text = MLP
    for key, value in params.items():
        text = text.replace("{" + key + "}", "{" + ", ".join(f"{v:.9g}" for v in value.ravel())
                            + "}")
    return onnx.parser.parse_model(text)


TORCH_OPTIMIZERS = {
    "sgd": (SGD(0.05), lambda torch, p: torch.optim.SGD(p, lr=0.05)),
    "momentum": (Momentum(0.02), lambda torch, p: torch.optim.SGD(p, lr=0.02, momentum=0.9)),
    "nesterov": (Momentum(0.02, nesterov=True),
                 lambda torch, p: torch.optim.SGD(p, lr=0.02, momentum=0.9, nesterov=True)),
    "adam": (Adam(0.01), lambda torch, p: torch.optim.Adam(p, lr=0.01)),
    "adamw": (AdamW(0.01, weight_decay=0.1),
              lambda torch, p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1)),
}


@pytest.mark.torch
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("optimizer", sorted(TORCH_OPTIMIZERS))
def test_mlp_training_equals_torch_step_for_step(data, mode, optimizer):
    import torch

    X, y = data
    X = np.concatenate([X, X[:, :1] * X[:, 1:2]], axis=1).astype(np.float32)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    params = {"W1": net[0].weight, "B1": net[0].bias, "W2": net[2].weight, "B2": net[2].bias}
    model = _mlp_model({k: v.detach().numpy() for k, v in params.items()})
    ours, make_theirs = TORCH_OPTIMIZERS[optimizer]
    l2 = 0.01
    program = lossgraph.compile_program(model, optimizer=ours, fuse=mode,
                                        penalty={"w1": l2, "w2": l2})
    trainer = lossgraph.Trainer(program).fit(X, y, epochs=2, batch_size=40, shuffle=False,
                                             progress=False)

    theirs = make_theirs(torch, net.parameters())
    tx, ty = torch.from_numpy(X), torch.from_numpy(y).reshape(-1, 1)
    for _ in range(2):
        for lo in range(0, len(X), 40):
            theirs.zero_grad()
            loss = ((net(tx[lo:lo + 40]) - ty[lo:lo + 40]) ** 2).mean()
            loss = loss + l2 * (net[0].weight ** 2).sum() + l2 * (net[2].weight ** 2).sum()
            loss.backward()
            theirs.step()
    state = trainer.state
    for ours_name, theirs_name in [("w1", "W1"), ("b1", "B1"), ("w2", "W2"), ("b2", "B2")]:
        np.testing.assert_allclose(state[ours_name], params[theirs_name].detach().numpy(),
                                   rtol=1e-4, atol=1e-5, err_msg=ours_name)


# -- packing: the epoch graph updates all weights at once ----------------------------------------

ODD_RANKS = """
    <ir_version: 8, opset_import: ["" : 18]>
    odd (float[N, 4] x) => (float[N, 1] y)
    <float[4, 1] w = {0.1, -0.2, 0.3, 0.4}, float scale = {1.5}, float[2, 1, 1] cube = {0.2, -0.1},
     float[1] b = {0.5}>
    {
        h = MatMul(x, w)
        s = Mul(h, scale)
        c = ReduceSum <keepdims = 0> (cube)
        t = Add(s, c)
        y = Add(t, b)
    }
"""


@pytest.mark.parametrize("optimizer", ["nesterov", "adamw"])
def test_packed_epoch_equals_per_weight_steps_for_weights_of_any_rank(optimizer):
    rng = np.random.default_rng(5)
    X = rng.normal(size=(50, 4)).astype(np.float32)
    y = (X @ [1.0, -1.0, 2.0, 0.5] + 0.3).astype(np.float32)
    states = []
    for mode in ("step", "epoch"):  # 6 full batches of 8 in the Scan, then 2 rows alone
        program = lossgraph.compile_program(onnx.parser.parse_model(ODD_RANKS),
                                    weights=["w", "scale", "cube", "b"],
                                    optimizer=OPTIMIZERS[optimizer], fuse=mode)
        trainer = lossgraph.Trainer(program).fit(X, y, epochs=2, batch_size=8, shuffle=True,
                                                 random_state=1, progress=False)
        states.append(trainer.state)
    assert states[1]["cube"].shape == (2, 1, 1) and states[1]["scale"].shape == ()
    for name, value in states[0].items():
        np.testing.assert_allclose(states[1][name], value, rtol=1e-6, atol=1e-7, err_msg=name)


def _random_data(program: lossgraph.TrainingProgram, rows: int, classes: int, seed: int):
    """Features and a label for ``program``'s step graph, shaped and typed as it takes them."""
    rng = np.random.default_rng(seed)
    step = program.graphs["train_step"].graph
    roles = {v["role"]: v["name"] for v in program.manifest["graphs"]["train_step"]["inputs"]}
    arrays = []
    for name in (roles["feature"], roles["label"]):
        tensor = next(i for i in step.input if i.name == name).type.tensor_type
        shape = [d.dim_value or rows for d in tensor.shape.dim]
        dtype = onnx.helper.tensor_dtype_to_np_dtype(tensor.elem_type)
        arrays.append(rng.integers(0, classes, size=shape).astype(dtype) if dtype.kind == "i"
                      else rng.normal(size=shape).astype(dtype))
    return arrays


@pytest.mark.parametrize("name", sorted(p.stem for p in GOLDEN_MODELS.glob("*.onnx")))
def test_every_golden_model_trains_the_same_packed_and_specialized(name):
    """Epoch graphs (packed update, batch-specialized by the Trainer) train the weights the
    step graphs train, on every golden model, the CNN's BatchNormalization included.

    To float rounding, not bit for bit: on an AVX-512 machine one shuffled batch differs by
    1 ulp, with onnxruntime's graph optimizations on or off. onnxruntime's kernels pick
    their code paths (and so their summation order) by CPU, shape and memory layout, and
    the Scan's in-graph batches are laid out differently from the step's numpy views."""
    score = ("binary_log_loss" if name == "skl_logistic_binary" else "multiclass_log_loss"
             if "classifier" in name or "logistic" in name else "squared_error")
    states = []
    for mode in ("step", "epoch"):
        program = lossgraph.compile_program(GOLDEN_MODELS / f"{name}.onnx", loss=score,
                                    optimizer=Adam(0.01), fuse=mode)
        X, y = _random_data(program, rows=37, classes=2 if "binary" in name else 3, seed=0)
        trainer = lossgraph.Trainer(program).fit(X, y, epochs=2, batch_size=8, shuffle=True,
                                                 random_state=0, progress=False)
        states.append(trainer.state)
    for weight, value in states[0].items():
        np.testing.assert_allclose(states[1][weight], value, rtol=1e-5, atol=1e-7,
                                   err_msg=weight)
