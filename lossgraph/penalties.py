"""L1, L2 and elastic penalties on weights: the formula, in one place.

For a weight ``W`` with coefficients ``a`` (L1) and ``b`` (L2)::

    penalty(W)      = a sum|W| + b sum W^2
    penalty_grad(W) = a sign(W) + 2 b W          (sign(0) = 0, the subgradient torch uses)

``add_loss_output`` adds the terms to the loss (autodiff then derives their gradient);
the standalone penalty graph of ``fuse="separate"`` emits both the terms and the
gradient. Penalties are given as ``{weight: b}`` (L2) or ``{weight: {"l1": a, "l2": b}}``,
or to ``compile_program`` as a :class:`Penalty` on every trained weight but those it
excludes (biases and normalization weights with ``"auto"``).
"""

from __future__ import annotations

import reprlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
from onnx import helper

from .builder import GraphBuilder, standalone_model
from .errors import UnknownNameError, UnsupportedOptionError, suggest
from .graphs import weights_dtype
from .names import NameAuthority
from .options import non_negative, weight_patterns

__all__ = ["Penalty", "parse_penalty", "penalty_terms", "penalty_gradient", "penalty_graph",
           "build_penalty", "BuiltPenalty"]

_REDUCTIONS = (("l1", "ReduceL1"), ("l2", "ReduceSumSquare"))


@dataclass(frozen=True)
class Penalty:
    """``l1 sum|W| + l2 sum W^2`` on every trained weight ``W`` but those
    ``exclude_from_weight_decay`` selects: names or regular expressions
    (:func:`lossgraph.options.matching_weights`), or ``"auto"``, every bias and normalization
    scale and shift (:func:`lossgraph.analysis.no_decay_weights`), as ``AdamW`` takes them.
    :func:`~lossgraph.compile_program` resolves it, once it knows the trained weights, into
    the per-weight dict (:meth:`by_weight`)."""

    l1: float = 0.0
    l2: float = 0.0
    exclude_from_weight_decay: str | tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for kind in ("l1", "l2"):
            object.__setattr__(self, kind, non_negative(f"Penalty: {kind}", getattr(self, kind)))
        object.__setattr__(self, "exclude_from_weight_decay", weight_patterns(
            "Penalty: exclude_from_weight_decay", self.exclude_from_weight_decay))

    def by_weight(self, weights: Sequence[str], excluded: Sequence[str]
                  ) -> dict[str, dict[str, float]]:
        """The dict form on ``weights`` but ``excluded``."""
        return {w: {"l1": self.l1, "l2": self.l2} for w in weights if w not in excluded}


def parse_penalty(penalty: Mapping[str, Any] | None) -> dict[str, dict[str, float]]:
    """Normalize ``{name: b}`` / ``{name: {"l1": a, "l2": b}}`` to ``{name: {"l1": a, "l2": b}}``.

    Coefficients must be finite and non-negative; unknown keys are errors.
    """
    if isinstance(penalty, Penalty):
        raise UnsupportedOptionError(
            f"{penalty!r} applies to every trained weight, which compile_program knows: pass it "
            "there, or give the penalty here by weight: {'coef': {'l1': 0.01, 'l2': 0.1}}.")
    if penalty is not None and not isinstance(penalty, Mapping):
        raise UnsupportedOptionError(
            f"penalty={reprlib.repr(penalty)} must be a dict by weight name: {{'coef': 0.1}} "
            "(L2) or {'coef': {'l1': 0.01, 'l2': 0.1}}; or, for compile_program, a Penalty "
            "(l2=0.1) on every trained weight.")
    normalized: dict[str, dict[str, float]] = {}
    for name, spec in (penalty or {}).items():
        if not isinstance(name, str):
            raise UnsupportedOptionError(
                f"Penalty keys are weight names; {name!r} is a {type(name).__name__}.")
        if isinstance(spec, Mapping):
            unknown = sorted(set(spec) - {"l1", "l2"})
            if unknown:
                raise UnsupportedOptionError(
                    f"Penalty on {name!r} has unknown key {unknown[0]!r}; use 'l1' and/or 'l2', "
                    f"e.g. {{{name!r}: {{'l1': 0.01, 'l2': 0.1}}}}."
                )
            coefficients = {"l1": spec.get("l1", 0.0), "l2": spec.get("l2", 0.0)}
        else:
            coefficients = {"l1": 0.0, "l2": spec}
        for kind, value in coefficients.items():
            coefficients[kind] = non_negative(f"Penalty coefficient {kind}", value,
                                              f" on {name!r}")
        normalized[name] = coefficients
    return normalized


def penalty_terms(b: GraphBuilder, weight: str, coefficients: Mapping[str, float], dtype: Any,
                  hint: str) -> list[str]:
    """``[a sum|W|, b sum W^2]`` for ``weight``, without the zero terms."""
    terms = []
    for kind, reduce_op in _REDUCTIONS:
        if coefficients.get(kind, 0.0) > 0:
            if reduce_op == "ReduceL1" and b.opset < 18 and _is_double(dtype):
                # onnxruntime 1.19 has no double ReduceL1 kernel before opset 18 (measured)
                norm = b.reduce("ReduceSum", b.Abs(weight), keepdims=0, hint=f"{hint}_{kind}")
            else:
                norm = b.reduce(reduce_op, weight, keepdims=0, hint=f"{hint}_{kind}")
            coefficient = b.const(coefficients[kind], dtype, f"{hint}_{kind}_coef")
            terms.append(b.Mul(norm, coefficient, hint=f"{hint}_{kind}_penalty"))
    return terms


def _is_double(dtype: Any) -> bool:
    """Whether ``dtype`` (a numpy dtype or an ONNX element type) is float64."""
    if isinstance(dtype, int):
        return dtype == onnx.TensorProto.DOUBLE
    return np.dtype(dtype) == np.float64


def penalty_gradient(b: GraphBuilder, weight: str, coefficients: Mapping[str, float],
                     dtype: Any) -> str:
    """``a sign(W) + 2 b W``; ``0 W`` when both coefficients are zero."""
    l1, l2 = float(coefficients.get("l1", 0.0)), float(coefficients.get("l2", 0.0))
    grads = []
    if l1:
        grads.append(b.Mul(b.Sign(weight), b.const(l1, dtype, "l1")))
    if l2:
        grads.append(b.Mul(weight, b.const(2.0 * l2, dtype, "two_l2")))
    if not grads:
        return b.Mul(weight, b.const(0.0, dtype, "zero"))
    return grads[0] if len(grads) == 1 else b.Add(*grads)


@dataclass(frozen=True)
class BuiltPenalty:
    """A penalty graph (:func:`penalty_graph`) and the names of its outputs."""

    model: onnx.ModelProto
    penalty: str  # the penalty, summed over the weights
    gradients: dict[str, str]  # weight -> its penalty's gradient

    @property
    def roles(self) -> dict[str, str]:
        """The role of each input and output, as the manifest names them."""
        return {**{w: "weight" for w in self.gradients}, self.penalty: "penalty",
                **{g: "penalty_gradient" for g in self.gradients.values()}}


def penalty_graph(weights: Mapping[str, np.ndarray], penalty: Any) -> onnx.ModelProto:
    """The standalone penalty graph for ``penalty`` (add_loss_output's dict form).

    ``weights`` maps every trainable weight's name to its value (giving dtype and
    shape); the penalty's names must be among them. Inputs: the penalized weights in
    the penalty's order; outputs: ``penalty`` (their sum, a scalar of the weights'
    float type), then ``<W>_penalty_grad`` for each (each with a suffix where a weight
    has that name).
    """
    return build_penalty(weights, penalty).model


def build_penalty(weights: Mapping[str, np.ndarray], penalty: Any) -> BuiltPenalty:
    """:func:`penalty_graph` with the names it chose."""
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
    names = NameAuthority(weights)
    inputs = [helper.make_tensor_value_info(name, elem_type, value.shape)
              for name, value in penalized.items()]
    total_name = names.fresh("penalty")
    grad_names = {name: names.fresh(f"{name}_penalty_grad") for name in penalized}

    b = GraphBuilder(names, opset=18)
    total: str | None = None
    outputs: list[tuple[str, str, onnx.ValueInfoProto]] = []
    for name, value in penalized.items():
        terms = penalty_terms(b, name, coefficients[name], dtype, hint=name)
        term = (b.Add(*terms) if len(terms) > 1 else terms[0]) if terms else b.const(
            0.0, dtype, "zero")
        total = term if total is None else b.Add(total, term)
        grad = penalty_gradient(b, name, coefficients[name], dtype)
        info = helper.make_tensor_value_info(grad_names[name], elem_type, value.shape)
        outputs.append((grad, grad_names[name], info))
    assert total is not None
    outputs.insert(0, (total, total_name, helper.make_tensor_value_info(total_name, elem_type, [])))
    model = standalone_model(b, "penalty", inputs, outputs, 18)
    return BuiltPenalty(model, total_name, grad_names)
