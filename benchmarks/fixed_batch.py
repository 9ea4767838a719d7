"""What freeing a fixed batch costs, and what it frees: ``GeneralizeBatch`` on torch's
exports of small CNNs and torchvision's classification models (random weights, built from
their constructors, never downloaded), each exported with a fixed batch of 2 by torch's
default exporter (dynamo) and by the legacy one.

For each export: the nodes, the pass's wall time (the least of ``--repeat`` runs), whether
the batch was freed (and what was rewritten) or kept (why), and for a freed one the largest
difference between the freed model at 5 rows in onnxruntime and the torch module.

Run from the repository root (needs torch; torchvision for its models):
      python -m benchmarks.fixed_batch [--models cnn,resnet18,...] [--repeat 3]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
import time
import types
import warnings
from collections.abc import Callable

import numpy as np


def _torchvision() -> object | None:
    """torchvision, its compiled operators skipped (they do not load beside the CPU torch
    2.13 from PyPI, and its classification models never call them); None without it."""
    for name in ("torchvision._meta_registrations", "torchvision._autograd_registrations"):
        sys.modules.setdefault(name, types.ModuleType(name))
    try:
        import torchvision
    except ImportError:
        return None
    return torchvision


def models() -> dict[str, tuple[Callable[[], object], tuple[int, ...]]]:
    """The modules measured, by name: a constructor and the shape of one row."""
    import torch

    class CNN(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv, self.fc = torch.nn.Conv2d(1, 4, 3), torch.nn.Linear(4 * 13 * 13, 10)

        def forward(self, x):
            h = torch.nn.functional.max_pool2d(torch.relu(self.conv(x)), 2)
            return self.fc(h.view(x.size(0), -1))

    found: dict[str, tuple[Callable[[], object], tuple[int, ...]]] = {"cnn": (CNN, (1, 28, 28))}
    vision = _torchvision()
    if vision is not None:
        for name in ("resnet18", "mobilenet_v3_small", "shufflenet_v2_x0_5", "squeezenet1_1"):
            found[name] = (lambda n=name: getattr(vision.models, n)(num_classes=10),
                           (3, 64, 64))
    return found


def measure(name: str, build: Callable[[], object], row: tuple[int, ...], dynamo: bool,
            repeat: int) -> dict[str, object]:
    """One export of ``name`` and what ``GeneralizeBatch`` does with it."""
    import onnx
    import torch

    from lossgraph.passes import GeneralizeBatch
    from lossgraph.runtime.session import create_session

    net = build().eval()
    buffer = io.BytesIO()
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        torch.onnx.export(net, (torch.randn(2, *row),), buffer, dynamo=dynamo)
    model = onnx.load_from_string(buffer.getvalue())
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        result = GeneralizeBatch()(model)
        times.append(time.perf_counter() - start)
    report = result.report
    difference = None
    if report.freed:
        X = torch.randn(5, *row)
        with torch.no_grad():
            expected = net(X).numpy()
        session = create_session(result.model)
        got = session.run(None, {session.get_inputs()[0].name: X.numpy()})[0]
        difference = float(np.abs(got - expected).max())
    return {"model": name, "exporter": "dynamo" if dynamo else "legacy",
            "nodes": len(model.graph.node), "ms": 1000 * min(times), "freed": report.freed,
            "max_difference": difference, "detail": report.describe()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=None, help="comma-separated names (default: all)")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    available = models()
    chosen = args.models.split(",") if args.models else list(available)
    print("| model | exporter | nodes | ms | freed | max difference | what |")
    print("|---|---|---|---|---|---|---|")
    for name in chosen:
        for dynamo in (True, False):
            row = measure(name, *available[name], dynamo, args.repeat)
            difference = ("-" if row["max_difference"] is None
                          else f"{row['max_difference']:.1e}")
            print(f"| {row['model']} | {row['exporter']} | {row['nodes']} | {row['ms']:.0f} | "
                  f"{'yes' if row['freed'] else 'no'} | {difference} | {row['detail']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
