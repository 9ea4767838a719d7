"""Which graph library should lossgraph use? lossgraph's own graph utilities beside
onnx-graphsurgeon's and onnx-ir's, side by side on the same models in one run.

Models (exported with torch, perturbed so the exporter ties no weights):

- ``transformer``: ``torch.nn.TransformerEncoder`` (7 layers, d_model 32, 4 heads, ffn 64,
  free batch axis), legacy exporter (``dynamo=False``, opset 14), then onnxruntime's basic
  graph optimizations, which lossgraph needs to compile it (the raw export leaves a
  ``Squeeze``'s rank unknown);
- ``transformer-dynamo``: the 6-layer encoder of ``gradient_graphs.py`` (dynamo exporter,
  fixed batch of 2; lossgraph.compile refuses a fixed batch);
- ``bert``: a BERT-base-size encoder from torch.nn modules (12 layers, d_model 768, 12 heads,
  ffn 3072, vocabulary 30522, 128 tokens, pooler; 110M parameters), exported like
  ``transformer``;
- ``transformer-step``, ``bert-step``: the ``train_step`` graph ``lossgraph.compile`` makes
  of each (weights as inputs), which the trainer specializes to its batch size.

Every measurement runs in a fresh subprocess (``--worker``) that loads the model file and
times each step (the least of ``--repeat`` runs); memory is the worker's peak resident set
(``VmHWM``) and that peak less its resident set before loading, and, in one more
subprocess, tracemalloc's peak (Python objects and numpy arrays; protobuf's own memory is
invisible to it). The tools:

- ``lossgraph``: the hand-written utilities a library provides: ``SpecializeBatch``
  (static batch, ``Shape``/``Size``/``Reshape`` folded to a fixed point), the walker's
  dead-code removal, ``rename_values`` of every value;
- ``graphsurgeon``: ``import_onnx``, static batch, ``fold_constants``, ``cleanup``,
  ``toposort``, rename every tensor, ``export_onnx``;
- ``onnx-ir``: ``from_proto``, static batch, onnxscript's ``fold_constants`` (onnx-ir has no
  constant folder), ``RemoveUnusedNodesPass``, ``TopologicalSortPass``, rename every
  value, ``to_proto``;
- ``compile``: ``lossgraph.compile_program(model)`` as a whole, for scale.

``round trip`` says whether the library's import and export with no pass in between gives
back the input's bytes (lossgraph's passes promise byte-identical output).

Run: python benchmarks/graph_library.py [--models transformer,bert] [--cache DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib
import inspect
import io
import json
import os
import subprocess
import sys
import tempfile
import time
import tracemalloc
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace

import onnx

ROOT = Path(__file__).resolve().parents[1]
TOOLS = ("lossgraph", "graphsurgeon", "onnx-ir", "compile")
MODELS = ("transformer", "transformer-dynamo", "bert", "transformer-step", "bert-step")
#: the static batch each model is specialized to
BATCH = {"transformer": 2, "transformer-dynamo": 2, "bert": 8, "transformer-step": 2,
         "bert-step": 8}


# -- models ---------------------------------------------------------------------------
def _perturbed(net):
    """``net`` with every parameter nudged: torch's exporters merge equal initializers
    (a TransformerEncoder's copied layers), which would shrink the graph."""
    import torch

    with torch.no_grad():
        for parameter in net.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.01)
    return net.eval()


def _legacy_export(net, example, batch_axes: dict) -> onnx.ModelProto:
    import torch

    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(net, (example,), buffer, dynamo=False, opset_version=14,
                          input_names=["x"], output_names=["y"], dynamic_axes=batch_axes)
    return onnx.load_model_from_string(buffer.getvalue())


def _basic_optimized(model: onnx.ModelProto, path: Path) -> None:
    """Write ``model`` as onnxruntime's basic graph optimizations leave it (constants
    folded, Identity and Squeeze chains gone), importing only the standard domain."""
    import onnxruntime

    from lossgraph.runtime.session import create_session, quiet_session_options

    create_session(model, session_options=quiet_session_options(
        graph_optimization_level=onnxruntime.GraphOptimizationLevel.ORT_ENABLE_BASIC,
        optimized_model_filepath=str(path)))
    optimized = onnx.load(path)
    standard = [o for o in optimized.opset_import if o.domain in ("", "ai.onnx")]
    del optimized.opset_import[:]
    optimized.opset_import.extend(standard)
    onnx.save(optimized, path)


def _encoder(layers: int, d_model: int, heads: int, ffn: int, activation: str = "relu"):
    import torch

    layer = torch.nn.TransformerEncoderLayer(d_model=d_model, nhead=heads, dim_feedforward=ffn,
                                             dropout=0.0, activation=activation,
                                             batch_first=True)
    return torch.nn.TransformerEncoder(layer, num_layers=layers, enable_nested_tensor=False)


def export_transformer(path: Path) -> None:
    import torch

    torch.manual_seed(0)
    net = _perturbed(_encoder(7, 32, 4, 64))
    model = _legacy_export(net, torch.randn(2, 10, 32), {"x": {0: "batch"}, "y": {0: "batch"}})
    _basic_optimized(model, path)


def export_transformer_dynamo(path: Path) -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gradient_graphs

    onnx.save(gradient_graphs._transformer()[2], path)


def export_bert(path: Path) -> None:
    import torch

    class Bert(torch.nn.Module):
        """BERT-base's shapes: token and position embeddings, 12 encoder layers, pooler."""

        def __init__(self) -> None:
            super().__init__()
            self.tokens = torch.nn.Embedding(30522, 768)
            self.positions = torch.nn.Parameter(torch.randn(128, 768) * 0.02)
            self.norm = torch.nn.LayerNorm(768)
            self.encoder = _encoder(12, 768, 12, 3072, activation="gelu")
            self.pooler = torch.nn.Linear(768, 768)

        def forward(self, ids):
            hidden = self.encoder(self.norm(self.tokens(ids) + self.positions))
            return torch.tanh(self.pooler(hidden[:, 0]))

    torch.manual_seed(0)
    net = _perturbed(Bert())
    ids = torch.randint(0, 30522, (2, 128))
    model = _legacy_export(net, ids, {"x": {0: "batch"}, "y": {0: "batch"}})
    _basic_optimized(model, path)


def step_graph_of(base: str) -> Callable[[Path], None]:
    """An exporter of the ``train_step`` graph that ``lossgraph.compile`` makes of model
    ``base`` (weights as inputs): the graph the trainer specializes to its batch."""

    def export(path: Path) -> None:
        import lossgraph

        source = path.with_name(f"{base}.onnx")
        if not source.exists():
            EXPORTERS[base](source)
        onnx.save(lossgraph.compile_program(onnx.load(source)).graphs["train_step"], path)

    return export


EXPORTERS: dict[str, Callable[[Path], None]] = {
    "transformer": export_transformer,
    "transformer-dynamo": export_transformer_dynamo,
    "bert": export_bert,
    "transformer-step": step_graph_of("transformer"),
    "bert-step": step_graph_of("bert"),
}


# -- the measured work, one function per tool (run in a worker subprocess) -----------
class Steps:
    """Times named steps of one measurement."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        yield
        self.seconds[name] = time.perf_counter() - start


def _renamed(name: str) -> str:
    return f"{name}_r"


def run_lossgraph(path: Path, batch: int, steps: Steps) -> onnx.ModelProto:
    from lossgraph.autodiff.walker import _drop_dead_code
    from lossgraph.graphs import names_in_graph, rename_values
    from lossgraph.speed import SpecializeBatch

    with steps("load"):
        model = onnx.load(path)
    with steps("fold shapes"):
        model = SpecializeBatch(batch)(model).model
    with steps("dead code"):
        graph = model.graph
        kept = SimpleNamespace(nodes=list(graph.node), initializers=list(graph.initializer))
        _drop_dead_code(kept, [o.name for o in graph.output])
        del graph.node[:]
        graph.node.extend(kept.nodes)
    with steps("rename"):
        rename_values(graph, {n: _renamed(n) for n in names_in_graph(graph)})
    return model


def _fix_leading_dim(values, batch: int) -> None:
    for value in values:
        dims = value.type.tensor_type.shape.dim
        if dims and not dims[0].HasField("dim_value"):
            dims[0].dim_value = batch


def run_graphsurgeon(path: Path, batch: int, steps: Steps) -> onnx.ModelProto:
    with steps("import library"):
        import onnx_graphsurgeon as gs
    with steps("load"):
        model = onnx.load(path)
    with steps("infer_shapes"):  # fold_shapes folds only what the graph's types tell
        _fix_leading_dim(model.graph.input, batch)
        model = onnx.shape_inference.infer_shapes(model, data_prop=True)
    with steps("import_onnx"):
        graph = gs.import_onnx(model)
        del model
    with steps("import onnxruntime"):  # fold_constants evaluates with it; the trainer
        importlib.import_module("onnxruntime")  # imports it too, compile does not
    with steps("fold_constants"):
        graph.fold_constants()
    with steps("cleanup"):
        graph.cleanup()
    with steps("toposort"):
        graph.toposort()
    with steps("rename"):
        for tensor in graph.tensors().values():
            tensor.name = _renamed(tensor.name)
    with steps("export_onnx"):
        return gs.export_onnx(graph)


def run_onnx_ir(path: Path, batch: int, steps: Steps) -> onnx.ModelProto:
    with steps("import library"):
        import onnx_ir as ir
        from onnx_ir.passes.common import RemoveUnusedNodesPass, TopologicalSortPass
    with steps("load"):
        proto = onnx.load(path)
    with steps("from_proto"):
        model = ir.from_proto(proto)
        del proto
    for value in model.graph.inputs:
        if value.shape is not None and len(value.shape) and not isinstance(value.shape[0], int):
            value.shape = ir.Shape([batch, *value.shape[1:]])
    with contextlib.suppress(ImportError), steps("fold_constants (onnxscript)"):
        from onnxscript.optimizer import fold_constants

        fold_constants(model)
    with steps("RemoveUnusedNodes"):
        RemoveUnusedNodesPass()(model)
    with steps("TopologicalSort"):
        TopologicalSortPass()(model)
    with steps("rename"):
        for node in model.graph:
            for value in node.outputs:
                value.name = _renamed(value.name)
    with steps("to_proto"):
        return ir.to_proto(model)


def run_compile(path: Path, batch: int, steps: Steps) -> onnx.ModelProto:
    import lossgraph

    with steps("load"):
        model = onnx.load(path)
    with steps("compile"):
        program = lossgraph.compile_program(model)
    return program.graphs["train_step"]


RUNNERS = {"lossgraph": run_lossgraph, "graphsurgeon": run_graphsurgeon,
           "onnx-ir": run_onnx_ir, "compile": run_compile}


def round_trip_identical(tool: str, path: Path) -> bool | None:
    """Do the library's import and export, with nothing in between, give back the bytes
    onnx serializes the model to? (None: not a library.)"""
    model = onnx.load(path)
    if tool == "graphsurgeon":
        import onnx_graphsurgeon as gs

        back = gs.export_onnx(gs.import_onnx(model))
    elif tool == "onnx-ir":
        import onnx_ir as ir

        back = ir.to_proto(ir.from_proto(model))
    else:
        return None
    return back.SerializeToString() == model.SerializeToString()


def worker(tool: str, path: Path, batch: int, traced: bool) -> dict:
    """One measurement in this (fresh) process, as a JSON-able dict."""
    from benchmarks.machine import process_memory_mb  # workers run with the root on the path

    steps = Steps()
    if traced:
        tracemalloc.start()
    rss_at_start = process_memory_mb("VmRSS")
    try:
        result = RUNNERS[tool](path, batch, steps)
        with steps("serialize"):
            data = result.SerializeToString()
    except Exception as error:  # report any tool's failure as a row, not a traceback
        return {"error": f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"}
    record = {"seconds": steps.seconds, "nodes": len(result.graph.node),
              "shape_ops": sum(n.op_type in ("Shape", "Size") for n in result.graph.node),
              "sha256": hashlib.sha256(data).hexdigest(),
              "peak_rss_mb": process_memory_mb("VmHWM"), "rss_at_start_mb": rss_at_start}
    if traced:
        record["traced_peak_mb"] = tracemalloc.get_traced_memory()[1] / 2**20
    else:
        record["round_trip_identical"] = round_trip_identical(tool, path)
    return record


# -- the side-by-side run ------------------------------------------------------------
def measure(tool: str, path: Path, batch: int, traced: bool, python: str) -> dict:
    """Run :func:`worker` in a fresh interpreter and return its record."""
    command = [python, str(Path(__file__).resolve()), "--worker", tool, str(path),
               "--batch", str(batch)] + (["--traced"] if traced else [])
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    lines = done.stdout.strip().splitlines()
    if done.returncode or not lines:
        return {"error": f"worker exited {done.returncode}: {done.stderr.strip()[-200:]}"}
    return json.loads(lines[-1])


def fastest(records: list[dict]) -> dict:
    """The first record, with each step's time the least over all of them (the run least
    disturbed by other work on the machine)."""
    if any("error" in record for record in records):
        return next(record for record in records if "error" in record)
    best = dict(records[0])
    best["seconds"] = {step: min(r["seconds"][step] for r in records)
                       for step in records[0]["seconds"]}
    return best


def hand_written_utilities() -> list[tuple[str, str, int]]:
    """(function, file, lines) of each lossgraph utility a graph library provides."""
    from lossgraph import graphs
    from lossgraph.autodiff import walker
    from lossgraph.runtime import specialize

    rows = []
    for function in (specialize._fold_static_shapes, walker._drop_dead_code,
                     graphs.rename_values):
        lines, _ = inspect.getsourcelines(function)
        file = Path(inspect.getsourcefile(function)).relative_to(ROOT)
        rows.append((function.__name__, str(file), len(lines)))
    return rows


def _steps_text(seconds: dict[str, float]) -> str:
    return ", ".join(f"{name} {s * 1000:.0f}" for name, s in seconds.items())


def print_table(name: str, source_nodes: int, records: dict[str, dict],
                traced: dict[str, dict]) -> None:
    """One model's row per tool. ``peak``: the worker's peak resident set; ``added``: that
    peak less the worker's resident set before it loaded anything; ``traced``:
    tracemalloc's peak; ``Shape``: Shape and Size nodes left; ``same twice``: the
    timed and the traced run (two processes) wrote the same bytes."""
    print(f"\n{name}: {source_nodes} nodes")
    print(f"{'tool':13s} {'total ms':>9s} {'peak':>7s} {'added':>7s} {'traced':>7s} "
          f"{'nodes':>6s} {'Shape':>5s} {'same twice':>10s} {'round trip':>10s}  steps (ms)")
    for tool, record in records.items():
        if "error" in record:
            print(f"{tool:13s} {'n/a':>9s}  {record['error']}")
            continue
        total = sum(record["seconds"].values())
        added = record["peak_rss_mb"] - record["rss_at_start_mb"]
        again = traced.get(tool, {})
        peak = f"{again['traced_peak_mb']:.0f}MB" if "traced_peak_mb" in again else "-"
        same = "-" if "sha256" not in again else ("yes" if again["sha256"] == record[
            "sha256"] else "no")
        identical = record["round_trip_identical"]
        trip = "-" if identical is None else ("identical" if identical else "differs")
        print(f"{tool:13s} {total * 1000:9.0f} {record['peak_rss_mb']:5.0f}MB {added:5.0f}MB "
              f"{peak:>7s} {record['nodes']:6d} {record['shape_ops']:5d} {same:>10s} "
              f"{trip:>10s}  {_steps_text(record['seconds'])}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(MODELS),
                        help=f"comma-separated, of {', '.join(MODELS)} (default: all)")
    parser.add_argument("--tools", default=",".join(TOOLS),
                        help=f"comma-separated, of {', '.join(TOOLS)} (default: all)")
    parser.add_argument("--cache", type=Path,
                        help="folder that keeps the exported models between runs")
    parser.add_argument("--repeat", type=int, default=3,
                        help="timed runs per tool and model; each step's least time is shown")
    parser.add_argument("--no-traced", action="store_true",
                        help="skip the tracemalloc runs (they take 2-3x longer)")
    parser.add_argument("--json", type=Path, help="also write every record here")
    parser.add_argument("--worker", nargs=2, metavar=("TOOL", "MODEL"),
                        help="internal: one measurement in this process, printed as JSON")
    parser.add_argument("--batch", type=int, default=2, help="internal: the worker's batch")
    parser.add_argument("--traced", action="store_true", help="internal: trace allocations")
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker[0], Path(args.worker[1]), args.batch,
                                args.traced)))
        return

    versions = {}
    for module in ("onnx", "onnxruntime", "onnx_graphsurgeon", "onnx_ir", "onnxscript"):
        with contextlib.suppress(ImportError):
            versions[module] = __import__(module).__version__
    print(f"python {sys.version.split()[0]}, " + ", ".join(f"{k} {v}" for k, v in versions.items()))
    print("\nlossgraph's hand-written graph utilities that a library provides:")
    for function, file, lines in hand_written_utilities():
        print(f"  {function:22s} {file:32s} {lines:3d} lines")

    tools = args.tools.split(",")
    everything = {}
    with contextlib.ExitStack() as stack:
        folder = args.cache or Path(stack.enter_context(tempfile.TemporaryDirectory()))
        folder.mkdir(parents=True, exist_ok=True)
        for name in args.models.split(","):
            path = folder / f"{name}.onnx"
            if not path.exists():
                try:
                    EXPORTERS[name](path)
                except ImportError as error:
                    print(f"\n{name}: skipped ({error})")
                    continue
            source_nodes = len(onnx.load(path, load_external_data=False).graph.node)
            kinds = [t for t in tools if t != "compile" or not name.endswith("-step")]
            records = {t: fastest([measure(t, path, BATCH[name], False, sys.executable)
                                   for _ in range(args.repeat)]) for t in kinds}
            traced = {} if args.no_traced else {
                t: measure(t, path, BATCH[name], True, sys.executable)
                for t in kinds if t != "compile"}
            print_table(name, source_nodes, records, traced)
            everything[name] = {"nodes": source_nodes, "records": records, "traced": traced}
    if args.json:
        args.json.write_text(json.dumps(everything, indent=2) + "\n")


if __name__ == "__main__":
    main()
