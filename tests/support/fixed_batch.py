"""Models exported with a fixed batch, written in ONNX text syntax at any batch size, and
the exported model run the way it runs: in runs of its own batch
(tests/passes/test_fixed_batch.py, tests/test_fixed_batch.py).

Freed by :class:`~lossgraph.passes.GeneralizeBatch`: :func:`hidden_width_two` (a view's
hidden width equal to the batch of 2), :func:`flatten_to_linear`, :func:`unflatten`,
:func:`expanded`, :func:`concat_token`, :func:`constant_mask`. Kept, each for a reason of
its own: :func:`per_row_constant`, :func:`batch_merged`, :func:`split_batch`,
:func:`unsqueezed_one`. :func:`by_runs` is what the exported model computes on any number
of rows.
"""

from __future__ import annotations

import numpy as np
import onnx

from lossgraph.runtime.session import create_session

from .models import parse_model

HEADER = '<ir_version: 8, opset_import: ["" : 18]>'


def parse(text: str) -> onnx.ModelProto:
    """The model of graph ``text`` (ONNX text syntax) at ai.onnx opset 18."""
    return parse_model(HEADER + text)


def weights(shape: tuple[int, ...], seed: int) -> str:
    """``shape`` values of a fixed random draw, as ONNX text."""
    values = np.random.default_rng(seed).standard_normal(int(np.prod(shape)))
    return ", ".join(f"{v:.4f}" for v in values)


def hidden_width_two(batch: int = 2) -> onnx.ModelProto:
    """``x @ w`` of 4 columns viewed as (batch, 2, 2), summed over its middle axis: the
    exporter wrote the view's target as ``[batch, 2, 2]``, so at a batch of 2 the hidden
    width 2 equals the batch."""
    return parse(f"""
        g (float[{batch}, 3] x) => (float[{batch}, 2] y)
          <float[3, 4] w = {{{weights((3, 4), 0)}}}, int64[3] view = {{{batch}, 2, 2}},
           int64[1] middle = {{1}}> {{
            h = MatMul(x, w)
            r = Reshape(h, view)
            y = ReduceSum <keepdims: int = 0> (r, middle)
        }}""")


def flatten_to_linear(batch: int, allowzero: int = 1) -> onnx.ModelProto:
    """A (batch, 2, 3) input flattened by ``Reshape(x, [batch, 6])`` (dynamo writes
    ``allowzero=1``) into a linear layer of 3 outputs."""
    return parse(f"""
        g (float[{batch}, 2, 3] x) => (float[{batch}, 3] y)
          <float[6, 3] w = {{{weights((6, 3), 1)}}}, float[3] b = {{0.1, -0.2, 0.3}},
           int64[2] flat = {{{batch}, 6}}> {{
            h = Reshape <allowzero: int = {allowzero}> (x, flat)
            m = MatMul(h, w)
            y = Add(m, b)
        }}""")


def unflatten(batch: int = 2) -> onnx.ModelProto:
    """(batch, 12) viewed as (batch, 4, 3) (``allowzero=1``, as dynamo writes it), summed
    over its middle axis."""
    return parse(f"""
        g (float[{batch}, 12] x) => (float[{batch}, 3] y)
          <int64[3] view = {{{batch}, 4, 3}}, int64[1] middle = {{1}}> {{
            r = Reshape <allowzero: int = 1> (x, view)
            y = ReduceSum <keepdims: int = 0> (r, middle)
        }}""")


def batch_merged(batch: int = 2) -> onnx.ModelProto:
    """The batch merged with an axis: (batch, 4, 3) -> (batch * 4, 3), a product, then
    back to (batch, 4 * 2): the second Reshape splits ``4 * batch`` rows into two axes,
    and which one holds the batch is not known from shapes (the first holds it here)."""
    return parse(f"""
        g (float[{batch}, 4, 3] x) => (float[{batch}, 8] y)
          <float[3, 2] w = {{{weights((3, 2), 2)}}}, int64[2] rows = {{{4 * batch}, 3}},
           int64[2] back = {{{batch}, 8}}> {{
            r = Reshape(x, rows)
            m = MatMul(r, w)
            y = Reshape(m, back)
        }}""")


def expanded(batch: int = 2) -> onnx.ModelProto:
    """``Expand(x[batch, 1, 3], [batch, 4, 3])``: the batch axis expanded to itself."""
    return parse(f"""
        g (float[{batch}, 1, 3] x) => (float[{batch}, 4] y)
          <float[3] w = {{0.5, -1.0, 2.0}}, int64[3] shape = {{{batch}, 4, 3}},
           int64[1] last = {{2}}> {{
            e = Expand(x, shape)
            m = Mul(e, w)
            y = ReduceSum <keepdims: int = 0> (m, last)
        }}""")


def per_row_constant(batch: int = 2) -> onnx.ModelProto:
    """The input times a constant with a row of its own for each row of the exported
    batch: it has no value for other rows, so the batch stays."""
    return parse(f"""
        g (float[{batch}, 3] x) => (float[{batch}, 3] y)
          <float[{batch}, 3] c = {{{weights((batch, 3), 4)}}}> {{
            y = Mul(x, c)
        }}""")


def concat_token(batch: int = 2) -> onnx.ModelProto:
    """A learned token prepended to each row's sequence: the exporter folded
    ``token.expand(batch, -1, -1)`` into a constant of the batch's rows, all equal."""
    token = ", ".join(["0.5, -1.0, 2.0"] * batch)
    return parse(f"""
        g (float[{batch}, 4, 3] x) => (float[{batch}, 3] y)
          <float[{batch}, 1, 3] token = {{{token}}}, int64[1] middle = {{1}}> {{
            s = Concat <axis: int = 1> (token, x)
            y = ReduceMean <keepdims: int = 0> (s, middle)
        }}""")


def constant_mask(batch: int = 2) -> onnx.ModelProto:
    """A mask made from nothing, ``ConstantOfShape([batch, 3])``, times the input: it
    meets the input's batch axis in the Mul, and its rows are all equal."""
    return parse(f"""
        g (float[{batch}, 3] x) => (float[{batch}, 3] y)
          <int64[2] shape = {{{batch}, 3}}, float[3] w = {{1.0, 2.0, 3.0}}> {{
            ones = ConstantOfShape <value: tensor = float[1] {{1.0}}> (shape)
            m = Mul(x, ones)
            y = Mul(m, w)
        }}""")


def split_batch() -> onnx.ModelProto:
    """(4, 3) rows of a batch of 4 reshaped to (2, 2, 3) and summed over the middle axis:
    which of the two axes of 2 is the batch is not known (at 4 rows it mixes rows)."""
    return parse(f"""
        g (float[4, 3] x) => (float[4, 3] y)
          <float[3, 3] w = {{{weights((3, 3), 3)}}}, int64[3] split = {{2, 2, 3}},
           int64[2] back = {{4, 3}}> {{
            m = MatMul(x, w)
            r = Reshape(m, split)
            y = Reshape(r, back)
        }}""")


def unsqueezed_one() -> onnx.ModelProto:
    """A batch of 1 reshaped to ``[1, 1, 6]``: either 1 may be the batch."""
    return parse("""
        g (float[1, 6] x) => (float[1, 1, 6] y) <int64[3] shape = {1, 1, 6}> {
            y = Reshape(x, shape)
        }""")


def run(model: onnx.ModelProto, X: np.ndarray) -> np.ndarray:
    """``model``'s first output on ``X``, its one input."""
    session = create_session(model)
    return session.run(None, {session.get_inputs()[0].name: X})[0]


def by_runs(model: onnx.ModelProto, X: np.ndarray, batch: int) -> np.ndarray:
    """The exported model on ``X`` in runs of its own ``batch`` rows."""
    return np.concatenate([run(model, X[i:i + batch]) for i in range(0, len(X), batch)])
