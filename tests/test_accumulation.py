"""Gradient accumulation: ``k`` micro-batches, one update, equal to one step at ``k`` times
the batch (every fusion mode, sample weights, a trailing partial group, a saved program,
streamed batches), and to torch accumulating ``loss / k`` over ``k`` backward passes."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from support.linear import linear_data, linear_model, linear_text

import lossgraph
from lossgraph.optim import SGD, Adam, AdamW
from lossgraph.passes import GroupGradients, SumGradients
from lossgraph.schedules import Linear

MODES = ("step", "epoch", "separate")
OPTIMIZERS = {"sgd": SGD(0.05), "adam": Adam(0.05)}
#: 84 rows at batch 8: ten full micro-batches and one of 4 rows, so updates of 4, 4 and a
#: trailing group of 2 + 1 (20 rows), as batches of 32 rows are 32, 32 and 20
ROWS, BATCH, STEPS = 84, 8, 4


@pytest.fixture(scope="module")
def data():
    X, y = linear_data(ROWS, seed=3)
    weights = np.random.default_rng(5).uniform(0.1, 2.0, ROWS).astype(np.float32)
    return X, y, weights


def _program(fuse: str, optimizer: str, weighted: bool, reduction: str = "mean",
             **options) -> lossgraph.TrainingProgram:
    loss_options = {"reduction": reduction, **({"weight_name": "sample_weight"} if weighted
                                               else {})}
    return lossgraph.compile_program(linear_model(), loss="squared_error",
                                     loss_options=loss_options,
                                     optimizer=OPTIMIZERS.get(optimizer, SCHEDULED), fuse=fuse,
                                     accumulation_steps=STEPS, **options)


def _assert_same_state(ours: lossgraph.Trainer, theirs: lossgraph.Trainer, what: str) -> None:
    for name, value in theirs.state.items():
        np.testing.assert_allclose(ours.state[name], value, rtol=2e-5, atol=1e-6,
                                   err_msg=f"{name} ({what})")


#: AdamW with decay groups (each weight updated apart, no packed epoch) and a warmup then
#: a linear decay: the schedule is per update, not per micro-batch
SCHEDULED = AdamW(Linear(0.05, total_steps=6, warmup_steps=2), weight_decay=0.1,
                  exclude_from_weight_decay="intercept")


@pytest.mark.parametrize("fuse", MODES)
@pytest.mark.parametrize(("optimizer", "weighted"), [("sgd", False), ("scheduled", True)],
                         ids=["sgd", "adamw-schedule-decay-groups-sample_weight"])
def test_accumulating_micro_batches_equals_one_larger_batch(data, fuse, optimizer, weighted,
                                                            tmp_path):
    X, y, weights = data
    sample_weight = weights if weighted else None
    program = _program(fuse, optimizer, weighted)
    ours, theirs = lossgraph.Trainer(program), lossgraph.Trainer(program)
    for shuffle in (True, False):  # fuse="epoch": the shuffled and the ordered epoch graph
        ours.fit(X, y, sample_weight, epochs=2, batch_size=BATCH, shuffle=shuffle,
                 random_state=0, progress=False)
        theirs.fit(X, y, sample_weight, epochs=2, batch_size=STEPS * BATCH, shuffle=shuffle,
                   random_state=0, progress=False, accumulation_steps=1)
        assert ours.steps_ == theirs.steps_ == 6  # per update, not per micro-batch
        _assert_same_state(ours, theirs, f"shuffle={shuffle}")
        if not weighted:  # a mean of equal micro-batches' means is the batch's mean
            np.testing.assert_allclose(ours.train_losses_, theirs.train_losses_, rtol=1e-5)
    program.save(tmp_path / "program")
    loaded = lossgraph.TrainingProgram.load(tmp_path / "program")
    assert loaded.manifest["accumulation"] == {"steps": STEPS, "loss_reduction": "mean"}
    again = lossgraph.Trainer(loaded).fit(X, y, sample_weight, epochs=2, batch_size=BATCH,
                                          shuffle=False, random_state=0, progress=False)
    _assert_same_state(again, ours, "after save and load")


@pytest.mark.parametrize("fuse", MODES)
def test_clipping_and_the_average_see_the_accumulated_gradient(data, fuse):
    """max_grad_norm clips the gradient of the whole update (the micro-batches' sum, as
    torch's clip_grad_norm_ after k backward passes), once per update, and ema_decay
    averages the weights of each update: equal to one larger batch, norms included."""
    X, y, _ = data
    program = _program(fuse, "adam", False, max_grad_norm=0.05, ema_decay=0.8)
    ours = lossgraph.Trainer(program).fit(X, y, epochs=2, batch_size=BATCH, shuffle=False,
                                          progress=False)
    theirs = lossgraph.Trainer(program).fit(X, y, epochs=2, batch_size=STEPS * BATCH,
                                            shuffle=False, progress=False,
                                            accumulation_steps=1)
    _assert_same_state(ours, theirs, "clipped and averaged")
    assert len(ours.grad_norms_) == ours.steps_ == 6
    np.testing.assert_allclose(ours.grad_norms_, theirs.grad_norms_, rtol=2e-5)
    assert max(ours.grad_norms_) > 0.05  # some updates were clipped


def test_a_summed_loss_adds_the_micro_batches_gradients(data):
    """(the engine scales micro-batches for every mode alike)"""
    X, y, _ = data
    program = _program("epoch", "sgd", False, reduction="sum")
    ours = lossgraph.Trainer(program).fit(X, y, epochs=1, batch_size=BATCH, shuffle=False,
                                          progress=False)
    theirs = lossgraph.Trainer(program).fit(X, y, epochs=1, batch_size=STEPS * BATCH,
                                            shuffle=False, progress=False,
                                            accumulation_steps=1)
    _assert_same_state(ours, theirs, "reduction='sum'")


@pytest.mark.parametrize("fuse", ("step", "epoch"))
def test_max_steps_and_step_callbacks_count_updates(data, fuse):
    X, y, _ = data

    class Steps(lossgraph.Callback):
        def __init__(self):
            self.seen = []

        def on_step_end(self, trainer, step, logs):
            self.seen.append((step, logs["batch"]))

    steps = Steps()
    trainer = lossgraph.Trainer(_program(fuse, "sgd", False)).fit(
        X, y, batch_size=BATCH, max_steps=2, shuffle=False, callbacks=[steps], progress=False)
    assert trainer.steps_ == 2
    assert steps.seen == [(1, 0), (2, STEPS)]  # each update from its first micro-batch


def test_streamed_batches_accumulate_as_arrays_do(data):
    X, y, _ = data
    program = _program("step", "adam", False)
    batches = [(X[lo:lo + BATCH], y[lo:lo + BATCH]) for lo in range(0, ROWS, BATCH)]
    streamed = lossgraph.Trainer(program).fit(batches, epochs=2, progress=False)
    arrays = lossgraph.Trainer(program).fit(X, y, epochs=2, batch_size=BATCH, shuffle=False,
                                            progress=False)
    assert streamed.steps_ == arrays.steps_ == 6
    _assert_same_state(streamed, arrays, "streamed")


def test_a_fixed_batch_trains_at_k_times_its_size(data):
    """A model whose exported batch of 2 the program keeps, 3 micro-batches an update: the
    weights of the same model, free of its batch, at batches of 6."""
    X, y, _ = data
    fixed = onnx.parser.parse_model(linear_text().replace(
        "float[N, 4] x) => (float[N, 1] y)", "float[2, 4] x) => (float[2, 1] y)"))
    options = {"loss": "squared_error", "optimizer": Adam(0.05), "fuse": "epoch"}
    program = lossgraph.compile_program(fixed, fixed_batch="keep", accumulation_steps=3,
                                        **options)
    ours = lossgraph.Trainer(program).fit(X, y, epochs=2, random_state=0, progress=False)
    theirs = lossgraph.Trainer(lossgraph.compile_program(linear_model(), **options)).fit(
        X, y, epochs=2, batch_size=6, random_state=0, progress=False)
    assert ours.steps_ == theirs.steps_ == 28
    _assert_same_state(ours, theirs, "a fixed batch")


@pytest.mark.torch
@pytest.mark.parametrize("fuse", MODES)
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_accumulation_equals_torch_dividing_the_loss_by_k(data, fuse, optimizer):
    """torch's recipe: loss / k, backward k times, one optimizer step (full groups: 64 rows
    at batch 8, k = 4)."""
    import torch

    X, y, _ = data
    X, y = X[:64], y[:64]
    program = _program(fuse, optimizer, False, penalty={"coef": 0.01})
    trainer = lossgraph.Trainer(program).fit(X, y, epochs=2, batch_size=BATCH, shuffle=False,
                                             progress=False)
    start = program.state
    coef = torch.tensor(start["coef"], requires_grad=True)
    intercept = torch.tensor(start["intercept"], requires_grad=True)
    make = {"sgd": lambda p: torch.optim.SGD(p, lr=0.05),
            "adam": lambda p: torch.optim.Adam(p, lr=0.05)}[optimizer]
    theirs = make([coef, intercept])
    tx, ty = torch.from_numpy(X), torch.from_numpy(y).reshape(-1, 1)
    for _ in range(2):
        for group in range(0, len(X), STEPS * BATCH):
            theirs.zero_grad()
            for lo in range(group, group + STEPS * BATCH, BATCH):
                loss = ((tx[lo:lo + BATCH] @ coef + intercept - ty[lo:lo + BATCH]) ** 2).mean()
                ((loss + 0.01 * (coef ** 2).sum()) / STEPS).backward()
            theirs.step()
    np.testing.assert_allclose(trainer.state["coef"], coef.detach().numpy(), rtol=1e-5,
                               atol=1e-6)
    np.testing.assert_allclose(trainer.state["intercept"], intercept.detach().numpy(),
                               rtol=1e-5, atol=1e-6)


def test_the_accumulating_graphs_run_in_onnxruntime(run_model):
    """train_accumulate adds the scaled gradient to the sum it reads; the group's gradient
    model sums its micro-batches' gradients weighted by their scales."""
    program = lossgraph.compile_program(linear_model(), loss="squared_error", fuse="step",
                                        accumulation_steps=2)
    X, y = linear_data(6, seed=1)
    y = y.reshape(-1, 1)
    weights = {w: program.state[w] for w in program.weights}
    assert {"train_accumulate", "train_step_accumulated"} <= set(program.graphs)
    sums = {f"{w}_grad_sum": np.full_like(v, 0.5) for w, v in weights.items()}
    scale = np.array(0.25, np.float32)
    outputs = run_model(program.graphs["train_accumulate"],
                        {"x": X, "label": y, "gradient_scale": scale, **weights, **sums})
    residual = X @ weights["coef"] + weights["intercept"] - y
    expected = {"coef": 2 * X.T @ residual / len(X), "intercept": 2 * residual.mean(axis=0)}
    for name in weights:
        np.testing.assert_allclose(outputs[f"{name}_grad_sum_new"], 0.5 + 0.25 * expected[name],
                                   rtol=1e-5, err_msg=name)
    assert SumGradients.__name__ in str(lossgraph.describe_plan(
        linear_model(), loss="squared_error", accumulation_steps=2))
    assert GroupGradients.__name__ in str(lossgraph.describe_plan(
        linear_model(), loss="squared_error", fuse="epoch", accumulation_steps=2))
