"""The architectures people fine-tune, exported both ways and trained by lossgraph in every
fusion mode, each compared with torch trained the same way: the catalogue behind
``docs/supported_models.md``.

Every model is built from its library's constructor or config with random weights (nothing
is downloaded), small enough to train in a second (64x64 or 32x32 images, 2 transformer
layers of width 32), every parameter and running statistic moved off its initial value as a
fine-tuned checkpoint's are (:func:`like_a_checkpoint`: the exporters merge equal
initializers, which a fresh model is full of), and dropout off (``p = 0``: the same
function in torch and in the export, where random masks would differ). Then, for each
way to export (:data:`EXPORTERS`):

- ``legacy``: ``torch.onnx.export(..., dynamo=False, opset_version=17,
  do_constant_folding=False)``, the batch axis (and a text model's sequence axis) dynamic by
  ``dynamic_axes``; a model with BatchNorm in training mode
  (``training=TrainingMode.TRAINING``), the others in eval mode;
- ``dynamo``: ``torch.onnx.export(..., dynamo=True, optimize=False)`` with
  ``dynamic_shapes`` (torch.export ``Dim`` objects). torch 2.13's dynamo exporter writes
  BatchNorm in inference mode from a training module, so its torch reference trains with
  BatchNorm in eval mode, the function the export computes;
- ``legacy-folded`` and ``dynamo-optimized``: the same with torch's default folding, which
  changes which weights the export has (in the ``step`` mode only);

and for each fusion mode, :meth:`Case.run` compiles the export (cross entropy of the
logits, SGD), trains one epoch of :data:`STEPS` batches in order, and compares it with
``torch.optim.SGD`` on the module over the same batches (:func:`compare`: the epoch's mean
loss, and every trained tensor, within the family's tolerance beyond torch's own float32
rounding). The outcome is one of :data:`STATUSES`.

``python tests/support/supported_models.py`` runs the catalogue, records the outcomes in
``tests/support/supported_models.json`` and writes the page from them;
``tests/test_supported_models.py`` holds the page to the record and runs a representative
part of the catalogue again.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import inspect
import io
import json
import re
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx

if __name__ == "__main__":  # run as a script: lossgraph and support from the checkout
    sys.path[:0] = [str(Path(__file__).resolve().parents[n]) for n in (2, 1)]
from support.environment import ROOT, model_library  # noqa: E402

RECORD = Path(__file__).resolve().with_name("supported_models.json")
PAGE = ROOT / "docs" / "supported_models.md"

FUSE_MODES = ("step", "epoch", "separate")


@dataclass(frozen=True)
class Exporter:
    """A way to export: torch's ``dynamo`` exporter or the legacy one, with its constant
    folding (the legacy ``do_constant_folding``, the dynamo ``optimize``) on, as torch's
    defaults have it, or off, as an export for training should; run in ``fuse_modes``."""

    name: str
    dynamo: bool
    folding: bool
    fuse_modes: tuple[str, ...]


#: The exports of every architecture: both exporters with folding off in every fusion mode,
#: and with torch's default folding in one (folding changes the export, not the training).
EXPORTERS = (Exporter("legacy", False, False, FUSE_MODES),
             Exporter("dynamo", True, False, FUSE_MODES),
             Exporter("legacy-folded", False, True, ("step",)),
             Exporter("dynamo-optimized", True, True, ("step",)))
#: SGD steps per case (one epoch of that many batches), and the learning rate
STEPS, LEARNING_RATE = 3, 0.001
LEGACY_OPSET = 17

#: What a case can come to. A named error is a lossgraph.errors class: the case is refused
#: before any work, by name and with its reason. The export's weights not being the
#: module's is the exporter's doing; lossgraph training it without a warning, a wrong number
#: and a raw exception are defects (:func:`is_defect`), each one of KNOWN's.
(EQUAL, NAMED_ERROR, EXPORT_FAILS, WEIGHTS_CHANGED_WARNED, WEIGHTS_CHANGED, DIFFERS,
 RAW_EXCEPTION) = (
    "equal to torch", "named error", "export fails", "not the module's weights, warned",
    "not the module's weights", "differs from torch", "raw exception")
STATUSES = (EQUAL, NAMED_ERROR, EXPORT_FAILS, WEIGHTS_CHANGED_WARNED, WEIGHTS_CHANGED, DIFFERS,
            RAW_EXCEPTION)


@dataclass(frozen=True)
class Family:
    """A kind of model, and the tolerance of its comparison with torch (:func:`compare`):
    of the epoch's mean loss, relative, and of each trained tensor, relative to the largest
    change training made, beyond torch's own float32 rounding."""

    name: str
    tolerance: float


CNN = Family("convolutional network", 1e-4)
VISION = Family("vision transformer", 1e-4)
TEXT = Family("text transformer", 1e-4)
AUDIO = Family("audio transformer", 1e-4)


@dataclass(frozen=True)
class Architecture:
    """One row of the catalogue: a model from ``source`` (one of
    :data:`support.environment.MODEL_LIBRARIES`), ``build(library)`` making it (a
    ``torch.nn.Module`` whose ``forward`` takes the inputs by position and returns the
    logits), and ``inputs(rows, seed)`` its example inputs by name (axis 0 the batch)."""

    name: str
    source: str
    family: Family
    build: Callable[[Any], Any]
    #: how the model is built, for the page
    how: str
    inputs: Callable[[int, int], dict[str, np.ndarray]]
    #: the input axes besides the batch that are dynamic, by input name: {axis: name}
    dynamic: dict[str, dict[int, str]] = field(default_factory=dict)
    #: the dynamic axes of the logits besides the batch
    output_dynamic: dict[int, str] = field(default_factory=dict)
    #: trained as its constructor made it (equal norms and zero biases), not like a
    #: checkpoint (:func:`like_a_checkpoint`)
    fresh: bool = False
    #: compile_program's untie, where not its default
    untie: str | None = None


# -- inputs -----------------------------------------------------------------------------------

SIZE, LENGTH, VOCABULARY, CLASSES = 64, 8, 99, 10


def images(rows: int, seed: int, name: str = "x", size: int = SIZE) -> dict[str, np.ndarray]:
    """Normal noise images, ``(rows, 3, size, size)``."""
    rng = np.random.default_rng(seed)
    return {name: rng.normal(size=(rows, 3, size, size)).astype(np.float32)}


def pixels(rows: int, seed: int) -> dict[str, np.ndarray]:
    """:func:`images` as transformers names them, 32x32."""
    return images(rows, seed, "pixel_values", 32)


def tokens(rows: int, seed: int) -> dict[str, np.ndarray]:
    """Token ids (from 2: 0 and 1 are special in some vocabularies) and an attention mask
    that pads the last 2 tokens of every other row."""
    rng = np.random.default_rng(seed)
    mask = np.ones((rows, LENGTH), np.int64)
    mask[1::2, LENGTH - 2:] = 0
    return {"input_ids": rng.integers(2, VOCABULARY, size=(rows, LENGTH)),
            "attention_mask": mask}


def translation(rows: int, seed: int) -> dict[str, np.ndarray]:
    """:func:`tokens`, and the decoder's token ids (shorter)."""
    rng = np.random.default_rng(seed + 1000)
    return {**tokens(rows, seed),
            "decoder_input_ids": rng.integers(2, VOCABULARY, size=(rows, LENGTH - 2))}


def waveform(rows: int, seed: int) -> dict[str, np.ndarray]:
    """Normal noise, 400 samples a row."""
    rng = np.random.default_rng(seed)
    return {"input_values": rng.normal(size=(rows, 400)).astype(np.float32)}


def features(rows: int, seed: int) -> dict[str, np.ndarray]:
    """Normal noise log-mel features, 8 bins by 32 frames."""
    rng = np.random.default_rng(seed)
    return {"input_features": rng.normal(size=(rows, 8, 32)).astype(np.float32)}


# -- the catalogue ----------------------------------------------------------------------------


def _logits_module() -> type:
    import torch

    class Logits(torch.nn.Module):
        """A transformers model called with its inputs by name, returning its logits."""

        def __init__(self, model: Any, names: tuple[str, ...]) -> None:
            super().__init__()
            self.model, self.names = model, names

        def forward(self, *inputs):
            return self.model(**dict(zip(self.names, inputs))).logits

    return Logits


def logits_of(model: Any, inputs: Callable[[int, int], dict[str, np.ndarray]]) -> Any:
    """The transformers ``model`` called with ``inputs``' arrays by position, returning its
    logits (the exported output)."""
    return _logits_module()(model, tuple(inputs(1, 0)))


TEXT_AXES = {"input_ids": {1: "sequence"}, "attention_mask": {1: "sequence"}}
#: transformers' configs of the sizes the catalogue uses, dropout off
SMALL = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
         "intermediate_size": 37, "hidden_dropout_prob": 0.0,
         "attention_probs_dropout_prob": 0.0}


def _torchvision() -> list[Architecture]:
    def image(name: str, build: Callable[[Any], Any], how: str) -> Architecture:
        return Architecture(name, "torchvision", CNN, build, how, images)

    def convnext(tv: Any) -> Any:
        block = tv.models.convnext.CNBlockConfig
        return tv.models.ConvNeXt([block(24, 48, 1), block(48, 96, 1), block(96, 192, 1),
                                   block(192, None, 1)], num_classes=CLASSES)

    def vit(tv: Any) -> Any:
        return tv.models.VisionTransformer(image_size=SIZE, patch_size=16, num_layers=2,
                                           num_heads=2, hidden_dim=32, mlp_dim=64,
                                           num_classes=CLASSES)

    def swin(tv: Any) -> Any:
        return tv.models.SwinTransformer(patch_size=[4, 4], embed_dim=16, depths=[2, 2],
                                         num_heads=[2, 4], window_size=[4, 4],
                                         num_classes=CLASSES)

    def models(name: str) -> Callable[[Any], Any]:
        return lambda tv: getattr(tv.models, name)(num_classes=CLASSES)

    def mobilenet(tv: Any) -> Any:
        setting, _ = tv.models.mobilenetv3._mobilenet_v3_conf("mobilenet_v3_small")
        return tv.models.MobileNetV3(setting[:4], 128, num_classes=CLASSES)

    def efficientnet(tv: Any) -> Any:
        setting, _ = tv.models.efficientnet._efficientnet_conf("efficientnet_b0",
                                                               width_mult=1.0, depth_mult=1.0)
        return tv.models.EfficientNet(setting[:3], 0.2, last_channel=128, num_classes=CLASSES)

    return [
        image("resnet18", models("resnet18"), "resnet18(num_classes=10)"),
        image("mobilenet_v3_small", mobilenet,
              "MobileNetV3 of mobilenet_v3_small's first 4 blocks, last_channel=128"),
        image("efficientnet_b0", efficientnet,
              "EfficientNet of efficientnet_b0's first 3 stages, last_channel=128"),
        image("shufflenet_v2", lambda tv: tv.models.ShuffleNetV2(
            [2, 2, 2], [24, 24, 48, 96, 128], num_classes=CLASSES),
            "ShuffleNetV2(stages_repeats=[2, 2, 2], stages_out_channels=[24, 24, 48, 96, "
            "128])"),
        image("squeezenet1_0", models("squeezenet1_0"), "squeezenet1_0(num_classes=10)"),
        image("densenet", lambda tv: tv.models.DenseNet(growth_rate=8, block_config=(2, 2),
                                                         num_init_features=16,
                                                         num_classes=CLASSES),
              "DenseNet(growth_rate=8, block_config=(2, 2), num_init_features=16)"),
        image("convnext", convnext, "ConvNeXt([CNBlockConfig(24, 48, 1), ..., "
                                    "CNBlockConfig(192, None, 1)])"),
        Architecture("vit", "torchvision", VISION, vit,
                     "VisionTransformer(image_size=64, patch_size=16, num_layers=2, "
                     "num_heads=2, hidden_dim=32, mlp_dim=64)", images),
        Architecture("swin", "torchvision", VISION, swin,
                     "SwinTransformer(patch_size=[4, 4], embed_dim=16, depths=[2, 2], "
                     "num_heads=[2, 4], window_size=[4, 4])", images),
    ]


def _timm() -> list[Architecture]:
    def model(name: str, family: Family = CNN, **options: Any) -> Architecture:
        shown = "".join(f", {k}={v!r}" for k, v in options.items())
        return Architecture(
            name, "timm", family,
            lambda timm: timm.create_model(name, num_classes=CLASSES, **options),
            f"create_model({name!r}, num_classes=10{shown})", images)

    return [
        model("resnet10t"),
        model("mobilenetv3_small_050"),
        model("convnext_atto", depths=(1, 1, 1, 1)),
        model("mobilevit_xxs"),
        model("vit_tiny_patch16_224", VISION, img_size=SIZE, depth=2),
        model("deit_tiny_patch16_224", VISION, img_size=SIZE, depth=2),
    ]


def _transformers() -> list[Architecture]:
    def text(name: str, make: Callable[[Any], Any], how: str, **options: Any) -> Architecture:
        return Architecture(name, "transformers", TEXT,
                            lambda t: logits_of(make(t), tokens), how, tokens, TEXT_AXES,
                            **options)

    def bert(t: Any) -> Any:
        return t.BertForSequenceClassification(t.BertConfig(
            vocab_size=VOCABULARY, max_position_embeddings=64, num_labels=3, **SMALL))

    def distilbert(t: Any) -> Any:
        return t.DistilBertForSequenceClassification(t.DistilBertConfig(
            vocab_size=VOCABULARY, max_position_embeddings=64, dim=32, n_layers=2, n_heads=2,
            hidden_dim=37, dropout=0.0, attention_dropout=0.0, seq_classif_dropout=0.0,
            num_labels=3))

    def roberta(t: Any) -> Any:
        return t.RobertaForSequenceClassification(t.RobertaConfig(
            vocab_size=VOCABULARY, max_position_embeddings=64, num_labels=3, **SMALL))

    def gpt2(t: Any) -> Any:
        return t.GPT2LMHeadModel(t.GPT2Config(
            n_embd=32, n_layer=2, n_head=2, vocab_size=VOCABULARY, n_positions=64,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))

    def t5(t: Any) -> Any:
        return t.T5ForConditionalGeneration(t.T5Config(
            vocab_size=VOCABULARY, d_model=32, d_kv=16, d_ff=37, num_layers=2, num_heads=2,
            dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0))

    def vit(t: Any) -> Any:
        return t.ViTForImageClassification(t.ViTConfig(
            image_size=32, patch_size=8, num_labels=CLASSES, **SMALL))

    def wav2vec2(t: Any) -> Any:
        return t.Wav2Vec2ForSequenceClassification(t.Wav2Vec2Config(
            conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3),
            num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=2, num_labels=3,
            apply_spec_augment=False, mask_time_prob=0.0, layerdrop=0.0,
            activation_dropout=0.0, feat_proj_dropout=0.0, final_dropout=0.0,
            **{**SMALL, "hidden_dropout_prob": 0.0}))

    def whisper(t: Any) -> Any:
        return t.WhisperForAudioClassification(t.WhisperConfig(
            d_model=32, encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=37,
            decoder_layers=1, decoder_attention_heads=2, decoder_ffn_dim=37, num_mel_bins=8,
            max_source_positions=16, vocab_size=VOCABULARY, num_labels=3, dropout=0.0,
            attention_dropout=0.0, activation_dropout=0.0))

    small = "hidden_size=32, num_hidden_layers=2, num_attention_heads=2"
    return [
        text("bert", bert, f"BertForSequenceClassification(BertConfig({small}))"),
        text("bert-fresh", bert, "the same, trained as its config made it (equal "
                                  "LayerNorm weights, zero biases)", fresh=True),
        text("bert-fresh-untied", bert, "bert-fresh, compiled with untie=\"auto\"",
             fresh=True, untie="auto"),
        text("distilbert", distilbert,
             "DistilBertForSequenceClassification(DistilBertConfig(dim=32, n_layers=2))"),
        text("roberta", roberta, f"RobertaForSequenceClassification(RobertaConfig({small}))"),
        text("gpt2", gpt2, "GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=2))",
             output_dynamic={1: "sequence"}),
        Architecture("t5", "transformers", TEXT, lambda t: logits_of(t5(t), translation),
                     "T5ForConditionalGeneration(T5Config(d_model=32, num_layers=2))",
                     translation, {**TEXT_AXES, "decoder_input_ids": {1: "target"}},
                     {1: "target"}),
        Architecture("vit", "transformers", VISION, lambda t: logits_of(vit(t), pixels),
                     f"ViTForImageClassification(ViTConfig(image_size=32, patch_size=8, "
                     f"{small}))", pixels),
        Architecture("wav2vec2", "transformers", AUDIO,
                     lambda t: logits_of(wav2vec2(t), waveform),
                     f"Wav2Vec2ForSequenceClassification(Wav2Vec2Config(conv_dim=(16, 16), "
                     f"{small}))", waveform),
        Architecture("whisper", "transformers", AUDIO,
                     lambda t: logits_of(whisper(t), features),
                     "WhisperForAudioClassification(WhisperConfig(d_model=32, "
                     "encoder_layers=2, num_mel_bins=8, max_source_positions=16))", features),
    ]


def catalogue() -> list[Architecture]:
    """Every architecture of the suite, in the page's order."""
    return [*_torchvision(), *_timm(), *_transformers()]


# -- one case ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Outcome:
    """What one case came to: a status of :data:`STATUSES`, and its reason (the error's
    class and message, or the deviation from torch)."""

    status: str
    reason: str = ""

    def as_record(self) -> dict[str, str]:
        return dataclasses.asdict(self)


def no_dropout(net: Any) -> None:
    """Every dropout of ``net`` (torch's, torchvision's stochastic depth, timm's drop path)
    set to drop nothing, in place (a random layer left on shows as a difference from
    torch)."""
    import torch

    for layer in net.modules():
        if isinstance(layer, torch.nn.modules.dropout._DropoutNd):
            layer.p = 0.0
        elif hasattr(layer, "drop_prob"):  # timm's DropPath
            layer.drop_prob = 0.0
        elif type(layer).__name__ == "StochasticDepth":  # torchvision's
            layer.p = 0.0


def has_batch_norm(net: Any) -> bool:
    import torch

    return any(isinstance(layer, torch.nn.modules.batchnorm._BatchNorm)
               for layer in net.modules())


def _set_mode(net: Any, dynamo: bool) -> None:
    """Training mode, with BatchNorm in eval mode for the dynamo exporter (which writes no
    training-mode BatchNormalization)."""
    import torch

    net.train()
    if dynamo:
        for layer in net.modules():
            if isinstance(layer, torch.nn.modules.batchnorm._BatchNorm):
                layer.eval()


def like_a_checkpoint(net: Any, inputs: Callable[[int, int], dict[str, np.ndarray]]) -> None:
    """Make ``net``, fresh from its constructor, look like a trained checkpoint, in place:
    every parameter moved by noise of a twentieth of its spread (a tenth of a unit where it
    has none: the ones and zeros of fresh norms and biases, which the exporters would merge
    into shared initializers), and the BatchNorm running statistics those of ``inputs``
    (their average over a few training-mode passes of 8 rows), so that the eval-mode
    function is the size of the training-mode one."""
    import torch

    with torch.no_grad():
        for parameter in net.parameters():
            spread = float(parameter.std()) if parameter.numel() > 1 else 0.0
            parameter.add_(torch.randn_like(parameter) * 0.05 * (spread or 0.1))
        norms = [layer for layer in net.modules()
                 if isinstance(layer, torch.nn.modules.batchnorm._BatchNorm)]
        if norms:
            momenta = [layer.momentum for layer in norms]
            for layer in norms:
                layer.reset_running_stats()
                layer.momentum = None  # a cumulative average
            net.train()
            for seed in range(10, 13):
                net(*(torch.from_numpy(v) for v in inputs(8, seed).values()))
            for layer, momentum in zip(norms, momenta):
                layer.momentum = momentum


def build(architecture: Architecture) -> Any:
    """The architecture's module, seeded, like a checkpoint (:func:`like_a_checkpoint`),
    dropout off."""
    import torch

    torch.manual_seed(0)
    net = architecture.build(model_library(architecture.source))
    no_dropout(net)
    if not architecture.fresh:
        like_a_checkpoint(net, architecture.inputs)
    return net


def export(architecture: Architecture, exporter: Exporter) -> tuple[onnx.ModelProto, Any]:
    """The export, and the module as the export left it (the legacy exporter's trace of a
    training module moves its running statistics, and the export holds the moved ones)."""
    import torch

    net = build(architecture)
    _set_mode(net, exporter.dynamo)
    example = {k: torch.from_numpy(v) for k, v in architecture.inputs(2, 0).items()}
    names = list(example)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecation, tracer and opset warnings
        if exporter.dynamo:
            dims = {"batch": torch.export.Dim("batch", min=1)}
            dims.update((name, torch.export.Dim(name, min=2, max=64))
                        for axes in architecture.dynamic.values() for name in axes.values())
            shapes = tuple({0: dims["batch"], **{axis: dims[name] for axis, name
                                                 in architecture.dynamic.get(n, {}).items()}}
                           for n in names)
            if any(p.kind is p.VAR_POSITIONAL
                   for p in inspect.signature(net.forward).parameters.values()):
                shapes = (shapes,)  # a forward(*inputs) takes them as one argument
            model = torch.onnx.export(net, tuple(example.values()), dynamo=True,
                                      input_names=names, output_names=["logits"],
                                      dynamic_shapes=shapes, optimize=exporter.folding,
                                      verbose=False).model_proto
        else:
            buffer = io.BytesIO()
            axes = {n: {0: "batch", **architecture.dynamic.get(n, {})} for n in names}
            axes["logits"] = {0: "batch", **architecture.output_dynamic}
            training = (torch.onnx.TrainingMode.TRAINING if has_batch_norm(net)
                        else torch.onnx.TrainingMode.EVAL)
            torch.onnx.export(net, tuple(example.values()), buffer, dynamo=False,
                              opset_version=LEGACY_OPSET, input_names=names,
                              output_names=["logits"], dynamic_axes=axes, training=training,
                              do_constant_folding=exporter.folding)
            model = onnx.load_from_string(buffer.getvalue())
    _set_mode(net, exporter.dynamo)
    return model, net


@dataclass
class Reference:
    """torch's training of the module: the loss of each step, and the parameters and
    running statistics before and after, by name."""

    losses: list[float]
    before: dict[str, np.ndarray]
    after: dict[str, np.ndarray]
    #: the parameters torch trains (``requires_grad``), and those it does not
    parameters: list[str]
    frozen: list[str]
    #: the tensors after the same training in float64
    exact: dict[str, np.ndarray]

    def trained(self) -> list[str]:
        """The names of what training changes: the parameters, and the running statistics
        the training-mode BatchNorm layers update."""
        return [*self.parameters, *(n for n in self.before
                                    if n not in self.parameters and n not in self.frozen
                                    and not np.array_equal(self.before[n], self.after[n]))]


def tensors(net: Any) -> dict[str, np.ndarray]:
    """``net``'s parameters (a tied one once) and floating-point buffers, by name, copied."""
    named = [*net.named_parameters(), *net.named_buffers()]
    return {name: t.detach().numpy().copy() for name, t in named if t.is_floating_point()}


def torch_loss(logits: Any, labels: Any) -> Any:
    """Cross entropy of the logits over their last axis, the mean over every other."""
    import torch

    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                             labels.reshape(-1))


def sgd_steps(net: Any, X: dict[str, np.ndarray], y: np.ndarray, rows: int) -> list[float]:
    """:data:`STEPS` SGD steps of ``rows`` rows, in order, on ``net`` (in place, float inputs
    in ``net``'s precision): the loss of each."""
    import torch

    dtype = next(net.parameters()).dtype
    optimizer = torch.optim.SGD(net.parameters(), lr=LEARNING_RATE)
    losses = []
    # oneDNN's float32 convolution gradients are about 1% of the largest gradient away from
    # float64's on these networks (ResNet-18's first Conv); torch's own kernels, 1e-6
    with torch.backends.mkldnn.flags(enabled=False):
        for step in range(STEPS):
            batch = [torch.from_numpy(v[step * rows:(step + 1) * rows]) for v in X.values()]
            optimizer.zero_grad()
            loss = torch_loss(net(*(b.to(dtype) if b.is_floating_point() else b
                                    for b in batch)),
                              torch.from_numpy(y[step * rows:(step + 1) * rows]))
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    return losses


def train_torch(net: Any, X: dict[str, np.ndarray], y: np.ndarray, rows: int) -> Reference:
    """:func:`sgd_steps` on a copy of ``net``, and on a float64 copy (float32's own rounding
    is the distance between the two)."""
    net, exact = copy.deepcopy(net), copy.deepcopy(net).double()
    before = tensors(net)
    losses = sgd_steps(net, X, y, rows)
    sgd_steps(exact, X, y, rows)
    parameters = dict(net.named_parameters())
    return Reference(losses, before, tensors(net),
                     [n for n, p in parameters.items() if p.requires_grad],
                     [n for n, p in parameters.items() if not p.requires_grad],
                     tensors(exact))


def data(architecture: Architecture, net: Any, rows: int) -> tuple[dict[str, np.ndarray],
                                                                   np.ndarray]:
    """``STEPS * rows`` rows of inputs, and random class labels of the logits' shape but
    the classes axis."""
    import torch

    X = architecture.inputs(STEPS * rows, 1)
    with torch.no_grad():  # on a copy: a training-mode BatchNorm moves its statistics
        shape = copy.deepcopy(net)(*(torch.from_numpy(v[:2]) for v in X.values())).shape
    y = np.random.default_rng(2).integers(0, shape[-1], size=(STEPS * rows, *shape[1:-1]))
    return X, y


@dataclass
class Trained:
    """lossgraph's training: the epoch's mean loss, the state before and after, and the
    names of the warnings lossgraph gave."""

    loss: float
    before: dict[str, np.ndarray]
    after: dict[str, np.ndarray]
    names: list[str]
    warned: list[str]


def frozen_weights(model: onnx.ModelProto, reference: Reference) -> list[str]:
    """The export's initializers holding a parameter torch does not train (``requires_grad``
    off, as Whisper's positional embedding): lossgraph is told to leave them as they are."""
    if not reference.frozen:
        return []
    initializers = {i.name: onnx.numpy_helper.to_array(i) for i in model.graph.initializer}
    found = match({n: reference.before[n] for n in reference.frozen}, initializers)
    return sorted({weight for holders in found.holders.values() for weight, _ in holders})


def train_lossgraph(model: onnx.ModelProto, fuse: str, X: dict[str, np.ndarray],
                    y: np.ndarray, rows: int, frozen: list[str],
                    untie: str | None = None) -> Trained:
    """One epoch of :data:`STEPS` batches of ``rows`` rows, in order, trained by lossgraph,
    the ``frozen`` initializers left out of the weights, ``untie`` given to
    compile_program."""
    import lossgraph
    from lossgraph.errors import LossgraphWarning
    from lossgraph.optim import SGD

    weights = ([w for w in lossgraph.trainable_initializers(model) if w not in frozen]
               if frozen else None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", LossgraphWarning)
        program = lossgraph.compile_program(model, weights, loss="multiclass_log_loss",
                                            loss_options={"from_logits": True},
                                            optimizer=SGD(LEARNING_RATE), fuse=fuse,
                                            untie=untie)
        trainer = lossgraph.Trainer(program)
        trainer.fit(X, y, epochs=1, batch_size=rows, shuffle=False, progress=False)
    warned = sorted({w.category.__name__ for w in caught
                     if issubclass(w.category, LossgraphWarning)})
    names = [*program.weights, *program.buffers]
    return Trained(trainer.train_losses_[0], {n: program.state[n] for n in names},
                   trainer.state, names, warned)


@dataclass
class Matching:
    """Which of the program's weights and buffers holds which of the module's tensors
    (``{tensor: (weight, transposed)}``), and what the export changed: tensors it holds in
    no weight, several tensors merged into one weight, one tensor copied into several."""

    pairs: dict[str, tuple[str, bool]]
    missing: list[str]
    #: {weight: the tensors of equal values it holds}, where there are fewer weights
    merged: dict[str, list[str]]
    #: {tensor: the weights holding it beyond its own}
    copied: dict[str, list[str]]
    #: every weight holding each tensor
    holders: dict[str, list[tuple[str, bool]]]
    #: tensors of equal values held by as many weights, none named after them: which holds
    #: which shows only after training (:func:`pair_by_training`)
    ambiguous: list[tuple[list[str], list[tuple[str, bool]]]]

    def changes(self) -> str:
        """What the export changed, in words; empty when its weights are the module's."""
        said = []
        if self.missing:
            said.append(f"{len(self.missing)} of the module's tensors are no weight of the "
                        f"export (folded into constants or into other weights): "
                        f"{_names(self.missing)}")
        if self.merged:
            count = len({n for names in self.merged.values() for n in names})
            said.append(f"the export merged {count} tensors of equal values into "
                        f"{len(self.merged)} shared weights: {_names(self.merged)}")
        if self.copied:
            said.append(f"the export holds {len(self.copied)} of the module's tensors "
                        f"twice, as separate weights: {_names(self.copied)}")
        return "; ".join(said)


def _names(names: Any, shown: int = 3) -> str:
    names = list(names)
    more = f", ... ({len(names)} in all)" if len(names) > shown else ""
    return ", ".join(f"'{n}'" for n in names[:shown]) + more


def as_module(stored: np.ndarray, shape: tuple[int, ...], transposed: bool) -> np.ndarray:
    """A weight of the export in the shape of the module's tensor it holds."""
    return stored.reshape(shape[::-1]).T if transposed else stored.reshape(shape)


def _holds(stored: np.ndarray, value: np.ndarray, transposed: bool) -> bool:
    """Whether ``stored`` is ``value`` (transposed), up to axes of length 1."""
    if transposed and value.ndim != 2:
        return False
    value = value.T if transposed else value
    return (stored.size == value.size
            and np.squeeze(stored).shape == np.squeeze(value).shape
            and np.array_equal(stored.reshape(value.shape), value))


def match(module: dict[str, np.ndarray], program: dict[str, np.ndarray]) -> Matching:
    """Pair each of the module's tensors with the program's weights (or buffers) holding its
    value, as it is, transposed (exporters store a Linear's weight for MatMul) or with axes
    of length 1 added or removed (a layer scale stored as ``(1, C, 1, 1)``)."""
    holders: dict[str, list[tuple[str, bool]]] = {}
    for name, value in module.items():
        found = {}  # a weight that holds it as it is, not also transposed
        for weight, stored in program.items():
            for transposed in (False, True):
                if weight not in found and _holds(stored, value, transposed):
                    found[weight] = transposed
            holders[name] = list(found.items())
    # tensors of one value (a fresh model's zero biases) are held by the same weights: fewer
    # weights than tensors is a merge, more a copy; a weight named after a tensor is its own
    groups: dict[tuple[tuple[str, bool], ...], list[str]] = {}
    for name, found in holders.items():
        if found:
            groups.setdefault(tuple(sorted(found)), []).append(name)
    pairs: dict[str, tuple[str, bool]] = {}
    merged: dict[str, list[str]] = {}
    copied: dict[str, list[str]] = {}
    ambiguous = []
    for found, names in groups.items():
        if len(found) < len(names):
            merged.update((weight, names) for weight, _ in found)
            continue
        free = list(found)
        for name in names:
            named = [h for h in free if _named_after(h[0], name)]
            if len(named) == 1:
                pairs[name] = named[0]
                free.remove(named[0])
        unpaired = [n for n in names if n not in pairs]
        if len(free) > len(unpaired):
            copied.update((n, [w for w, _ in free]) for n in names)
        elif len(unpaired) == 1:
            pairs[unpaired[0]] = free[0]
        elif unpaired:
            ambiguous.append((unpaired, free))
    return Matching(pairs, [n for n, found in holders.items() if not found], merged, copied,
                    holders, ambiguous)


def _named_after(weight: str, tensor: str) -> bool:
    """Whether the export's ``weight`` bears the name of the module's ``tensor`` (the
    exporters keep a parameter's qualified name, perhaps under a prefix)."""
    return weight == tensor or weight.endswith("." + tensor) or tensor.endswith("." + weight)


def pair_by_training(matching: Matching, reference: Reference,
                     trained: Trained) -> dict[str, tuple[str, bool]]:
    """:attr:`Matching.pairs`, and the ambiguous tensors each paired with the weight of equal
    initial value that ends nearest to it after training (in turn, the nearest pair first):
    equal before training, the weights can only be told apart by what training did."""
    pairs = dict(matching.pairs)
    for names, found in matching.ambiguous:
        distances = sorted(
            (float(np.abs(as_module(trained.after[weight], reference.after[name].shape,
                                    transposed) - reference.after[name]).max()),
             name, (weight, transposed))
            for name in names for weight, transposed in found)
        taken: set[str] = set()
        for _, name, holder in distances:
            if name not in pairs and holder[0] not in taken:
                pairs[name] = holder
                taken.add(holder[0])
    return pairs


def compare(architecture: Architecture, reference: Reference, trained: Trained) -> Outcome:
    """The outcome of lossgraph's training against torch's: the losses, and each of the
    module's tensors after training against the weight holding it."""
    warned = f" (lossgraph warned: {', '.join(trained.warned)})" if trained.warned else ""
    matching = match({n: reference.before[n] for n in reference.trained()},
                     {n: trained.before[n] for n in trained.names})
    if matching.changes():
        return Outcome(WEIGHTS_CHANGED_WARNED if trained.warned else WEIGHTS_CHANGED,
                       matching.changes() + warned)
    tolerance = architecture.family.tolerance
    expected = float(np.mean(reference.losses))
    if abs(trained.loss - expected) > tolerance * max(abs(expected), 1.0):
        return Outcome(DIFFERS, f"the loss {trained.loss:.7g}, torch's {expected:.7g}")
    pairs = pair_by_training(matching, reference, trained)
    changes = {n: reference.after[n] - reference.before[n] for n in pairs}
    largest = max(float(np.abs(c).max()) for c in changes.values())
    if largest == 0:
        raise AssertionError(f"{architecture.name}: training changed no weight: the "
                             "comparison would prove nothing")
    worst, error = "", 0.0
    for name, (weight, transposed) in pairs.items():
        ours = as_module(trained.after[weight], reference.after[name].shape, transposed)
        theirs = reference.after[name]
        # beyond twice torch's own float32 rounding (its distance from float64 training):
        # as close to exact as torch, lossgraph is at most that far from torch
        rounding = float(np.abs(theirs - reference.exact[name]).max())
        difference = max(float(np.abs(ours - theirs).max()) - 2 * rounding, 0.0) / largest
        if difference > error:
            worst, error = name, difference
    if error > tolerance:
        return Outcome(DIFFERS, f"'{worst}' after training is {error:.2g} of the largest "
                                f"change away from torch's (tolerance {tolerance:g})")
    return Outcome(EQUAL, warned.strip())


def describe(error: BaseException) -> str:
    """An error's class and the first line of its message; for an error raised from
    another (torch's exporter wraps the cause in a ConversionError whose first line says
    only which step failed), the cause's too."""
    def line(error: BaseException) -> str:
        text = re.sub(r"\x1b\[[0-9;]*m", "", str(error)).strip()  # terminal colours
        return f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"

    cause = error
    while cause.__cause__ is not None:
        cause = cause.__cause__
    return line(error) + (f" ({line(cause)})" if cause is not error else "")


#: rows a batch
ROWS = 4


class Case:
    """The cases of one architecture: its exports and torch references made once, each
    (exporter, fuse) run on demand."""

    def __init__(self, architecture: Architecture) -> None:
        self.architecture = architecture
        self._exports: dict[Exporter, tuple[onnx.ModelProto, Any] | BaseException] = {}
        self._references: dict[Exporter, tuple[dict[str, np.ndarray], np.ndarray,
                                                Reference]] = {}

    def _export(self, exporter: Exporter) -> tuple[onnx.ModelProto, Any] | BaseException:
        if exporter not in self._exports:
            try:
                self._exports[exporter] = export(self.architecture, exporter)
            except Exception as error:  # the exporter's own failure, recorded as such
                self._exports[exporter] = error
        return self._exports[exporter]

    def run(self, exporter: Exporter, fuse: str) -> Outcome:
        """Train the ``exporter``'s export with ``fuse`` and compare it with torch."""
        from lossgraph.errors import LossgraphError

        exported = self._export(exporter)
        if isinstance(exported, BaseException):
            return Outcome(EXPORT_FAILS, describe(exported))
        model, net = exported
        if exporter not in self._references:
            X, y = data(self.architecture, net, ROWS)
            self._references[exporter] = X, y, train_torch(net, X, y, ROWS)
        X, y, reference = self._references[exporter]
        try:
            trained = train_lossgraph(model, fuse, X, y, ROWS,
                                      frozen_weights(model, reference), self.architecture.untie)
        except LossgraphError as error:
            return Outcome(NAMED_ERROR, describe(error))
        except Exception as error:  # a defect: recorded, and the suite fails unless KNOWN
            return Outcome(RAW_EXCEPTION, describe(error))
        return compare(self.architecture, reference, trained)


# -- the record and the page ------------------------------------------------------------------

#: What is known of the cases that are not equal to torch, by (source/name, exporter), or
#: ("*", exporter) for every architecture: why, and what to do. Every defect
#: (:func:`is_defect`) must be here; tests/test_supported_models.py fails on an entry whose
#: cases are all equal to torch.
KNOWN: dict[tuple[str, str], str] = {
    ("*", "legacy-folded"): "torch's default do_constant_folding=True folds computations of "
    "parameters alone into initializers of their own (Swin's relative-position bias "
    "gathered from its table, a weight-normed convolution's weight) and stores a tied "
    "embedding again, transposed, for the output projection (GPT-2, T5). lossgraph trains "
    "those initializers as the export has them and warns (FoldedWeightWarning: an "
    "initializer the exporter named onnx::<Op>_<n> that is no transposed Linear weight, a "
    "tensor stored twice). Export with do_constant_folding=False to train the module's "
    "parameters.",
    ("*", "dynamo-optimized"): "torch's default optimize=True folds each inference-mode "
    "BatchNorm into the Conv before it, folds computations of parameters alone (Swin's "
    "tables, weight norm), removes zero biases, stores a tied embedding twice (GPT-2) and "
    "merges initializers of equal values (a fresh BERT). lossgraph trains the export as it "
    "is and warns: FoldedWeightWarning for what the export's records say the optimizer "
    "folded or dropped (its rewrite rules, the parameters its graph signature names) and "
    "for a tensor stored twice, TiedWeightWarning for merged initializers. Export with "
    "optimize=False to train the module's parameters.",
    ("transformers/bert-fresh", "legacy"): "the legacy exporter merges initializers of equal "
    "values (a fresh model's LayerNorm ones and zero biases) into one, even with folding "
    "off: lossgraph warns (TiedWeightWarning) and trains the shared initializer as one "
    "tied weight; compile_program(untie=\"auto\") gives each layer its own copy, equal to "
    "torch (the bert-fresh-untied row).",
    ("transformers/t5", "dynamo"): "torch 2.13's dynamo exporter fails decomposing T5's "
    "attention output reshape with a dynamic sequence axis (a torch defect); the legacy "
    "export trains equal to torch.",
    ("transformers/t5", "dynamo-optimized"): "as with the dynamo exporter.",
}


def known(architecture: Architecture, exporter: Exporter) -> str:
    """KNOWN's note on the architecture's cases with the exporter, or ''."""
    return (KNOWN.get((f"{architecture.source}/{architecture.name}", exporter.name))
            or KNOWN.get(("*", exporter.name), ""))

#: The libraries whose versions the page states.
VERSIONS = ("torch", "torchvision", "timm", "transformers", "onnx", "onnxruntime-training-cpu",
            "onnxruntime")


def case_key(architecture: Architecture, exporter: Exporter, fuse: str) -> str:
    return f"{architecture.source}/{architecture.name}/{exporter.name}/{fuse}"


def columns() -> list[tuple[Exporter, str]]:
    """Every (exporter, fusion mode) an architecture runs in, in the page's order."""
    return [(exporter, fuse) for exporter in EXPORTERS for fuse in exporter.fuse_modes]


def cases() -> list[tuple[Architecture, Exporter, str]]:
    """Every (architecture, exporter, fusion mode), in the page's order."""
    return [(a, exporter, fuse) for a in catalogue() for exporter, fuse in columns()]


def load_record() -> dict[str, Any]:
    return json.loads(RECORD.read_text())


def versions() -> dict[str, str]:
    from importlib import metadata

    found = {}
    for dist in VERSIONS:
        try:
            found[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return found


def is_defect(status: str) -> bool:
    """Whether a case of this status is a defect of lossgraph's (and needs a KNOWN entry):
    a wrong number, a raw exception, or training an export that is not the module's weights
    without a warning."""
    return status in (WEIGHTS_CHANGED, DIFFERS, RAW_EXCEPTION)


HEADER = """\
# Supported models

<!-- Generated by `PYTHONPATH=. python tests/support/supported_models.py` (which runs
     every case and records the outcomes in tests/support/supported_models.json); do not
     edit. -->

The architectures people fine-tune, built from torchvision, timm and transformers with
random weights (nothing is downloaded), exported by both torch exporters and trained by
lossgraph in each fusion mode, against torch trained the same way.

**To train an export, turn the exporter's constant folding off**:
`torch.onnx.export(..., dynamo=False, do_constant_folding=False)` or
`torch.onnx.export(..., dynamo=True, optimize=False)`. With torch's defaults (the
*folded* and *optimized* columns) the exporters fold some parameters into constants
(Swin's relative-position tables, weight-normed convolutions, a BatchNorm into the Conv
before it) or store a tied embedding twice (GPT-2, T5): lossgraph then trains the export,
which is not training the module.

`PYTHONPATH=. python tests/support/supported_models.py` runs the whole catalogue (about
15 minutes of CPU) and writes this page (`--render` writes it from the record alone);
`tests/test_supported_models.py` (marked `torch` and `slow`, skipped where a library is
missing) holds the page to the record and runs a representative part of the catalogue
again, failing when a case's outcome is not the recorded one.

How each case runs:

- **The model**: built by the constructor or config shown, small (2 transformer layers of
  width 32, reduced depths where the constructor allows), then made to look like a
  checkpoint: every parameter moved by noise of a twentieth of its spread (a fresh
  model's equal LayerNorm weights and zero biases are merged into shared initializers by
  the exporters; the row marked *fresh* keeps them), BatchNorm running statistics those of
  the inputs. Dropout, stochastic depth and drop path are off (`p = 0`): a random mask
  differs between torch and onnxruntime.
- **legacy**: `torch.onnx.export(model, args, f, dynamo=False, opset_version=17,
  dynamic_axes=..., do_constant_folding=False)` with a dynamic batch (and sequence) axis; a
  model with BatchNorm in training mode (`training=torch.onnx.TrainingMode.TRAINING`),
  which trains its running statistics. **legacy-folded**: the same with torch's default
  `do_constant_folding=True`.
- **dynamo**: `torch.onnx.export(model, args, dynamo=True, dynamic_shapes=...,
  optimize=False)` with `torch.export.Dim` axes. torch 2.13's dynamo exporter writes
  BatchNorm in inference mode, so its torch reference trains with BatchNorm in eval mode.
  **dynamo-optimized**: the same with torch's default `optimize=True`.
- **Training**: `compile_program(model, loss="multiclass_log_loss", loss_options={"from_logits":
  True}, optimizer=SGD(0.001), fuse=...)` (the cross entropy of the logits; of every
  position's logits for the token models), the default weights but those holding a
  parameter torch does not train (`requires_grad=False`, as Whisper's positional
  embedding), then `Trainer.fit` of one epoch of 3 batches of 4 rows, in order; torch: the
  same 3 steps of `torch.optim.SGD(lr=0.001)` and `cross_entropy`, with oneDNN off (its
  float32 convolution gradients are about 1% of the largest gradient away from float64's
  on ResNet-18; torch's own kernels, 1e-6).
- **Equal to torch**: the epoch's mean loss within the family's tolerance (relative), and
  every parameter and running statistic after training, paired with the export's weight
  holding it (as it is, transposed, or with axes of length 1 added or removed), within the
  tolerance times the largest change training made to any of them, beyond twice torch's
  own float32 rounding of the tensor (its distance from the same training in float64: a
  lossgraph as close to the exact result as torch is at most that far from torch). The
  steps are far smaller than the weights, and a model whose predictions are near uniform
  has gradients far smaller than the values they are summed from: float32 rounding is
  then a sizeable fraction of the change.

| family | tolerance |
|---|---|
"""

STATUS_HELP = {
    EQUAL: "trains step for step as torch does",
    NAMED_ERROR: "lossgraph refuses the model before any work, with a lossgraph.errors "
                 "class naming what is wrong",
    EXPORT_FAILS: "torch's exporter fails on the model (nothing to train)",
    WEIGHTS_CHANGED_WARNED: "the export's weights are not the module's parameters (merged, "
                            "copied or folded into constants by the exporter), and "
                            "lossgraph's warning says so",
    WEIGHTS_CHANGED: "the export's weights are not the module's parameters (merged, copied "
                     "or folded into constants by the exporter): lossgraph trains the "
                     "export, which is not training the module, without a warning (a "
                     "defect)",
    DIFFERS: "a defect: lossgraph's training differs from torch's",
    RAW_EXCEPTION: "a defect: an exception that is not lossgraph's",
}


def _cell_text(text: str) -> str:
    """``text`` safe in a Markdown table's row."""
    return text.replace("|", "\\|")


def render(record: dict[str, Any]) -> str:
    """The page, from the record."""
    outcomes = record["cases"]
    lines = [HEADER.rstrip("\n")]
    families = {a.family: None for a in catalogue()}
    lines += [f"| {f.name} | {f.tolerance:g} |" for f in families]
    lines += ["", "Statuses:", ""]
    lines += [f"- **{status}**: {text}." for status, text in STATUS_HELP.items()]
    lines += ["", "Versions: " + ", ".join(f"{k} {v}" for k, v in record["versions"].items())
              + ".", "", "## Summary", "",
              "| source | exporter | cases | " + " | ".join(STATUSES) + " |",
              "|---|---|---|" + "---|" * len(STATUSES)]
    sources = list(dict.fromkeys(a.source for a in catalogue()))
    for source in sources:
        for exporter in EXPORTERS:
            statuses = [outcomes[case_key(a, e, f)]["status"] for a, e, f in cases()
                        if a.source == source and e == exporter]
            lines.append(f"| {source} | {exporter.name} | {len(statuses)} | "
                         + " | ".join(str(statuses.count(s)) for s in STATUSES) + " |")
    notes: dict[str, int] = {}
    for source in sources:
        lines += ["", f"## {source}", "",
                  "| model | built as | " + " | ".join(f"{e.name} {f}" for e, f in columns())
                  + " |", "|---|---|" + "---|" * len(columns())]
        for architecture in (a for a in catalogue() if a.source == source):
            cells = []
            for exporter, fuse in columns():
                outcome = outcomes[case_key(architecture, exporter, fuse)]
                cell = "equal" if outcome["status"] == EQUAL else outcome["status"]
                text = outcome["reason"]
                if text:
                    number = notes.setdefault(
                        f"{architecture.name}, {exporter.name}: {text}", len(notes) + 1)
                    cell += f" [{number}](#note-{number})"
                cells.append(cell)
            lines.append(f"| {architecture.name} | `{architecture.how}` | "
                         + " | ".join(cells) + " |")
    if notes:
        lines += ["", "## Notes", ""]
        lines += [f'{number}. <a id="note-{number}"></a>{_cell_text(text)}'
                  for text, number in notes.items()]
    lines += ["", "## What is known", "",
              "Why the cases that are not equal to torch are so, and what to do:", ""]
    lines += [f"- **{exporter}, {'every model' if name == '*' else name}**: {text}"
              for (name, exporter), text in KNOWN.items()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    """Run the catalogue (or ``--only`` some architectures, ``--exporters`` some exporters),
    record the outcomes and write the page."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated architecture names: run these, keep "
                                       "the other records")
    parser.add_argument("--exporters", help="comma-separated exporter names (" + ", ".join(
        e.name for e in EXPORTERS) + "): run their cases, keep the other records")
    parser.add_argument("--render", action="store_true",
                        help="write the page from the record, running nothing")
    args = parser.parse_args(argv)
    only = set(args.only.split(",")) if args.only else None
    exporters = set(args.exporters.split(",")) if args.exporters else None

    def selected(architecture: Architecture, exporter: Exporter) -> bool:
        return ((only is None or architecture.name in only)
                and (exporters is None or exporter.name in exporters))

    record = load_record() if RECORD.exists() else {"cases": {}}
    if not args.render:
        started = time.process_time()
        kept = {case_key(*c): record["cases"][case_key(*c)] for c in cases()
                if not selected(c[0], c[1]) and case_key(*c) in record["cases"]}
        record = {"versions": versions(), "cases": kept}
        for architecture in catalogue():
            case = Case(architecture)
            for exporter, fuse in columns():
                if not selected(architecture, exporter):
                    continue
                start = time.process_time()
                outcome = case.run(exporter, fuse)
                record["cases"][case_key(architecture, exporter, fuse)] = outcome.as_record()
                print(f"{architecture.source:12} {architecture.name:22} {exporter.name:16} "
                      f"{fuse:9} {time.process_time() - start:6.1f}s {outcome.status}: "
                      f"{outcome.reason}", flush=True)
        print(f"{time.process_time() - started:.0f} s of CPU time", flush=True)
        record["cases"] = {case_key(*c): record["cases"][case_key(*c)] for c in cases()
                           if case_key(*c) in record["cases"]}
        RECORD.write_text(json.dumps(record, indent=1) + "\n")
    missing = [case_key(*c) for c in cases() if case_key(*c) not in record["cases"]]
    if missing:
        print(f"{PAGE} not written: {len(missing)} cases are not recorded, e.g. {missing[0]}")
        return
    PAGE.write_text(render(record))


if __name__ == "__main__":
    main()
