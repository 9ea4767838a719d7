"""The token-level cross entropy: ``multiclass_log_loss`` of an ``(N, d1, ..., C)`` prediction
(classes on the last axis) against int64 labels ``(N, d1, ...)``, with ``ignore_index``.

The reference is torch's ``F.cross_entropy(z.view(-1, C), y.view(-1), ignore_index=k)``: the
mean over the positions whose label is not ``k``; per-row sample weights weigh each row's
positions (``sum_i w_i sum_t l_it / sum_i w_i c_i``, ``c_i`` the row's counted positions).
``sum`` and ``none`` keep lossgraph's per-row losses, the mean over each row's positions.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from support.gradcheck import check_gradients, cotangent

import lossgraph
from lossgraph import add_loss_output, get_roles
from lossgraph.errors import (
    InvalidDataError,
    ShapeMismatchError,
    UnsupportedOptionError,
)
from lossgraph.metadata import LOSS_KEY, read_json
from lossgraph.optim import AdamW
from lossgraph.passes import RemoveLossOutput

IGNORE = -100  # torch's and transformers' ignore_index
ROWS, LENGTH, FEATURES, CLASSES = 6, 5, 3, 4


def token_model(dtype: str = "float", weights_as_inputs: bool = False,
                classes: int = CLASSES) -> onnx.ModelProto:
    """``logits = x @ W + b``: a class score at each position of ``x`` ``(N, T, F)``."""
    rng = np.random.default_rng(3)
    W = rng.normal(size=(FEATURES, classes)).round(3)
    b = rng.normal(size=classes).round(3)
    values = lambda a: ", ".join(map(str, a.ravel()))  # noqa: E731
    params = (f", {dtype}[{FEATURES}, {classes}] W, {dtype}[{classes}] b" if weights_as_inputs
              else "")
    initializers = ("" if weights_as_inputs else
                    f"<{dtype}[{FEATURES}, {classes}] W = {{{values(W)}}}, "
                    f"{dtype}[{classes}] b = {{{values(b)}}}>")
    return onnx.parser.parse_model(f"""
        <ir_version: 8, opset_import: ["" : 18]>
        tokens ({dtype}[N, T, {FEATURES}] x{params}) => ({dtype}[N, T, {classes}] logits)
        {initializers}
        {{
            scores = MatMul(x, W)
            logits = Add(scores, b)
        }}""")


def identity(shape: str, dtype: str = "double") -> onnx.ModelProto:
    return onnx.parser.parse_model(f"""
        <ir_version: 8, opset_import: ["" : 18]>
        identity ({dtype}[{shape}] x) => ({dtype}[{shape}] y) {{ y = Identity(x) }}""")


def labels(rng: np.random.Generator, shape: tuple[int, ...], classes: int = CLASSES,
           ignored: float = 0.3) -> np.ndarray:
    """Class labels with about ``ignored`` of them ``IGNORE``; every row keeps one."""
    y = rng.integers(0, classes, size=shape)
    y[rng.uniform(size=shape) < ignored] = IGNORE
    y.reshape(len(y), -1)[:, 0] = rng.integers(0, classes, size=len(y))
    return y


def reference(z: np.ndarray, y: np.ndarray, w: np.ndarray | None, reduction: str,
              from_logits: bool = True, ignore_index: int | None = IGNORE) -> np.ndarray:
    """The documented formula in float64: per-position losses ``l`` (0 where ignored), the
    per-row loss the mean over positions, the mean over counted positions."""
    log_p = (z - z.max(-1, keepdims=True)) if from_logits else np.log(z)
    if from_logits:
        log_p = log_p - np.log(np.exp(log_p).sum(-1, keepdims=True))
    counted = np.ones(y.shape) if ignore_index is None else (y != ignore_index).astype(float)
    safe = np.where(counted > 0, y, 0)
    l = -np.take_along_axis(log_p, safe[..., None], -1)[..., 0] * counted  # noqa: E741
    w = np.ones(len(y)) if w is None else w
    axes = tuple(range(1, y.ndim))
    rows = w * l.mean(axis=axes)
    if reduction == "none":
        return rows
    if reduction == "sum":
        return rows.sum()
    return rows.sum() / (w * counted.mean(axis=axes)).sum()


def run(model: onnx.ModelProto, **feeds: np.ndarray) -> np.ndarray:
    from lossgraph.runtime.session import create_session

    return create_session(model).run([get_roles(model)["loss"]], feeds)[0]


# -- values --------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(ROWS, LENGTH), (ROWS, 3, 2)])
@pytest.mark.parametrize("from_logits", [True, False])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_loss_equals_the_documented_formula(rng, shape, from_logits, weighted, reduction):
    dims = ", ".join(["N", *(f"d{i}" for i in range(1, len(shape))), str(CLASSES)])
    z = rng.normal(size=(*shape, CLASSES)) * 3
    p = np.exp(z) / np.exp(z).sum(-1, keepdims=True)
    y = labels(rng, shape)
    w = rng.uniform(0.2, 2, size=ROWS)
    model = add_loss_output(identity(dims), "multiclass_log_loss", from_logits=from_logits,
                            ignore_index=IGNORE, reduction=reduction,
                            weight_name="w" if weighted else None)
    feeds = {"x": z if from_logits else p, "label": y, **({"w": w} if weighted else {})}
    expected = reference(z if from_logits else p, y, w if weighted else None, reduction,
                         from_logits)
    np.testing.assert_allclose(run(model, **feeds), expected, rtol=1e-12)


@pytest.mark.torch
def test_mean_is_torchs_cross_entropy_over_the_flattened_positions(rng):
    import torch

    z, y = rng.normal(size=(ROWS, LENGTH, CLASSES)), labels(rng, (ROWS, LENGTH))
    theirs = torch.nn.functional.cross_entropy(
        torch.from_numpy(z).reshape(-1, CLASSES), torch.from_numpy(y).reshape(-1),
        ignore_index=IGNORE)
    model = add_loss_output(identity(f"N, T, {CLASSES}"), "multiclass_log_loss",
                            from_logits=True, ignore_index=IGNORE)
    np.testing.assert_allclose(run(model, x=z, label=y), float(theirs), rtol=1e-12)


def test_without_ignore_index_the_mean_is_over_every_position(rng):
    z, y = rng.normal(size=(ROWS, LENGTH, CLASSES)), rng.integers(0, CLASSES, (ROWS, LENGTH))
    model = add_loss_output(identity(f"N, T, {CLASSES}"), "multiclass_log_loss",
                            from_logits=True)
    np.testing.assert_allclose(run(model, x=z, label=y),
                               reference(z, y, None, "mean", ignore_index=None), rtol=1e-12)
    assert not any(n.op_type == "Equal" for n in model.graph.node)
    assert read_json(model, LOSS_KEY) is None


def test_ignore_index_may_be_a_class_and_changes_nothing_when_no_label_is_it(rng):
    z, y = rng.normal(size=(ROWS, LENGTH, CLASSES)), labels(rng, (ROWS, LENGTH), ignored=0)
    plain = add_loss_output(identity(f"N, T, {CLASSES}"), "multiclass_log_loss",
                            from_logits=True, reduction="sum")
    unused = add_loss_output(identity(f"N, T, {CLASSES}"), "multiclass_log_loss",
                             from_logits=True, reduction="sum", ignore_index=IGNORE)
    np.testing.assert_allclose(run(unused, x=z, label=y), run(plain, x=z, label=y), rtol=1e-14)
    class_two = add_loss_output(identity(f"N, T, {CLASSES}"), "multiclass_log_loss",
                                from_logits=True, ignore_index=2)
    np.testing.assert_allclose(run(class_two, x=z, label=y),
                               reference(z, y, None, "mean", ignore_index=2), rtol=1e-12)


def test_row_level_labels_take_ignore_index_too(rng):
    z, y = rng.normal(size=(9, CLASSES)), rng.integers(0, CLASSES, 9)
    y[[1, 4]] = IGNORE
    model = add_loss_output(identity(f"N, {CLASSES}"), "multiclass_log_loss", from_logits=True,
                            ignore_index=IGNORE)
    np.testing.assert_allclose(run(model, x=z, label=y), reference(z, y, None, "mean"),
                               rtol=1e-12)


# -- gradients -------------------------------------------------------------------------


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_gradients_equal_finite_differences(rng, weighted, reduction):
    model = add_loss_output(token_model("double", weights_as_inputs=True),
                            "multiclass_log_loss", from_logits=True, ignore_index=IGNORE,
                            reduction=reduction, weight_name="w" if weighted else None)
    inputs = {"x": rng.normal(size=(ROWS, LENGTH, FEATURES)),
              "W": rng.normal(size=(FEATURES, CLASSES)), "b": rng.normal(size=CLASSES),
              "label": labels(rng, (ROWS, LENGTH)),
              **({"w": rng.uniform(0.2, 2, ROWS)} if weighted else {})}
    check_gradients(model, inputs, wrt=["x", "W", "b"], ort=False)


@pytest.mark.torch
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("from_logits", [True, False])
def test_gradients_equal_torch_autograd_with_ignore_index(rng, weighted, from_logits):
    import torch

    F = torch.nn.functional
    base = token_model("double", weights_as_inputs=True)
    if not from_logits:  # probabilities: a softmax in the model
        base.graph.node[-1].output[0] = "raw"
        base.graph.node.append(onnx.helper.make_node("Softmax", ["raw"], ["logits"], axis=-1))
    model = add_loss_output(base, "multiclass_log_loss", from_logits=from_logits,
                            ignore_index=IGNORE, weight_name="w" if weighted else None)
    x, y = rng.normal(size=(ROWS, LENGTH, FEATURES)), labels(rng, (ROWS, LENGTH))
    W, b = rng.normal(size=(FEATURES, CLASSES)), rng.normal(size=CLASSES)
    w = rng.uniform(0.2, 2, ROWS)
    tensors = {k: torch.tensor(v, requires_grad=True) for k, v in {"W": W, "b": b}.items()}
    logits = torch.from_numpy(x) @ tensors["W"] + tensors["b"]
    per_token = F.cross_entropy(logits.reshape(-1, CLASSES), torch.from_numpy(y).reshape(-1),
                                ignore_index=IGNORE, reduction="none").reshape(y.shape)
    row_weight = torch.from_numpy(w if weighted else np.ones(ROWS))[:, None]
    theirs = (row_weight * per_token).sum() / (row_weight * torch.from_numpy(y != IGNORE)).sum()
    theirs.backward()
    R = float(cotangent((), np.float64))  # check_gradients differentiates R * loss
    reference_grads = {k: R * t.grad.numpy() for k, t in tensors.items()}
    inputs = {"x": x, "W": W, "b": b, "label": y, **({"w": w} if weighted else {})}
    check_gradients(model, inputs, wrt=["W", "b"], reference=reference_grads, ort=False)
    np.testing.assert_allclose(run(model, **inputs), theirs.item(), rtol=1e-10)


# -- training: every fuse mode, sample weights, like torch's AdamW --------------------------


def torch_token_loss(logits, y, weights=None):
    """torch's cross entropy with ignore_index, each row's tokens weighted by its weight."""
    import torch

    per_token = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), y.reshape(-1), ignore_index=IGNORE,
        reduction="none").reshape(y.shape)
    row = torch.ones(len(y), dtype=logits.dtype) if weights is None else weights
    return (row[:, None] * per_token).sum() / (row[:, None] * (y != IGNORE)).sum()


@pytest.mark.torch
@pytest.mark.parametrize("fuse", ["step", "epoch", "separate"])
@pytest.mark.parametrize("weighted", [False, True])
def test_training_equals_torch_adamw_step_for_step(rng, fuse, weighted):
    """One epoch of three batches (one fit: the epoch graph runs them in one Scan) against
    three torch AdamW steps on the same loss; the epoch's loss is the rows-weighted mean of
    the batches' losses, as the Trainer records it."""
    import torch

    batch, steps = 4, 3
    rows = batch * steps
    X = rng.normal(size=(rows, LENGTH, FEATURES)).astype(np.float32)
    y = labels(rng, (rows, LENGTH), ignored=0.4)
    w = rng.uniform(0.2, 2, rows).astype(np.float32)
    program = lossgraph.compile_program(
        token_model(), loss="multiclass_log_loss", fuse=fuse,
        loss_options={"from_logits": True, "ignore_index": IGNORE,
                      **({"weight_name": "sample_weight"} if weighted else {})},
        optimizer=AdamW(0.05, beta1=0.8, beta2=0.99, epsilon=1e-6, weight_decay=0.05))
    trainer = lossgraph.Trainer(program)
    trainer.fit(X, y, sample_weight=w if weighted else None, epochs=1, batch_size=batch,
                shuffle=False, progress=False)

    params = {k: torch.tensor(v, requires_grad=True) for k, v in program.state.items()
              if k in program.weights}
    theirs = torch.optim.AdamW(params.values(), lr=0.05, betas=(0.8, 0.99), eps=1e-6,
                               weight_decay=0.05)
    losses = []
    for step in range(steps):
        part = slice(step * batch, (step + 1) * batch)
        theirs.zero_grad()
        logits = torch.from_numpy(X[part]) @ params["W"] + params["b"]
        loss = torch_token_loss(logits, torch.from_numpy(y[part]),
                                torch.from_numpy(w[part]) if weighted else None)
        loss.backward()
        theirs.step()
        losses.append(loss.item())
    for name, value in params.items():
        np.testing.assert_allclose(trainer.state[name], value.detach().numpy(), rtol=1e-5,
                                   atol=1e-6, err_msg=name)
    assert trainer.train_losses_ == [pytest.approx(np.mean(losses), rel=1e-5)]
    moved = max(np.abs(trainer.state[n] - program.state[n]).max() for n in params)
    assert moved > 0.05, "training hardly moved the weights"


# -- the Trainer's label check -----------------------------------------------------------


@pytest.fixture(scope="module")
def ignoring_trainer():
    return lossgraph.Trainer(lossgraph.compile_program(
        token_model(), loss="multiclass_log_loss",
        loss_options={"from_logits": True, "ignore_index": IGNORE}))


def test_the_ignored_label_is_recorded_and_accepted(ignoring_trainer, rng):
    assert read_json(ignoring_trainer.program.graphs["evaluate"], LOSS_KEY) == {
        "ignore_index": IGNORE}
    X = rng.normal(size=(ROWS, LENGTH, FEATURES)).astype(np.float32)
    y = labels(rng, (ROWS, LENGTH))
    assert (y == IGNORE).any()
    ignoring_trainer.fit(X, y, epochs=1, batch_size=ROWS, progress=False)
    assert np.isfinite(ignoring_trainer.train_losses_[-1])


@pytest.mark.parametrize(("value", "pattern"), [
    (-1, r"class label -1 at row 2, position \(3,\), but the model's classes are 0\.\.3 "
         r"\(or -100, the loss's ignore_index\)"),
    (CLASSES, r"class label 4 at row 2, position \(3,\)"),
])
def test_other_labels_outside_the_classes_are_named_by_row_and_position(ignoring_trainer, rng,
                                                                       value, pattern):
    X = rng.normal(size=(ROWS, LENGTH, FEATURES)).astype(np.float32)
    y = labels(rng, (ROWS, LENGTH))
    y[2, 3] = value
    with pytest.raises(InvalidDataError, match=pattern):
        ignoring_trainer.fit(X, y, progress=False)


def test_labels_all_ignored_are_refused_before_training(ignoring_trainer, rng):
    X = rng.normal(size=(ROWS, LENGTH, FEATURES)).astype(np.float32)
    with pytest.raises(InvalidDataError, match="-100 .the loss's ignore_index. everywhere"):
        ignoring_trainer.fit(X, np.full((ROWS, LENGTH), IGNORE), progress=False)


@pytest.mark.parametrize("fuse", ["step", "epoch"])
def test_a_batch_whose_labels_are_all_ignored_is_named(rng, fuse):
    trainer = lossgraph.Trainer(lossgraph.compile_program(
        token_model(), loss="multiclass_log_loss", fuse=fuse,
        loss_options={"from_logits": True, "ignore_index": IGNORE}))
    X = rng.normal(size=(8, LENGTH, FEATURES)).astype(np.float32)
    y = labels(rng, (8, LENGTH))
    y[4:] = IGNORE
    before = trainer.state
    with pytest.raises(InvalidDataError, match="No label of epoch 0, batch 1 counts"):
        trainer.fit(X, y, batch_size=4, shuffle=False, progress=False)
    if fuse == "epoch":  # the epoch's state is restored
        np.testing.assert_array_equal(trainer.state["W"], before["W"])


def test_without_ignore_index_the_label_minus_100_is_refused(rng):
    trainer = lossgraph.Trainer(lossgraph.compile_program(
        token_model(), loss="multiclass_log_loss", loss_options={"from_logits": True}))
    X = rng.normal(size=(ROWS, LENGTH, FEATURES)).astype(np.float32)
    y = labels(rng, (ROWS, LENGTH))
    with pytest.raises(InvalidDataError, match=r"class label -100 at row \d, position "
                                               r"\(\d,\), but the model's classes are 0\.\.3:"):
        trainer.fit(X, y, progress=False)


def test_labels_of_the_wrong_shape_are_refused(ignoring_trainer, rng):
    X = rng.normal(size=(ROWS, LENGTH, FEATURES)).astype(np.float32)
    with pytest.raises(ShapeMismatchError, match=r"y has shape \(6,\)"):
        ignoring_trainer.fit(X, np.zeros(ROWS, np.int64), progress=False)


# -- structure and errors --------------------------------------------------------------


def test_the_label_has_the_predictions_axes_but_the_classes():
    model = add_loss_output(token_model(), "multiclass_log_loss", from_logits=True,
                            ignore_index=IGNORE)
    label = model.graph.input[-1].type.tensor_type
    assert label.elem_type == onnx.TensorProto.INT64
    assert [d.dim_param for d in label.shape.dim] == ["N", "T"]
    assert read_json(model, LOSS_KEY) == {"ignore_index": IGNORE}
    back = RemoveLossOutput()(model).model
    assert read_json(back, LOSS_KEY) is None and get_roles(back) == {}


@pytest.mark.parametrize(("shape", "pattern"), [
    ("N, T, 1", r"\(N, d1, \.\.\., classes\).*has shape \(N, T, 1\)"),
    ("N", r"has shape \(N,\)"),
])
def test_predictions_without_a_class_axis_are_shape_errors(shape, pattern):
    with pytest.raises(ShapeMismatchError, match=pattern):
        add_loss_output(identity(shape), "multiclass_log_loss", from_logits=True)


@pytest.mark.parametrize("value", [True, 1.5, float("nan"), "-100", 2**63])
def test_ignore_index_must_be_an_int64(value):
    with pytest.raises(UnsupportedOptionError, match="ignore_index=.* must be an int64 label"):
        add_loss_output(token_model(), "multiclass_log_loss", ignore_index=value)


def test_the_command_line_gives_ignore_index_as_an_integral_number(tmp_path):
    """``--loss-option ignore_index=-100`` reads the value as the number -100.0."""
    from lossgraph.cli import main

    onnx.save(token_model(), tmp_path / "tokens.onnx")
    assert main(["compile", str(tmp_path / "tokens.onnx"), "--loss", "multiclass_log_loss",
                 "--loss-option", "from_logits=true", "--loss-option", "ignore_index=-100",
                 "-o", str(tmp_path / "program")]) == 0
    program = lossgraph.TrainingProgram.load(tmp_path / "program")
    assert read_json(program.graphs["evaluate"], LOSS_KEY) == {"ignore_index": IGNORE}


def test_ignore_index_is_an_option_of_multiclass_log_loss_only():
    with pytest.raises(UnsupportedOptionError, match="takes no option 'ignore_index'"):
        add_loss_output(token_model(), "squared_error", ignore_index=IGNORE)
    with pytest.raises(UnsupportedOptionError, match="no key 'ignore_index'"):
        lossgraph.compile_program(token_model(), loss="squared_error",
                                  loss_options={"ignore_index": IGNORE})


# -- data-parallel ---------------------------------------------------------------------


def test_data_parallel_refuses_a_mean_over_counted_positions():
    from lossgraph.parallel import ParallelProgram

    with pytest.raises(UnsupportedOptionError, match="data-parallel step divides"):
        ParallelProgram.compile(token_model(), loss="multiclass_log_loss",
                                loss_options={"from_logits": True, "ignore_index": IGNORE})


@pytest.mark.parametrize("options", [
    {"from_logits": True},
    {"from_logits": True, "ignore_index": IGNORE, "reduction": "sum"},
])
def test_data_parallel_token_loss_equals_one_process(rng, options):
    """Without ignore_index the mean over positions is the mean of the rows' means, and with
    reduction='sum' nothing is divided: two replicas step like one Trainer."""
    from lossgraph.parallel import ParallelProgram, Replica, array_shards

    parallel = ParallelProgram.compile(token_model(), loss="multiclass_log_loss",
                                       loss_options=options, optimizer=AdamW(0.05))
    X = rng.normal(size=(10, LENGTH, FEATURES)).astype(np.float32)
    y = labels(rng, (10, LENGTH), ignored=0.4 if "ignore_index" in options else 0)
    trainer = lossgraph.Trainer(parallel.program)
    trainer.fit(X, y, batch_size=5, shuffle=False, progress=False)
    replicas = [Replica(parallel, None) for _ in range(2)]
    for shards in zip(*(array_shards((X, y), 5, rank, 2) for rank in range(2))):
        parts = [r.contribution(s) for r, s in zip(replicas, shards)]
        for replica in replicas:
            replica.apply(parts[0] + parts[1])
    for name in parallel.program.weights:
        np.testing.assert_allclose(replicas[0].trainer.state[name], trainer.state[name],
                                   rtol=1e-5, atol=1e-6, err_msg=name)
