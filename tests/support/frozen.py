"""A model whose large weight stays frozen (a LoRA base, or a weight compile leaves out):
``Y = Gemm(Relu(X @ fc1), fc2, transB=1)``, fc1 [128, 128] (64 KiB: the smallest a
program holds apart, lossgraph.graphs.held.HOLD_MIN_BYTES), fc2 [3, 128]."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

import lossgraph

SIZE = 128


def frozen_model() -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    w1 = rng.normal(size=(SIZE, SIZE)).astype(np.float32) / SIZE
    w2 = rng.normal(size=(3, SIZE)).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["X", "fc1.weight"], ["h"], name="/fc1/MatMul"),
             helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("Gemm", ["r", "fc2.weight"], ["Y"], name="/fc2/Gemm", transB=1)]
    graph = helper.make_graph(
        nodes, "frozen", [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", SIZE])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["N", 3])],
        [numpy_helper.from_array(w1, "fc1.weight"), numpy_helper.from_array(w2, "fc2.weight")])
    return helper.make_model(graph, ir_version=8, opset_imports=[helper.make_opsetid("", 17)])


def frozen_data(rows: int = 8) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1)
    return (rng.normal(size=(rows, SIZE)).astype(np.float32),
            rng.normal(size=(rows, 3)).astype(np.float32))


def frozen_program(kind: str, fuse: str = "step") -> lossgraph.TrainingProgram:
    """``kind`` "lora": adapters on fc1; "weights": fc2 alone trained."""
    options = ({"adapters": lossgraph.LoRA(rank=4, targets=["fc1"])} if kind == "lora"
               else {"weights": ["fc2.weight"]})
    return lossgraph.compile_program(frozen_model(), fuse=fuse, optimizer="adamw", **options)
