"""Weights an exporter folded, copied or dropped (:func:`lossgraph.analysis.folded_weights`):
found from what torch's exports record (the dynamo exporter's graph signature and rewrite
rules, the legacy exporter's names for folded values) and from the values (a tensor stored
twice), warned at compile (FoldedWeightWarning) and listed by ``lossgraph inspect``; exports
without folding raise nothing."""

from __future__ import annotations

import io
import json
import warnings

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import lossgraph
from lossgraph.analysis import TORCH_SIGNATURE, folded_weights
from lossgraph.cli import main
from lossgraph.errors import FoldedWeightWarning

RNG = np.random.default_rng(0)


def _model(initializers: dict[str, np.ndarray], nodes: list[onnx.NodeProto], *,
           producer: str = "pytorch", signature: str | None = None) -> onnx.ModelProto:
    """``x`` (batch, 4) through ``nodes`` to ``y``, with ``initializers``."""
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])],
        [numpy_helper.from_array(v.astype(np.float32), k) for k, v in initializers.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)],
                              producer_name=producer)
    model.ir_version = 8
    if signature is not None:
        helper.set_model_props(model, {})
        entry = model.graph.metadata_props.add()
        entry.key, entry.value = TORCH_SIGNATURE, signature
    return model


def _meta(node: onnx.NodeProto, **props: str) -> onnx.NodeProto:
    for key, value in props.items():
        entry = node.metadata_props.add()
        entry.key, entry.value = key.replace("__", "."), value
    return node


def _tied_projection(copy: np.ndarray | None = None) -> onnx.ModelProto:
    """``y = (x @ w) @ w_copy``: a projection and its tied transpose stored again."""
    w = RNG.normal(size=(4, 6))
    return _model({"w": w, "w_copy": w.T if copy is None else copy},
                  [helper.make_node("MatMul", ["x", "w"], ["h"]),
                   helper.make_node("MatMul", ["h", "w_copy"], ["y"])], producer="")


def test_a_tensor_stored_again_transposed_is_a_copy():
    found = folded_weights(_tied_projection())
    assert [f.name for f in found] == ["w_copy"]
    assert "a copy of 'w', transposed" in found[0].how


def test_equal_constant_values_and_different_values_are_no_copies():
    assert folded_weights(_tied_projection(RNG.normal(size=(6, 4)))) == []
    zeros = _model({"a": np.zeros((4, 4)), "b": np.zeros((4, 4))},
                   [helper.make_node("MatMul", ["x", "a"], ["h"]),
                    helper.make_node("MatMul", ["h", "b"], ["y"])], producer="")
    assert folded_weights(zeros) == []  # a fresh model's equal zeros are not a copy


def _dynamo_export() -> onnx.ModelProto:
    """What torch's dynamo exporter with optimize=True writes for a Conv-free stand-in: a
    Gemm whose BatchNorm was fused in, a Gemm whose zero bias was removed, a weight computed
    from its parametrization; the signature names the module's parameters."""
    signature = "\n".join(f"p_{n.replace('.', '_')}: PARAMETER target='{n}'" for n in (
        "fc.weight", "bn.weight", "bn.bias", "head.weight", "head.bias",
        "proj.parametrizations.weight.original0", "proj.parametrizations.weight.original1"))
    fused = _meta(helper.make_node("Gemm", ["x", "fc.weight", "fc.weight_bias"], ["h"]),
                  pkg__onnxscript__rewriter__rule_name="FuseBatchNormIntoConv, "
                                                      "RemoveOptionalBiasFromConv",
                  pkg__torch__onnx__name_scopes="['', 'bn', '_native_batch_norm']")
    unbiased = _meta(helper.make_node("Gemm", ["h", "head.weight"], ["g"]),
                     pkg__onnxscript__rewriter__rule_name="RemoveOptionalBiasFromGemm",
                     pkg__torch__onnx__name_scopes="['', 'head', 'linear']")
    return _model({"fc.weight": RNG.normal(size=(4, 4)), "fc.weight_bias": RNG.normal(size=4),
                   "head.weight": RNG.normal(size=(4, 4)), "val_3": RNG.normal(size=(4, 4))},
                  [fused, unbiased, helper.make_node("MatMul", ["g", "val_3"], ["y"])],
                  signature=signature)


def test_what_the_dynamo_exporters_optimizer_folded_is_found_from_its_records():
    found = {f.name: f.how for f in folded_weights(_dynamo_export())}
    assert found.keys() == {"fc.weight", "fc.weight_bias", "head.bias", "proj.weight"}
    assert "'bn' folded in by torch's optimizer (FuseBatchNormIntoConv)" in found["fc.weight"]
    assert "zero bias" in found["head.bias"] and "RemoveOptionalBiasFromGemm" in found["head.bias"]
    assert "parametrizations.weight.original0" in found["proj.weight"]


def test_the_legacy_exporters_folded_values_are_found_but_parameters_laid_out_otherwise():
    """A transposed Linear weight (``onnx::MatMul_<n>``) and a scale reshaped to broadcast
    (one dimension above 1) are parameters laid out otherwise: not reported."""
    model = _model({"onnx::Conv_12": RNG.normal(size=(4, 16)),
                    "onnx::Mul_3": RNG.normal(size=(1, 16)),
                    "onnx::MatMul_7": RNG.normal(size=(16, 4))},
                   [helper.make_node("MatMul", ["x", "onnx::Conv_12"], ["h"]),
                    helper.make_node("Mul", ["h", "onnx::Mul_3"], ["g"]),
                    helper.make_node("MatMul", ["g", "onnx::MatMul_7"], ["y"])])
    assert [f.name for f in folded_weights(model)] == ["onnx::Conv_12"]
    model.producer_name = "skl2onnx"  # the names mean something only in torch's exports
    assert folded_weights(model) == []


def test_compile_warns_naming_each_folded_weight_and_how_to_export_the_parameters():
    with pytest.warns(FoldedWeightWarning) as caught:
        lossgraph.compile_program(_dynamo_export(), loss="squared_error")
    message = str(caught[0].message)
    assert "4 were folded, copied or dropped" in message
    assert "'fc.weight' ('bn' folded in" in message
    assert "optimize=False" in message and "do_constant_folding=False" in message


def test_inspect_lists_the_folded_weights(tmp_path, capsys):
    path = tmp_path / "tied.onnx"
    onnx.save(_tied_projection(), path)
    assert main(["inspect", str(path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [f["name"] for f in report["folded"]] == ["w_copy"]
    assert main(["inspect", str(path)]) == 0
    assert "weights that are not the module's parameters" in capsys.readouterr().out


@pytest.mark.torch
@pytest.mark.parametrize("dynamo", [True, False], ids=["dynamo", "legacy"])
def test_torchs_default_export_warns_and_an_export_without_folding_does_not(dynamo):
    """A Conv-BatchNorm net (dynamo folds the BatchNorm) and a tied embedding and output
    projection (the legacy exporter stores the tie again, transposed), each exported with
    torch's defaults and with folding off."""
    import torch

    torch.manual_seed(0)
    if dynamo:
        net = torch.nn.Sequential(torch.nn.Conv2d(2, 3, 3), torch.nn.BatchNorm2d(3),
                                  torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(12, 2))
        example, option = (torch.randn(2, 2, 4, 4),), "optimize"
    else:
        class TiedLM(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.embed = torch.nn.Embedding(12, 8)

            def forward(self, ids):
                return self.embed(ids) @ self.embed.weight.T

        net, example, option = TiedLM(), (torch.randint(0, 12, (2, 5)),), "do_constant_folding"

    def export(folding: bool) -> onnx.ModelProto:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if dynamo:
                return torch.onnx.export(
                    net.eval(), example, dynamo=True, verbose=False, optimize=folding,
                    dynamic_shapes=({0: torch.export.Dim("batch")},)).model_proto
            buffer = io.BytesIO()
            torch.onnx.export(net, example, buffer, dynamo=False, opset_version=17,
                              input_names=["ids"], dynamic_axes={"ids": {0: "batch"}},
                              do_constant_folding=folding)
            return onnx.load_from_string(buffer.getvalue())

    with pytest.warns(FoldedWeightWarning, match=option.split("_")[0]):
        lossgraph.compile_program(export(True), loss="squared_error")
    with warnings.catch_warnings():
        warnings.simplefilter("error", FoldedWeightWarning)
        lossgraph.compile_program(export(False), loss="squared_error")
