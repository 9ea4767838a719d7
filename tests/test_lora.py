"""LoRA adapters (lossgraph.adapters, lossgraph.passes.lora, compile_program(adapters=)).

The rewrite leaves the model's outputs as they were; trained from the same A and B as PEFT
(``peft.LoraConfig`` + ``get_peft_model``) on the same data with the same optimizer, the
adapters equal PEFT's after every step in every fusion mode, and the merged model predicts
what PEFT's ``merge_and_unload()`` model does. A tiny BERT (``transformers.BertConfig``,
no download) is exported once per module by torch's dynamo exporter (the legacy exporter
in one test); hand-built models cover the layouts an exporter writes (Gemm's transB, a
Transpose, a DequantizeLinear of a quantized base, a Conv) and the named errors.
"""

from __future__ import annotations

import copy
import warnings

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import lossgraph
from lossgraph.adapters import Adapter, LoRA, lora_candidates, merge_adapters, read_adapters
from lossgraph.errors import (
    StuckWeightWarning,
    UnknownNameError,
    UnsupportedModelError,
    UnsupportedOptionError,
)
from lossgraph.optim import SGD, AdamW
from lossgraph.passes import AddLoRA, strip_training
from lossgraph.runtime.session import create_session

FUSES = ("step", "epoch", "separate")


def _run(model: onnx.ModelProto, **feeds: np.ndarray) -> np.ndarray:
    return create_session(model).run(None, feeds)[0]


def _ops(model: onnx.ModelProto) -> list[str]:
    return [n.op_type for n in model.graph.node]


# -- hand-built models ------------------------------------------------------------------------


def _two_layers(quantized: bool = False, transposed: bool = False) -> onnx.ModelProto:
    """``Y = Gemm(Relu(X @ fc1), fc2, transB=1)`` (X: [N, 4], Y: [N, 3]); ``quantized``: fc1
    an int8 tensor dequantized before the product; ``transposed``: fc1 stored [out, in] and
    transposed by a node."""
    rng = np.random.default_rng(0)
    w1 = rng.normal(size=(4, 6)).astype(np.float32)
    w2 = rng.normal(size=(3, 6)).astype(np.float32)
    nodes, tensors = [], [numpy_helper.from_array(w2, "fc2.weight")]
    first = "fc1.weight"
    if quantized:
        scale = np.float32(0.02)
        tensors += [numpy_helper.from_array(np.clip(np.round(w1 / scale), -127, 127)
                                            .astype(np.int8), "fc1.weight"),
                    numpy_helper.from_array(np.asarray(scale), "fc1.scale"),
                    numpy_helper.from_array(np.asarray(0, np.int8), "fc1.zero_point")]
        nodes.append(helper.make_node("DequantizeLinear", ["fc1.weight", "fc1.scale",
                                                           "fc1.zero_point"], ["fc1.w"]))
        first = "fc1.w"
    elif transposed:
        tensors.append(numpy_helper.from_array(w1.T.copy(), "fc1.weight"))
        nodes.append(helper.make_node("Transpose", ["fc1.weight"], ["fc1.w"], perm=[1, 0]))
        first = "fc1.w"
    else:
        tensors.append(numpy_helper.from_array(w1, "fc1.weight"))
    nodes += [helper.make_node("MatMul", ["X", first], ["h"], name="/fc1/MatMul"),
              helper.make_node("Relu", ["h"], ["r"]),
              helper.make_node("Gemm", ["r", "fc2.weight"], ["Y"], name="/fc2/Gemm", transB=1)]
    graph = helper.make_graph(nodes, "two_layers",
                              [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", 4])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["N", 3])],
                              tensors)
    return helper.make_model(graph, ir_version=8, opset_imports=[helper.make_opsetid("", 17)])


def _data(rows: int = 8, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(rows, 4)).astype(np.float32),
            rng.normal(size=(rows, 3)).astype(np.float32))


def _with_random_b(model: onnx.ModelProto, seed: int = 3) -> onnx.ModelProto:
    """``model`` with every adapter's B drawn at random (B starts at zero)."""
    rng = np.random.default_rng(seed)
    changed = copy.deepcopy(model)
    b_names = {a.b for a in read_adapters(model)}
    for tensor in changed.graph.initializer:
        if tensor.name in b_names:
            value = numpy_helper.to_array(tensor)
            tensor.CopyFrom(numpy_helper.from_array(
                rng.normal(size=value.shape).astype(value.dtype), tensor.name))
    return changed


def test_candidates_name_the_module_of_each_product_and_its_layout():
    model = _two_layers()
    assert lora_candidates(model) == [
        lossgraph.adapters.LoRACandidate("fc1.weight", "fc1", "MatMul", (4, 6)),
        lossgraph.adapters.LoRACandidate("fc2.weight", "fc2", "Gemm", (3, 6))]
    result = AddLoRA(LoRA(rank=2, alpha=4))(model)
    assert result.report == read_adapters(result.model) == (
        Adapter("fc1.weight", "fc1", "fc1.lora_A", "fc1.lora_B", "linear", 2, 4.0, "in_out"),
        Adapter("fc2.weight", "fc2", "fc2.lora_A", "fc2.lora_B", "linear", 2, 4.0, "out_in"))
    shapes = {t.name: tuple(t.dims) for t in result.model.graph.initializer}
    assert shapes["fc1.lora_A"] == (4, 2) and shapes["fc1.lora_B"] == (2, 6)
    assert shapes["fc2.lora_A"] == (6, 2) and shapes["fc2.lora_B"] == (2, 3)
    assert result.report[0].peft_names() == ("base_model.model.fc1.lora_A.weight",
                                             "base_model.model.fc1.lora_B.weight")


@pytest.mark.parametrize("layout", ["plain", "transposed", "quantized"])
def test_the_rewrite_keeps_outputs_and_the_merge_folds_the_update_back(layout):
    """Before training (B zero) the outputs are unchanged; with B drawn at random the branch
    adds ``scale * X A B``, which merge folds into the base weight (a float base) giving the
    graph before the rewrite, same values; the user's model is never changed."""
    model = _two_layers(quantized=layout == "quantized", transposed=layout == "transposed")
    before = model.SerializeToString()
    X, _ = _data()
    adapted = lossgraph.add_lora(model, targets=["fc1", "fc2"], rank=2, alpha=3, dropout=0.25)
    assert model.SerializeToString() == before
    inference = strip_training(adapted)  # the Dropout off
    np.testing.assert_allclose(_run(inference, X=X), _run(model, X=X), rtol=1e-6, atol=1e-6)
    trained = _with_random_b(inference)
    values = {t.name: numpy_helper.to_array(t) for t in trained.graph.initializer}
    if layout == "quantized":
        with pytest.raises(UnsupportedOptionError, match="quantized"):
            merge_adapters(trained)
        return
    merged = merge_adapters(trained)
    assert _ops(merged) == _ops(model) and not read_adapters(merged)
    assert [t.name for t in merged.graph.initializer] == [t.name for t in model.graph.initializer]
    np.testing.assert_allclose(_run(merged, X=X), _run(trained, X=X), rtol=1e-5, atol=1e-5)
    w1 = X @ _effective(model, "fc1.weight")
    delta = 1.5 * values["fc1.lora_A"] @ values["fc1.lora_B"]
    np.testing.assert_allclose(_effective(merged, "fc1.weight"),
                               _effective(model, "fc1.weight") + delta, rtol=1e-5, atol=1e-6)
    assert np.abs(X @ _effective(merged, "fc1.weight") - w1).max() > 0.1


def _effective(model: onnx.ModelProto, name: str) -> np.ndarray:
    """The [in, out] weight the product of ``name`` reads."""
    value = next(numpy_helper.to_array(t) for t in model.graph.initializer if t.name == name)
    transposed = any(n.op_type == "Transpose" and n.input[0] == name for n in model.graph.node)
    return value.T if transposed else value


def test_a_quantized_base_trains_its_adapters_and_stays_integer():
    """QLoRA's shape: the base int8 tensor dequantized before the product stays an int8
    initializer of every training graph; the adapters train; merge=True refuses, merge=False
    keeps the base quantized and the branch beside it."""
    model = _two_layers(quantized=True)
    X, y = _data(16)
    program = lossgraph.compile_program(model, adapters=LoRA(rank=2, alpha=2, targets=["fc1"]),
                                        optimizer=SGD(0.01))
    assert program.weights == ["fc1.lora_A", "fc1.lora_B"]
    for graph in program.graphs.values():
        base = [t for t in graph.graph.initializer if t.name == "fc1.weight"]
        assert base and base[0].data_type == TensorProto.INT8
        assert "fc1.weight" not in {i.name for i in graph.graph.input}
    trainer = lossgraph.Trainer(program)
    trainer.fit(X, y, epochs=4, batch_size=8, shuffle=False, progress=False)
    assert trainer.train_losses_[-1] < trainer.train_losses_[0]
    kept = trainer.to_inference_model()
    assert any(t.name == "fc1.weight" and t.data_type == TensorProto.INT8
               for t in kept.graph.initializer)
    np.testing.assert_allclose(_run(kept, X=X), trainer.predict(X), rtol=1e-5, atol=1e-5)
    with pytest.raises(UnsupportedOptionError, match="merge=False"):
        trainer.to_inference_model(merge=True)


@pytest.mark.parametrize("fuse", FUSES)
def test_only_the_adapters_train_and_merge_gives_the_original_graph(fuse):
    """compile_program(adapters=...): the adapters are the weights, the base weights stay
    initializers of the training graphs (never in the state); merge=True is the original
    graph with ``W + delta``, merge=False keeps the branch; both predict what the trainer
    does. weights= names a base weight that trains too."""
    model = _two_layers()
    X, y = _data(16)
    program = lossgraph.compile_program(model, adapters=LoRA(rank=2, targets="fc.*"),
                                        optimizer="adamw", fuse=fuse)
    adapters = ["fc1.lora_A", "fc1.lora_B", "fc2.lora_A", "fc2.lora_B"]
    assert program.weights == adapters
    assert not {"fc1.weight", "fc2.weight"} & set(program.state)
    assert [a.a for a in program.adapters] == ["fc1.lora_A", "fc2.lora_A"]
    trainer = lossgraph.Trainer(program)
    trainer.fit(X, y, epochs=3, batch_size=8, shuffle=False, progress=False)
    merged, kept = trainer.to_inference_model(merge=True), trainer.to_inference_model()
    assert _ops(merged) == _ops(model)
    assert len(kept.graph.node) == len(model.graph.node) + 2 * 5
    assert read_adapters(kept) == program.adapters and not read_adapters(merged)
    assert all(read_adapters(program.graphs[name]) == program.adapters
               for name in ("evaluate", "predict"))  # the record kept by every later pass
    for exported in (merged, kept):
        np.testing.assert_allclose(_run(exported, X=X), trainer.predict(X), rtol=1e-5,
                                   atol=1e-5)
    assert np.abs(_run(merged, X=X) - _run(model, X=X)).max() > 1e-3
    assert lossgraph.export.to_inference_model(trainer, merge=True) == merged
    untrained = program.to_inference_model(merge=True)  # B zero: the model given
    assert _ops(untrained) == _ops(model)
    np.testing.assert_allclose(_run(untrained, X=X), _run(model, X=X), rtol=1e-6, atol=1e-6)
    more = lossgraph.compile_program(model, adapters=LoRA(rank=2, targets=["fc1"]),
                                     weights=["fc2.weight"], fuse=fuse)
    assert more.weights == ["fc1.lora_A", "fc1.lora_B", "fc2.weight"]


def test_a_model_add_lora_rewrote_compiles_and_the_manifest_keeps_the_adapters(tmp_path):
    """The record in the model's metadata is enough: its adapters train alone; the
    manifest lists them, and a saved program loads with them and trains the same."""
    model = lossgraph.add_lora(_two_layers(), targets=["fc1"], rank=3)
    X, y = _data(8)
    program = lossgraph.compile_program(model, optimizer=SGD(0.1))
    assert program.weights == ["fc1.lora_A", "fc1.lora_B"]
    loaded = lossgraph.TrainingProgram.load(program.save(tmp_path / "program"))
    assert loaded.adapters == program.adapters == read_adapters(model)
    trained = []
    for each in (program, loaded):
        trainer = lossgraph.Trainer(each)
        trainer.fit(X, y, epochs=2, batch_size=8, shuffle=False, progress=False)
        trained.append(trainer.state["fc1.lora_B"])
    np.testing.assert_array_equal(*trained)
    assert np.abs(trained[0]).max() > 0
    assert lossgraph.compile_program(_two_layers()).adapters == ()


def test_dropout_runs_in_training_only():
    """The branch's Dropout is in training mode in the training graph and off in the
    eval, predict and exported graphs."""
    model = _two_layers()
    program = lossgraph.compile_program(model, adapters=LoRA(rank=2, targets=["fc1"],
                                                             dropout=0.5))

    def dropouts(graph: onnx.ModelProto) -> int:
        return sum(n.op_type == "Dropout" for n in graph.graph.node)

    assert dropouts(program.graphs["train_step"]) == 1
    assert dropouts(program.graphs["evaluate"]) == dropouts(program.graphs["predict"]) == 0
    assert dropouts(program.to_inference_model()) == 0
    X, y = _data()
    np.testing.assert_allclose(_run(program.to_inference_model(), X=X), _run(model, X=X),
                               rtol=1e-6, atol=1e-6)
    trainer = lossgraph.Trainer(program)
    trainer.fit(X, y, epochs=2, batch_size=4, progress=False)
    assert np.isfinite(trainer.train_losses_).all()
    assert np.abs(trainer.state["fc1.lora_B"]).max() > 0


@pytest.mark.training
def test_the_ort_backend_trains_the_adapters_alike():
    model = _two_layers()
    X, y = _data(8)
    states = []
    for backend in ("onnx", "ort"):
        program = lossgraph.compile_program(model, adapters=LoRA(rank=2, targets=["fc1"]),
                                            optimizer=SGD(0.1), backend=backend)
        trainer = lossgraph.Trainer(program)
        trainer.fit(X, y, epochs=2, batch_size=8, shuffle=False, progress=False)
        states.append(trainer.state["fc1.lora_B"])
    np.testing.assert_allclose(*states, rtol=1e-5, atol=1e-6)


# -- named errors -----------------------------------------------------------------------------


def test_named_errors_before_any_work():
    model = _two_layers()
    with pytest.raises(UnsupportedModelError, match="'fc1.scale'.*not the weight of a product"):
        lossgraph.add_lora(_two_layers(quantized=True), targets=["fc1.scale"])
    with pytest.raises(UnsupportedOptionError, match="rank=5 is larger.*'fc2'"):
        lossgraph.add_lora(model, targets=["fc2"], rank=5)
    with pytest.raises(UnknownNameError, match="matches no weight.*'fc1'"):
        lossgraph.add_lora(model, targets=["attention"])
    with pytest.raises(UnknownNameError, match="matches no weight"):
        lossgraph.add_lora(model, targets="fc3.*")
    with pytest.raises(UnsupportedOptionError, match="adapters="):
        lossgraph.compile_program(model, adapters={"rank": 2})
    for bad in ({"rank": 0}, {"dropout": 1.0}, {"init": "xavier"}, {"alpha": 0},
                {"ops": ("Einsum",)}, {"targets": 3}, {"targets": "("}):
        with pytest.raises(UnsupportedOptionError):
            LoRA(**bad)


def test_zero_adapters_warn_at_compile():
    with pytest.warns(StuckWeightWarning, match="init='zeros'"):
        lossgraph.compile_program(_two_layers(), adapters=LoRA(rank=2, init="zeros"))


def test_targets_by_callable_by_op_and_all_linear():
    model = _two_layers()
    assert [a.module for a in AddLoRA(LoRA(rank=2, targets=lambda c: c.op == "Gemm"))(model)
            .report] == ["fc2"]
    assert [a.module for a in AddLoRA(LoRA(rank=2, ops=("MatMul",)))(model).report] == ["fc1"]
    # the output layer (fc2 writes Y) is left out, as PEFT leaves out the output embedding
    assert [a.module for a in AddLoRA(LoRA(rank=2, targets="all-linear"))(model).report] == [
        "fc1"]
    # no module path names PEFT's defaults: every 2-D MatMul/Gemm weight
    assert [a.module for a in AddLoRA(LoRA(rank=2))(model).report] == ["fc1", "fc2"]


# -- against PEFT -----------------------------------------------------------------------------

torch_marks = [pytest.mark.torch]


def _conv_net():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(2, 4, 3, padding=1), torch.nn.ReLU(),
                               torch.nn.Flatten(), torch.nn.Linear(4 * 5 * 5, 3)).eval()


def _grouped_conv() -> onnx.ModelProto:
    weight = np.random.default_rng(0).normal(size=(4, 2, 3, 3)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Conv", ["X", "conv.weight"], ["Y"], name="/conv/Conv", group=2,
                          pads=[1, 1, 1, 1])], "grouped",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", 4, 5, 5])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["N", 4, 5, 5])],
        [numpy_helper.from_array(weight, "conv.weight")])
    return helper.make_model(graph, ir_version=8, opset_imports=[helper.make_opsetid("", 17)])


def test_a_grouped_conv_is_refused():
    with pytest.raises(UnsupportedModelError, match="group=2"):
        lossgraph.add_lora(_grouped_conv(), targets=["conv"], rank=2)


def _peft(net, rank: int, alpha: float, targets: list[str]):
    """PEFT's LoRA on a copy of ``net``, dropout off."""
    peft = pytest.importorskip("peft", reason="needs peft")
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0)
    return peft.get_peft_model(copy.deepcopy(net), config)


def _peft_layer(peft_model, module: str):
    return peft_model.base_model.model.get_submodule(module)


def _peft_tensors(peft_model, adapter: Adapter) -> tuple[np.ndarray, np.ndarray]:
    """PEFT's A and B of ``adapter``'s module, laid out as lossgraph's (linear: transposed)."""
    layer = _peft_layer(peft_model, adapter.module)
    a, b = (layer.lora_A["default"].weight.detach().numpy(),
            layer.lora_B["default"].weight.detach().numpy())
    return (a, b) if adapter.kind == "conv" else (a.T.copy(), b.T.copy())


def _start_from_peft(program: lossgraph.TrainingProgram, peft_model) -> None:
    for adapter in program.adapters:
        program.state[adapter.a], program.state[adapter.b] = _peft_tensors(peft_model, adapter)


def _assert_trains_like_peft(model, net, X, y, fuse, optimizers, rank=4, alpha=8,
                             targets=("query", "value"), steps=2, rows=4, loss=None):
    """``steps`` minibatch steps of lossgraph (adapters from PEFT's initial A and B, B drawn
    at random so that both move from the first step) and of PEFT: equal adapters after
    each; then the merged model predicts what PEFT's merge_and_unload() model does, with the
    original model's ops."""
    import torch

    F = torch.nn.functional
    peft_model = _peft(net, rank, alpha, list(targets))
    torch.manual_seed(1)
    with torch.no_grad():
        for name, parameter in peft_model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(std=0.5)
    ours, theirs = optimizers
    program = lossgraph.compile_program(model, adapters=LoRA(rank, alpha, list(targets)),
                                        loss=loss or "multiclass_log_loss",
                                        loss_options={"from_logits": True}, optimizer=ours,
                                        fuse=fuse)
    assert program.weights == [n for a in program.adapters for n in (a.a, a.b)]
    assert sorted(a.module for a in program.adapters) == sorted(
        name.removeprefix("base_model.model.") for name, layer in peft_model.named_modules()
        if hasattr(layer, "lora_A") and layer.lora_A)
    _start_from_peft(program, peft_model)
    initial = {name: program.state[name].copy() for name in program.weights}
    trainer = lossgraph.Trainer(program)
    optimizer = theirs([p for p in peft_model.parameters() if p.requires_grad])
    feeds = X if isinstance(X, dict) else {"x": X}
    for step in range(steps):
        batch = slice(rows * step, rows * (step + 1))
        part = {k: v[batch] for k, v in feeds.items()}
        trainer.fit(part if isinstance(X, dict) else X[batch], y[batch], epochs=1,
                    batch_size=rows, shuffle=False, progress=False, warm_start=step > 0)
        optimizer.zero_grad()
        logits = peft_model(**{k: torch.from_numpy(v) for k, v in part.items()})
        logits = getattr(logits, "logits", logits)
        F.cross_entropy(logits, torch.from_numpy(y[batch])).backward()
        optimizer.step()
        for adapter in program.adapters:
            for name, value in zip((adapter.a, adapter.b), _peft_tensors(peft_model, adapter)):
                np.testing.assert_allclose(trainer.state[name], value, rtol=1e-5, atol=1e-6,
                                           err_msg=f"{name} after step {step}")
    moved = {n: float(np.abs(trainer.state[n] - initial[n]).max()) for n in initial}
    assert min(moved.values()) > 100 * 1e-6, moved  # far beyond the tolerance
    merged = trainer.to_inference_model(merge=True)
    assert _ops(merged) == _ops(lossgraph.strip_training(model))
    with torch.no_grad():
        expected = peft_model.merge_and_unload()(**{k: torch.from_numpy(v)
                                                    for k, v in feeds.items()})
    expected = getattr(expected, "logits", expected).numpy()
    np.testing.assert_allclose(_run(merged, **feeds), expected, rtol=1e-5, atol=1e-5)


BERT_ROWS, BERT_LENGTH, VOCABULARY = 12, 8, 50


def _bert_net():
    transformers = pytest.importorskip("transformers", reason="needs transformers")
    import torch

    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=VOCABULARY, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=16, num_labels=2,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, classifier_dropout=0.0)
    net = transformers.BertForSequenceClassification(config)
    with torch.no_grad():  # no two equal tensors, which the exporters would merge
        for parameter in net.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.05)
    return net.eval()


class _Logits:
    """The logits of a BertForSequenceClassification called on input_ids."""

    def __new__(cls, net):
        import torch

        class Logits(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.net = net

            def forward(self, input_ids):
                return self.net(input_ids=input_ids).logits

        return Logits()


def _bert_data() -> tuple[dict[str, np.ndarray], np.ndarray]:
    rng = np.random.default_rng(5)
    return ({"input_ids": rng.integers(0, VOCABULARY, (BERT_ROWS, BERT_LENGTH))},
            rng.integers(0, 2, BERT_ROWS))


def _export_bert(net, dynamo: bool) -> onnx.ModelProto:
    import io

    import torch

    example = (torch.from_numpy(_bert_data()[0]["input_ids"][:2]),)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if dynamo:
            batch = torch.export.Dim("batch", min=2)
            return torch.onnx.export(net, example, dynamo=True, input_names=["input_ids"],
                                     output_names=["logits"], verbose=False,
                                     dynamic_shapes=({0: batch},)).model_proto
        buffer = io.BytesIO()
        torch.onnx.export(net, example, buffer, dynamo=False, opset_version=17,
                          input_names=["input_ids"], output_names=["logits"],
                          dynamic_axes={"input_ids": {0: "batch"}, "logits": {0: "batch"}})
        return onnx.load_from_string(buffer.getvalue())


@pytest.fixture(scope="module")
def bert():
    """The tiny BERT and its dynamo export, made once per module."""
    pytest.importorskip("torch", reason="needs torch")
    net = _bert_net()
    return net, _export_bert(net, dynamo=True)


def _optimizers(name: str):
    import torch

    if name == "sgd":
        return SGD(2.0), lambda p: torch.optim.SGD(p, lr=2.0)
    return (AdamW(0.01, weight_decay=0.01),
            lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.01))


@pytest.mark.torch
def test_the_bert_export_is_unchanged_by_add_lora_and_targets_query_and_value(bert):
    net, model = bert
    X, _ = _bert_data()
    adapted = lossgraph.add_lora(model, rank=4)  # PEFT's default for BERT: query, value
    assert [a.module for a in read_adapters(adapted)] == [
        "bert.encoder.layer.0.attention.self.query", "bert.encoder.layer.0.attention.self.value"]
    np.testing.assert_allclose(_run(strip_training(adapted), **X), _run(model, **X),
                               rtol=1e-6, atol=1e-6)
    with pytest.raises(UnsupportedModelError, match="'bert.embeddings.LayerNorm.weight'.*"
                                                    "LayerNormalization"):
        lossgraph.add_lora(model, targets=["bert.embeddings.LayerNorm.weight"])
    with pytest.raises(UnknownNameError, match="q_proj.*Valid targets: 'bert.encoder"):
        lossgraph.add_lora(model, targets=["q_proj"])


@pytest.mark.torch
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("fuse", FUSES)
def test_bert_adapters_train_like_peft(bert, fuse, optimizer):
    net, model = bert
    X, y = _bert_data()
    _assert_trains_like_peft(model, net, X, y, fuse, _optimizers(optimizer))


@pytest.mark.torch
def test_the_legacy_export_trains_like_peft():
    """The legacy exporter renames the weights (``onnx::MatMul_200``): the module paths come
    from its node names."""
    net = _bert_net()
    model = _export_bert(net, dynamo=False)
    X, y = _bert_data()
    _assert_trains_like_peft(model, net, X, y, "step", _optimizers("sgd"))


@pytest.mark.torch
def test_conv_lora_computes_and_trains_like_peft():
    """PEFT's conv LoRA: A a Conv with the base's kernel, stride and padding, B a 1x1 Conv,
    same shapes as PEFT's; with B drawn at random the outputs and one SGD step's adapters
    equal PEFT's, and the merged model predicts what merge_and_unload()'s does."""
    import torch
    from support.torch_steps import legacy_export

    net = _conv_net()
    X = np.random.default_rng(0).normal(size=(8, 2, 5, 5)).astype(np.float32)
    y = np.random.default_rng(1).integers(0, 3, 8)
    model = legacy_export(net, X[:2])
    peft_model = _peft(net, 2, 4, ["0"])
    with torch.no_grad():
        _peft_layer(peft_model, "0").lora_B["default"].weight.normal_()
    adapted = lossgraph.add_lora(model, targets=["0"], rank=2, alpha=4)
    (adapter,) = read_adapters(adapted)
    assert (adapter.kind, adapter.module) == ("conv", "0")
    a, b = _peft_tensors(peft_model, adapter)
    values = {adapter.a: a, adapter.b: b}
    shapes = {t.name: tuple(t.dims) for t in adapted.graph.initializer}
    assert (shapes[adapter.a], shapes[adapter.b]) == (a.shape, b.shape) == ((2, 2, 3, 3),
                                                                            (4, 2, 1, 1))
    with torch.no_grad():
        expected = peft_model(torch.from_numpy(X)).numpy()
    program = lossgraph.compile_program(adapted, optimizer=SGD(0.1),
                                        loss="multiclass_log_loss",
                                        loss_options={"from_logits": True})
    program.state.update(values)
    trainer = lossgraph.Trainer(program)
    np.testing.assert_allclose(trainer.predict(X), expected, rtol=1e-5, atol=1e-5)
    trainer.fit(X, y, epochs=1, batch_size=8, shuffle=False, progress=False)
    optimizer = torch.optim.SGD([p for p in peft_model.parameters() if p.requires_grad], lr=0.1)
    torch.nn.functional.cross_entropy(peft_model(torch.from_numpy(X)),
                                      torch.from_numpy(y)).backward()
    optimizer.step()
    for name, value in zip((adapter.a, adapter.b), _peft_tensors(peft_model, adapter)):
        np.testing.assert_allclose(trainer.state[name], value, rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        merged = peft_model.merge_and_unload()(torch.from_numpy(X)).numpy()
    np.testing.assert_allclose(_run(trainer.to_inference_model(merge=True), x=X), merged,
                               rtol=1e-5, atol=1e-5)


def test_the_ort_artifacts_train_the_adapters_alone(tmp_path):
    """to_ort_artifacts(adapters=...): the checkpoint's trainable parameters are the
    adapters, the base weights constants of the training model."""
    from lossgraph.export import read_ort_checkpoint, to_ort_artifacts

    artifacts = to_ort_artifacts(_two_layers(), tmp_path / "artifacts",
                                 adapters=LoRA(rank=2, targets=["fc1"]), optimizer="adamw")
    assert sorted(read_ort_checkpoint(artifacts.checkpoint)) == ["fc1.lora_A", "fc1.lora_B"]
    training = onnx.load(artifacts.training_model)
    assert "fc1.weight" in {t.name for t in training.graph.initializer}


def test_a_damaged_adapters_record_is_named():
    from lossgraph.errors import InvalidProgramError
    from lossgraph.manifest import check_manifest

    manifest = copy.deepcopy(lossgraph.compile_program(
        _two_layers(), adapters=LoRA(rank=2, targets=["fc1"])).manifest)
    manifest["adapters"][0].pop("layout")
    with pytest.raises(InvalidProgramError, match=r"adapters\[0\]"):
        check_manifest(manifest)
    model = lossgraph.add_lora(_two_layers(), targets=["fc1"], rank=2)
    onnx.helper.set_model_props(model, {"lossgraph.adapters": '{"weight": 1}'})
    with pytest.raises(UnsupportedModelError, match="'lossgraph.adapters' record is damaged"):
        lossgraph.compile_program(model)
