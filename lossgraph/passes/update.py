"""update_graph: an optimizer's weight update as a standalone ONNX graph.

For weights ``w_1 .. w_k`` the graph computes, with the optimizer's formulas
(:mod:`lossgraph.optim`),

    (learning_rate, step, w_1, w_1_grad, <w_1 states>, ..., w_k, w_k_grad, <w_k states>)
        -> (w_1_new, <w_1 state>_new, ..., w_k_new, <w_k state>_new)

``learning_rate`` is a scalar of the weights' float type (the schedule's value for
this update, :meth:`Optimizer.schedule`), ``step`` an int64 scalar holding the
1-based update number (only Adam and AdamW read it). Weights and their states have
the shapes of the arrays given; a runner feeds the outputs back as the next step's
inputs. The graph is IR 10, standard ONNX ops only, and runs on onnxruntime-training
1.19 and on current onnxruntime alike.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper

from ..builder import GraphBuilder
from ..errors import (
    DTypeMismatchError,
    InternalError,
    UnsupportedModelError,
    UnsupportedOptionError,
)
from ..graphs import FLOAT_TYPES
from ..names import NameAuthority
from ..optim import Optimizer
from ..target import active_target, finalize

__all__ = ["update_graph", "weights_dtype", "standalone_model"]


def weights_dtype(weights: Mapping[str, np.ndarray], what: str) -> np.dtype:
    """The one float dtype (float32 or float64) all ``weights`` share."""
    if not weights:
        raise UnsupportedOptionError(f"{what} needs at least one weight; none was given.")
    dtypes: dict[np.dtype, str] = {}
    for name, value in weights.items():
        dtype = np.asarray(value).dtype
        if helper.np_dtype_to_tensor_dtype(dtype) not in FLOAT_TYPES:
            raise DTypeMismatchError(
                f"Weight {name!r} is {dtype}; {what} works on float32 or float64 weights."
            )
        dtypes.setdefault(dtype, name)
    if len(dtypes) > 1:
        listing = ", ".join(f"{name!r} is {dtype}" for dtype, name in dtypes.items())
        raise UnsupportedModelError(
            f"{what} needs weights of one float type, but {listing}. Cast the model's "
            "weights to one type first."
        )
    return next(iter(dtypes))


def standalone_model(
    b: GraphBuilder,
    name: str,
    inputs: Sequence[onnx.ValueInfoProto],
    outputs: Sequence[tuple[str, str, onnx.ValueInfoProto]],
    opset: int,
) -> onnx.ModelProto:
    """A model holding ``b``'s nodes, with ``outputs`` as ``(value, output name, info)``.

    Each value is renamed to its output name where ``b`` produced it (consumers
    included), or copied with ``Identity`` where it is a graph input, an initializer
    or already another output. The output names must be reserved in ``b.names``.
    """
    produced = {o for node in b.nodes for o in node.output}
    renames: dict[str, str] = {}
    for value, out_name, _ in outputs:
        if value in produced and value not in renames:
            renames[value] = out_name
        else:
            b.Identity(renames.get(value, value), outputs=[out_name])
    for node in b.nodes:
        node.input[:] = [renames.get(i, i) for i in node.input]
        node.output[:] = [renames.get(o, o) for o in node.output]
    graph = helper.make_graph([], name, list(inputs), [info for _, _, info in outputs])
    b.append_to(graph)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    finalize(model)
    try:
        onnx.checker.check_model(model, full_check=True)
    except Exception as exc:  # pragma: no cover - a bug, not a user error
        raise InternalError(f"{name} is invalid ({exc}); this is a bug in lossgraph.") from exc
    return model


def _check_opset(opset: int) -> None:
    target = active_target()
    if not target.min_opset <= opset <= target.max_opset:
        raise UnsupportedOptionError(
            f"opset={opset} is outside {target.min_opset}..{target.max_opset}, "
            f"the range {target.description} load."
        )


def update_graph(
    optimizer: Optimizer, weights: Mapping[str, np.ndarray], opset: int = 18
) -> onnx.ModelProto:
    """The standalone update graph of ``optimizer`` for ``weights`` (name -> initial value).

    Inputs: ``learning_rate``, ``step``, then per weight ``w``, ``w_grad``, its states
    (:meth:`Optimizer.state_names`); outputs per weight ``w_new`` then ``<state>_new``.
    """
    if not isinstance(optimizer, Optimizer):
        raise UnsupportedOptionError(
            f"optimizer must be a lossgraph.optim optimizer (SGD, Momentum, Adam, AdamW), "
            f"not {optimizer!r}."
        )
    _check_opset(opset)
    dtype = weights_dtype(weights, "update_graph")
    elem_type = helper.np_dtype_to_tensor_dtype(dtype)
    names = NameAuthority()
    inputs = [
        helper.make_tensor_value_info(names.claim("learning_rate", "input name"), elem_type, []),
        helper.make_tensor_value_info(names.claim("step", "input name"), TensorProto.INT64, []),
    ]
    plan: list[tuple[str, str, list[str], list[str], tuple[int, ...]]] = []
    for weight, value in weights.items():
        shape = np.shape(value)
        states = optimizer.state_names(weight)
        for name in (weight, f"{weight}_grad", *states):
            names.claim(name, "weight, gradient or state name")
            inputs.append(helper.make_tensor_value_info(name, elem_type, shape))
        plan.append((weight, f"{weight}_grad", states, [], shape))
    for weight, _, states, out_names, _ in plan:
        for name in (weight, *states):
            out_names.append(names.claim(f"{name}_new", "output name"))

    b = GraphBuilder(names, opset)
    outputs: list[tuple[str, str, onnx.ValueInfoProto]] = []
    for weight, grad, states, out_names, shape in plan:
        new_weight, new_states = optimizer.emit_update(
            b, weight, grad, states, "learning_rate", "step", dtype
        )
        for value, out_name in zip([new_weight, *new_states], out_names):
            info = helper.make_tensor_value_info(out_name, elem_type, shape)
            outputs.append((value, out_name, info))
    return standalone_model(b, f"{type(optimizer).__name__}_update", inputs, outputs, opset)
