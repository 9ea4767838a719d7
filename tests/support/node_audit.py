"""The ONNX project's backend node tests as a gradient test suite nobody here wrote.

    .venv/bin/python tests/support/node_audit.py         # every node test: totals, wrong, crash
    .venv/bin/python tests/support/node_audit.py -k resize   # tests whose name matches a regex
    .venv/bin/python tests/support/node_audit.py --list unsupported  # every (test, input), why

The installed onnx generates its node tests (``onnx.backend.test.case.node``): each is
a one-node model (or a function body expanded into nodes) with inputs and outputs.
For each test and each float input ``x``, lossgraph's gradient (``backend="onnx"``,
vector-Jacobian mode) of the random linear functional

    L = sum_k <R_k, y_k>        (y_k the float outputs, R_k fixed random cotangents)

is compared with finite differences of ``L`` evaluated by onnxruntime.

**Precision.** The model is retyped to float64 (every float tensor, Cast target and
constant) when onnxruntime runs it so; else to float32; else run as it is. The
opset is converted into the range lossgraph emits for (13 to the target's maximum)
with ``onnx.version_converter``, as lossgraph's own error message advises.

**Finite differences.** Per coordinate, with step ``h = s max(1, |x_i|)`` (``s`` =
2^-20 in float64, 2^-8 in float32), both one-sided quotients ``f+`` and ``f-`` are
computed. The gradient passes where it lies in ``[min(f+, f-), max(f+, f-)]`` widened
by ``tol = rtol |fd| + rtol scale + noise``: on a smooth function the interval
holds the derivative and has width ``h |f''|``; at a kink or jump (Relu at 0, Floor
at an integer, a tie of Max) every value between the one-sided slopes is a
subgradient of that 1-D slice. ``scale`` is the largest central difference of the
input (so tiny components are judged against the gradient's size), ``noise`` the
rounding of ``L`` amplified by the quotient, ``c u S / h`` with ``u`` the unit
roundoff and ``S = sum |R_k y_k|``. Coordinates where ``L`` is not finite at ``x +- h``
are not compared (a boundary of the domain, e.g. Sqrt at 0). Inputs larger than
``FULL`` elements are checked at ``FULL`` random coordinates plus ``DIRECTIONS``
random directions (a directional derivative catches an error anywhere).

**Categories.** pass, wrong (values, NaN, shape or dtype), missing rule
(``MissingGradientError``), unsupported (another named lossgraph error: the reason is
listed), not differentiable (``NoGradientError``, or no float output), crash (any
other exception, lossgraph's internal errors, or a gradient graph onnxruntime cannot
run), and skipped: the runtime cannot run the forward model, the forward is random
(two runs differ), no coordinate has a finite reference, or onnxruntime's forward
differs from the ONNX reference outputs and the gradient does not match it (a bug of
the runtime: finite differences of it measure another function).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import re
import sys
import time
import warnings
import zlib
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

import lossgraph
from lossgraph.errors import (
    InternalError,
    InvalidRuleError,
    LossgraphError,
    MissingGradientError,
    NoGradientError,
)
from lossgraph.runtime.session import create_session, quiet_session_options
from lossgraph.target import TARGETS, use_target

PASS, WRONG, MISSING, UNSUPPORTED, NOT_DIFFERENTIABLE, CRASH, SKIPPED = (
    "pass", "wrong", "missing rule", "unsupported", "not differentiable", "crash", "skipped")
CATEGORIES = (PASS, WRONG, MISSING, UNSUPPORTED, NOT_DIFFERENTIABLE, CRASH, SKIPPED)

FULL = 96  # inputs with more elements are checked at FULL random coordinates ...
DIRECTIONS = 2  # ... and along this many random directions
MIN_OPSET = 13
_FLOAT_TYPES = {TensorProto.FLOAT16, TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.BFLOAT16}
_TYPE_ATTRIBUTES = ("to", "dtype")
_STASHING = ("LayerNormalization", "GroupNormalization", "RMSNormalization")  # stash_type


@dataclass(frozen=True)
class Precision:
    """How a test runs: the element type its floats are retyped to, and its FD scheme."""

    name: str
    elem_type: int | None  # None: as the test has it
    step: float
    rtol: float
    unit: float  # roundoff of L's evaluations, relative to S


FLOAT64 = Precision("float64", TensorProto.DOUBLE, 2.0**-20, 1e-5, 1e-14)
FLOAT32 = Precision("float32", TensorProto.FLOAT, 2.0**-8, 1e-2, 2e-6)
AS_IS = Precision("as is", None, 2.0**-8, 1e-2, 2e-6)


@dataclass(frozen=True)
class Result:
    """The verdict for one float input of one node test."""

    test: str
    input: str
    category: str
    detail: str = ""
    precision: str = ""


# ------------------------------------------------------------------------- test cases
def node_tests(modules: Sequence[str] | None = None) -> list:
    """The node tests onnx generates: all of them, or those of some case modules only.

    ``modules`` name files of ``onnx/backend/test/case/node`` (``"relu"``, ``"pow"``):
    importing one runs its exporters, which is what makes the tests, and is far
    faster than generating all of them (seven seconds, mostly 3-D pooling).
    """
    from onnx.backend.test.case import node as cases

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if modules is None:
            return list(cases.collect_testcases())
        for module in modules:
            importlib.import_module(f"{cases.__name__}.{module}")
    return list(cases._NodeTestCases)


def _runtime():
    import onnxruntime

    return onnxruntime


def _target() -> str:
    """The widest lossgraph target this onnxruntime loads."""
    version = tuple(int(p) for p in _runtime().__version__.split(".")[:2])
    return "onnxruntime" if version >= (1, 20) else "default"


# ------------------------------------------------------------------------- conversions
def _with_opset(model: onnx.ModelProto, low: int, high: int) -> tuple[onnx.ModelProto, str]:
    """The model at an ai.onnx opset within [low, high], and a note saying how.

    ``onnx.version_converter`` first; failing that (it lacks adapters for many recent
    versions), the opset number is relabelled when the model still passes the full
    checker there: the ops exist at that opset with the same inputs, attributes and
    types (later versions of most ops only added element types). A model without an
    ai.onnx import (a test of another domain) gets one.
    """
    version = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None)
    if version is None:
        relabelled = onnx.ModelProto()
        relabelled.CopyFrom(model)
        relabelled.opset_import.append(onnx.helper.make_opsetid("", high))
        return relabelled, ""
    if low <= version <= high:
        return model, ""
    wanted = min(max(version, low), high)
    with contextlib.suppress(Exception):
        converted = onnx.version_converter.convert_version(model, wanted)
        onnx.checker.check_model(converted, full_check=True)
        return converted, f"opset {version} converted to {wanted}"
    relabelled = onnx.ModelProto()
    relabelled.CopyFrom(model)
    for opset in relabelled.opset_import:
        if opset.domain in ("", "ai.onnx"):
            opset.version = wanted
    with contextlib.suppress(Exception):
        onnx.checker.check_model(relabelled, full_check=True)
        return relabelled, f"opset {version} relabelled {wanted}"
    return model, ""


def _retype_type(value_type: onnx.TypeProto, to: int) -> None:
    kind = value_type.WhichOneof("value")
    if kind == "tensor_type" and value_type.tensor_type.elem_type in _FLOAT_TYPES:
        value_type.tensor_type.elem_type = to
    elif kind == "sequence_type":
        _retype_type(value_type.sequence_type.elem_type, to)
    elif kind == "optional_type":
        _retype_type(value_type.optional_type.elem_type, to)


def _retype_tensor(tensor: onnx.TensorProto, to: int) -> None:
    if tensor.data_type in _FLOAT_TYPES and tensor.data_type != to:
        array = numpy_helper.to_array(tensor).astype(onnx.helper.tensor_dtype_to_np_dtype(to))
        tensor.CopyFrom(numpy_helper.from_array(array, tensor.name))


def _retype_graph(graph: onnx.GraphProto, to: int) -> None:
    for value in (*graph.input, *graph.output, *graph.value_info):
        _retype_type(value.type, to)
    for tensor in graph.initializer:
        _retype_tensor(tensor, to)
    for node in graph.node:
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.TENSOR:
                _retype_tensor(attribute.t, to)
            elif attribute.type == onnx.AttributeProto.TENSORS:
                for tensor in attribute.tensors:
                    _retype_tensor(tensor, to)
            elif attribute.type == onnx.AttributeProto.GRAPH:
                _retype_graph(attribute.g, to)
            elif attribute.type == onnx.AttributeProto.GRAPHS:
                for sub in attribute.graphs:
                    _retype_graph(sub, to)
            elif attribute.name in _TYPE_ATTRIBUTES and attribute.i in _FLOAT_TYPES:
                attribute.i = to
        if node.op_type in _STASHING:  # statistics in the new type too, not float32
            kept = [a for a in node.attribute if a.name != "stash_type"]
            del node.attribute[:]
            node.attribute.extend([*kept, onnx.helper.make_attribute("stash_type", to)])


def retyped(model: onnx.ModelProto, to: int) -> onnx.ModelProto:
    """The same model computing every float tensor in element type ``to``."""
    result = onnx.ModelProto()
    result.CopyFrom(model)
    _retype_graph(result.graph, to)
    return result


def _is_float(value) -> bool:
    return isinstance(value, np.ndarray) and value.dtype.kind == "f"


def _retype_value(value, precision: Precision):
    if precision.elem_type is None or not _is_float(value):
        return value
    return value.astype(onnx.helper.tensor_dtype_to_np_dtype(precision.elem_type))


# ------------------------------------------------------------------------- runtime
def _session(model: onnx.ModelProto):
    model = onnx.ModelProto.FromString(model.SerializeToString())
    model.ir_version = min(model.ir_version, 10)
    return create_session(model, session_options=quiet_session_options(log_severity_level=4))


@dataclass
class Forward:
    """A test's model for one input ``x`` in one precision, with a session that runs it."""

    precision: Precision
    model: onnx.ModelProto
    x: str
    value: np.ndarray  # x's value
    others: dict  # the inputs that cannot be initializers (sequences)
    outputs: list[str]  # float tensor outputs, seeded
    seeded: list[str]  # what lossgraph is asked to differentiate (float + non-tensor outputs)
    cotangents: dict[str, np.ndarray]
    masks: dict[str, np.ndarray]
    session: object
    scale: float  # S = sum |R_k y_k|

    def functional(self, value: np.ndarray) -> float:
        """L(x) = sum_k <R_k, y_k> over the outputs' finite base positions, in float64."""
        try:
            values = self.session.run(self.outputs, {**self.others, self.x: value})
        except Exception:  # e.g. a perturbed input the op rejects
            return float("nan")
        total = 0.0
        for name, y in zip(self.outputs, values):
            mask = self.masks[name]
            if np.shape(y) != mask.shape:
                return float("nan")
            total += float(np.sum(self.cotangents[name][mask] * np.asarray(y, np.float64)[mask]))
        return total


def _float_outputs(model: onnx.ModelProto) -> tuple[list[str], list[str]]:
    """(float tensor outputs, outputs lossgraph is asked for: those and non-tensor ones)."""
    floats, seeded = [], []
    for output in model.graph.output:
        kind = output.type.WhichOneof("value")
        if kind == "tensor_type":
            if output.type.tensor_type.elem_type in _FLOAT_TYPES:
                floats.append(output.name)
                seeded.append(output.name)
        else:
            seeded.append(output.name)
    return floats, seeded


def _values(case) -> dict[str, object]:
    """The test's input values by name (numpy scalars as 0-d arrays)."""
    names = [i.name for i in case.model.graph.input]
    return {n: np.asarray(v) if isinstance(v, np.generic) else v
            for n, v in zip(names, case.data_sets[0][0])}


def _frozen(case, x: str) -> onnx.ModelProto:
    """The test's model with every input but ``x`` an initializer, as exporters write
    shapes, axes, indices and the weights one does not differentiate."""
    model = onnx.ModelProto()
    model.CopyFrom(case.model)
    values = _values(case)
    kept = [i for i in model.graph.input if i.name == x or not isinstance(values[i.name],
                                                                          np.ndarray)]
    for value in model.graph.input:
        if value not in kept:
            model.graph.initializer.append(numpy_helper.from_array(values[value.name],
                                                                   value.name))
    del model.graph.input[:]
    model.graph.input.extend(kept)
    model.ir_version = max(model.ir_version, 4)  # IR 3 wants every initializer an input
    return model


def _forward(case, model: onnx.ModelProto, x: str, precision: Precision) -> Forward | None:
    """The test in ``precision``, if onnxruntime runs it (deterministically)."""
    if precision.elem_type is not None:
        model = retyped(model, precision.elem_type)
        try:
            onnx.checker.check_model(model, full_check=True)
        except Exception:
            return None
    values = _values(case)
    value = _retype_value(values[x], precision)
    others = {i.name: values[i.name] for i in model.graph.input if i.name != x}
    floats, seeded = _float_outputs(model)
    if not floats:  # sequence outputs only: lossgraph's verdict needs no forward
        return None
    try:
        session = _session(model)
        first, *again = (session.run(floats, {**others, x: value}) for _ in range(3))
    except Exception:
        return None
    if any(not np.array_equal(a, b, equal_nan=True) for run in again for a, b in zip(first, run)):
        raise _Random()  # onnxruntime's seeded Dropout repeats its first mask once
    rng = np.random.default_rng(zlib.crc32(case.name.encode()))
    cotangents, masks, scale = {}, {}, 0.0
    for name, y in zip(floats, first):
        y64 = np.asarray(y, np.float64)
        masks[name] = np.isfinite(y64)
        cotangents[name] = np.asarray(rng.normal(size=y64.shape) * masks[name])
        scale += float(np.sum(np.abs(cotangents[name][masks[name]] * y64[masks[name]])))
    forward = Forward(precision, model, x, value, others, floats, seeded, cotangents, masks,
                      session, scale)
    return forward if precision is not FLOAT64 or _computes_in_double(forward, rng) else None


def _computes_in_double(forward: Forward, rng: np.random.Generator) -> bool:
    """Whether onnxruntime really computes the retyped model in double: along a random
    direction, L's increments over steps h, 2h and 3h (h ~ 6e-8 |x|) must be in ratio
    1 : 2 : 3 to 1e-4, and must not vanish where a larger step changes L. Some kernels
    compute internally in float32 (norms, statistics), which makes float64 finite
    differences noise."""
    direction = rng.normal(size=forward.value.shape)
    magnitude = max(1.0, float(np.max(np.abs(forward.value), initial=0.0)))
    base = forward.functional(forward.value)

    def increment(step: float) -> float:
        return forward.functional(forward.value + step * magnitude * direction) - base

    step = 2.0**-24  # a float32 computation quantizes such increments to a few ulps
    small, double, triple = (increment(k * step) for k in (1, 2, 3))
    if not all(np.isfinite(v) for v in (small, double, triple)):
        return True  # no evidence either way
    if small == 0:
        return double == triple == 0 and increment(FLOAT32.step) == 0
    return abs(double / small - 2) < 1e-4 and abs(triple / small - 3) < 1e-4


class _Random(Exception):
    """Two runs of the forward model differ."""


# ------------------------------------------------------------------------- checking
def _gradient_graph(forward: Forward) -> tuple[onnx.ModelProto, list[str], str]:
    """lossgraph's VJP graph for x: (model, names of its cotangent inputs, grad output)."""
    with use_target(_target()):
        graph = lossgraph.gradient(forward.model, weights=[forward.x], outputs=forward.seeded)
    seed_inputs = [i.name for i in graph.graph.input][len(forward.model.graph.input):]
    return graph, seed_inputs, graph.graph.output[-1].name


def _classify_error(exc: Exception) -> tuple[str, str]:
    message = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    if isinstance(exc, MissingGradientError):
        return MISSING, message
    if isinstance(exc, NoGradientError):
        return NOT_DIFFERENTIABLE, message
    if isinstance(exc, (InternalError, InvalidRuleError)) or not isinstance(exc, LossgraphError):
        return CRASH, message
    return UNSUPPORTED, message


def _increments(forward: Forward, base: float, direction: np.ndarray, step: float
                ) -> tuple[float, float, float]:
    """(L(x + h d) - L(x), L(x) - L(x - h d), h) along ``direction`` ``d``, with the
    step ``h`` actually taken after rounding to the input's type."""
    value = forward.value
    plus = np.asarray(value + step * direction, dtype=value.dtype)
    minus = np.asarray(value - step * direction, dtype=value.dtype)
    index = np.unravel_index(np.argmax(np.abs(direction)), direction.shape)
    ratio = float(direction[index])
    h_plus = (float(plus[index]) - float(value[index])) / ratio
    h_minus = (float(value[index]) - float(minus[index])) / ratio
    if h_plus <= 0 or h_minus <= 0:
        return float("nan"), float("nan"), 0.0
    # one h for both sides: rescale the increments to it (exact for a linear L)
    h = min(h_plus, h_minus)
    return ((forward.functional(plus) - base) * h / h_plus,
            (base - forward.functional(minus)) * h / h_minus, h)


def _jumps(forward: Forward, base: float, direction: np.ndarray, step: float,
           increments: tuple[float, float]) -> bool:
    """Whether L jumps at x along ``direction``: an increment that does not shrink with
    the step (doubling h leaves it within 50%), where a smooth L's grows 2x to 4x."""
    wide = _increments(forward, base, direction, 2 * step)
    return any(np.isfinite(w) and d != 0 and 0.5 < w / d < 1.5
               for d, w in zip(increments, wide[:2]))


def _probes(value: np.ndarray, grad: np.ndarray, seed: int
            ) -> list[tuple[str, np.ndarray, float]]:
    """(label, direction, lossgraph's slope along it): coordinates, and random directions
    for large inputs."""
    rng = np.random.default_rng(seed)
    if value.size <= FULL:
        coordinates = range(value.size)
    else:
        coordinates = sorted(rng.choice(value.size, FULL, replace=False))
    probes = []
    for flat in coordinates:
        index = np.unravel_index(flat, value.shape)
        direction = np.zeros(value.shape)
        direction[index] = 1.0
        probes.append((f"at {tuple(int(i) for i in index)}", direction, float(grad[index])))
    if value.size > FULL:
        for k in range(DIRECTIONS):
            direction = rng.normal(size=value.shape)
            probes.append((f"along random direction {k}", direction,
                           float(np.sum(grad * direction))))
    return probes


def _compare(forward: Forward, grad: np.ndarray) -> tuple[str, str]:
    """PASS or WRONG (SKIPPED when nothing can be compared), with the worst probe."""
    value, precision = forward.value, forward.precision
    if grad.shape != value.shape:
        return WRONG, f"gradient shape {grad.shape}, input shape {value.shape}"
    if grad.dtype != value.dtype:
        return WRONG, f"gradient dtype {grad.dtype}, input dtype {value.dtype}"
    if value.size == 0:
        return PASS, "empty input"
    base = forward.functional(value)
    measured = []
    for label, direction, slope in _probes(value, np.asarray(grad, np.float64),
                                           zlib.crc32(forward.x.encode())):
        magnitude = max(1.0, float(np.max(np.abs(value[direction != 0]))))
        step = precision.step * magnitude
        up, down, h = _increments(forward, base, direction, step)
        if np.isfinite(up) and np.isfinite(down):
            noise = 16 * precision.unit * max(forward.scale, abs(base)) / h
            measured.append((label, direction, step, slope, (up, down), h, noise))
    if not measured:
        return SKIPPED, "no finite finite-difference reference"
    # absolute tolerance from the gradient's size (robust to a jump's huge quotient)
    scale = float(np.percentile([abs(u + d) / 2 / h / np.linalg.norm(direction)
                                 for _, direction, _, _, (u, d), h, _ in measured], 90))
    worst, worst_excess, compared = "", 0.0, 0
    for label, direction, step, slope, (up, down), h, noise in measured:
        plus, minus = up / h, down / h
        tol = precision.rtol * (abs(plus + minus) / 2 + scale * np.linalg.norm(direction)) + noise
        low, high = min(plus, minus) - tol, max(plus, minus) + tol
        if np.isfinite(slope) and low <= slope <= high:
            compared += 1
            continue
        if _jumps(forward, base, direction, step, (up, down)):
            continue  # no derivative here to compare with
        compared += 1
        excess = max(low - slope, slope - high) / tol if np.isfinite(slope) else float("inf")
        if excess >= worst_excess:
            worst_excess = excess
            worst = (f"{label}: lossgraph {slope:.6g}, finite differences "
                     f"{(plus + minus) / 2:.6g} (one-sided {plus:.6g}, {minus:.6g})")
    if worst:
        return WRONG, worst
    return (PASS, "") if compared else (SKIPPED, "L jumps at every probe")


def _differs_from_reference(case, model: onnx.ModelProto, x: str) -> str:
    """Why onnxruntime's forward is no reference for this test: it differs from the
    outputs the ONNX reference implementation gave (beyond the test's own tolerance),
    so finite differences of it measure another function; '' when it agrees."""
    floats = _float_outputs(model)[0]
    names = [o.name for o in case.model.graph.output]
    expected = dict(zip(names, case.data_sets[0][1]))
    values = _values(case)
    feeds = {i.name: values[i.name] for i in model.graph.input}
    try:
        got = _session(model).run(floats, feeds)
    except Exception:
        return ""
    for name, y in zip(floats, got):
        want = np.asarray(expected[name], np.float64)
        y = np.asarray(y, np.float64)
        if y.shape != want.shape or not np.allclose(y, want, rtol=max(case.rtol, 1e-3),
                                                    atol=max(case.atol, 1e-5), equal_nan=True):
            return (f"onnxruntime's forward differs from the ONNX reference outputs for "
                    f"{name!r}: finite differences of it are no reference for {x!r}")
    return ""


def _dependence(forward: Forward, probes: int = 8) -> str:
    """' (L depends on it: ...)' when finite differences at a few coordinates show that
    L changes with x after all, which a declared non-differentiable input may do (a
    Resize scale, a class weight); else ''."""
    value = forward.value
    base = forward.functional(value)
    largest = 0.0
    for flat in range(min(value.size, probes)):
        direction = np.zeros(value.shape)
        direction[np.unravel_index(flat, value.shape)] = 1.0
        step = forward.precision.step * max(1.0, float(np.abs(value.flat[flat])))
        up, down, h = _increments(forward, base, direction, step)
        if h and np.isfinite(up) and np.isfinite(down) and up * down > 0:  # no jump
            largest = max(largest, abs(up + down) / 2 / h)
    noise = 16 * forward.precision.unit * max(forward.scale, abs(base), 1.0) / \
        forward.precision.step
    return f" (L depends on it: |dL/dx| up to {largest:.3g})" if largest > 10 * noise else ""


def audit_input(case, x: str) -> Result:
    """The verdict for float input ``x`` of ``case``, in the first precision that runs."""
    high = TARGETS[_target()].max_opset
    model, note = _with_opset(_frozen(case, x), MIN_OPSET, high)
    suffix = f" [{note}]" if note else ""
    forwards, seen = [], set()
    for precision in (FLOAT64, FLOAT32, AS_IS):
        forward = _forward(case, model, x, precision)
        if forward is not None and forward.model.SerializeToString() not in seen:
            seen.add(forward.model.SerializeToString())
            forwards.append(forward)
    if not forwards:  # lossgraph may still refuse it: that verdict holds on any runtime
        try:
            with use_target(_target()):
                lossgraph.gradient(model, weights=[x], outputs=_float_outputs(model)[1])
        except Exception as exc:
            category, message = _classify_error(exc)
            return Result(case.name, x, category, message + suffix)
        return Result(case.name, x, SKIPPED, "onnxruntime cannot run the forward model" + suffix)
    notes = []
    mismatch = _differs_from_reference(case, model, x)
    for forward in forwards:
        try:
            graph, seed_inputs, grad_name = _gradient_graph(forward)
        except Exception as exc:
            category, message = _classify_error(exc)
            if category == NOT_DIFFERENTIABLE:
                message += _dependence(forward)
            return Result(case.name, x, category, message + suffix, forward.precision.name)
        feeds = {**forward.others, x: forward.value}
        outputs = {o.name: o for o in forward.model.graph.output}
        for seed, output in zip(seed_inputs, forward.seeded):
            elem_type = outputs[output].type.tensor_type.elem_type
            feeds[seed] = forward.cotangents[output].astype(
                onnx.helper.tensor_dtype_to_np_dtype(elem_type))
        try:
            grad = _session(graph).run([grad_name], feeds)[0]
        except Exception as exc:
            notes.append(f"{forward.precision.name}: onnxruntime cannot run the gradient "
                         f"graph: {str(exc).splitlines()[0][:200]}")
            continue
        category, detail = _compare(forward, np.asarray(grad))
        if mismatch and category != PASS:  # the reference is onnxruntime's forward
            category, detail = SKIPPED, mismatch + f" (gradient check: {detail})"
        return Result(case.name, x, category, "; ".join([*notes, detail]).strip("; ") + suffix,
                      forward.precision.name)
    return Result(case.name, x, CRASH, "; ".join(notes) + suffix)


def audit_case(case) -> list[Result]:
    """The verdicts for every float input of one node test."""
    inputs = [n for n, v in _values(case).items() if _is_float(v)]
    if inputs and not _float_outputs(case.model)[1]:
        return [Result(case.name, x, NOT_DIFFERENTIABLE, "no float output") for x in inputs]
    results = []
    for x in inputs:
        try:
            results.append(audit_input(case, x))
        except _Random:
            results.append(Result(case.name, x, SKIPPED, "random forward: two runs differ"))
    return results


def audit(cases: Iterable) -> list[Result]:
    """The verdicts for every float input of every test in ``cases``."""
    results = []
    for case in cases:
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.simplefilter("ignore")
            try:
                results.extend(audit_case(case))
            except Exception as exc:  # the harness itself must not hide a test
                results.append(Result(case.name, "?", CRASH, f"harness: {exc!r}"))
    return results


# ------------------------------------------------------------------------- report
def totals(results: Sequence[Result]) -> Counter:
    return Counter(r.category for r in results)


# A test's verdict is the first of these that any of its float inputs got: one wrong
# input makes the test wrong; a test passes when an input passes and no input is wrong,
# crashed, missing a rule or unsupported (its other inputs, like Resize's scales, may be
# not differentiable).
_TEST_PRECEDENCE = (WRONG, CRASH, MISSING, UNSUPPORTED, PASS, NOT_DIFFERENTIABLE, SKIPPED)


def verdicts_per_test(results: Sequence[Result]) -> dict[str, str]:
    """One verdict per node test, from the verdicts of its float inputs."""
    seen: dict[str, set[str]] = {}
    for r in results:
        seen.setdefault(r.test, set()).add(r.category)
    return {test: next(c for c in _TEST_PRECEDENCE if c in categories)
            for test, categories in seen.items()}


def table(results: Sequence[Result]) -> str:
    """The totals per float input and per node test, as a Markdown table."""
    header = "| counted per | " + " | ".join(CATEGORIES) + " | total |"
    rule = "|" + "---|" * (len(CATEGORIES) + 2)
    rows = []
    for unit, categories in (("float input", [r.category for r in results]),
                             ("node test", list(verdicts_per_test(results).values()))):
        counts = Counter(categories)
        rows.append(f"| {unit} | " + " | ".join(str(counts.get(c, 0)) for c in CATEGORIES)
                    + f" | {len(categories)} |")
    return "\n".join([header, rule, *rows])


def listing(results: Sequence[Result], category: str) -> str:
    lines = [f"{r.test} [{r.input}] ({r.precision}): {r.detail}" for r in results
             if r.category == category]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-k", "--filter", default=None, help="regex on test names")
    parser.add_argument("--list", action="append", default=[], choices=CATEGORIES,
                        help="also list every result of this category (repeatable)")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    cases = node_tests()
    if args.filter:
        cases = [c for c in cases if re.search(args.filter, c.name)]
    results = audit(cases)
    elapsed = time.perf_counter() - started
    print(f"onnx {onnx.__version__}, onnxruntime {_runtime().__version__}, "
          f"{len(cases)} node tests, {len(results)} float inputs, {elapsed:.0f} s")
    print(table(results))
    precisions = Counter(r.precision for r in results if r.category in (PASS, WRONG))
    print("compared in:", ", ".join(f"{k} {v}" for k, v in sorted(precisions.items())))
    for category in (WRONG, CRASH, *[c for c in args.list if c not in (WRONG, CRASH)]):
        found = listing(results, category)
        print(f"\n{category}:\n{found or '(none)'}")
    return 0


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
