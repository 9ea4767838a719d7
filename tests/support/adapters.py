"""The small models the LoRA adapter files' and compositions' tests share
(export/test_adapters.py, test_lora_compositions.py).

- ``query_model()``: ``y = x @ encoder.query.weight.T + bias`` as torch exports a Linear
  (a Gemm with ``transB``), no torch needed: the weight, named like a torch parameter,
  gives the module path ``encoder.query``; ``query_data()`` its data;
- ``lora_program(fuse, optimizer)``: that model compiled with rank-2 adapters (alpha 4);
- ``torch_net()``: a torch module with ``encoder.query`` and ``encoder.value`` linear
  layers, and ``torch_program(net)``: its legacy export compiled with adapters on both.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

import lossgraph
from lossgraph.adapters import LoRA
from lossgraph.optim import SGD

RANK, ALPHA = 2, 4.0


def query_model(seed: int = 0) -> onnx.ModelProto:
    rng = np.random.default_rng(seed)
    graph = helper.make_graph(
        [helper.make_node("Gemm", ["x", "encoder.query.weight", "encoder.query.bias"], ["y"],
                          transB=1)], "query",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 5])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3])],
        [numpy_helper.from_array(rng.normal(size=(3, 5)).astype(np.float32),
                                 "encoder.query.weight"),
         numpy_helper.from_array(rng.normal(size=3).astype(np.float32), "encoder.query.bias")])
    return helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 21)])


def query_data(rows: int = 24) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1)
    X = rng.normal(size=(rows, 5)).astype(np.float32)
    return X, (X @ rng.normal(size=(5, 3))).astype(np.float32)


def lora_program(fuse: str = "step", optimizer: Any = None, rank: int = RANK
                 ) -> lossgraph.TrainingProgram:
    return lossgraph.compile_program(query_model(), adapters=LoRA(rank=rank, alpha=ALPHA),
                                     optimizer=optimizer or SGD(0.05), fuse=fuse)


def torch_net() -> Any:
    import torch

    class Encoder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.query, self.value = torch.nn.Linear(5, 4), torch.nn.Linear(4, 3)

        def forward(self, x):
            return self.value(torch.relu(self.query(x)))

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.encoder = Encoder()

        def forward(self, x):
            return self.encoder(x)

    torch.manual_seed(0)
    return Net()


def torch_program(net: Any) -> lossgraph.TrainingProgram:
    from .torch_steps import legacy_export

    model = legacy_export(net, np.zeros((2, 5), np.float32))
    return lossgraph.compile_program(model, adapters=LoRA(rank=RANK, alpha=ALPHA,
                                                           targets=["query", "value"]),
                                     optimizer=SGD(0.05))
