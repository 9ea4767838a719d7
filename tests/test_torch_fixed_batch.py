"""torch's default export trains as it is: ``torch.onnx.export(net, (x0,), path)``.

In torch 2.13 the default exporter is dynamo, and without ``dynamic_shapes`` it fixes the
batch at the example's rows and writes the shape constants computed from it (``flatten``
and ``view(x.size(0), -1)`` become ``Reshape(h, [2, 676])`` and ``Reshape(h, [2, -1])``).
A small CNN (conv, relu, pool, flatten, linear) and one whose ``view`` bakes the batch,
exported that way and by the legacy exporter with a fixed batch, are compiled with no
option but the loss and the optimizer, as docs/reference/program.md shows: lossgraph frees
their batch (``GeneralizeBatch``), and ``Trainer.fit`` in every fusion mode ends with the
weights torch reaches training the same way on the same batches.

A mask the exporter folded into a constant of the batch's rows is read as one row. A
model whose batch lossgraph cannot free (each row scaled by its position in the batch)
trains at its batch, each epoch's last short batch left out, equal to torch's
``DataLoader(drop_last=True)`` on the same order of rows; and the export calls every
message suggests run in torch 2.13 (both exporters) and give a model with a free batch.
"""

from __future__ import annotations

import contextlib
import io
import warnings
from pathlib import Path

import numpy as np
import onnx
import pytest

torch = pytest.importorskip("torch", reason="needs torch (pip install torch==2.13.0)")

import lossgraph  # noqa: E402
from lossgraph.cli.inspection import inspect_model  # noqa: E402
from lossgraph.errors import FixedBatchWarning, UnsupportedModelError  # noqa: E402
from lossgraph.optim import SGD  # noqa: E402
from lossgraph.passes.fixed_batch import export_calls, fixed_batch  # noqa: E402

pytestmark = pytest.mark.torch
nn = torch.nn

RATE = 0.05
EPOCHS, ROWS, BATCH = 2, 12, 4


class CNN(nn.Module):
    """conv, relu, pool, flatten, linear."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(1, 3, 3)
        self.pool = nn.MaxPool2d(2)
        self.fc = nn.Linear(3 * 4 * 4, 4)

    def features(self, x):
        return self.pool(torch.relu(self.conv(x)))

    def forward(self, x):
        return self.fc(torch.flatten(self.features(x), 1))


class ViewCNN(CNN):
    """The same, flattened by ``view(x.size(0), -1)``: the batch read from the input."""

    def forward(self, x):
        h = self.features(x)
        return self.fc(h.view(x.size(0), -1))


class Masked(nn.Module):
    """A linear layer over a mask of ones made from the batch size: dynamo folds the mask
    into a constant of the example's rows, all equal, which meets the input's batch axis
    in a Mul: lossgraph reads it as one row."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.o = nn.Linear(4, 3)

    def forward(self, x):
        mask = torch.ones(x.shape[0], x.shape[1])
        return self.o((x * mask[:, :, None]).sum(1))


class RowScaled(Masked):
    """Each row scaled by its position in the batch: dynamo folds ``arange`` into a
    constant with a value of its own for each of the example's rows, which has no value
    for other rows, so the batch stays fixed."""

    def forward(self, x):
        scale = torch.arange(1, x.shape[0] + 1, dtype=x.dtype)[:, None, None]
        return self.o((x * scale).sum(1))


def export(net: nn.Module, example: torch.Tensor, path: Path, **options) -> Path:
    """``torch.onnx.export(net, (example,), path, **options)``, its chatter silenced."""
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        torch.onnx.export(net, (example,), str(path), **options)
    return path


def images(rows: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((rows, 1, 10, 10)).astype(np.float32),
            rng.integers(0, 4, rows))


@pytest.fixture(scope="module")
def exports(tmp_path_factory) -> dict[str, Path]:
    """Each CNN exported by torch's default call, and by the legacy exporter, with a fixed
    batch of 2 rows."""
    folder = tmp_path_factory.mktemp("exports")
    example = torch.from_numpy(images(2)[0])
    paths = {}
    for net in (CNN(), ViewCNN()):
        name = type(net).__name__
        paths[f"{name} default"] = export(net.eval(), example, folder / f"{name}.onnx")
        paths[f"{name} legacy"] = export(net.eval(), example, folder / f"{name}_legacy.onnx",
                                         dynamo=False)
    return paths


def trained_torch(net: nn.Module, X: np.ndarray, y: np.ndarray, orders, batch: int,
                  loss) -> dict[str, np.ndarray]:
    """``net`` trained by ``torch.optim.SGD`` on the rows of each epoch's order, in
    batches of ``batch`` (the last short batch left out, as ``drop_last=True``)."""
    optimizer = torch.optim.SGD(net.parameters(), lr=RATE)
    for order in orders:
        for start in range(0, len(order) - batch + 1, batch):
            rows = order[start:start + batch]
            optimizer.zero_grad()
            loss(net(torch.from_numpy(X[rows])), torch.from_numpy(y[rows])).backward()
            optimizer.step()
    return {name: value.detach().numpy() for name, value in net.state_dict().items()}


def assert_weights_equal(trainer: lossgraph.Trainer, expected: dict[str, np.ndarray]) -> None:
    state = trainer.state
    assert set(trainer.program.weights) <= set(expected)
    for name in trainer.program.weights:
        np.testing.assert_allclose(state[name], expected[name], rtol=2e-4, atol=2e-6,
                                   err_msg=name)


#: torch's default export in every fusion mode, each other export in one (the modes
#: differ in the engine, the exports in what GeneralizeBatch rewrites)
TRAINED = [("CNN default", "step"), ("CNN default", "epoch"), ("CNN default", "separate"),
           ("ViewCNN default", "separate"), ("CNN legacy", "epoch"), ("ViewCNN legacy", "step")]


@pytest.mark.parametrize(("source", "fuse"), TRAINED)
def test_torchs_default_export_of_a_cnn_trains_like_torch(exports, source, fuse):
    model = onnx.load(exports[source])
    assert fixed_batch(model) == 2  # the batch the example had
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # freed, no FixedBatchWarning
        program = lossgraph.compile_program(
            exports[source], loss="multiclass_log_loss", loss_options={"from_logits": True},
            optimizer=SGD(RATE), fuse=fuse)
    assert program.manifest["batch"]["fixed"] is False
    X, y = images(ROWS, seed=1)
    trainer = lossgraph.Trainer(program)
    trainer.fit(X, y, epochs=EPOCHS, batch_size=BATCH, random_state=3)
    rng = np.random.default_rng(3)  # the Trainer's shuffling, each epoch in turn
    orders = [rng.permutation(ROWS) for _ in range(EPOCHS)]
    net = (CNN if source.startswith("CNN") else ViewCNN)()
    expected = trained_torch(net, X, y, orders, BATCH, nn.functional.cross_entropy)
    assert_weights_equal(trainer, expected)
    with torch.no_grad():  # and it predicts any number of rows, as the net does
        torch_prediction = net(torch.from_numpy(X[:5])).numpy()
    np.testing.assert_allclose(trainer.predict(X[:5]), torch_prediction, rtol=1e-4, atol=1e-5)


def test_the_default_export_is_freed_where_the_batch_is_baked(exports):
    """What compile does, as describe_plan prints it: dynamo's flatten and view targets
    read the batch from the data; the legacy exporter's Flatten holds no batch."""
    lines = {source: lossgraph.describe_plan(path, loss="multiclass_log_loss",
                                             loss_options={"from_logits": True}).splitlines()[0]
             for source, path in exports.items()}
    assert lines["CNN default"].endswith("freed (Reshape 'node_view' [2, 48] -> [-1, 48])")
    assert lines["ViewCNN default"].endswith("freed (Reshape 'node_view' [2, -1] -> [-1, 48])")
    assert lines["CNN legacy"].endswith("freed (no shape constant holds it)")
    assert lines["ViewCNN legacy"].endswith("freed (Reshape '/Reshape' [2, -1] -> [0, -1])")


def test_a_batch_of_one_is_freed_too(tmp_path):
    path = export(CNN().eval(), torch.from_numpy(images(1)[0]), tmp_path / "cnn.onnx")
    program = lossgraph.compile_program(path, loss="multiclass_log_loss",
                                        loss_options={"from_logits": True})
    assert program.manifest["batch"] == {
        "size": 1, "fixed": False, "loss_reduction": "mean",
        "detail": "its fixed batch of 1 row freed (Reshape 'node_view' [1, 48] -> [-1, 48])"}


class Encoder(nn.Module):
    """A transformer encoder layer (batch first) and a linear head on its mean."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(2)
        self.layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
        self.o = nn.Linear(8, 3)

    def forward(self, x):
        return self.o(self.layer(x).mean(1))


@pytest.mark.parametrize("rows", [1, 2])
def test_an_attention_layer_is_kept_at_its_batch_never_freed_wrong(rows, tmp_path):
    """dynamo writes the attention's heads as (batch * heads, ...) views split back later,
    and at a batch of 1 its views fit the batch at several axes: the shapes cannot tell
    which, so the batch stays, and the kept model computes what torch does (its LayerNorms'
    equal scales, which the exporter merged, untied as the docs say)."""
    path = export(Encoder().eval(), torch.zeros(rows, 5, 8), tmp_path / "encoder.onnx")
    with pytest.warns(FixedBatchWarning, match="is not known"):
        program = lossgraph.compile_program(path, untie="auto")
    assert program.manifest["batch"]["fixed"]
    X = np.random.default_rng(4).standard_normal((2 * rows, 5, 8)).astype(np.float32)
    with torch.no_grad():
        expected = Encoder().eval()(torch.from_numpy(X)).numpy()
    np.testing.assert_allclose(lossgraph.Trainer(program).predict(X), expected, rtol=1e-4,
                               atol=1e-5)


@pytest.fixture(scope="module")
def row_scaled(tmp_path_factory) -> Path:
    return export(RowScaled().eval(), torch.zeros(2, 5, 4),
                  tmp_path_factory.mktemp("row_scaled") / "row_scaled.onnx")


def test_a_mask_the_exporter_folded_is_read_as_one_row(tmp_path):
    path = export(Masked().eval(), torch.zeros(2, 5, 4), tmp_path / "masked.onnx")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # freed, no FixedBatchWarning
        program = lossgraph.compile_program(path, weights=["o.weight", "o.bias"])
    assert program.manifest["batch"]["detail"] == (
        "its fixed batch of 2 rows freed (Mul 'node_mul' reads 'unsqueeze' of shape "
        "[2, 5, 1] as its one row [1, 5, 1])")
    X = np.random.default_rng(3).standard_normal((5, 5, 4)).astype(np.float32)
    with torch.no_grad():
        expected = Masked()(torch.from_numpy(X)).numpy()
    np.testing.assert_allclose(lossgraph.Trainer(program).predict(X), expected, rtol=1e-5,
                               atol=1e-6)


@pytest.mark.parametrize("fuse", ["step", "epoch", "separate"])
def test_an_unproven_batch_trains_at_its_size_like_torch_with_drop_last(row_scaled, fuse):
    # the scale, a float constant, would be a default weight: train the layer's
    with pytest.warns(FixedBatchWarning, match="Mul 'node_mul'"):
        program = lossgraph.compile_program(row_scaled, weights=["o.weight", "o.bias"],
                                            optimizer=SGD(RATE), fuse=fuse)
    rng = np.random.default_rng(2)
    X = rng.standard_normal((9, 5, 4)).astype(np.float32)
    y = rng.standard_normal((9, 3)).astype(np.float32)
    trainer = lossgraph.Trainer(program)
    trainer.fit(X, y, epochs=3, random_state=4)
    assert trainer.steps_ == 3 * 4  # 9 rows: four batches of 2 an epoch, one row left out
    orders = np.random.default_rng(4)
    expected = trained_torch(RowScaled(), X, y, [orders.permutation(9) for _ in range(3)], 2,
                             nn.functional.mse_loss)
    assert_weights_equal(trainer, expected)


def run_call(call: str, net: nn.Module, example: torch.Tensor, path: Path) -> onnx.ModelProto:
    """``call`` (an export call as a message writes it) run with ``model``, ``args`` and
    ``path``, its chatter silenced; the model it writes."""
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        eval(call, {"torch": torch}, {"model": net, "args": (example,), "path": str(path)})
    return onnx.load(path)


@pytest.mark.parametrize("source", ["CNN default", "CNN legacy"])
def test_the_export_calls_inspect_gives_for_a_cnn_run_in_torch(exports, source, tmp_path):
    """inspect's calls for the CNN's own export (its input and output names), run on a
    small CNN: both write a free batch, and the model predicts as the net does."""
    calls = inspect_model(exports[source])["fixed_batch"]["export"]
    net = CNN().eval()
    X = images(5)[0]
    with torch.no_grad():
        expected = net(torch.from_numpy(X)).numpy()
    for index, call in enumerate(calls):
        model = run_call(call, net, torch.from_numpy(images(2)[0]), tmp_path / f"{index}.onnx")
        assert fixed_batch(model) is None, call
        trainer = lossgraph.Trainer(lossgraph.compile_program(
            model, loss="multiclass_log_loss", loss_options={"from_logits": True}))
        np.testing.assert_allclose(trainer.predict(X), expected, rtol=1e-4, atol=1e-5)


def test_every_suggested_export_call_runs_in_torch_and_frees_the_batch(row_scaled, tmp_path):
    """The calls of the error (fixed_batch='generalize'), the warning and inspect, run as
    written with ``model``, ``args`` and ``path``: both give a model with a free batch,
    which trains without a warning and predicts as the net does."""
    with pytest.raises(UnsupportedModelError) as error:
        lossgraph.compile_program(row_scaled, fixed_batch="generalize")
    with pytest.warns(FixedBatchWarning) as warned:
        lossgraph.compile_program(row_scaled)
    calls = export_calls(["x"], ["linear"])
    net = RowScaled().eval()
    X = np.random.default_rng(3).standard_normal((5, 5, 4)).astype(np.float32)
    with torch.no_grad():
        expected = net(torch.from_numpy(X)).numpy()
    for index, call in enumerate(calls):
        assert call in str(error.value) and call in str(warned[0].message)
        model = run_call(call, net, torch.zeros(2, 5, 4), tmp_path / f"suggested_{index}.onnx")
        assert fixed_batch(model) is None, call
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            trainer = lossgraph.Trainer(lossgraph.compile_program(model))
        np.testing.assert_allclose(trainer.predict(X), expected, rtol=1e-5, atol=1e-6)
