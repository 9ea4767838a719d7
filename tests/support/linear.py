"""The small linear model the tests share, and its data.

:data:`LINEAR` is ``y = x @ coef + intercept``: four features, weights that start away from
zero. :func:`linear_text` writes the same model with other names (scikit-learn's ``X`` and
``score``), weights, opsets or a flat ``(N,)`` output; :func:`linear_model` parses it.
:func:`linear_program` compiles it; :func:`linear_data` draws features and noisy targets of
a known linear function.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx

import lossgraph
from lossgraph.optim import Momentum

#: The weights :data:`LINEAR` starts from: not zeros, not random.
COEF = (0.1, -0.2, 0.3, 0.0)
INTERCEPT = 0.5


def _numbers(values: Sequence[float]) -> str:
    return ", ".join(repr(float(v)) if isinstance(v, np.floating) else repr(v) for v in values)


def linear_text(coef: Sequence[float] = COEF, intercept: float | None = INTERCEPT, *,
                x: str = "x", y: str = "y", hidden: str = "h", flat: bool = False,
                opset: int = 18, ir_version: int = 8, coef_name: str = "coef",
                intercept_name: str = "intercept") -> str:
    """The linear model in ONNX text syntax: ``y = x @ coef (+ intercept)``, ``y`` of shape
    ``(N, 1)`` (``(N,)`` when ``flat``); no Add when ``intercept`` is None."""
    n = len(coef)
    coef_type = f"float[{n}]" if flat else f"float[{n}, 1]"
    out_type = "float[N]" if flat else "float[N, 1]"
    weights = f"{coef_type} {coef_name} = {{{_numbers(coef)}}}"
    if intercept is None:
        weights_line, body = weights, f"        {y} = MatMul({x}, {coef_name})\n"
    else:
        weights_line = (f"{weights}, float[1] {intercept_name} = "
                        f"{{{_numbers([intercept])}}}")
        body = (f"        {hidden} = MatMul({x}, {coef_name})\n"
                f"        {y} = Add({hidden}, {intercept_name})\n")
    return (f'\n    <ir_version: {ir_version}, opset_import: ["" : {opset}]>\n'
            f"    linear (float[N, {n}] {x}) => ({out_type} {y})\n"
            f"    <{weights_line}>\n"
            f"    {{\n{body}    }}\n")


#: y = x @ coef + intercept, four features, weights with a non-zero start.
LINEAR = linear_text()


def linear_model(coef: Sequence[float] = COEF, intercept: float | None = INTERCEPT,
                 **options) -> onnx.ModelProto:
    """:func:`linear_text`'s model, parsed."""
    return onnx.parser.parse_model(linear_text(coef, intercept, **options))


def linear_program(fuse: str = "step", optimizer=None, **options) -> lossgraph.TrainingProgram:
    """:data:`LINEAR` compiled, with Nesterov momentum unless another optimizer is given."""
    return lossgraph.compile_program(onnx.parser.parse_model(LINEAR), fuse=fuse,
                                     optimizer=optimizer or Momentum(0.01, nesterov=True),
                                     **options)


def linear_data(rows: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Features and noisy targets of a known linear function, float32."""
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(rows, 4)).astype(np.float32)
    y = (X @ [1.0, -2.0, 0.5, 3.0] + 1.0 + 0.1 * rng.normal(size=rows)).astype(np.float32)
    return X, y
