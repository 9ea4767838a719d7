"""torch's own modules, exported by both torch exporters, train in lossgraph as in torch.

Each module of ``MODULES`` is exported by the TorchScript exporter (``dynamo=False``, a
dynamic batch axis by ``dynamic_axes``) and by the dynamo exporter (``dynamo=True``, by
``dynamic_shapes``), at opset 17 and at the exporter's default opset, from an ``eval()``
module and from a ``train()`` one (the TorchScript exporter with
``training=TrainingMode.TRAINING``). For every export:

- the gradient of the mean squared error with respect to every parameter equals torch
  autograd's in float64 on the same weights (the export computes in float32);
- three SGD steps, and three Adam steps, of a ``lossgraph.Trainer`` equal
  ``torch.optim.SGD`` / ``torch.optim.Adam`` on the module step for step (the loss of each
  step, and the eval-mode predictions after it).

The exports keep torch's parameters as initializers (``do_constant_folding=False``,
dynamo ``optimize=False``, but for ``DYNAMO_OPTIMIZED``): with the exporters' defaults an
eval-mode BatchNormalization is folded into the Conv before it and weights are written as
transposed or reordered copies under new names, so the model's weights are no longer the
module's parameters and training them is not training the module.

The dynamo exporter (torch 2.13) has no training mode: from a ``train()`` module it writes
BatchNormalization in inference mode (the running statistics, which training then never
updates) and keeps Dropout random (``test_dynamo_exports_a_training_module_...``). The
torch reference of those exports is the module with its BatchNorm layers in ``eval()``,
the function the export computes.
"""

from __future__ import annotations

import copy
import io
import warnings

import numpy as np
import onnx
import pytest

torch = pytest.importorskip("torch", reason="needs torch (pip install torch==2.13.0)")

from support.torch_steps import (  # noqa: E402
    assert_gradients_close,
    assert_gradients_like_torch,
    assert_steps_like_torch,
    lossgraph_gradients,
    make_distinct,
    torch_gradients,
)

import lossgraph  # noqa: E402
from lossgraph.errors import UnsupportedModelError  # noqa: E402
from lossgraph.optim import SGD, Adam  # noqa: E402

nn = torch.nn
F = torch.nn.functional
pytestmark = pytest.mark.torch


# -- the modules -----------------------------------------------------------------------------


class Recurrent(nn.Module):
    """``nn.LSTM``, ``nn.GRU`` or ``nn.RNN`` (batch first), a Linear head on the last output."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.rnn = getattr(nn, kind)(3, 4, batch_first=True)
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.rnn(x)[0][:, -1])


class ResidualBlock(nn.Module):
    """Conv-BN-ReLU-Conv-BN plus the input, ReLU, a Linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 3, 3, padding=1, bias=False), nn.BatchNorm2d(3)
        self.conv2, self.bn2 = nn.Conv2d(3, 3, 3, padding=1, bias=False), nn.BatchNorm2d(3)
        self.head = nn.Linear(3 * 5 * 5, 2)

    def forward(self, x):
        h = self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x)))))
        return self.head(torch.flatten(F.relu(h + x), 1))


class Encoder(nn.Module):
    """Two ``nn.TransformerEncoderLayer`` (batch first, dropout 0), norm first or last."""

    def __init__(self, norm_first: bool) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True,
                                           norm_first=norm_first)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)

    def forward(self, x):
        return self.encoder(x)


class SelfAttention(nn.Module):
    """``nn.MultiheadAttention`` of a sequence with itself."""

    def __init__(self) -> None:
        super().__init__()
        self.attention = nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, x):
        return self.attention(x, x, x, need_weights=False)[0]


class Embedding(nn.Module):
    """``nn.Embedding`` of 5 tokens, a Linear head, the mean over the tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.embedding(x)).mean(1)


class EmbeddingBag(nn.Module):
    """``nn.EmbeddingBag`` (mean of bags of 3 tokens), a Linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(10, 4, mode="mean")
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.bag(x))


class Upsampling(nn.Module):
    """A 1x1 Conv, then ``nn.Upsample`` or ``F.interpolate`` (the output is the image)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 2, 1)
        self.how = how
        self.upsample = {"nearest": nn.Upsample(scale_factor=2, mode="nearest"),
                         "bilinear": nn.Upsample(scale_factor=2, mode="bilinear",
                                                 align_corners=False)}.get(how)

    def forward(self, x):
        h = self.conv(x)
        if self.upsample is not None:
            return self.upsample(h)
        if self.how == "interpolate_bilinear":
            return F.interpolate(h, scale_factor=2, mode="bilinear", align_corners=False)
        return F.interpolate(h, size=(7, 7), mode="bilinear", align_corners=True)


def _cnn(p: float):
    """Conv (no bias: before BatchNorm it has no gradient, which Adam would amplify from
    rounding noise), BatchNorm2d, ReLU, Dropout(p), Linear."""
    return nn.Sequential(nn.Conv2d(2, 3, 3, bias=False), nn.BatchNorm2d(3), nn.ReLU(),
                         nn.Dropout(p), nn.Flatten(), nn.Linear(3 * 4 * 4, 2))


#: name: (make the module, input shape without the batch axis, token count for integer
#: inputs or None for float ones)
MODULES = {
    "mlp": (lambda: nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)), (4,), None),
    "cnn": (lambda: _cnn(0.0), (2, 6, 6), None),
    "resnet_block": (ResidualBlock, (3, 5, 5), None),
    "lstm": (lambda: Recurrent("LSTM"), (5, 3), None),
    "gru": (lambda: Recurrent("GRU"), (5, 3), None),
    "rnn": (lambda: Recurrent("RNN"), (5, 3), None),
    "encoder_norm_last": (lambda: Encoder(False), (4, 8), None),
    "encoder_norm_first": (lambda: Encoder(True), (4, 8), None),
    "multihead_attention": (SelfAttention, (4, 8), None),
    "embedding": (Embedding, (5,), 10),
    "embedding_bag": (EmbeddingBag, (3,), 10),
    "upsample_nearest": (lambda: Upsampling("nearest"), (2, 3, 3), None),
    "upsample_bilinear": (lambda: Upsampling("bilinear"), (2, 3, 3), None),
    "interpolate_bilinear": (lambda: Upsampling("interpolate_bilinear"), (2, 3, 3), None),
    "interpolate_align_corners": (lambda: Upsampling("align_corners"), (2, 3, 3), None),
}
#: A CNN whose Dropout drops: for the gradient with the mask the forward pass drew.
DROPOUT = (lambda: _cnn(0.5), (2, 6, 6), None)
EXPORTERS = ("legacy", "dynamo")
OPSETS = (17, None)  # None: the exporter's default
MODES = ("eval", "train")
OPTIMIZERS = {"sgd": (SGD(0.05), lambda p: torch.optim.SGD(p, lr=0.05)),
              "adam": (Adam(0.01), lambda p: torch.optim.Adam(p, lr=0.01))}
ROWS = 8


def _net(make, mode: str, exporter: str):
    """The module (seeded), every parameter and running statistic different from every
    other (an exporter merges equal initializers), in the mode of the export (see the
    docstring for the dynamo exporter's training mode)."""
    torch.manual_seed(0)
    net = make()
    make_distinct(net)
    net.train(mode == "train")
    if exporter == "dynamo":
        for layer in net.modules():
            if isinstance(layer, nn.modules.batchnorm._BatchNorm):
                layer.eval()
    return net


def _inputs(spec, rows: int, seed: int = 1) -> np.ndarray:
    shape, tokens = spec[1], spec[2]
    rng = np.random.default_rng(seed)
    if tokens is not None:
        return rng.integers(0, tokens, size=(rows, *shape))
    return rng.normal(size=(rows, *shape)).astype(np.float32)


def _targets(spec, X: np.ndarray) -> np.ndarray:
    """Random targets of the module's output shape."""
    net = spec[0]().eval()
    with torch.no_grad():
        shape = net(torch.from_numpy(X)).shape
    return np.random.default_rng(2).normal(size=shape).astype(np.float32)


#: Exported with the dynamo exporter's optimizer on: onnxruntime (1.19 and 1.32) crashes
#: (segmentation fault) loading the unoptimized EmbeddingBag export, whose Loop carries a
#: sequence; the optimizer keeps the parameters as they are for this module.
DYNAMO_OPTIMIZED = {"embedding_bag"}


def _spec(name: str):
    return DROPOUT if name == "cnn_dropout" else MODULES[name]


def _export(name: str, exporter: str, opset: int | None,
            mode: str) -> tuple[onnx.ModelProto, dict[str, torch.Tensor]]:
    """The export, and the module's state after it."""
    spec = _spec(name)
    net = _net(spec[0], mode, exporter)
    example = torch.from_numpy(_inputs(spec, 3, seed=0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecation and opset conversion warnings
        if exporter == "dynamo":
            program = torch.onnx.export(
                net, (example,), dynamo=True, opset_version=opset,
                optimize=name in DYNAMO_OPTIMIZED,
                input_names=["x"], output_names=["y"],
                dynamic_shapes=({0: torch.export.Dim("N", min=2)},), verbose=False)
            return program.model_proto, copy.deepcopy(net.state_dict())
        buffer = io.BytesIO()
        torch.onnx.export(
            net, (example,), buffer, dynamo=False, opset_version=opset,
            do_constant_folding=False, input_names=["x"], output_names=["y"],
            dynamic_axes={"x": {0: "N"}, "y": {0: "N"}},
            training=(torch.onnx.TrainingMode.TRAINING if mode == "train"
                      else torch.onnx.TrainingMode.EVAL))
        return onnx.load_from_string(buffer.getvalue()), copy.deepcopy(net.state_dict())


@pytest.fixture(scope="module")
def exported():
    """``exported(name, exporter, opset, mode)`` -> ``(model, net)``: the export, made once
    per module file, and a new module as the export left it (the TorchScript exporter's
    trace of a ``train()`` module moves its running statistics, and the export holds the
    moved ones)."""
    cache: dict[tuple, tuple[onnx.ModelProto, dict[str, torch.Tensor]]] = {}

    def get(name: str, exporter: str, opset: int | None, mode: str):
        key = (name, exporter, opset, mode)
        if key not in cache:
            cache[key] = _export(name, exporter, opset, mode)
        model, state = cache[key]
        net = _net(_spec(name)[0], mode, exporter)
        net.load_state_dict(state)
        return model, net

    return get


#: Exports lossgraph refuses by name (test_the_dynamo_embedding_bag_is_refused_...):
#: the dynamo exporter's EmbeddingBag is a Loop that collects a sequence (SequenceEmpty,
#: SequenceInsert, ConcatFromSequence), and no gradient passes a sequence.
REFUSED = {("embedding_bag", "dynamo")}


def _case(name: str, exporter: str, opset: int | None, mode: str):
    return pytest.param(name, exporter, opset, mode,
                        id=f"{name}-{exporter}-{'opset17' if opset else 'default'}-{mode}")


MATRIX = [_case(name, exporter, opset, mode)
          for name in MODULES for exporter in EXPORTERS for opset in OPSETS for mode in MODES
          if (name, exporter) not in REFUSED]


# -- gradients and steps ----------------------------------------------------------------------


@pytest.mark.parametrize("name, exporter, opset, mode", MATRIX)
def test_gradients_equal_torch_autograd_in_float64(exported, name, exporter, opset, mode):
    spec = MODULES[name]
    model, net = exported(name, exporter, opset, mode)
    X = _inputs(spec, 6)
    assert_gradients_like_torch(model, net, X, _targets(spec, X))


@pytest.mark.parametrize("opset", OPSETS, ids=["opset17", "default"])
def test_the_dynamo_embedding_bag_is_refused_naming_the_weight_and_the_node(exported, opset):
    """compile_program names the parameter no gradient can reach and the Loop that blocks
    it, rather than training the head alone; named weights still train."""
    model, _ = exported("embedding_bag", "dynamo", opset, "eval")
    with pytest.raises(UnsupportedModelError, match=r"(?s)'bag\.weight'.*-> \[Loop .*\(a "
                                                    r"sequence\).*'head\.weight', 'head\.bias'"):
        lossgraph.compile_program(model)
    program = lossgraph.compile_program(model, weights=["head.weight", "head.bias"])
    assert program.weights == ["head.weight", "head.bias"]


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("name, exporter, opset, mode", MATRIX)
def test_steps_equal_torch_optim(exported, name, exporter, opset, mode, optimizer):
    spec = MODULES[name]
    ours, theirs = OPTIMIZERS[optimizer]
    model, net = exported(name, exporter, opset, mode)
    program = lossgraph.compile_program(model, optimizer=ours)
    assert sorted(program.weights) == sorted(name for name, _ in net.named_parameters())
    X = _inputs(spec, 3 * ROWS)
    # atol: float32 rounding of the weights (1e-7) grows to 1e-5 in the predictions of the
    # eval-mode residual block after training-mode steps
    assert_steps_like_torch(lossgraph.Trainer(program), net, theirs(net.parameters()), X,
                            _targets(spec, X), steps=3, rows=ROWS, atol=5e-5)


class FixedMask(nn.Module):
    """Dropout with a given mask: ``x * mask / (1 - p)``."""

    def __init__(self, mask: np.ndarray, p: float) -> None:
        super().__init__()
        self.register_buffer("scale", torch.from_numpy(mask.astype(np.float32) / (1 - p)))

    def forward(self, x):
        return x * self.scale


@pytest.mark.parametrize("opset", OPSETS, ids=["opset17", "default"])
@pytest.mark.parametrize("exporter", EXPORTERS)
def test_dropout_gradient_is_torchs_with_the_mask_of_the_forward_pass(exported, exporter,
                                                                       opset):
    """A training-mode Dropout(0.5): the gradient of the run equals torch's with the mask
    that run drew (read from the Dropout's input and output: where its input is 0, after a
    ReLU, the mask changes nothing). The dynamo exporter writes the Dropout without its mask
    output; the gradient pass adds it."""
    exported_model, net = exported("cnn_dropout", exporter, opset, "train")
    model = onnx.ModelProto()
    model.CopyFrom(exported_model)
    (dropout,) = [n for n in model.graph.node if n.op_type == "Dropout"]
    model.graph.output.extend(onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT,
                                                                 ("N", 3, 4, 4))
                              for name in (dropout.input[0], dropout.output[0]))
    X = _inputs(DROPOUT, 6)
    y = _targets(DROPOUT, X)
    names = [name for name, _ in net.named_parameters()]
    ours = lossgraph_gradients(model, names, X, y, output_index="y",
                               fetch=(dropout.input[0], dropout.output[0]))
    before, after = ours.pop(dropout.input[0]), ours.pop(dropout.output[0])
    mask = (after != 0) | (before == 0)
    assert 0.2 < mask[before != 0].mean() < 0.8
    net[3] = FixedMask(mask, 0.5)
    assert_gradients_close(ours, torch_gradients(net, X, y))


def test_dynamo_exports_a_training_module_with_inference_mode_batch_normalization(exported):
    """Why the dynamo exports of ``train()`` modules are compared with torch's BatchNorm in
    eval mode: torch 2.13's dynamo exporter writes no training-mode BatchNormalization
    (the TorchScript exporter does) but keeps a training Dropout."""
    def ops(model: onnx.ModelProto) -> dict[str, onnx.NodeProto]:
        return {n.op_type: n for n in model.graph.node}

    legacy = ops(exported("cnn_dropout", "legacy", 17, "train")[0])
    dynamo = ops(exported("cnn_dropout", "dynamo", 17, "train")[0])
    assert len(legacy["BatchNormalization"].output) == 3
    assert len(dynamo["BatchNormalization"].output) == 1
    assert all(a.name != "training_mode" or a.i == 0
               for a in dynamo["BatchNormalization"].attribute)
    assert "Dropout" in legacy and "Dropout" in dynamo
