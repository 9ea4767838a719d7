"""A training graph as onnxruntime should run it for one batch size::

    SpecializeBatch(batch) = fix the batch size -> FoldStaticShapes -> TransposedProducts
                             -> SplitRowProducts

    batch input  x[N, ...]  ->  x[batch, ...]    (the scanned inputs of an epoch graph's
                                                 Scan, which its signature names, or where it
                                                 accumulates gradients those of the Scan over
                                                 each update's micro-batches; any other
                                                 graph's own data inputs)

A program's ``train_step`` and ``train_epoch`` graphs serve every batch size: a step
takes a batch of symbolic size and recomputes its shapes every time. For the one batch
size a fit uses they are constants (:mod:`~lossgraph.speed.fold_static_shapes`),
a transposed product is written as the product of the transposes
(:mod:`~lossgraph.speed.transposed_products`, for onnxruntime's order), and long one-row
products can be split for onnxruntime's threads
(:mod:`~lossgraph.speed.split_row_products`). The result is for running, not for saving:
the program keeps its general graphs.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import onnx

from ..errors import InvalidModelError, UnsupportedModelError, UnsupportedOptionError
from ..graphs import subgraphs
from ..metadata import SIGNATURE_KEY, read_json
from ..models import ModelLike
from ..passes.contract import Pass, PassResult, Pipeline, Reports
from ..target import active_target, loading_target, use_target
from .fold_static_shapes import FoldStaticShapes
from .split_row_products import SplitRowProducts
from .transposed_products import TransposedProducts

__all__ = ["SpecializeBatch", "set_leading_dims"]


@dataclass(frozen=True)
class SpecializeBatch(Pass[Reports | None]):
    """The training graph with its steps taking batches of ``batch`` rows, its shape
    arithmetic folded and its long one-row products split (module doc)."""

    batch: int

    def __post_init__(self) -> None:
        if isinstance(self.batch, bool) or not isinstance(self.batch, int) or self.batch < 1:
            raise UnsupportedOptionError(
                f"SpecializeBatch(batch={self.batch!r}): the batch size must be an int >= 1.")

    def run(self, model: ModelLike, *, checked: bool = False) -> PassResult:
        """Run for the runtimes that load ``model``: a program compiled for current
        onnxruntime alone (a newer opset) is specialized for it too."""
        loading = loading_target(model) if isinstance(model, onnx.ModelProto) else None
        with use_target(loading or active_target()):
            return super().run(model, checked=checked)

    def call(self, model: onnx.ModelProto) -> PassResult:
        signature = read_json(model, SIGNATURE_KEY) or {}
        rates = signature.get("learning_rates")  # the epoch Scan's last input (EpochGraph)
        scans = [node for node in model.graph.node
                 if node.op_type == "Scan" and rates and node.input[-1] == rates]
        if scans:  # an epoch graph: the Scan's batches get the static size
            fixed = False
            for scan in scans:
                if signature.get("gradient_scale"):  # a Scan over updates, each a Scan over
                    # micro-batches (lossgraph.passes.accumulate): theirs get the size
                    scan = next(n for n in next(subgraphs(scan)).node if n.op_type == "Scan")
                fixed |= bool(set_leading_dims(_scanned_rows(scan), self.batch))
        else:
            names = set_leading_dims(model.graph.input, self.batch)
            fixed = names is not None
            _fix_named_dims(model.graph, (names or set()) - {""}, self.batch)
        try:
            folded = Pipeline((FoldStaticShapes(), TransposedProducts(), SplitRowProducts()))(model)
        except InvalidModelError as exc:
            # the graph was valid with a symbolic batch: its shapes contradict each other
            # once the batch is a number, so the model's rows do not follow its inputs'
            detail = str(exc).partition("valid ONNX model: ")[2].partition(". Check it")[0]
            raise UnsupportedModelError(
                f"For batches of {self.batch} rows, the model's shapes contradict each other "
                f"({detail or exc}): it computes an output whose rows are not one per input "
                "row (a Reshape or a broadcast that mixes rows), or declares a shape it does "
                "not compute. lossgraph trains models that map each input row to an output "
                "row: fix the model's graph or its declared output shapes.") from None
        return PassResult(folded.model, folded.report or None, fixed or folded.changed)


def _scanned_rows(scan: onnx.NodeProto) -> list[onnx.ValueInfoProto]:
    """The body inputs a Scan hands a batch of rows: its scanned inputs but the last, one
    value per batch (the learning rate of an epoch's update, the gradient scale of a
    group's micro-batch)."""
    scanned = next(a.i for a in scan.attribute if a.name == "num_scan_inputs")
    inputs = next(subgraphs(scan)).input  # a Scan holds one graph: its body
    return list(inputs[len(inputs) - scanned:len(inputs) - 1])


def set_leading_dims(values: Iterable[onnx.ValueInfoProto], size: int | str,
                     fixed: int | None = None) -> set[str] | None:
    """Give every value whose leading dimension is symbolic (a batch, not a scalar or a
    weight), or is the number ``fixed``, the leading dimension ``size`` (a number, or a
    name); the names of the symbolic dimensions replaced (``""`` for an unnamed one), or
    None when no dimension was replaced. :class:`SpecializeBatch` fixes a free batch with
    it, :class:`~lossgraph.passes.fixed_batch.GeneralizeBatch` frees a fixed one."""
    names: set[str] = set()
    replaced = False
    for value in values:
        dims = value.type.tensor_type.shape.dim
        if not dims or (dims[0].HasField("dim_value") and dims[0].dim_value != fixed):
            continue
        if not dims[0].HasField("dim_value"):
            names.add(dims[0].dim_param)
        dims[0].Clear()
        if isinstance(size, str):
            dims[0].dim_param = size
        else:
            dims[0].dim_value = size
        replaced = True
    return names if replaced else None


def _fix_named_dims(graph: onnx.GraphProto, names: set[str], batch: int) -> None:
    """Declare ``batch`` for every dimension of the graph's outputs and values named like a
    fixed batch dimension (a name stands for one size throughout the graph), so that the
    outputs' shapes are as static as the inputs'."""
    for value in (*graph.output, *graph.value_info):
        for dim in value.type.tensor_type.shape.dim:
            if dim.dim_param and dim.dim_param in names:
                dim.Clear()
                dim.dim_value = batch
