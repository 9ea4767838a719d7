"""Recurrent layers: LSTM, GRU and RNN, in every direction and layout.

Each direction runs its recurrence time-major and forward in its own time ("canonical":
layout 1 is transposed, a reverse direction reads its sequences reversed by
ReverseSequence), with ``a = x_t W^T + h_{t-1} R^T + Wb + Rb`` split into gate blocks:

    RNN    h_t = f(a)
    GRU    z = f(a_z), r = f(a_r), n = g(x_t Wh^T + (r h_{t-1}) Rh^T + Rbh + Wbh)
           (linear_before_reset: n = g(x_t Wh^T + r (h_{t-1} Rh^T + Rbh) + Wbh)),
           h_t = (1 - z) n + z h_{t-1}
    LSTM   i = f(a_i + Pi c_{t-1}), f = f(a_f + Pf c_{t-1}) (input_forget: f = 1 - i),
           c_t = f c_{t-1} + i g(a_c), o = f(a_o + Po c_t), h_t = o h(c_t)

with every gate's pre-activation clipped to [-clip, clip] when ``clip`` is set. A step
past a sequence's length keeps the state and writes zeros to Y; a sequence of length 0 has
Y_h = Y_c = 0 (as onnxruntime; its RNN did otherwise before 1.20). The gradient of each
direction:

    1. a Scan forward in time recomputes the states h_t (and c_t);
    2. the gates and their slopes follow for all steps at once from h_{t-1} (and c_{t-1});
    3. a Scan backward in time carries dh (and dc), seeded with dY_h (and dY_c), adds dY_t,
       and emits da_t, the gradient of the gates' pre-activations; the carries left after
       the first step are d initial_h and d initial_c;
    4. dX = da W,  dW = sum_t da_t^T x_t,  dR = sum_t da_t^T h_{t-1} (GRU's n block:
       (r h_{t-1}), or with linear_before_reset d(h_{t-1} Rh^T) = r dn),
       dB = sums of da,  dP = sums of da_i c_{t-1}, da_o c_t, da_f c_{t-1}.

Activations: Relu, Tanh, Sigmoid, Affine, LeakyRelu, ThresholdedRelu, ScaledTanh,
HardSigmoid, Elu, Softsign, Softplus; ``activation_alpha`` and ``activation_beta`` are
consumed in order by the activations that take them. Affine, ThresholdedRelu and
ScaledTanh need them given: their defaults differ between the ONNX operators and
onnxruntime.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
from onnx import helper

from ...builder import GraphBuilder
from ...errors import UnsupportedModelError
from ..registry import grad_rule

_INT64 = onnx.TensorProto.INT64
_BEFORE_START = int(np.iinfo(np.int64).min)

#: activation -> (takes alpha, takes beta)
_ACTIVATIONS = {
    "relu": (False, False), "tanh": (False, False), "sigmoid": (False, False),
    "affine": (True, True), "leakyrelu": (True, False), "thresholdedrelu": (True, False),
    "scaledtanh": (True, True), "hardsigmoid": (True, True), "elu": (True, False),
    "softsign": (False, False), "softplus": (False, False),
}
#: the alpha and beta defaults the ONNX operators and onnxruntime agree on
_AGREED_DEFAULTS = {"leakyrelu": (0.01, 0.0), "hardsigmoid": (0.2, 0.5), "elu": (1.0, 0.0)}


# ------------------------------------------------------------------ activations
@dataclass(frozen=True)
class _Activation:
    """One activation function of the spec's list, with its alpha and beta."""

    name: str
    alpha: float = 0.0
    beta: float = 0.0

    def __call__(self, b: GraphBuilder, z: str, like: _Type) -> str:
        c = like.const
        if self.name in ("sigmoid", "tanh", "relu"):
            return b.op(self.name.capitalize(), z)
        if self.name == "affine":
            return b.Add(b.Mul(z, c(b, self.alpha)), c(b, self.beta))
        if self.name == "leakyrelu":
            return b.Add(b.Relu(z), b.Mul(b.Min(z, c(b, 0.0)), c(b, self.alpha)))
        if self.name == "thresholdedrelu":
            return b.Mul(z, like.cast(b, b.Greater(z, c(b, self.alpha))))
        if self.name == "scaledtanh":
            return b.Mul(b.Tanh(b.Mul(z, c(b, self.beta))), c(b, self.alpha))
        if self.name == "hardsigmoid":
            affine = b.Add(b.Mul(z, c(b, self.alpha)), c(b, self.beta))
            return b.Max(b.Min(affine, c(b, 1.0)), c(b, 0.0))
        if self.name == "elu":
            negative = b.Sub(b.Exp(b.Min(z, c(b, 0.0))), c(b, 1.0))
            return b.Add(b.Relu(z), b.Mul(negative, c(b, self.alpha)))
        if self.name == "softsign":
            return b.Div(z, b.Add(b.Abs(z), c(b, 1.0)))
        # softplus, stably: max(z, 0) + log(1 + e^-|z|)
        return b.Add(b.Relu(z), b.Log(b.Add(b.Exp(b.Neg(b.Abs(z))), c(b, 1.0))))

    def slope(self, b: GraphBuilder, z: str, y: str, like: _Type) -> str:
        """f'(z), shaped like z, from z and y = f(z)."""
        c = like.const
        one = c(b, 1.0)
        if self.name == "sigmoid":
            return b.Mul(y, b.Sub(one, y))
        if self.name == "tanh":
            return b.Sub(one, b.Mul(y, y))
        if self.name == "relu":
            return like.cast(b, b.Greater(z, c(b, 0.0)))
        if self.name == "affine":
            return b.Expand(c(b, self.alpha), b.Shape(z))
        if self.name == "leakyrelu":
            positive = like.cast(b, b.GreaterOrEqual(z, c(b, 0.0)))
            return b.Add(b.Mul(positive, c(b, 1.0 - self.alpha)), c(b, self.alpha))
        if self.name == "thresholdedrelu":
            return like.cast(b, b.Greater(z, c(b, self.alpha)))
        if self.name == "scaledtanh":
            t = b.Tanh(b.Mul(z, c(b, self.beta)))
            return b.Mul(b.Sub(one, b.Mul(t, t)), c(b, self.alpha * self.beta))
        if self.name == "hardsigmoid":
            u = b.Add(b.Mul(z, c(b, self.alpha)), c(b, self.beta))
            inside = b.And(b.Greater(u, c(b, 0.0)), b.Less(u, one))
            return b.Mul(like.cast(b, inside), c(b, self.alpha))
        if self.name == "elu":  # 1 for z >= 0, else alpha e^z = y + alpha
            positive = like.cast(b, b.GreaterOrEqual(z, c(b, 0.0)))
            negative = b.Mul(b.Sub(one, positive), b.Add(y, c(b, self.alpha)))
            return b.Add(positive, negative)
        if self.name == "softsign":
            d = b.Add(b.Abs(z), one)
            return b.Reciprocal(b.Mul(d, d))
        return b.Sigmoid(z)  # softplus


def _activations(node, count: int, directions: int) -> list[list[_Activation]]:
    """The ``count`` activations of each direction, alpha and beta consumed in order."""
    op = node.op_type
    names = [n.decode() if isinstance(n, bytes) else n for n in node.attr("activations", [])]
    names = names or list(_CELLS[op].defaults) * directions
    if len(names) != count * directions:
        raise UnsupportedModelError(
            f"{op} node {node.name!r} lists {len(names)} activations; a {op} with "
            f"{directions} direction(s) takes {count * directions} ({count} per direction).")
    alphas, betas = list(node.attr("activation_alpha", [])), list(node.attr("activation_beta", []))
    result = []
    for name in names:
        key = name.lower()
        if key not in _ACTIVATIONS:
            raise UnsupportedModelError(
                f"{op} node {node.name!r} uses the activation {name!r}, which is not one of "
                "the spec's: Relu, Tanh, Sigmoid, Affine, LeakyRelu, ThresholdedRelu, "
                "ScaledTanh, HardSigmoid, Elu, Softsign, Softplus.")
        takes = _ACTIVATIONS[key]
        params = []
        for taken, given, default in zip(takes, (alphas, betas), _AGREED_DEFAULTS.get(key, (0, 0))):
            if not taken:
                params.append(0.0)
            elif given:
                params.append(float(given.pop(0)))
            elif key in _AGREED_DEFAULTS:
                params.append(default)
            else:
                raise UnsupportedModelError(
                    f"{op} node {node.name!r} uses {name} without its alpha/beta in "
                    "activation_alpha/activation_beta: the ONNX operators and onnxruntime "
                    "default them differently. Give them explicitly.")
        result.append(_Activation(key, *params))
    if op == "RNN":
        _check_rnn_parameters(node, names, directions)
    return [result[d * count:(d + 1) * count] for d in range(directions)]


def _check_rnn_parameters(node, names: list[str], directions: int) -> None:
    """onnxruntime's RNN reads alpha and beta by direction (default 0), the spec in the order
    of the activations that take them (their operators' defaults): both readings agree
    when every direction's activation takes the parameter and it is given for each."""
    for position, attribute in enumerate(("activation_alpha", "activation_beta")):
        takes = [_ACTIVATIONS[n.lower()][position] for n in names]
        if any(takes) and not (all(takes) and len(node.attr(attribute, [])) >= directions):
            raise UnsupportedModelError(
                f"RNN node {node.name!r} uses activations {names} with {attribute} "
                f"{list(node.attr(attribute, []))}: onnxruntime reads it by direction "
                "(default 0), the ONNX spec in the order of the activations that take it "
                "(their operators' defaults), and the two differ here. Give every direction "
                f"an activation that takes it, and {attribute} one value per direction.")


# -------------------------------------------------------------------- helpers
@dataclass(frozen=True)
class _Type:
    """The float type of the layer, for constants and casts in any builder."""

    elem: int

    def const(self, b: GraphBuilder, value: float | list) -> str:
        return b.const(value, self.elem, "rnn_const")

    def cast(self, b: GraphBuilder, condition: str) -> str:
        return b.Cast(condition, to=self.elem)

    def info(self, name: str) -> onnx.ValueInfoProto:
        """A value of this type, its shape left to inference: the carries and slices of the
        Scans, (batch, features) each."""
        return helper.make_tensor_value_info(name, self.elem, None)


class _Body(GraphBuilder):
    """The nodes of a Scan body; its constants live in the outer graph, which it reads."""

    def __init__(self, outer: GraphBuilder) -> None:
        super().__init__(outer.names, outer.opset, prefix=outer.prefix)
        self._outer = outer

    def const(self, value, dtype, hint: str = "const") -> str:
        return self._outer.const(value, dtype, hint)


_Step = Callable[[GraphBuilder, list[str], list[str]], tuple[list[str], list[str]]]


def _scan(g, step: _Step, states: Sequence[str], scanned: Sequence[str], like: _Type,
          hint: str, backward: bool = False) -> tuple[list[str], list[str]]:
    """``Scan`` of ``step(b, carries, slices) -> (new carries, per-step outputs)`` over the
    leading axis of ``scanned`` (last step first when ``backward``, outputs in time order);
    the final carries and the stacked outputs."""
    b = _Body(g)
    carries = [g.names.fresh(f"{hint}_carry") for _ in states]
    slices = [g.names.fresh(f"{hint}_slice") for _ in scanned]
    new_carries, outs = step(b, carries, slices)
    produced = {o for n in b.nodes for o in n.output}
    results: list[str] = []
    for name in [*new_carries, *outs]:  # body outputs: distinct values of the body
        results.append(name if name in produced and name not in results else b.Identity(name))
    body = helper.make_graph(b.nodes, g.names.fresh(f"{hint}_body"),
                             [like.info(n) for n in carries + slices],
                             [like.info(n) for n in results])
    k = len(scanned)
    values = g.op("Scan", *states, *scanned, outputs=len(results), hint=hint, body=body,
                  num_scan_inputs=k, scan_input_directions=[1] * k if backward else None,
                  scan_output_directions=[1] * len(outs) if backward and outs else None)
    values = [values] if isinstance(values, str) else list(values)
    return values[:len(states)], values[len(states):]


def _block(b: GraphBuilder, x: str, index: int, size: int, count: int = 1) -> str:
    """Gate blocks ``index .. index + count`` (of ``size`` each) on the last axis of ``x``."""
    return b.Slice(x, b.ints([index * size], "starts"), b.ints([(index + count) * size], "ends"),
                   b.ints([-1], "axes"))


def _linear(b: GraphBuilder, h: str, r: str, bias: str | None) -> str:
    """h R^T + bias, for h of rank 2. (Gemm transposes for free; onnxruntime would fuse
    Transpose + MatMul into com.microsoft.FusedMatMul, which has no double kernel.)"""
    return b.Gemm(h, r, bias, transB=1)


def _column_sum(g, rows: str) -> str:
    return g.reduce("ReduceSum", rows, [0], keepdims=0)


@dataclass
class _Weights:
    """One direction's weights, shaped for the recurrence."""

    W: str  # (G H, I)
    R: str  # (G H, H)
    wb: str | None  # (G H,)
    rb: str | None  # (G H,)
    p: list[str] = field(default_factory=list)  # Pi, Po, Pf: (H,) each
    extra: dict[str, str] = field(default_factory=dict)


# ---------------------------------------------------------------------- cells
class _Cell:
    """What differs between RNN, GRU and LSTM: the step, and its adjoint."""

    defaults: tuple[str, ...] = ()  # the activations' defaults
    gates = 1

    def __init__(self, node, acts: list[_Activation], hidden: int, like: _Type) -> None:
        self.acts, self.hidden, self.like = acts, hidden, like
        self.clip = node.attr("clip")

    def prepare(self, g, w: _Weights) -> None:
        """Extra forms of the weights the cell reads."""

    def pre(self, b: GraphBuilder, xw: str, h: str, w: _Weights) -> str:
        """x_t W^T + Wb (given) + h R^T + Rb."""
        return b.Add(xw, _linear(b, h, w.R, w.rb))

    def activate(self, b: GraphBuilder, act: _Activation, a: str) -> str:
        if self.clip is not None:
            bound = self.like.const(b, self.clip)
            a = b.Clip(a, b.Neg(bound), bound)
        return act(b, a, self.like)

    def slope(self, g, act: _Activation, a: str, y: str) -> str:
        """d act(clip(a)) / da."""
        if self.clip is None:
            return act.slope(g, a, y, self.like)
        bound = self.like.const(g, self.clip)
        inside = self.like.cast(g, g.LessOrEqual(g.Abs(a), bound))
        return g.Mul(act.slope(g, g.Clip(a, g.Neg(bound), bound), y, self.like), inside)

    def step(self, b, xw: str, states: list[str], w: _Weights) -> tuple[list[str], dict]:
        """The new states from x_t W^T + Wb and the states, and the values on the way."""
        raise NotImplementedError

    def coefficients(self, g, v: dict, prev: list[str]) -> list[str]:
        """What the adjoint step reads per time step, from ``step``'s values (all steps)."""
        raise NotImplementedError

    def back(self, b, k: list[str], dh: str, dc: str | None, w: _Weights
             ) -> tuple[str, str | None, list[str]]:
        """The adjoint step: (dh_{t-1}, dc_{t-1}, per-step outputs, da_t first) from the
        gradients of the new states and the coefficients ``k``."""
        raise NotImplementedError

    def recurrent(self, g, outs: list[str], v: dict, prev: list[str]) -> list[tuple[str, str]]:
        """(gradient of a block of h R^T, the rows it multiplies) pairs: dR = their
        products, stacked."""
        return [(outs[0], prev[0])]


class _Rnn(_Cell):
    defaults = ("Tanh",)

    def step(self, b, xw, states, w):
        a = self.pre(b, xw, states[0], w)
        h = self.activate(b, self.acts[0], a)
        return [h], {"a": a, "h": h}

    def coefficients(self, g, v, prev):
        return [self.slope(g, self.acts[0], v["a"], v["h"])]

    def back(self, b, k, dh, dc, w):
        da = b.Mul(dh, k[0])
        return b.MatMul(da, w.R), None, [da]


class _Gru(_Cell):
    defaults = ("Sigmoid", "Tanh")
    gates = 3

    def __init__(self, node, acts, hidden, like) -> None:
        super().__init__(node, acts, hidden, like)
        self.linear_before_reset = bool(node.attr("linear_before_reset", 0))

    def prepare(self, g, w):
        H = self.hidden
        rows = [g.ints([0], "axes")]
        w.extra = {"R_zr": g.Slice(w.R, g.ints([0], "starts"), g.ints([2 * H], "ends"), *rows),
                   "R_h": g.Slice(w.R, g.ints([2 * H], "starts"), g.ints([3 * H], "ends"), *rows)}
        if w.rb:
            w.extra.update(rb_zr=_block(g, w.rb, 0, H, 2), rb_h=_block(g, w.rb, 2, H))

    def step(self, b, xw, states, w):
        (h,), H, e = states, self.hidden, w.extra
        a_zr = b.Add(_block(b, xw, 0, H, 2), _linear(b, h, e["R_zr"], e.get("rb_zr")))
        a_z, a_r = _block(b, a_zr, 0, H), _block(b, a_zr, 1, H)
        z, r = self.activate(b, self.acts[0], a_z), self.activate(b, self.acts[0], a_r)
        if self.linear_before_reset:
            q = _linear(b, h, e["R_h"], e.get("rb_h"))
            a_h = b.Add(_block(b, xw, 2, H), b.Mul(r, q))
        else:
            q = _linear(b, b.Mul(r, h), e["R_h"], e.get("rb_h"))
            a_h = b.Add(_block(b, xw, 2, H), q)
        n = self.activate(b, self.acts[1], a_h)
        new = b.Add(n, b.Mul(z, b.Sub(h, n)))
        return [new], {"a_z": a_z, "a_r": a_r, "a_h": a_h, "z": z, "r": r, "n": n, "q": q}

    def coefficients(self, g, v, prev):
        (h,) = prev
        one = self.like.const(g, 1.0)
        k_z = g.Mul(g.Sub(h, v["n"]), self.slope(g, self.acts[0], v["a_z"], v["z"]))
        k_h = g.Mul(g.Sub(one, v["z"]), self.slope(g, self.acts[1], v["a_h"], v["n"]))
        k_r = g.Mul(v["q"] if self.linear_before_reset else h,
                    self.slope(g, self.acts[0], v["a_r"], v["r"]))
        return [k_z, k_h, k_r, v["r"], v["z"]]

    def back(self, b, k, dh, dc, w):
        k_z, k_h, k_r, r, z = k
        e = w.extra
        dz, dn = b.Mul(dh, k_z), b.Mul(dh, k_h)
        if self.linear_before_reset:  # n's recurrent product is q = h Rh^T + Rbh
            dq = b.Mul(dn, r)
            dr = b.Mul(dn, k_r)
            d_rec = b.Concat(dz, dr, dq, axis=-1)
            dprev = b.MatMul(d_rec, w.R)
            outs = [b.Concat(dz, dr, dn, axis=-1), d_rec]
        else:  # n's recurrent product is (r h) Rh^T
            d_rh = b.MatMul(dn, e["R_h"])
            dr = b.Mul(d_rh, k_r)
            dprev = b.Add(b.Mul(d_rh, r), b.MatMul(b.Concat(dz, dr, axis=-1), e["R_zr"]))
            outs = [b.Concat(dz, dr, dn, axis=-1)]
        return b.Add(dprev, b.Mul(dh, z)), None, outs

    def recurrent(self, g, outs, v, prev):
        if self.linear_before_reset:
            return [(outs[1], prev[0])]
        H = self.hidden
        return [(_block(g, outs[0], 0, H, 2), prev[0]),
                (_block(g, outs[0], 2, H), g.Mul(v["r"], prev[0]))]


class _Lstm(_Cell):
    defaults = ("Sigmoid", "Tanh", "Tanh")
    gates = 4

    def __init__(self, node, acts, hidden, like) -> None:
        super().__init__(node, acts, hidden, like)
        self.input_forget = bool(node.attr("input_forget", 0))

    def step(self, b, xw, states, w):
        (h, c), H = states, self.hidden
        f_, g_, h_ = self.acts
        a = self.pre(b, xw, h, w)
        a_i, a_o, a_f, a_c = (_block(b, a, k, H) for k in range(4))
        if w.p:
            a_i, a_f = b.Add(a_i, b.Mul(c, w.p[0])), b.Add(a_f, b.Mul(c, w.p[2]))
        i = self.activate(b, f_, a_i)
        f = (b.Sub(self.like.const(b, 1.0), i) if self.input_forget
             else self.activate(b, f_, a_f))
        cell = self.activate(b, g_, a_c)
        c_new = b.Add(b.Mul(f, c), b.Mul(i, cell))
        if w.p:
            a_o = b.Add(a_o, b.Mul(c_new, w.p[1]))
        o = self.activate(b, f_, a_o)
        hc = h_(b, c_new, self.like)  # h() is not clipped
        return [b.Mul(o, hc), c_new], {"a_i": a_i, "a_o": a_o, "a_f": a_f, "a_c": a_c,
                                       "i": i, "f": f, "g": cell, "o": o, "hc": hc,
                                       "c": c_new}

    def coefficients(self, g, v, prev):
        f_, g_, h_ = self.acts
        c_prev = prev[1]
        k_o = g.Mul(v["hc"], self.slope(g, f_, v["a_o"], v["o"]))
        k_c = g.Mul(v["o"], h_.slope(g, v["c"], v["hc"], self.like))
        k_g = g.Mul(v["i"], self.slope(g, g_, v["a_c"], v["g"]))
        slope_i = self.slope(g, f_, v["a_i"], v["i"])
        if self.input_forget:  # c = (1 - i) c_prev + i g
            return [k_o, k_c, g.Mul(g.Sub(v["g"], c_prev), slope_i), k_g, v["f"]]
        k_f = g.Mul(c_prev, self.slope(g, f_, v["a_f"], v["f"]))
        return [k_o, k_c, g.Mul(v["g"], slope_i), k_g, v["f"], k_f]

    def back(self, b, k, dh, dc, w):
        k_o, k_c, k_i, k_g, f = k[:5]
        do = b.Mul(dh, k_o)
        dcell = b.Add(dc, b.Mul(dh, k_c))
        if w.p:
            dcell = b.Add(dcell, b.Mul(do, w.p[1]))
        di, dg = b.Mul(dcell, k_i), b.Mul(dcell, k_g)
        df = b.Mul(dcell, self.like.const(b, 0.0)) if self.input_forget else b.Mul(dcell, k[5])
        dc_prev = b.Mul(dcell, f)
        if w.p:
            dc_prev = b.Add(dc_prev, b.Add(b.Mul(di, w.p[0]), b.Mul(df, w.p[2])))
        da = b.Concat(di, do, df, dg, axis=-1)
        return b.MatMul(da, w.R), dc_prev, [da]

    def peephole_grad(self, g, da: str, v: dict, prev: list[str]) -> str:
        """dP = (sum da_i c_{t-1}, sum da_o c_t, sum da_f c_{t-1})."""
        H, c_prev = self.hidden, prev[1]
        parts = [_column_sum(g, g.Mul(_block(g, da, k, H), c))
                 for k, c in ((0, c_prev), (1, v["c"]), (2, c_prev))]
        return g.Concat(*parts, axis=0)


_CELLS: dict[str, type[_Cell]] = {"RNN": _Rnn, "GRU": _Gru, "LSTM": _Lstm}


# -------------------------------------------------------------------- the rule
@dataclass
class _Layer:
    """The node's layout-free view: time-major values, per-direction pieces."""

    g: Any  # the GradContext
    like: _Type
    x: str  # (T, B, I)
    lens: str | None  # (B,) int64
    reversal: str | None = None  # max(lens, 1): ReverseSequence of length 0 is unreliable
    mask: str | None = None  # (T, B, 1): 1 for the steps within a sequence
    keep: str | None = None  # 1 - mask
    started: str | None = None  # (B, 1): 1 for sequences of length > 0

    def rows(self, v: str) -> str:
        """(T, B, F) as (T B, F)."""
        g = self.g
        return g.Reshape(v, g.Concat(g.ints([-1], "minus_one"), g.dims(v, 2, 3), axis=0))

    def steps(self, rows: str, width: int) -> str:
        """(T B, width) as (T, B, width)."""
        g = self.g
        return g.Reshape(rows, g.Concat(g.dims(self.x, 0, 2), g.ints([width], "width"), axis=0))

    def flip(self, v: str) -> str:
        """``v`` (time-major) with each sequence reversed in time."""
        g = self.g
        if self.lens is not None:
            if self.reversal is None:  # onnxruntime leaves a sequence of length 0 unwritten
                self.reversal = g.Max(self.lens, g.const(1, np.int64, "one"))
            return g.ReverseSequence(v, self.reversal, batch_axis=1, time_axis=0)
        return g.Slice(v, g.ints([-1], "starts"), g.ints([_BEFORE_START], "ends"),
                       g.ints([0], "axes"), g.ints([-1], "steps"))


def _recurrent(g, node, dys: Sequence[str | None]):
    """The gradients of an LSTM, GRU or RNN node (module docstring)."""
    op = node.op_type
    x_in, w_in, r_in = node.inputs[:3]
    b_in, lens_in, h0_in, c0_in, p_in = (node.input(i) for i in range(3, 8))
    layout = node.attr("layout", 0)
    direction = node.attr("direction", "forward")
    if direction not in ("forward", "reverse", "bidirectional"):
        raise UnsupportedModelError(f"{op} node {node.name!r} has direction {direction!r}.")
    count = 2 if direction == "bidirectional" else 1
    hidden = node.attr("hidden_size") or _static_dim(g, r_in, -1, op)
    like = _Type(g.elem_type(x_in))
    cell_type = _CELLS[op]
    acts = _activations(node, len(cell_type.defaults), count)
    dy, dyh, dyc = (*dys, None, None)[:3]

    time_major = [1, 0, 2]
    layer = _Layer(g, like,
                   x_in if layout == 0 else g.Transpose(x_in, perm=time_major),
                   g.Cast(lens_in, to=_INT64) if lens_in else None)
    if layer.lens is not None:
        _masks(g, layer)
    wanted = set(node.wanted)
    per_direction = []
    state_axis = 0 if layout == 0 else 1
    for d in range(count):
        cell = cell_type(node, acts[d], hidden, like)
        pick = functools.partial(_pick, g, d)
        y_d = None
        if dy is not None:
            y_d = pick(dy, 1 if layout == 0 else 2)
            y_d = y_d if layout == 0 else g.Transpose(y_d, perm=time_major)
        per_direction.append(_direction(
            layer, cell, _weights(g, cell, pick, w_in, r_in, b_in, p_in, hidden),
            reverse=direction == "reverse" or d == 1,
            h0=pick(h0_in, state_axis) if h0_in else None,
            c0=pick(c0_in, state_axis) if c0_in else None,
            dy=y_d, dyh=pick(dyh, state_axis) if dyh is not None else None,
            dyc=pick(dyc, state_axis) if dyc is not None else None))

    def stacked(key: str, axis: int = 0) -> str:
        parts = [g.unsqueeze(r[key], [axis]) for r in per_direction]
        return parts[0] if count == 1 else g.Concat(*parts, axis=axis)

    def want(name: str | None) -> bool:
        return bool(name) and name in wanted

    dx = None
    if want(x_in):
        dx = g.sum_of([r["x"] for r in per_direction])
        dx = dx if layout == 0 else g.Transpose(dx, perm=time_major)
    return node.grads(
        dx,
        stacked("W") if want(w_in) else None,
        stacked("R") if want(r_in) else None,
        stacked("B") if want(b_in) else None,
        None,
        stacked("h0", state_axis) if want(h0_in) else None,
        stacked("c0", state_axis) if op == "LSTM" and want(c0_in) else None,
        stacked("P") if op == "LSTM" and want(p_in) else None,
    )


def _pick(g, d: int, v: str, axis: int) -> str:
    """Direction ``d`` of ``v``, its directions on ``axis``."""
    return g.Gather(v, g.const(d, np.int64, "direction"), axis=axis)


def _static_dim(g, name: str, axis: int, op: str) -> int:
    shape = g.shape(name)
    if shape is None or not isinstance(shape[axis], int):
        raise UnsupportedModelError(
            f"The {op} gradient needs the hidden size: give the node its hidden_size "
            f"attribute, or {name!r} a static shape.")
    return shape[axis]


def _masks(g, layer: _Layer) -> None:
    """mask[t, b] = t < lens[b], keep = 1 - mask, started[b] = lens[b] > 0."""
    like, x = layer.like, layer.x
    steps = g.Range(g.const(0, np.int64, "zero"), g.Squeeze(g.dims(x, 0, 1)),
                    g.const(1, np.int64, "one"))
    within = g.Less(g.unsqueeze(steps, [1]), layer.lens)
    layer.mask = like.cast(g, g.unsqueeze(within, [2]))
    layer.keep = g.Sub(like.const(g, 1.0), layer.mask)
    started = g.Greater(layer.lens, g.const(0, np.int64, "zero"))
    layer.started = like.cast(g, g.unsqueeze(started, [1]))


def _weights(g, cell: _Cell, pick, w_in, r_in, b_in, p_in, hidden: int) -> _Weights:
    size = cell.gates * hidden
    w, r = pick(w_in, 0), pick(r_in, 0)
    wb = rb = None
    if b_in:
        bias = pick(b_in, 0)
        wb, rb = _block(g, bias, 0, size), _block(g, bias, 1, size)
    peepholes = []
    if p_in and isinstance(cell, _Lstm):
        p = pick(p_in, 0)
        peepholes = [_block(g, p, k, hidden) for k in range(3)]
    weights = _Weights(w, r, wb, rb, peepholes)
    cell.prepare(g, weights)
    return weights


def _direction(layer: _Layer, cell: _Cell, w: _Weights, *, reverse: bool, h0, c0, dy, dyh,
               dyc) -> dict[str, str]:
    """The gradients of one direction: dX (time-major), dW, dR, dB, dh0, dc0, dP."""
    g, like, hidden = layer.g, layer.like, cell.hidden
    lstm = isinstance(cell, _Lstm)
    flip = layer.flip if reverse else (lambda v: v)
    x = flip(layer.x)
    x_rows = layer.rows(x)
    xw_rows = _linear(g, x_rows, w.W, w.wb)
    xw = layer.steps(xw_rows, cell.gates * hidden)
    state_shape = g.Concat(g.dims(layer.x, 1, 2), g.ints([hidden], "hidden"), axis=0)
    zeros = lambda: g.Expand(like.const(g, 0.0), state_shape)  # noqa: E731
    initial = [h0 or zeros(), *([c0 or zeros()] if lstm else [])]

    # 1. the states, forward in time
    masked = layer.mask is not None

    def forward(b, carries, slices):
        new, _ = cell.step(b, slices[0], carries, w)
        if masked:  # past a sequence's end the state is kept
            new = [b.Add(b.Mul(n, slices[1]), b.Mul(old, slices[2]))
                   for n, old in zip(new, carries)]
        return new, list(new)

    _, states = _scan(g, forward, initial, [xw, *([layer.mask, layer.keep] if masked else [])],
                      like, "rnn_forward")

    # 2. gates and slopes for every step at once, as rows (time x batch, features)
    before_last = [g.ints([0], "starts"), g.ints([-1], "ends"), g.ints([0], "axes")]
    prev = [layer.rows(g.Concat(g.unsqueeze(s0, [0]), g.Slice(s, *before_last), axis=0))
            for s0, s in zip(initial, states)]
    _, values = cell.step(g, xw_rows, prev, w)
    coefficients = [layer.steps(k, hidden) for k in cell.coefficients(g, values, prev)]

    # 3. the adjoint, backward in time
    seeds = [dyh, *([dyc] if lstm else [])]
    if masked:  # a sequence of length 0 has Y_h = Y_c = 0
        seeds = [g.Mul(s, layer.started) if s is not None else None for s in seeds]
    seeds = [s if s is not None else zeros() for s in seeds]
    extra = ([flip(dy)] if dy is not None else []) + ([layer.mask, layer.keep] if masked else [])
    n = len(coefficients)

    def backward(b, carries, slices):
        dh, dc = carries[0], carries[1] if lstm else None
        k, rest = slices[:n], slices[n:]
        d_out = b.Add(dh, rest.pop(0)) if dy is not None else dh
        if masked:
            mask, keep = rest
            d_out, dc_in = b.Mul(d_out, mask), b.Mul(dc, mask) if lstm else None
        else:
            dc_in = dc
        dh_prev, dc_prev, outs = cell.back(b, k, d_out, dc_in, w)
        if masked:
            dh_prev = b.Add(dh_prev, b.Mul(dh, keep))
            dc_prev = b.Add(dc_prev, b.Mul(dc, keep)) if lstm else None
        return [dh_prev, *([dc_prev] if lstm else [])], outs

    finals, outs = _scan(g, backward, seeds, [*coefficients, *extra], like, "rnn_backward",
                         backward=True)

    # 4. the gradients of the inputs: sums over time and batch of products of rows
    rows = [layer.rows(o) for o in outs]
    blocks = cell.recurrent(g, rows, values, prev)
    weight_grads = [g.Gemm(d, h, transA=1) for d, h in blocks]
    result = {
        "x": flip(g.MatMul(outs[0], w.W)),
        "W": g.Gemm(rows[0], x_rows, transA=1),
        "R": weight_grads[0] if len(blocks) == 1 else g.Concat(*weight_grads, axis=0),
        "B": g.Concat(_column_sum(g, rows[0]), *[_column_sum(g, d) for d, _ in blocks], axis=0),
        "h0": finals[0],
    }
    if lstm:
        result["c0"] = finals[1]
        if w.p:
            result["P"] = cell.peephole_grad(g, rows[0], values, prev)
    return result


@grad_rule("RNN", nondiff=(4,), notes="every direction, layout, activation and clip; "
                                      "sequence_lens and initial_h")
def rnn(g, node, *dys):
    """h_t = f(a_t), a_t = x_t W^T + h_{t-1} R^T + Wb + Rb:  da_t = f'(a_t) (dY_t + dh_t),
    dh_{t-1} = da_t R, carried back in time by a Scan (module docstring)."""
    return _recurrent(g, node, dys)


@grad_rule("GRU", nondiff=(4,), notes="every direction, layout, activation and clip; "
                                      "linear_before_reset, sequence_lens and initial_h")
def gru(g, node, *dys):
    """h_t = (1 - z) n + z h_{t-1}:  dz = dh (h_{t-1} - n) f'(a_z), dn = dh (1 - z) g'(a_n),
    dr from n's recurrent product, dh_{t-1} = dh z + (dz, dr, dn) R, carried back in time
    by a Scan (module docstring)."""
    return _recurrent(g, node, dys)


@grad_rule("LSTM", nondiff=(4,), notes="every direction, layout, activation and clip; "
                                       "peepholes, input_forget, sequence_lens, initial_h/c")
def lstm(g, node, *dys):
    """c_t = f c_{t-1} + i g(a_c), h_t = o h(c_t):  do = dh h(c_t) f'(a_o),
    dc = dc_t + dh o h'(c_t) (+ do Po), (di, df, dg) = dc (g, c_{t-1}, i) (f', f', g'),
    dc_{t-1} = dc f (+ di Pi + df Pf), dh_{t-1} = (di, do, df, dg) R, carried back in time
    by a Scan (module docstring)."""
    return _recurrent(g, node, dys)
