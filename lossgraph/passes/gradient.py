"""gradient: add the gradients of a loss (or a vector-Jacobian product) as outputs.

Scalar-loss mode (``outputs=None``)::

    (inputs) -> (outputs)    becomes    (inputs) -> (outputs, w1_grad, w2_grad, ...)

with ``wk_grad = d loss / d wk``. Vector-Jacobian mode (``outputs=[y, ...]``)::

    (inputs) -> (outputs)    becomes    (inputs, y_grad, ...) -> (outputs, w1_grad, ...)

with ``wk_grad = sum_y y_grad . d y / d wk`` (``y_grad`` is the gradient of some
external loss with respect to ``y``, computed elsewhere, e.g. by torch).

Two backends give the same inputs and outputs: ``"onnx"`` (lossgraph's own
autodiff, standard ONNX ops only, runs on any onnxruntime) and ``"ort"``
(onnxruntime-training's ``GradientGraphBuilder``; ``com.microsoft`` ops, runs only
on the training build).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper

from .. import training_build
from ..analysis import (
    blocked_message,
    blocked_weights,
    default_weights,
    trainable_initializers,
)
from ..autodiff.walker import differentiate
from ..builder import GraphBuilder
from ..deprecation import renamed_keywords
from ..errors import (
    DTypeMismatchError,
    InternalError,
    MissingGradientError,
    ShapeMismatchError,
    UnknownNameError,
    UnsupportedModelError,
    UnsupportedOptionError,
    suggest,
)
from ..graphs import (
    FLOAT_TYPES,
    ForwardFacts,
    all_graphs,
    elem_type_name,
    is_onnx_op,
    names_in_graph,
    rename_values,
    with_weight_data,
)
from ..metadata import GRADIENTS_KEY, write_json
from ..models import ModelLike
from ..names import NameAuthority
from ..options import names as names_option
from ..roles import get_roles
from .contract import Pass, PassResult, name_fields
from .expand_functions import gradient_view
from .quantization import quantized_weight_hint

__all__ = ["Gradient", "gradient", "BACKENDS"]

#: The gradient backends: lossgraph's own autodiff, and onnxruntime-training's builder.
BACKENDS = ("onnx", "ort")


@dataclass(frozen=True)
class Gradient(Pass[dict[str, str]]):
    """Add ``<w>_grad`` outputs for each ``w`` of ``weights`` (module docstring; the options
    are those of :func:`gradient`). The report is ``{weight: gradient output}``."""

    weights: Sequence[str] | None = None
    loss_name: str | None = None
    backend: str = "onnx"
    outputs: Sequence[str] | None = None

    def __post_init__(self) -> None:
        name_fields(self, "weights", "outputs")

    def call(self, model: onnx.ModelProto) -> PassResult:
        grad_names = _differentiate(model, self.weights, self.loss_name, self.backend,
                                    self.outputs)
        return PassResult(model, grad_names)

    def run(self, model: ModelLike, *, checked: bool = False) -> PassResult[dict[str, str]]:
        try:
            return super().run(model, checked=checked)
        except InternalError as exc:
            if self.backend != "ort":
                raise
            # GradientGraphBuilder's graph fails the emitted-model check (its gradient ops'
            # shapes or opsets): the builder does not support this model.
            raise MissingGradientError(
                f"onnxruntime-training's GradientGraphBuilder emitted a graph the ONNX "
                f"checker rejects ({exc.__cause__}). Use backend='onnx'.") from exc.__cause__


@renamed_keywords(wrt="weights", loss="loss_name")
def gradient(
    model: ModelLike,
    weights: Sequence[str] | None = None,
    loss_name: str | None = None,
    backend: str = "onnx",
    outputs: Sequence[str] | None = None,
) -> onnx.ModelProto:
    """Return a copy of ``model`` that also outputs ``<w>_grad`` for each ``w`` in ``weights``.

    Args:
        model: the model (ModelProto, bytes or path).
        weights: initializers or graph inputs to differentiate with respect to, in the order
            of the new outputs; default :func:`~lossgraph.trainable_initializers` that
            reach the loss (or ``outputs``). One that no gradient reaches is a
            :class:`~lossgraph.errors.NoGradientError`.
        loss_name: the scalar output to differentiate (scalar-loss mode); default the loss
            recorded by :func:`~lossgraph.add_loss_output`, else ``"loss"``.
        backend: ``"onnx"`` (standard ops, any onnxruntime) or ``"ort"``
            (onnxruntime-training's builder, training build only).
        outputs: vector-Jacobian mode: outputs whose incoming gradients become inputs
            named ``<output>_grad``. Exclusive with ``loss_name``.
    """
    return Gradient(weights, loss_name, backend, outputs)(model).model


def _differentiate(model: onnx.ModelProto, wrt: Sequence[str] | None, loss: str | None,
                   backend: str, outputs: Sequence[str] | None) -> dict[str, str]:
    if backend not in BACKENDS:
        raise UnsupportedOptionError(f"backend={backend!r} is not 'onnx' or 'ort'.")
    graph = model.graph
    output_names = [o.name for o in graph.output]
    if outputs is not None and loss is not None:
        raise UnsupportedOptionError(
            "Pass either loss_name= (scalar-loss mode) or outputs= (vector-Jacobian mode), not "
            "both."
        )
    if outputs is not None and not outputs:
        raise UnsupportedOptionError(
            "outputs=[] names no output to take the vector-Jacobian product of: name some "
            f"({', '.join(map(repr, output_names))}), or leave outputs=None to differentiate "
            "the loss.")
    default_loss = get_roles(model).get("loss", "loss")
    targets = list(outputs) if outputs is not None else [loss or default_loss]
    for target in targets:
        if target not in output_names:
            what = "outputs=" if outputs is not None else "loss_name="
            raise UnknownNameError(
                f"{what} names {target!r}, which is not an output of the model."
                + suggest(target, output_names, "outputs")
            )
    names = NameAuthority.for_model(model)
    if backend == "onnx":
        _give_dropouts_masks(model, names)
    facts = ForwardFacts.of(model)
    for target in targets:
        if facts.elem_types.get(target) not in FLOAT_TYPES:
            raise DTypeMismatchError(
                f"Cannot differentiate output {target!r} of type {_type_name(facts, target)}: "
                "it must be a float or double tensor."
            )
    if wrt is not None and not wrt:
        names_option("weights", [], candidates=trainable_initializers(model))
    if wrt is None:  # the trainable weights that reach these targets, or an error
        wrt = default_weights(model, targets, facts.types, splits_as_tensors=False)
    wrt = list(wrt)
    _check_wrt(graph, wrt, facts)
    partial = [b for b in blocked_weights(model, targets, facts.types, wrt,
                                          splits_as_tensors=False) if b.partial]
    if partial:  # a gradient missing part of the weight's effect: a wrong number
        raise UnsupportedModelError(blocked_message(model, facts.types, partial, targets))

    grad_names = {w: names.fresh(f"{w}_grad") for w in wrt}
    if outputs is None:
        seed_inputs = []
        shape = facts.shapes.get(targets[0])
        if shape is None or any(d != 1 for d in shape):
            raise ShapeMismatchError(
                f"The loss {targets[0]!r} must be a scalar (or hold a single element); its "
                f"shape is {shape}. Reduce it first, or use outputs=[...] for a "
                "vector-Jacobian product."
            )
    else:
        seed_inputs = [
            helper.make_value_info(names.fresh(f"{o}_grad"), facts.types[o]) for o in targets
        ]

    if backend == "onnx":
        _onnx_backend(model, targets, seed_inputs, wrt, grad_names, names, facts)
    else:
        _ort_backend(model, targets, seed_inputs, wrt, grad_names, facts)
    graph.input.extend(seed_inputs)
    for w in wrt:
        graph.output.append(helper.make_value_info(grad_names[w], facts.types[w]))
    write_json(model, GRADIENTS_KEY, grad_names)
    return grad_names


def _give_dropouts_masks(model: onnx.ModelProto, names: NameAuthority) -> None:
    """A Dropout that may run in training mode without a mask output gets one, under a
    fresh name: its gradient is ``dy * mask / (1 - ratio)`` with the mask the forward drew.
    Exact: the node draws the same way with or without it (torch's dynamo exporter writes a
    training Dropout without its mask)."""
    for graph in all_graphs(model.graph):
        for node in graph.node:
            if (is_onnx_op(node, "Dropout")
                    and len(node.input) > 2 and node.input[2]
                    and (len(node.output) < 2 or not node.output[1])):
                mask = names.fresh(f"{node.output[0]}_mask")
                if len(node.output) < 2:
                    node.output.append(mask)
                else:
                    node.output[1] = mask


def _type_name(facts: ForwardFacts, name: str) -> str:
    """'float', 'int64', or the kind of a non-tensor value ('a sequence')."""
    value_type = facts.types.get(name)
    kind = value_type.WhichOneof("value") if value_type is not None else None
    if kind not in (None, "tensor_type"):
        return f"a {kind.removesuffix('_type')} (not a tensor)"
    elem_type = facts.elem_types.get(name, 0)
    return elem_type_name(elem_type) if elem_type else "unknown type"


def _check_wrt(graph: onnx.GraphProto, wrt: Sequence[str], facts: ForwardFacts) -> None:
    candidates = [t.name for t in graph.initializer] + [
        i.name for i in graph.input if i.name not in {t.name for t in graph.initializer}
    ]
    for w in wrt:  # distinct already: Gradient's fields are checked name lists
        if w not in candidates:
            raise UnknownNameError(
                f"weights names {w!r}, which is neither an initializer nor an input of the "
                "model."
                + suggest(w, candidates, "initializers and inputs")
            )
        if facts.elem_types.get(w) not in FLOAT_TYPES:
            raise DTypeMismatchError(
                f"Cannot differentiate with respect to {w!r} of type {_type_name(facts, w)}: "
                "only float and double tensors have gradients."
                + quantized_weight_hint(graph, w)
            )


def _onnx_backend(model, targets, seed_inputs, wrt, grad_names, names, facts) -> None:
    # ops without a rule but with a function body are differentiated through the body;
    # the forward keeps the op (expand_functions.py)
    view = gradient_view(model, names, facts, wrt, targets)
    if seed_inputs:
        seeds = {t: s.name for t, s in zip(targets, seed_inputs)}
        context = differentiate(view.model, seeds, wrt, grad_names, names, view.facts or facts)
    else:
        loss = targets[0]
        seeder = GraphBuilder(names, 1)
        one = seeder.const(np.ones(facts.shapes[loss]), facts.elem_types[loss], f"{loss}_seed")
        context = differentiate(view.model, {loss: one}, wrt, grad_names, names,
                                view.facts or facts)
        seeder.append_to(model.graph)
    view.add_recomputation(model, context.nodes)
    context.append_to(model.graph)


def _ort_backend(model, targets, seed_inputs, wrt, grad_names, facts) -> None:
    """Differentiate with onnxruntime-training's GradientGraphBuilder, same I/O contract.

    Vector-Jacobian products go through a scalar surrogate ``sum_y sum(y * y_grad)``,
    whose gradient is the product. Values the builder names like our outputs are
    renamed out of the way first.
    """
    C = training_build.bindings()
    if any(facts.elem_types[t] != onnx.TensorProto.FLOAT for t in targets):
        raise DTypeMismatchError(
            "backend='ort' differentiates float32 losses only (GradientGraphBuilder seeds the "
            f"loss gradient as float32); {targets[0]!r} is "
            f"{elem_type_name(facts.elem_types[targets[0]])}. Use backend='onnx'."
        )
    graph = model.graph
    original_inputs = list(graph.input)
    original_outputs = list(graph.output)
    work = onnx.ModelProto()
    work.CopyFrom(model)
    work.ir_version = min(work.ir_version, 10)
    names = NameAuthority.for_model(work)
    for name in [s.name for s in seed_inputs] + list(grad_names.values()):
        names.claim(name)
    temporary = {}
    if seed_inputs:
        b = GraphBuilder(names, 1)
        terms = []
        for target, seed in zip(targets, seed_inputs):
            temporary[seed.name] = names.fresh(f"lossgraph_seed_{target}")
            work.graph.input.append(helper.make_value_info(temporary[seed.name], seed.type))
            terms.append(b.reduce("ReduceSum", b.Mul(target, temporary[seed.name]), keepdims=0))
        loss = b.rename(b.sum_of(terms) if len(terms) > 1 else terms[0],
                        names.fresh("lossgraph_vjp_loss"))
        b.append_to(work.graph)
        loss_type = facts.elem_types[targets[0]]
        work.graph.output.append(helper.make_tensor_value_info(loss, loss_type, []))
    else:
        loss = targets[0]
    try:
        builder = C.GradientGraphBuilder(
            with_weight_data(work).SerializeToString(), {loss}, set(wrt), loss)
        with _native_stderr_silenced():  # the builder logs at info level whatever we set
            builder.build()
        built = onnx.load_model_from_string(builder.get_model())
    except Exception as exc:  # the builder raises RuntimeError with its own message
        detail = str(exc).strip()
        for marker in ("was false. ", " : FAIL : "):  # drop the C++ source location
            detail = detail.rsplit(marker, 1)[-1]
        raise MissingGradientError(
            f"onnxruntime-training's GradientGraphBuilder failed: {detail.rstrip('.')}. Use "
            "backend='onnx', or train only weights whose path to the loss it supports."
        ) from None
    ours = {**{v: k for k, v in temporary.items()}, **{f"{w}_grad": grad_names[w] for w in wrt}}
    before = names_in_graph(work.graph)
    clashes = {n: names.fresh(f"ort_{n}") for n in names_in_graph(built.graph) - before
               if n in set(ours.values()) and n not in ours}
    rename_values(built.graph, clashes)
    rename_values(built.graph, ours)
    for field in ("node", "initializer", "value_info"):
        del getattr(graph, field)[:]
        getattr(graph, field).extend(getattr(built.graph, field))
    del graph.input[:]
    graph.input.extend(original_inputs)
    del graph.output[:]
    graph.output.extend(original_outputs)
    existing = {o.domain for o in model.opset_import}
    model.opset_import.extend(o for o in built.opset_import if o.domain not in existing)


@contextlib.contextmanager
def _native_stderr_silenced() -> Iterator[None]:
    """Send what native code writes to file descriptor 2 to /dev/null for a moment."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "wb") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
