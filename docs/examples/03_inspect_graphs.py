"""03: inspect the training graphs a program holds.

``lossgraph.compile`` returns a TrainingProgram: ONNX graphs plus a manifest saying what
each graph's inputs and outputs are for (features, label, weights, optimizer states,
learning rate, their next values...). This script writes the graphs with
``save_onnx_graph`` into a temporary folder, reads one back with onnx, and prints its
inputs and outputs beside the roles the manifest gives them.

Run: python docs/examples/03_inspect_graphs.py
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import onnx

import lossgraph
from lossgraph.optim import Momentum

# A linear model written by hand in ONNX text syntax: y = x @ coef + intercept.
model = onnx.parser.parse_model("""
    <ir_version: 8, opset_import: ["" : 18]>
    linear (float[N, 3] x) => (float[N, 1] y)
    <float[3, 1] coef = {0.1, -0.2, 0.3}, float[1] intercept = {0.5}>
    {
        h = MatMul(x, coef)
        y = Add(h, intercept)
    }
""")
program = lossgraph.compile_program(model, optimizer=Momentum(0.01))
manifest = program.manifest  # program.save(folder) writes it as manifest.json
print("graphs:", sorted(program.graphs), "| optimizer:", manifest["optimizer"]["type"])
for weight in manifest["weights"]:
    states = ", ".join(state["name"] for state in weight["states"])
    print(f"weight {weight['name']} -> {weight['new']} (optimizer state: {states})")

with tempfile.TemporaryDirectory() as folder:
    paths = program.save_onnx_graph(folder)
    print("written:", sorted(Path(path).name for path in paths.values()))
    step = onnx.load(paths["train_step"])

documented = manifest["graphs"]["train_step"]
for kind, values in (("inputs", step.graph.input), ("outputs", step.graph.output)):
    print(f"train_step {kind}:")
    for value, entry in zip(values, documented[kind]):
        shape = [d.dim_param or d.dim_value for d in value.type.tensor_type.shape.dim]
        print(f"  {value.name:22s} {entry['role']:14s} {entry['dtype']:8s} {shape}")
        assert value.name == entry["name"]
    assert len(values) == len(documented[kind])
print("OK: the saved graph's inputs and outputs are the ones the manifest documents")
