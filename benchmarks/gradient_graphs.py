"""How big and how fast are lossgraph's gradient graphs?

1. Node counts of the gradient graph of the golden MLPs and CNN, lossgraph's ``onnx``
   backend against onnxruntime-training's ``ort`` backend (when installed).
2. Time to build the gradient of a model of over 500 nodes: a 6-layer transformer
   encoder exported with ``torch.onnx.export`` (needs torch and onnxscript), checked
   against torch autograd.

Run from the repository root: python -m benchmarks.gradient_graphs
"""

from __future__ import annotations

import io
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import onnx

import lossgraph
from lossgraph.runtime.session import create_session

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = [("skl_mlp_regressor", "squared_error", {}),
          ("skl_mlp_classifier", "multiclass_log_loss", {}),
          ("torch_cnn", "multiclass_log_loss", {"from_logits": True})]


def _gradient_nodes(model: onnx.ModelProto, backend: str) -> int | str:
    """How many nodes ``backend``'s gradient adds to ``model``, or why it has none."""
    try:
        result = lossgraph.gradient(model, backend=backend)
    except lossgraph.LossgraphError as error:
        return f"n/a ({type(error).__name__})"
    return len(result.graph.node) - len(model.graph.node)


def node_counts() -> None:
    """Prints the gradient graph's size per golden model and backend."""
    print("nodes of the gradient graph beyond the forward (with loss) graph")
    print(f"{'model':22s} {'forward':>8s} {'onnx':>6s} {'ort':>6s}  ratio onnx/ort")
    for name, score, options in GOLDEN:
        model = lossgraph.add_loss_output(ROOT / "golden_models" / f"{name}.onnx", score,
                                          **options)
        ours, theirs = _gradient_nodes(model, "onnx"), _gradient_nodes(model, "ort")
        ratio = f"{ours / theirs:.2f}" if isinstance(theirs, int) else "-"
        print(f"{name:22s} {len(model.graph.node):8d} {ours!s:>6s} {theirs!s:>6s}  {ratio}")


def _transformer() -> tuple[Any, Any, onnx.ModelProto]:
    """A 6-layer torch transformer encoder, an input for it, and its ONNX export."""
    import torch

    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(d_model=32, nhead=4, dim_feedforward=64,
                                             dropout=0.0, batch_first=True)
    net = torch.nn.TransformerEncoder(layer, num_layers=6, enable_nested_tensor=False).eval()
    x = torch.randn(2, 10, 32)
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(net, (x,), buffer, dynamo=True, opset_version=18, optimize=False,
                          input_names=["x"], output_names=["y"], verbose=False)
    return net, x, onnx.load_model_from_string(buffer.getvalue())


def build_time() -> None:
    """Prints the time to build the transformer's gradient, checked against torch autograd."""
    try:
        import torch
    except ImportError:
        print("\ntransformer build time: skipped (needs torch)")
        return
    net, x, model = _transformer()
    with_loss = lossgraph.add_loss_output(model, "squared_error")
    weights = lossgraph.trainable_initializers(with_loss)
    times = []
    for _ in range(5):
        start = time.perf_counter()
        result = lossgraph.gradient(with_loss)
        times.append(time.perf_counter() - start)
    label = np.zeros((2, 10, 32), np.float32)
    outputs = create_session(result).run([f"{w}_grad" for w in weights],
                                   {"x": x.numpy(), "label": label})
    loss = ((net(x) - torch.from_numpy(label)) ** 2).mean()
    loss.backward()
    params = dict(net.named_parameters())
    errors = [float(np.abs(o - params[w].grad.numpy()).max()) for w, o in zip(weights, outputs)
              if w in params]
    print(f"\ntransformer encoder (6 layers, torch.onnx dynamo export): {len(model.graph.node)} "
          f"nodes, {len(weights)} weights")
    print(f"  gradient build: median {statistics.median(times) * 1000:.0f} ms over 5 runs, "
          f"{len(result.graph.node)} nodes in the result")
    print(f"  vs torch autograd: {len(errors)} weight gradients, max |difference| "
          f"{max(errors):.2e}")
    print(f"  ort backend: {_gradient_nodes(with_loss, 'ort')}")


def main() -> None:
    print(f"python {sys.version.split()[0]}, onnx {onnx.__version__}")
    node_counts()
    build_time()


if __name__ == "__main__":
    main()
