"""SequencesToTensors: sequences that are tensor splits in disguise, rewritten into tensors::

    s = SplitToSequence(x, split; axis, keepdims)       p0, ..., pn-1 = Split(x, sizes; axis)
    y = SequenceAt(s, i)                          ->    y = p[i]    (i constant; i < 0: p[n + i])
    n = SequenceLength(s)                               n = Constant(n)
    c = ConcatFromSequence(s; axis, new_axis)           c = Concat(p0, ..., pn-1; axis)
                                                            (new_axis=1: each one Unsqueezed first)

with ``n`` the number of pieces and ``sizes`` their lengths: ``split`` itself when it is
a constant 1-D tensor; pieces of a constant scalar ``split`` (the last one maybe shorter),
or of length 1 when there is none, which needs the axis's static length. Without
``split``, ``keepdims=0`` removes the axis of every piece: ``p[i]`` is then
``Squeeze(piece i, axis)``.

Why: lossgraph differentiates tensors only, and torch's dynamo exporter writes
``torch.split`` and ``Tensor.split`` without its optimizer (``optimize=False``, the export
that keeps the module's parameters as the weights: GPT-2's attention projection) as a
``SplitToSequence`` read by ``SequenceAt``: no gradient would reach the weights before it.
The rewrite is exact: ``Split`` computes the same pieces.

What is rewritten (:func:`lossgraph.analysis.static_splits` decides, so that
:func:`~lossgraph.trainable_initializers` reads a model as compile_program differentiates
it): a ``SplitToSequence`` of the top-level graph whose number of pieces is static, whose
sequence is no graph output and is read only by ``SequenceAt`` at constant positions
(an initializer or a ``Constant``), ``SequenceLength`` and ``ConcatFromSequence``. The
readers' outputs keep their names. Anything else is left as it is; a weight whose
gradient must pass such a sequence is named by compile_program
(:func:`lossgraph.analysis.default_weights`). Sequences inside subgraphs are left alone.

Where it runs: :func:`~lossgraph.compile_program` runs it on the graphs from the loss
model (``evaluate``, the training graphs, ``fuse="separate"``'s gradient graph), before
``StabilizeNumerics``, when the loss model holds a ``SplitToSequence``; never on the
inference model: ``predict`` and the exported model keep the user's ops.
:func:`lossgraph.gradient` differentiates the graph as written: run this pass first.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import numpy_helper

from ..analysis import StaticSplit, static_splits
from ..builder import GraphBuilder
from ..graphs import ForwardFacts, attribute_value, is_onnx_op, opset_version, values_read
from ..names import NameAuthority
from .contract import Pass, PassResult

__all__ = ["SequencesToTensors", "holds_splits"]


def holds_splits(model: onnx.ModelProto) -> bool:
    """Whether the top-level graph has a ``SplitToSequence`` (something to look at)."""
    return any(is_onnx_op(n, "SplitToSequence")
               for n in model.graph.node)


@dataclass(frozen=True)
class SequencesToTensors(Pass[tuple[str, ...]]):
    """``SplitToSequence`` read at constant positions rewritten into ``Split`` (module
    doc); the report is the tuple of the sequences rewritten, in graph order."""

    def call(self, model: onnx.ModelProto) -> PassResult:
        if not holds_splits(model):
            return PassResult(model, (), changed=False)
        splits = static_splits(model.graph, ForwardFacts.of(model).types)
        if not splits:
            return PassResult(model, (), changed=False)
        graph = model.graph
        b = GraphBuilder(NameAuthority.for_model(model), opset_version(model) or 1,
                         prefix="sequences/")
        replaced = {r.output[0] for split in splits.values() for r in split.readers}
        nodes: list[onnx.NodeProto] = []
        for node in graph.node:
            if node.output and node.output[0] in splits:
                _emit_split(b, splits[node.output[0]])
                nodes.extend(b.nodes)
                b.nodes = []
            elif not (node.output and node.output[0] in replaced):
                nodes.append(node)
        graph.ClearField("node")
        graph.node.extend(nodes)
        graph.initializer.extend(b.initializers)
        released = {name for split in splits.values()
                    for node in (split.node, *split.readers) for name in node.input}
        _drop_unread_constants(graph, released)
        infos = [v for v in graph.value_info if v.name not in splits]
        del graph.value_info[:]
        graph.value_info.extend(infos)
        return PassResult(model, tuple(splits), changed=True)


def _drop_unread_constants(graph: onnx.GraphProto, released: set[str]) -> None:
    """The constants among ``released`` (the removed nodes' inputs: split lengths,
    positions) that nothing reads any more go: ``Constant`` nodes and initializers no
    input overrides."""
    unread = released - values_read(graph) - {o.name for o in graph.output}
    unread -= {v.name for v in graph.input}
    nodes = [n for n in graph.node if not (n.op_type == "Constant" and n.output[0] in unread)]
    if len(nodes) != len(graph.node):
        graph.ClearField("node")
        graph.node.extend(nodes)
    kept = [t for t in graph.initializer if t.name not in unread]
    if len(kept) != len(graph.initializer):
        del graph.initializer[:]
        graph.initializer.extend(kept)


def _emit_split(b: GraphBuilder, split: StaticSplit) -> None:
    """The Split, and what stands for each reader of the sequence (module doc)."""
    node, count = split.node, len(split.sizes)
    sequence, axis = node.output[0], int(attribute_value(node, "axis", 0))
    concatenated = any(r.op_type == "ConcatFromSequence" for r in split.readers)
    named = {}  # piece index -> its name: the output of the first SequenceAt taking it
    for output, index in split.pieces.items():
        named.setdefault(index, output)
    pieces = [named.get(i) or b.names.fresh(f"{sequence}_{i}") for i in range(count)]
    sizes = b.ints(split.sizes, hint=f"{sequence}_sizes")
    # the Split's outputs: the pieces, or what the pieces squeeze (fresh names)
    outputs = ([b.names.fresh(f"{sequence}_unsqueezed_{i}") for i in range(count)]
               if split.squeezed else pieces)
    if b.opset >= 13:
        b.op("Split", node.input[0], sizes, outputs=outputs, axis=axis)
    else:  # split was an attribute before opset 13
        b.op("Split", node.input[0], outputs=outputs, axis=axis, split=list(split.sizes))
    if split.squeezed:
        for i in range(count):
            if i in named or concatenated:
                b.rename(b.squeeze(outputs[i], [axis]), pieces[i], uses=False)
    for reader in split.readers:
        out = reader.output[0]
        if reader.op_type == "SequenceAt":
            if pieces[split.pieces[out]] != out:  # a second reader of the same piece
                b.Identity(pieces[split.pieces[out]], outputs=[out])
        elif reader.op_type == "SequenceLength":
            b.Constant(outputs=[out],
                       value=numpy_helper.from_array(np.array(count, np.int64)))
        else:  # ConcatFromSequence
            at = int(attribute_value(reader, "axis"))
            parts = pieces
            if int(attribute_value(reader, "new_axis", 0)):
                parts = [b.unsqueeze(p, [at]) for p in pieces]
            b.Concat(*parts, outputs=[out], axis=at)
