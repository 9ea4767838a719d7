"""The update of every weight at once: an update graph on flat vectors.

A runner may run a ``fuse="separate"`` program's ``update`` graph *packed*
(:func:`packed_update`): the same graph built for one flat vector holding every weight end
to end (its gradient and each state likewise). The optimizers' updates are elementwise, so
it gives the per-weight graph's numbers to the last bit (a clipped update's norm, one sum
of squares over the flat gradient, to float rounding), in a handful of kernels instead of
a handful per weight (at batch 15 on onnxcustom's MLP, 6 kernels in 6 us instead of 36 in
15 us). The state buffers lay the weights and states out so
(:class:`~lossgraph.runtime.ring.StateRing`'s packed groups).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import onnx

from ..graphs import is_onnx_op
from ..optim import Optimizer, build_update, update_graph
from ..passes.in_place import ELEMENTWISE
from ..speed import WidenScalarConstants
from ..update_options import UpdateOptions

__all__ = ["PackedUpdate", "packed_update"]


@dataclass(frozen=True)
class PackedUpdate:
    """An update graph on flat vectors (:func:`packed_update`).

    ``inputs`` and ``outputs`` map the graph's weight and state inputs, and its outputs
    with their next values, to the names laid end to end in them (``blocks``: the
    weights, then each state of every weight); ``gradient`` is the flat gradient input,
    the weights' gradients end to end.
    """

    model: onnx.ModelProto
    learning_rate: str
    step: str
    gradient: str
    inputs: dict[str, tuple[str, ...]]
    outputs: dict[str, tuple[str, ...]]
    #: the gradients' norm output, where the update clips them (one reduction over the flat
    #: gradient)
    grad_norm: str | None = None
    #: an output computed from the gradient by its one reader, elementwise (SGD's
    #: ``gradient * learning_rate``), which a runner may write over the gradient's own array
    #: where nothing reads the gradient after the update: no temporary of its size then
    over_gradient: str | None = None

    @property
    def blocks(self) -> list[tuple[str, ...]]:
        """The groups of names each flat vector holds, weights first."""
        return list(self.inputs.values())


def packed_update(update: onnx.ModelProto, optimizer: Optimizer,
                  weights: Mapping[str, np.ndarray],
                  options: UpdateOptions | None = None) -> PackedUpdate | None:
    """``update``, the update graph of ``optimizer`` (with ``options``: clipping, an EMA)
    for ``weights`` (name -> value), on flat vectors: the same graph built for one vector
    of every weight end to end, as ``compile_program`` builds it (:func:`update_graph`,
    then WidenScalarConstants).

    None where ``update`` is not the graph :func:`update_graph` builds (a hand-edited
    program: only its own graph may run), the weights are not of one float type, or the
    optimizer updates some weights differently (decay groups).
    """
    options = options or UpdateOptions()
    dtypes = {np.asarray(value).dtype for value in weights.values()}
    if len(dtypes) != 1 or not optimizer.same_for_every_weight:
        return None
    built = build_update(optimizer, weights, options=options)
    if WidenScalarConstants()(built.model).model.graph.SerializeToString() != \
            update.graph.SerializeToString():
        return None
    size = sum(int(np.asarray(value).size) for value in weights.values())
    flat = "weights"  # update_graph reads only the shape and dtype: no memory for the values
    shaped = np.broadcast_to(np.zeros((), *dtypes), (size,))
    model = WidenScalarConstants()(update_graph(optimizer, {flat: shaped},
                                                options=options)).model
    names = [flat, *options.state_names(optimizer, flat)]
    blocks = [tuple(weights), *(tuple(built.states[w][k] for w in weights)
                                for k in range(len(names) - 1))]
    over = _written_over(model, f"{flat}_grad")
    return PackedUpdate(model, "learning_rate", "step", f"{flat}_grad",
                        dict(zip(names, blocks)), {f"{n}_new": b for n, b in zip(names, blocks)},
                        "grad_norm" if options.clips else None, over)


def _written_over(model: onnx.ModelProto, gradient: str) -> str | None:
    """The output of the one node reading ``gradient``, made a graph output of ``model``
    (in place), where that node is elementwise and its output shaped and typed like
    ``gradient`` (its other inputs scalars) and no graph output already; else None."""
    readers = [node for node in model.graph.node if gradient in node.input]
    if len(readers) != 1 or not is_onnx_op(readers[0], *ELEMENTWISE) \
            or len(readers[0].output) != 1:
        return None
    output = readers[0].output[0]
    if output in {o.name for o in model.graph.output}:
        return None
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True).graph
    types = {v.name: v.type for v in (*inferred.input, *inferred.value_info)}
    if output not in types or types[output] != types[gradient]:
        return None
    model.graph.output.append(onnx.helper.make_value_info(output, types[gradient]))
    return output
