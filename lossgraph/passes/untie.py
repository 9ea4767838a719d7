"""UntieWeights: an initializer several layers read, one copy per layer.

    W read by layers L1, L2, L3         ->  W read by L1, W_1 by L2, W_2 by L3  (copies of W)
    W -> Identity -> X, read by L2      ->  X an initializer (a copy of W), read by L2

torch's exporters merge initializers of equal values: the unit LayerNorm scales and zero
biases of a fresh model, the copies of a layer (``nn.TransformerEncoder``'s), become one
initializer every layer reads (the legacy exporter names the others by ``Identity`` nodes
of it). Trained as it is, that initializer is one tied weight, which the torch model it
came from does not have (:func:`~lossgraph.analysis.tied_initializers` finds them).
Untied, each layer trains its own copy, starting from the same value, as in torch. The
first layer reading a weight keeps its name; a copy made of an ``Identity`` takes the
``Identity``'s output name (the torch parameter's, for the legacy exporter); any other
copy is named ``<name>_1``, ``<name>_2``, ... in the order of the layers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import onnx

from ..analysis import layer_readers
from ..errors import UnknownNameError, UnsupportedOptionError, suggest
from ..graphs import GraphIndex, is_onnx_op, rename_values, subgraphs
from ..names import NameAuthority
from .contract import Pass, PassResult, name_fields

__all__ = ["UntieWeights"]


@dataclass(frozen=True)
class UntieWeights(Pass[dict[str, list[str]]]):
    """Give each layer reading one of ``weights`` (initializers) its own copy (module doc).

    The report maps each untied initializer to the names of its copies, in graph order.
    An initializer fewer than two layers read is an error: there is nothing to untie.
    """

    weights: Sequence[str]

    def __post_init__(self) -> None:
        name_fields(self, "weights")

    def call(self, model: onnx.ModelProto) -> PassResult:
        graph = model.graph
        tensors = {t.name: t for t in graph.initializer}
        for name in self.weights:
            if name not in tensors:
                raise UnknownNameError(f"untie names {name!r}, which is not an initializer of "
                                       "the model." + suggest(name, list(tensors),
                                                              "initializers"))
            layers = len({id(node) for node, _ in layer_readers(graph, name)})
            if layers < 2:
                readers = "one layer reads" if layers else "no layer reads"
                raise UnsupportedOptionError(
                    f"untie names {name!r}, which {readers}: there is nothing to untie. Name "
                    "initializers several layers read (lossgraph inspect lists them), or pass "
                    "untie='auto'.")
        names = NameAuthority.for_model(model)
        copies = {name: _untie(graph, name, names) for name in self.weights}
        return PassResult(model, copies)


def _untie(graph: onnx.GraphProto, name: str, names: NameAuthority) -> list[str]:
    """Untie the initializer ``name`` of ``graph`` in place; the names of its copies."""
    made = []
    for tensor in [name, *_identities_as_copies(graph, name)]:
        made.append(tensor)
        made += _copy_per_reader(graph, tensor, names)
    return made[1:]


def _identities_as_copies(graph: onnx.GraphProto, name: str) -> list[str]:
    """Replace each ``Identity`` of ``name`` (or of such a copy) that
    :func:`~lossgraph.analysis.layer_readers` looks through by an initializer of its output
    name holding ``name``'s value; their names, in graph order."""
    outputs = {o.name for o in graph.output}
    copied: list[str] = []
    sources = {name}
    kept = []
    for node in graph.node:
        if is_onnx_op(node, "Identity") and node.input[0] in sources \
                and node.output[0] not in outputs:
            sources.add(node.output[0])
            copied.append(node.output[0])
        else:
            kept.append(node)
    if copied:
        del graph.node[:]
        graph.node.extend(kept)
        for after, copy in zip([name, *copied], copied):
            _add_copy(graph, name, copy, after)
    return copied


def _copy_per_reader(graph: onnx.GraphProto, tensor: str, names: NameAuthority) -> list[str]:
    """Give each node reading the initializer ``tensor`` but the first its own copy of it,
    named after it; their names, in graph order."""
    made: list[str] = []
    for node in GraphIndex(graph.node).readers(tensor)[1:]:
        copy = names.fresh(f"{tensor}_{len(made) + 1}")
        node.input[:] = [copy if i == tensor else i for i in node.input]
        for sub in subgraphs(node):
            rename_values(sub, {tensor: copy})
        _add_copy(graph, tensor, copy, made[-1] if made else tensor)
        made.append(copy)
    return made


def _add_copy(graph: onnx.GraphProto, source: str, name: str, after: str) -> None:
    """Add an initializer ``name`` holding ``source``'s value, right after the initializer
    ``after``."""
    tensors = list(graph.initializer)
    position = next(i for i, t in enumerate(tensors) if t.name == after)
    copy = onnx.TensorProto()
    copy.CopyFrom(next(t for t in tensors if t.name == source))
    copy.name = name
    tensors.insert(position + 1, copy)
    del graph.initializer[:]
    graph.initializer.extend(tensors)
