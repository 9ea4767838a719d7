"""Weights an exporter tied or froze, found and undone.

torch's exporters merge initializers of equal values: a fresh model's unit LayerNorm scales
and zero biases, a layer's copies, become one initializer several layers read (the legacy
exporter names the others by ``Identity`` nodes of it). Trained as they are, the layers
share one weight, which the torch model does not: ``compile_program`` warns
(``TiedWeightWarning``), and ``untie=`` gives each layer its own copy (``UntieWeights``),
which then trains as torch trains its parameters. A large float ``Constant`` feeding a
product like a weight is listed by ``inspect`` as not trainable, and trains when
``weights=`` names it (``ConstantsToInitializers``).
"""

from __future__ import annotations

import json
import warnings

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from support.torch_steps import (
    assert_gradients_like_torch,
    assert_steps_like_torch,
    legacy_export,
    torch_mse,
)

import lossgraph
from lossgraph.analysis import constant_weights, tied_initializers
from lossgraph.cli import main
from lossgraph.errors import TiedWeightWarning, UnknownNameError, UnsupportedOptionError
from lossgraph.export import to_inference_model
from lossgraph.optim import SGD, AdamW
from lossgraph.passes import ConstantsToInitializers, UntieWeights
from lossgraph.runtime.session import create_session

SIZE = 4


def _values(seed: int = 0) -> dict[str, np.ndarray]:
    """The weights of :func:`_two_layer_norms`: ``scale`` ones, the rest random."""
    rng = np.random.default_rng(seed)
    return {"scale": np.ones(SIZE, np.float32),
            "bias1": rng.normal(size=SIZE).astype(np.float32),
            "w": rng.normal(size=(SIZE, SIZE)).astype(np.float32),
            "bias2": rng.normal(size=SIZE).astype(np.float32),
            "v": rng.normal(size=(SIZE, 1)).astype(np.float32)}


def _two_layer_norms(identity: bool = False) -> onnx.ModelProto:
    """``LN2(LN1(x) @ w) @ v`` with one initializer ``scale`` for both LayerNorms' scales,
    as an exporter writes two fresh LayerNorms; with ``identity``, the second reads it
    through an ``Identity`` named ``scale2``, as the legacy exporter writes it."""
    second = "scale2" if identity else "scale"
    nodes = [helper.make_node("LayerNormalization", ["x", "scale", "bias1"], ["h1"], axis=-1,
                              name="ln1"),
             helper.make_node("MatMul", ["h1", "w"], ["m"], name="mm"),
             helper.make_node("LayerNormalization", ["m", second, "bias2"], ["h2"], axis=-1,
                              name="ln2"),
             helper.make_node("MatMul", ["h2", "v"], ["y"], name="out")]
    if identity:
        nodes.insert(0, helper.make_node("Identity", ["scale"], ["scale2"], name="tie"))
    graph = helper.make_graph(
        nodes, "two_layer_norms", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                 ["N", SIZE])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 1])],
        [numpy_helper.from_array(value, name) for name, value in _values().items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _data(rows: int = 24) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(5)
    X = rng.normal(size=(rows, SIZE)).astype(np.float32)
    return X, np.tanh(X.sum(axis=1, keepdims=True)).astype(np.float32)


# -- finding them ------------------------------------------------------------------------------


@pytest.mark.parametrize("identity", [False, True], ids=["direct", "through_identity"])
def test_an_initializer_two_layer_norms_read_is_found_tied(identity):
    model = _two_layer_norms(identity)
    tied = tied_initializers(model)
    assert [t.name for t in tied] == ["scale"]
    assert [(node.name, position) for node, position in tied[0].readers] == [("ln1", 1),
                                                                             ("ln2", 1)]
    assert "'scale' (read by 2 layers: LayerNormalization 'ln1', LayerNormalization 'ln2')" \
        == tied[0].describe()


def test_a_weight_two_different_layers_share_on_purpose_is_not_tied():
    """A language model's embedding table and its output projection: a Gather and a
    MatMul read one initializer, as the model ties them."""
    table = np.random.default_rng(0).normal(size=(5, 3)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Gather", ["table", "ids"], ["e"]),
         helper.make_node("Transpose", ["table"], ["t"]),
         helper.make_node("MatMul", ["e", "t"], ["y"])], "tied_on_purpose",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["N"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 5])],
        [numpy_helper.from_array(table, "table")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    assert tied_initializers(model) == []
    with warnings.catch_warnings():
        warnings.simplefilter("error", TiedWeightWarning)
        lossgraph.compile_program(model)


def test_a_weight_read_in_parts_is_not_tied():
    """torch's legacy LSTM export slices each gate out of one weight: three Slices read
    it, each a part, none a copy of its own."""
    weight = np.random.default_rng(1).normal(size=(6, 2)).astype(np.float32)
    starts = [numpy_helper.from_array(np.array([k], np.int64), f"s{k}") for k in (0, 2, 4, 6)]
    axis = numpy_helper.from_array(np.array([0], np.int64), "axis")
    nodes = [helper.make_node("Slice", ["w", f"s{k}", f"s{k + 2}", "axis"], [f"g{k}"])
             for k in (0, 2, 4)]
    nodes += [helper.make_node("Sum", ["g0", "g2", "g4"], ["gates"]),
              helper.make_node("MatMul", ["x", "gates"], ["y"])]
    graph = helper.make_graph(
        nodes, "gates", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 2])],
        [numpy_helper.from_array(weight, "w"), *starts, axis])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    assert tied_initializers(model, ["w"]) == []


def test_compiling_a_tied_weight_warns_naming_it_its_layers_and_the_way_out():
    with pytest.warns(TiedWeightWarning) as caught:
        program = lossgraph.compile_program(_two_layer_norms())
    message = str(caught[0].message)
    assert "'scale' (read by 2 layers: LayerNormalization 'ln1', LayerNormalization 'ln2')" \
        in message
    assert "untie='auto'" in message and "--untie" in message
    assert program.weights == ["scale", "bias1", "w", "bias2", "v"]  # trained tied
    assert "untied" not in program.manifest
    with warnings.catch_warnings():  # untie given: no warning
        warnings.simplefilter("error", TiedWeightWarning)
        lossgraph.compile_program(_two_layer_norms(), untie=["scale"])


# -- untying -----------------------------------------------------------------------------------


@pytest.mark.parametrize("identity", [False, True], ids=["direct", "through_identity"])
def test_untying_gives_each_layer_its_own_copy(identity):
    model = _two_layer_norms(identity)
    result = UntieWeights(["scale"])(model)
    copy = "scale2" if identity else "scale_1"  # an Identity's copy keeps the Identity's name
    assert result.report == {"scale": [copy]}
    untied = result.model
    assert [t.name for t in untied.graph.initializer] == \
        ["scale", copy, "bias1", "w", "bias2", "v"]
    readers = {n.name: list(n.input) for n in untied.graph.node}
    assert readers["ln1"][1] == "scale" and readers["ln2"][1] == copy
    assert "Identity" not in [n.op_type for n in untied.graph.node]
    assert tied_initializers(untied) == []
    assert [t.name for t in model.graph.initializer][:2] == ["scale", "bias1"]  # not mutated
    X, _ = _data()
    np.testing.assert_array_equal(create_session(untied).run(None, {"x": X})[0],
                                  create_session(model).run(None, {"x": X})[0])


def test_untying_an_unknown_or_unshared_initializer_is_an_error():
    with pytest.raises(UnknownNameError, match="untie names 'scal'.*Did you mean 'scale'"):
        lossgraph.compile_program(_two_layer_norms(), untie=["scal"])
    with pytest.raises(UnsupportedOptionError, match="untie names 'w', which one layer reads"):
        lossgraph.compile_program(_two_layer_norms(), untie="w")
    with pytest.raises(UnsupportedOptionError, match="untie=3 must be 'auto'"):
        lossgraph.compile_program(_two_layer_norms(), untie=3)


class _TwoLayerNorms:
    """The torch model :func:`_two_layer_norms` was exported from: each LayerNorm its own
    scale (both ones at first)."""

    def __new__(cls):
        import torch

        class Net(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                values = {k: torch.from_numpy(v.copy()) for k, v in _values().items()}
                self.scale1 = torch.nn.Parameter(values["scale"].clone())
                self.scale2 = torch.nn.Parameter(values["scale"].clone())
                self.bias1 = torch.nn.Parameter(values["bias1"])
                self.w = torch.nn.Parameter(values["w"])
                self.bias2 = torch.nn.Parameter(values["bias2"])
                self.v = torch.nn.Parameter(values["v"])

            def forward(self, x):
                F = torch.nn.functional
                h = F.layer_norm(x, (SIZE,), self.scale1, self.bias1) @ self.w
                return F.layer_norm(h, (SIZE,), self.scale2, self.bias2) @ self.v

        return Net()


@pytest.mark.torch
@pytest.mark.parametrize("fuse", ["step", "epoch"])
def test_untied_layer_norms_train_apart_like_torchs_two_parameters(fuse):
    pytest.importorskip("torch", reason="needs torch (pip install torch==2.13.0)")
    import torch

    X, y = _data()
    net = _TwoLayerNorms()
    program = lossgraph.compile_program(_two_layer_norms(), optimizer=SGD(0.1), fuse=fuse,
                                        untie="auto")
    assert program.manifest["untied"] == {"scale": ["scale_1"]}
    assert len(program.weights) == len(list(net.parameters()))
    trainer = lossgraph.Trainer(program)
    assert_steps_like_torch(trainer, net, torch.optim.SGD(net.parameters(), lr=0.1), X, y,
                            steps=3, rows=8, loss=torch_mse)
    state = trainer.state
    assert not np.allclose(state["scale"], state["scale_1"])  # trained apart, as in torch
    # the inference model keeps each layer's own scale, trained
    exported = {t.name: numpy_helper.to_array(t)
                for t in to_inference_model(trainer).graph.initializer}
    np.testing.assert_array_equal(exported["scale_1"], state["scale_1"])
    np.testing.assert_array_equal(exported["scale"], state["scale"])


@pytest.mark.torch
def test_the_tied_weight_trains_otherwise_than_torch():
    """Why the warning: left tied, the two scales move as one, and the model drifts from
    torch's after one step."""
    pytest.importorskip("torch", reason="needs torch (pip install torch==2.13.0)")
    import torch

    X, y = _data()
    net = _TwoLayerNorms()
    with pytest.warns(TiedWeightWarning):
        trainer = lossgraph.Trainer(lossgraph.compile_program(_two_layer_norms(),
                                                              optimizer=SGD(0.1)))
    with pytest.raises(AssertionError):
        assert_steps_like_torch(trainer, net, torch.optim.SGD(net.parameters(), lr=0.1), X, y,
                                steps=2, rows=8, loss=torch_mse)


def test_a_penalty_and_the_weights_named_carry_over_to_the_copies():
    program = lossgraph.compile_program(_two_layer_norms(), weights=["scale", "w"],
                                        penalty={"scale": 0.5}, untie="auto")
    assert program.weights == ["scale", "scale_1", "w"]
    X, y = _data()
    trainer = lossgraph.Trainer(program)
    loss = trainer.evaluate(X, y)
    plain = lossgraph.Trainer(lossgraph.compile_program(_two_layer_norms(), weights=["w"],
                                                        untie="auto")).evaluate(X, y)
    assert loss == pytest.approx(plain + 0.5 * 2 * SIZE, rel=1e-5)  # 0.5 sum(1^2), twice


def test_the_untied_program_saves_and_loads_with_its_manifest(tmp_path):
    program = lossgraph.compile_program(_two_layer_norms(), untie="auto")
    program.save(tmp_path / "program")
    loaded = lossgraph.TrainingProgram.load(tmp_path / "program")
    assert loaded.manifest["untied"] == {"scale": ["scale_1"]}
    manifest = json.loads((tmp_path / "program" / "manifest.json").read_text())
    assert manifest["untied"] == {"scale": ["scale_1"]}


# -- torch's exports ---------------------------------------------------------------------------


@pytest.mark.torch
def test_the_legacy_exports_identities_become_the_torch_parameters():
    """The legacy exporter writes each merged parameter as an Identity of the first: untied,
    the model's weights are the torch model's parameters, by name, with torch's gradient."""
    torch = pytest.importorskip("torch", reason="needs torch (pip install torch==2.13.0)")

    class Blocks(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first, self.second = torch.nn.LayerNorm(SIZE), torch.nn.LayerNorm(SIZE)
            self.mix = torch.nn.Linear(SIZE, SIZE)
            self.out = torch.nn.Linear(SIZE, 1)

        def forward(self, x):
            return self.out(self.second(self.mix(self.first(x))))

    torch.manual_seed(0)
    net = Blocks()
    X, y = _data()
    exported = legacy_export(net, X[:2])
    assert "Identity" in [n.op_type for n in exported.graph.node]
    tied = {t.name for t in tied_initializers(exported)}
    assert tied == {"first.weight", "first.bias"}
    untied = UntieWeights(sorted(tied))(exported)
    assert untied.report == {"first.bias": ["second.bias"], "first.weight": ["second.weight"]}
    assert_gradients_like_torch(untied.model, net, X, y)


def _bert_net():
    """A fresh BertForSequenceClassification (random weights, no download), dropout off, its
    pooler's and classifier's zero biases nudged: the dynamo exporter's optimizer drops a
    Linear's zero bias where it writes a Gemm, a parameter no untying brings back (the
    documented limit); the others stay as a fresh model has them."""
    import torch

    transformers = pytest.importorskip("transformers", reason="needs transformers")
    torch.manual_seed(0)
    config = transformers.BertConfig(
        hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=24,
        vocab_size=50, max_position_embeddings=32, num_labels=3, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, classifier_dropout=0.0)
    model = transformers.BertForSequenceClassification(config).eval()
    with torch.no_grad():
        for bias in (model.bert.pooler.dense.bias, model.classifier.bias):
            bias.add_(torch.randn_like(bias) * 0.1)

    class Logits(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask):
            return self.model(input_ids=input_ids, attention_mask=attention_mask).logits

    return Logits().eval()


@pytest.mark.torch
@pytest.mark.slow
def test_a_fresh_bert_exported_by_dynamo_untied_fine_tunes_like_torch():
    """torch.onnx.export(dynamo=True) as called by default merges a fresh BERT's equal
    initializers (its LayerNorm scales, its zero biases): this one's 41 parameters become 22
    weights, and compile warns. Untied, the program trains 41, and AdamW fine-tunes it step
    for step as torch.optim.AdamW does the torch model."""
    import torch

    F = torch.nn.functional
    net = _bert_net()
    rng = np.random.default_rng(3)
    X = {"input_ids": rng.integers(0, 50, size=(12, 6)),
         "attention_mask": np.ones((12, 6), np.int64)}
    X["attention_mask"][1::2, 4:] = 0
    y = rng.integers(0, 3, size=12)
    example = tuple(torch.from_numpy(v[:2]) for v in X.values())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        batch, sequence = torch.export.Dim("batch", min=2), torch.export.Dim("sequence", min=2)
        exported = torch.onnx.export(
            net, example, dynamo=True, input_names=list(X), output_names=["logits"],
            dynamic_shapes=({0: batch, 1: sequence}, {0: batch, 1: sequence}),
            verbose=False).model_proto
    parameters = len(list(net.parameters()))
    options = dict(loss="multiclass_log_loss", loss_options={"from_logits": True},
                   optimizer=AdamW(1e-3, weight_decay=0.01))
    with pytest.warns(TiedWeightWarning, match="LayerNorm"):
        tied = lossgraph.compile_program(exported, **options)
    assert (parameters, len(tied.weights)) == (41, 22)
    program = lossgraph.compile_program(exported, untie="auto", **options)
    assert len(program.weights) == parameters
    assert_steps_like_torch(lossgraph.Trainer(program), net,
                            torch.optim.AdamW(net.parameters(), lr=1e-3, weight_decay=0.01),
                            X, y, steps=3, rows=4, loss=F.cross_entropy,
                            forward=lambda n, inputs: n(**inputs))


# -- weights kept as constants -----------------------------------------------------------------


def _constant_weight() -> onnx.ModelProto:
    """``x @ c + b`` with ``c`` a Constant node of 16 values (an exporter folded it)."""
    rng = np.random.default_rng(1)
    c = rng.normal(size=(SIZE, SIZE)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Constant", [], ["c"], value=numpy_helper.from_array(c), name="fold"),
         helper.make_node("MatMul", ["x", "c"], ["m"], name="mm"),
         helper.make_node("Add", ["m", "b"], ["h"]),
         helper.make_node("ReduceSum", ["h", "axis"], ["y"], keepdims=1)], "constant_weight",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", SIZE])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 1])],
        [numpy_helper.from_array(np.zeros(SIZE, np.float32), "b"),
         numpy_helper.from_array(np.array([1], np.int64), "axis")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_a_constant_feeding_a_product_is_found_and_trains_when_named():
    model = _constant_weight()
    found = constant_weights(model)
    assert [(c.name, c.node.name, c.reader.name, c.dims) for c in found] == \
        [("c", "fold", "mm", (SIZE, SIZE))]
    assert lossgraph.compile_program(model).weights == ["b"]  # not trained: a constant
    program = lossgraph.compile_program(model, weights=["c", "b"], optimizer=SGD(0.1))
    assert program.weights == ["c", "b"]
    X, y = _data()
    trainer = lossgraph.Trainer(program).fit(X, y, epochs=1, batch_size=8, progress=False)
    exported = to_inference_model(trainer)
    assert "c" in {t.name for t in exported.graph.initializer}
    assert "Constant" not in [n.op_type for n in exported.graph.node]
    before = numpy_helper.to_array(model.graph.node[0].attribute[0].t)
    assert not np.allclose(trainer.state["c"], before)


def test_making_an_unknown_constant_an_initializer_is_an_error():
    with pytest.raises(UnknownNameError, match="'cc' is not the output of a Constant"):
        ConstantsToInitializers(["cc"])(_constant_weight())


# -- inspect and compile on the command line ---------------------------------------------------


def test_inspect_lists_tied_initializers_and_constant_weights(tmp_path, capsys):
    onnx.save(_two_layer_norms(), tmp_path / "tied.onnx")
    onnx.save(_constant_weight(), tmp_path / "constant.onnx")
    assert main(["inspect", str(tmp_path / "tied.onnx"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["tied"] == [{"name": "scale", "readers": ["LayerNormalization 'ln1'",
                                                            "LayerNormalization 'ln2'"]}]
    assert report["constants"] == []
    assert main(["inspect", str(tmp_path / "tied.onnx")]) == 0
    text = capsys.readouterr().out
    assert "initializers several layers read as their own" in text
    assert "compile --untie gives each layer its own copy" in text
    assert "  scale        2       LayerNormalization 'ln1', LayerNormalization 'ln2'" in text
    assert main(["inspect", str(tmp_path / "constant.onnx"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["constants"] == [{"name": "c", "node": "fold", "dtype": "float",
                                    "shape": [SIZE, SIZE], "size": SIZE * SIZE,
                                    "feeds": "MatMul 'mm'"}]
    assert main(["inspect", str(tmp_path / "constant.onnx")]) == 0
    text = capsys.readouterr().out
    assert "not trainable: a constant; compile --weights NAME makes it an initializer" in text
    assert "  c         float  [4, 4]  16      MatMul 'mm'" in text


def test_compile_untie_on_the_command_line_is_untie_auto(tmp_path, capsys):
    onnx.save(_two_layer_norms(), tmp_path / "tied.onnx")
    assert main(["compile", str(tmp_path / "tied.onnx"), "-o", str(tmp_path / "p"),
                 "--untie"]) == 0
    assert "trains scale, scale_1, bias1" in capsys.readouterr().out
    loaded = lossgraph.TrainingProgram.load(tmp_path / "p")
    expected = lossgraph.compile_program(_two_layer_norms(), untie="auto")
    assert loaded.manifest == expected.manifest
    assert main(["compile", str(tmp_path / "tied.onnx"), "-o", str(tmp_path / "q"),
                 "--untie", "scale"]) == 0
    assert lossgraph.TrainingProgram.load(tmp_path / "q").manifest == expected.manifest
    assert main(["compile", str(tmp_path / "tied.onnx"), "-o", str(tmp_path / "r")]) == 0
    assert "warning: This weight is read by several layers" in capsys.readouterr().err
