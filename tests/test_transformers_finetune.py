"""Transformers as people fine-tune them: a small BERT (sequence classification) and a small
GPT-2 (causal language model) from ``transformers`` configs, random weights (no download),
dropout off, exported by torch and fine-tuned by lossgraph with AdamW, step for step equal
to ``torch.optim.AdamW`` on the torch model.

The exports take the integer ``input_ids`` and ``attention_mask`` (dynamic batch and
sequence axes) and return the logits. Before export every parameter is moved off its
initial value: a fresh model's zero biases and unit LayerNorm weights are equal tensors,
which the TorchScript exporter merges into one initializer (a fine-tuned checkpoint has no
such ties). GPT-2's language-model head is tied to the token embedding (one parameter,
two names): the TorchScript export and the dynamo export with ``optimize=False`` keep it one
initializer; the default dynamo export unties it (``test_the_default_dynamo_export_...``),
so GPT-2 is fine-tuned from the other two.

GPT-2's next-token loss is lossgraph's token-level cross entropy (``multiclass_log_loss``
of the ``(B, T, V)`` logits with ``ignore_index=-100``, the labels shifted by the user), and
also written into the model by hand (``loss=None``), as ``GPT2LMHeadModel`` computes it.
"""

from __future__ import annotations

import io
import warnings

import numpy as np
import onnx
import pytest

torch = pytest.importorskip("torch", reason="needs torch (pip install torch==2.13.0)")
transformers = pytest.importorskip("transformers", reason="needs transformers")

from support.torch_steps import (  # noqa: E402
    assert_gradients_close,
    assert_gradients_like_torch,
    assert_steps_like_torch,
)

import lossgraph  # noqa: E402
from lossgraph.builder import GraphBuilder  # noqa: E402
from lossgraph.names import NameAuthority  # noqa: E402
from lossgraph.optim import AdamW  # noqa: E402
from lossgraph.roles import set_roles  # noqa: E402
from lossgraph.runtime.session import create_session  # noqa: E402

pytestmark = pytest.mark.torch

F = torch.nn.functional
BATCH, LENGTH, VOCABULARY, CLASSES = 4, 7, 99, 3
#: lossgraph's and torch's AdamW, with the same hyper-parameters
OPTIMIZERS = (AdamW(1e-3, beta1=0.8, beta2=0.99, epsilon=1e-6, weight_decay=0.05),
              lambda p: torch.optim.AdamW(p, lr=1e-3, betas=(0.8, 0.99), eps=1e-6,
                                          weight_decay=0.05))
INPUTS = ("input_ids", "attention_mask")
#: The exporters: the TorchScript one, the dynamo one keeping torch's parameters as the
#: model's weights (optimize=False), and the dynamo one as called by default (optimize=True:
#: it writes Linear weights as transposed copies under new names, which train alike under
#: elementwise updates such as AdamW's, but are not the module's parameters by name).
#: A dynamo export takes 5-20 s per model here.
DYNAMO = pytest.mark.slow
EXPORTERS = ("legacy", pytest.param("dynamo", marks=DYNAMO),
             pytest.param("dynamo_optimized", marks=DYNAMO))
#: The dynamo exporter (optimize=False) writes GPT-2's torch.split of the attention
#: projection as SplitToSequence + SequenceAt, which compile_program rewrites into a Split
#: (lossgraph.passes.SequencesToTensors).
GPT2_EXPORTERS = ("legacy", pytest.param("dynamo", marks=DYNAMO))


class Logits(torch.nn.Module):
    """A ``transformers`` model called with ``input_ids`` and ``attention_mask``, returning
    its logits (the exported output)."""

    def __init__(self, model) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask):
        return self.model(input_ids=input_ids, attention_mask=attention_mask).logits


def _bert():
    config = transformers.BertConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=37,
        vocab_size=VOCABULARY, max_position_embeddings=64, num_labels=CLASSES,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, classifier_dropout=0.0)
    return transformers.BertForSequenceClassification(config)


def _gpt2():
    config = transformers.GPT2Config(
        n_embd=32, n_layer=2, n_head=2, vocab_size=VOCABULARY, n_positions=64,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config)


MODELS = {"bert": _bert, "gpt2": _gpt2}


def _net(name: str) -> Logits:
    """The model (seeded), every parameter moved by noise, in eval mode (dropout is off
    anyway: eval and train compute the same)."""
    torch.manual_seed(0)
    net = Logits(MODELS[name]())
    with torch.no_grad():
        for parameter in net.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.05)
    return net.eval()


def _data(rows: int, seed: int = 1, padded: bool = True) -> dict[str, np.ndarray]:
    """Token ids, and an attention mask that pads the last 2 tokens of every other row
    (``padded``) or none."""
    rng = np.random.default_rng(seed)
    mask = np.ones((rows, LENGTH), np.int64)
    if padded:
        mask[1::2, LENGTH - 2:] = 0
    return {"input_ids": rng.integers(0, VOCABULARY, size=(rows, LENGTH)),
            "attention_mask": mask}


def _export(name: str, exporter: str) -> onnx.ModelProto:
    net = _net(name)
    example = tuple(torch.from_numpy(v) for v in _data(2, seed=0).values())
    sequence_output = {0: "batch", 1: "sequence"} if name == "gpt2" else {0: "batch"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecation and tracer warnings
        if exporter.startswith("dynamo"):
            batch = torch.export.Dim("batch", min=2)
            sequence = torch.export.Dim("sequence", min=2, max=64)
            return torch.onnx.export(
                net, example, dynamo=True, optimize=exporter == "dynamo_optimized",
                input_names=list(INPUTS),
                output_names=["logits"], verbose=False,
                dynamic_shapes=({0: batch, 1: sequence}, {0: batch, 1: sequence})).model_proto
        buffer = io.BytesIO()
        torch.onnx.export(net, example, buffer, dynamo=False, opset_version=17,
                          do_constant_folding=False, input_names=list(INPUTS),
                          output_names=["logits"],
                          dynamic_axes={**{i: {0: "batch", 1: "sequence"} for i in INPUTS},
                                        "logits": sequence_output})
        return onnx.load_from_string(buffer.getvalue())


@pytest.fixture(scope="module")
def exported():
    """``exported(name, exporter)``: the export, made once per module file."""
    cache: dict[tuple[str, str], onnx.ModelProto] = {}

    def get(name: str, exporter: str) -> onnx.ModelProto:
        if (name, exporter) not in cache:
            cache[name, exporter] = _export(name, exporter)
        return cache[name, exporter]

    return get


def _forward(net, inputs):
    return net(**inputs)


def _rows(X: dict[str, np.ndarray], rows: int) -> dict[str, np.ndarray]:
    return {name: value[:rows] for name, value in X.items()}


def _parameter_names(net) -> dict[str, str]:
    """Every name of each parameter (tied ones have several) -> its first name."""
    first = {id(p): name for name, p in net.named_parameters()}
    return {name: first[id(p)] for name, p in net.named_parameters(remove_duplicate=False)}


def _assert_weights_are_the_parameters(model: onnx.ModelProto, net) -> None:
    """The model's trainable initializers are the net's parameters, each once."""
    names = _parameter_names(net)
    trained = [names.get(w, w) for w in lossgraph.trainable_initializers(model)]
    assert sorted(trained) == sorted(set(names.values()))


# -- BERT: sequence classification ------------------------------------------------------------


@pytest.mark.parametrize("exporter", EXPORTERS)
def test_bert_classifier_fine_tunes_like_torch(exported, exporter):
    """Cross entropy of the logits (``multiclass_log_loss`` with ``from_logits``), the loss
    ``BertForSequenceClassification`` computes from ``labels``."""
    model = exported("bert", exporter)
    net = _net("bert")
    assert {i.name: i.type.tensor_type.elem_type for i in model.graph.input} == {
        "input_ids": onnx.TensorProto.INT64, "attention_mask": onnx.TensorProto.INT64}
    X = _data(3 * BATCH)
    y = np.random.default_rng(2).integers(0, CLASSES, size=3 * BATCH)
    if exporter != "dynamo_optimized":  # the weights are the parameters, by name
        assert_gradients_like_torch(model, net, _rows(X, BATCH), y[:BATCH],
                                    loss="multiclass_log_loss", from_logits=True,
                                    torch_loss=F.cross_entropy, forward=_forward)
    program = lossgraph.compile_program(model, loss="multiclass_log_loss",
                                        loss_options={"from_logits": True},
                                        optimizer=OPTIMIZERS[0])
    with torch.no_grad():  # the loss is the one transformers computes
        theirs = net.model(**{k: torch.from_numpy(v) for k, v in X.items()},
                           labels=torch.from_numpy(y)).loss
        assert float(theirs) == pytest.approx(
            float(F.cross_entropy(_forward(net, {k: torch.from_numpy(v) for k, v in X.items()}),
                                  torch.from_numpy(y))), rel=1e-6)
    assert_steps_like_torch(lossgraph.Trainer(program), net, OPTIMIZERS[1](net.parameters()),
                            X, y, steps=3, rows=BATCH, loss=F.cross_entropy, forward=_forward)


# -- GPT-2: causal language model -------------------------------------------------------------

IGNORE = -100  # torch's and transformers' ignore_index


def _torch_next_token_loss(logits, labels):
    """The loss ``GPT2LMHeadModel`` computes from ``labels``: the cross entropy of each
    position's logits against the next token, the mean over the tokens."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                           labels[:, 1:].reshape(-1))


def _with_next_token_loss(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` carrying :func:`_torch_next_token_loss` of its logits ``(B, T, V)`` against
    int64 labels ``(B, T)`` (the input ids), built by hand, with the shift inside the graph
    as ``GPT2LMHeadModel`` does it (lossgraph's own loss takes shifted labels)."""
    result = onnx.ModelProto()
    result.CopyFrom(model)
    opset = next(o.version for o in result.opset_import if o.domain in ("", "ai.onnx"))
    b = GraphBuilder(NameAuthority.for_model(result), opset)
    one, axis = b.ints([1]), b.ints([1])
    head = b.Slice("logits", b.ints([0]), b.ints([-1]), axis)  # the positions but the last
    following = b.Slice("labels", one, b.ints([np.iinfo(np.int64).max]), axis)
    log_p = b.LogSoftmax(head, axis=-1)
    picked = b.squeeze(b.GatherElements(log_p, b.unsqueeze(following, [2]), axis=2), [2])
    b.reduce("ReduceMean", b.Neg(picked), keepdims=0, hint="loss")
    b.append_to(result.graph)
    loss = result.graph.node[-1].output[0]
    result.graph.input.append(onnx.helper.make_tensor_value_info(
        "labels", onnx.TensorProto.INT64, ["batch", "sequence"]))
    result.graph.output.insert(0, onnx.helper.make_tensor_value_info(
        loss, onnx.TensorProto.FLOAT, []))
    set_roles(result, {"loss": loss, "label": "labels", "prediction": "logits"})
    return result


@pytest.mark.parametrize("exporter", GPT2_EXPORTERS)
def test_gpt2_language_model_fine_tunes_like_torch_with_the_loss_in_the_graph(exported,
                                                                             exporter):
    """The token-level cross entropy of the next tokens, the loss ``GPT2LMHeadModel``
    computes from ``labels=input_ids``, written into the model (``loss=None``)."""
    model = exported("gpt2", exporter)
    net = _net("gpt2")
    _assert_weights_are_the_parameters(model, net)
    program = lossgraph.compile_program(_with_next_token_loss(model), loss=None,
                                        optimizer=OPTIMIZERS[0])
    X = _data(3 * BATCH, padded=False)
    y = X["input_ids"]
    with torch.no_grad():  # the loss is the one transformers computes
        inputs = {k: torch.from_numpy(v) for k, v in X.items()}
        assert float(net.model(**inputs, labels=inputs["input_ids"]).loss) == pytest.approx(
            float(_torch_next_token_loss(_forward(net, inputs), inputs["input_ids"])),
            rel=1e-6)
    assert_steps_like_torch(lossgraph.Trainer(program), net, OPTIMIZERS[1](net.parameters()),
                            X, y, steps=3, rows=BATCH, loss=_torch_next_token_loss,
                            forward=_forward)


def test_gpt2_language_model_fine_tunes_with_lossgraphs_token_cross_entropy(exported):
    """What a user writes: lossgraph's cross entropy of the ``(B, T, V)`` logits against
    the ``(B, T)`` next tokens (shifted by the user), the padding and the last position
    ignored (``-100``): the loss ``GPT2LMHeadModel`` computes from ``labels``, averaged over
    the counted tokens of each batch (rows count different numbers of them)."""
    net = _net("gpt2")
    program = lossgraph.compile_program(
        exported("gpt2", "legacy"), loss="multiclass_log_loss",
        loss_options={"from_logits": True, "ignore_index": IGNORE}, optimizer=OPTIMIZERS[0])
    X = _data(3 * BATCH)
    labels = np.where(X["attention_mask"] == 1, X["input_ids"], IGNORE)  # no loss on padding
    next_tokens = np.full_like(labels, IGNORE)
    next_tokens[:, :-1] = labels[:, 1:]  # position t predicts token t + 1

    def torch_loss(logits, labels):
        return F.cross_entropy(logits.reshape(-1, VOCABULARY), labels.reshape(-1),
                               ignore_index=IGNORE)

    with torch.no_grad():  # the loss is the one transformers computes from the labels
        inputs = {k: torch.from_numpy(v) for k, v in X.items()}
        theirs = net.model(**inputs, labels=torch.from_numpy(labels)).loss
        assert float(theirs) == pytest.approx(
            float(torch_loss(_forward(net, inputs), torch.from_numpy(next_tokens))), rel=1e-6)
    assert_steps_like_torch(lossgraph.Trainer(program), net, OPTIMIZERS[1](net.parameters()),
                            X, next_tokens, steps=3, rows=BATCH, loss=torch_loss,
                            forward=_forward)


def test_tied_embedding_gets_the_gradient_of_both_uses(exported):
    """GPT-2's token embedding is also its output layer: the export holds it once, and its
    gradient is the sum of both uses, as torch's."""
    model = exported("gpt2", "legacy")
    net = _net("gpt2")
    tied = [name for name, p in net.named_parameters(remove_duplicate=False)
            if p is net.model.transformer.wte.weight]
    assert len(tied) == 2
    (stored,) = [i.name for i in model.graph.initializer if i.name in tied]
    X = _data(BATCH)
    gradient = lossgraph.gradient(_with_next_token_loss(model), [stored])
    (ours,) = create_session(gradient).run([f"{stored}_grad"], {**X, "labels": X["input_ids"]})
    reference = _net("gpt2").double()
    inputs = {k: torch.from_numpy(v) for k, v in X.items()}
    _torch_next_token_loss(_forward(reference, inputs), inputs["input_ids"]).backward()
    assert_gradients_close({stored: ours},
                           {stored: reference.model.transformer.wte.weight.grad.numpy()})


@DYNAMO
def test_the_default_dynamo_export_unties_gpt2s_embedding(exported):
    """Why GPT-2 is not fine-tuned from the default dynamo export (optimize=True): it reads
    the token embedding from one initializer and computes the logits from a transposed copy
    folded into another, so the two train apart where torch trains one tied parameter."""
    model = exported("gpt2", "dynamo_optimized")
    embedding = _net("gpt2").model.transformer.wte.weight.detach().numpy()
    stored = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    (gather,) = [n for n in model.graph.node if n.op_type == "Gather" and n.input[0] in stored
                 and stored[n.input[0]].shape == embedding.shape]
    np.testing.assert_array_equal(stored[gather.input[0]], embedding)
    (head,) = [n for n in model.graph.node if n.op_type == "MatMul"
               and stored.get(n.input[1], np.empty(0)).shape == embedding.T.shape]
    np.testing.assert_array_equal(stored[head.input[1]], embedding.T)
    trained = lossgraph.trainable_initializers(model)
    assert gather.input[0] in trained and head.input[1] in trained
