"""penalty_graph: L1, L2 and elastic penalties on chosen weights, and their gradients.

For each penalized weight ``W`` with coefficients ``a`` (L1) and ``b`` (L2):

    penalty(W)      = a sum|W| + b sum W^2
    penalty_grad(W) = a sign(W) + 2 b W          (sign(0) = 0, the subgradient torch uses)

The standalone graph takes the penalized weights (in the penalty's order) and
returns ``penalty``, the sum over all of them (a scalar of the weights' float type),
then ``<W>_penalty_grad`` for each. The value belongs in the reported loss; the
gradient is added to the loss gradient before the update, so the learning rate
scales it like any gradient. :func:`emit_penalty` emits one weight's terms into a
builder, for passes that fuse the penalty into a bigger graph.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import onnx
from onnx import helper

from ..builder import GraphBuilder
from ..errors import UnknownNameError, UnsupportedOptionError, suggest
from ..names import NameAuthority
from .loss import parse_penalty
from .update import standalone_model, weights_dtype

__all__ = ["penalty_graph", "emit_penalty"]


def emit_penalty(
    b: GraphBuilder, weight: str, coefficients: Mapping[str, float], dtype: Any
) -> tuple[str, str]:
    """Emit ``(a sum|W| + b sum W^2, a sign(W) + 2 b W)`` for ``weight`` into ``b``.

    ``coefficients`` is ``{"l1": a, "l2": b}`` (a missing key means 0). Zero terms are
    left out; with both zero the value is a constant 0 and the gradient ``0 * W``.
    """
    l1 = float(coefficients.get("l1", 0.0))
    l2 = float(coefficients.get("l2", 0.0))
    values: list[str] = []
    grads: list[str] = []
    if l1:
        a = b.const(l1, dtype, "l1")
        values.append(b.Mul(b.reduce("ReduceL1", weight, keepdims=0), a))
        grads.append(b.Mul(b.Sign(weight), a))
    if l2:
        values.append(b.Mul(b.reduce("ReduceSumSquare", weight, keepdims=0),
                            b.const(l2, dtype, "l2")))
        grads.append(b.Mul(weight, b.const(2.0 * l2, dtype, "two_l2")))
    if not values:
        return b.const(0.0, dtype, "zero"), b.Mul(weight, b.const(0.0, dtype, "zero"))
    value = values[0] if len(values) == 1 else b.Add(*values)
    grad = grads[0] if len(grads) == 1 else b.Add(*grads)
    return value, grad


def penalty_graph(weights: Mapping[str, np.ndarray], penalty: Any) -> onnx.ModelProto:
    """The standalone penalty graph for ``penalty`` (add_loss_output's dict form).

    ``weights`` maps every trainable weight's name to its value (giving dtype and
    shape); the penalty's names must be among them.
    """
    coefficients = parse_penalty(penalty)
    if not coefficients:
        raise UnsupportedOptionError(
            "penalty_graph needs at least one penalized weight, e.g. "
            "{'coef': {'l1': 0.01, 'l2': 0.1}}; the penalty given is empty."
        )
    for name in coefficients:
        if name not in weights:
            raise UnknownNameError(
                f"The penalty names {name!r}, which is not a weight."
                + suggest(name, list(weights), "weights")
            )
    penalized = {name: np.asarray(weights[name]) for name in coefficients}
    dtype = weights_dtype(penalized, "penalty_graph")
    elem_type = helper.np_dtype_to_tensor_dtype(dtype)
    names = NameAuthority()
    inputs = [
        helper.make_tensor_value_info(names.claim(name, "weight name"), elem_type, value.shape)
        for name, value in penalized.items()
    ]
    total_name = names.claim("penalty", "output name")
    grad_names = {name: names.claim(f"{name}_penalty_grad", "output name") for name in penalized}

    b = GraphBuilder(names, opset=18)
    total: str | None = None
    outputs: list[tuple[str, str, onnx.ValueInfoProto]] = []
    for name, value in penalized.items():
        term, grad = emit_penalty(b, name, coefficients[name], dtype)
        total = term if total is None else b.Add(total, term)
        info = helper.make_tensor_value_info(grad_names[name], elem_type, value.shape)
        outputs.append((grad, grad_names[name], info))
    assert total is not None
    outputs.insert(0, (total, total_name, helper.make_tensor_value_info(total_name, elem_type, [])))
    return standalone_model(b, "penalty", inputs, outputs, 18)
