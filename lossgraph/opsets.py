"""The ai.onnx opsets: what each op changed from one opset to the next, and a model moved
to the opset its target loads wherever its ops keep their meaning there.

A model imports one version of the default domain, and each of its nodes means what the
newest version of its op up to that opset says (``onnx.defs.get_schema(op, opset)``).
Moving the model to another opset changes nothing for an op whose version is the same at
both; for an op that changed in between, it depends on what changed. :func:`to_opset`
moves a model (in place) and refuses, naming the node, the op and the opset that changed
its meaning, whatever it cannot move without changing a number:

- **lowering** (a newer opset than the target loads, e.g. skl2onnx 1.20's default
  ``to_onnx(model, X[:1])`` at opset 22, for onnxruntime-training 1.19's opset 21): every
  op version crossed is looked up in :data:`CHANGES`. A change that adds element types
  (most of them) keeps the meaning for the types the node uses, which the older version
  must accept (checked, with the binding of its type variables); an attribute the older
  version lacks is dropped where it holds its default (which is the older behaviour, as
  for Cast's ``round_mode``), and refused otherwise; a change of meaning is refused, for
  the nodes it concerns (``AveragePool`` with ``ceil_mode=1``, ``Mod`` with ``fmod=0`` on
  floats, ...); an op the older opset does not have at all (``Swish``, ``Attention``,
  ...), or a version not classified here (a newer onnx), too.
- **raising** (an older opset than the target's oldest, e.g. skl2onnx's classifiers with
  a ZipMap at opset 9): onnx's version converter
  (``onnx.version_converter.convert_version``), whose adapters rewrite every upgrade that
  changed an op's inputs or attributes; its result is checked like any model.
- **duplicate imports** (skl2onnx lists the default domain twice, and
  ``convert_version`` changes only the first entry): one entry per domain is kept. Two
  different versions of the default domain are read as the newer, once every node means
  the same under both (the lowering check from the newer to the older); otherwise no one
  can tell which version the nodes were written for, and the model is refused.

The changes after opset 21 (the training build's newest), derived from onnx's schemas (each
op version's inputs, outputs, attributes, type constraints and documentation compared with
the one before it: ``tests/test_opsets.py`` checks that :data:`CHANGES` lists every op
version this onnx defines after 21) and classified from onnx's changelog
(https://github.com/onnx/onnx/blob/main/docs/Changelog.md, an anchor per version, e.g.
``#Cast-24``; for opset 28's changes not in it yet, the schemas' own documentation)::

    opset 22  bfloat16 added: Acos, Acosh, Asin, Asinh, Atan, Atanh, Bernoulli, Conv,
              ConvTranspose, Cos, Cosh, DeformConv, Det, Dropout, Elu, EyeLike, GRU,
              GlobalAveragePool, GlobalLpPool, GlobalMaxPool, GridSample, HardSigmoid,
              HardSwish, InstanceNormalization, LSTM, LpNormalization, LpPool, MaxRoiPool,
              MaxUnpool, Mish, Multinomial, NegativeLogLikelihoodLoss, RNN, RandomNormal,
              RandomNormalLike, RandomUniform, RandomUniformLike, RoiAlign, Round, Selu,
              Sin, Sinh, Softplus, Softsign, Tan, ThresholdedRelu
              AveragePool, MaxPool: bfloat16, and with ceil_mode=1 "sliding windows that
              would start in the right padded region are ignored" (meaning, ceil_mode=1)
    opset 23  float4e2m1 added: Cast, CastLike, Constant, ConstantOfShape, Flatten,
              Identity, If, Loop, Pad, Reshape, Scan, Shape, Size, Squeeze, Transpose,
              Unsqueeze
              DequantizeLinear: float4e2m1, and output_dtype (default: x_scale's type,
              opset 21's only choice)
              QuantizeLinear: float4e2m1, x and y_scale of different types (opset 21 takes
              one), and precision (default: y_scale's type)
              new: Attention, RMSNormalization, RotaryEmbedding
    opset 24  float8e8m0 added: Constant, ConstantOfShape, DequantizeLinear, Flatten,
              Identity, If, Loop, Pad, QuantizeLinear, Reshape, Scan, Shape, Size,
              Squeeze, Transpose, Unsqueeze
              bfloat16 added: SplitToSequence, TopK
              Cast, CastLike: float8e8m0, round_mode (default "up", for float8e8m0 only),
              and a saturating cast of +-Inf to float8e4m3fnuz or float8e5m2fnuz gives
              +-FLT_MAX, not NaN (meaning, for those casts)
              new: Attention (version 24), Swish, TensorScatter
    opset 25  int2 and uint2 added: Cast, CastLike, Constant, ConstantOfShape,
              DequantizeLinear, Flatten, Identity, If, Loop, Pad, QuantizeLinear, Reshape,
              Scan, Shape, Size, Squeeze, Transpose, Unsqueeze; new: Attention (25)
    opset 26  new: BitCast, CumProd
    opset 27  Range: float16 and bfloat16, and stash_type for them; new:
              CausalConvWithState, LinearAttention
    opset 28  float6e2m3 and float6e3m2 added: Cast, DequantizeLinear, QuantizeLinear
              bfloat16 added: Compress, Einsum, OneHot, ReverseSequence, Unique;
              bfloat16, float16 and double: Celu; more element types in sequences and
              optionals: Optional, OptionalGetElement, OptionalHasElement; integer types
              removed: ReduceLogSum, ReduceLogSumExp; a function body added, nothing else:
              DepthToSpace; SpaceToDepth: mode (default "DCR", the order before)
              Mod: fmod=0 defined on floating-point types (floor modulo), which opset 13
              allows on integers only (meaning, fmod=0 on floats)
              BitShift: signed types, and shifts by a negative amount or by the type's
              width or more defined (meaning)
              new: SwiGLU

Changes before opset 22 are not classified here: a target older than opset 21 refuses an
op that changed between its opset and the model's, naming it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import onnx
import onnx.defs
import onnx.version_converter

from .errors import InvalidModelError, UnsupportedModelError
from .graphs import (
    all_graphs,
    all_value_types,
    attribute_value,
    canonical_domain,
    subgraphs,
    without_weight_data,
)
from .target import Target, active_target, newer_targets_hint

__all__ = ["Change", "CHANGES", "NEW_OPS", "OpsetMove", "changes_between", "to_opset",
           "to_target"]

#: The kinds of a :class:`Change`.
TYPES, MEANING = "types", "meaning"

Types = Mapping[str, onnx.TypeProto]
#: Which nodes a change of element types also changes the meaning of: the reason for
#: ``node`` (its value types in ``types``), or None where it means the same.
Alters = Callable[[onnx.NodeProto, Types], "str | None"]


@dataclass(frozen=True)
class Change:
    """How ``op_type``'s version of opset ``version`` differs from its version before:
    ``kind`` :data:`TYPES` (element types added or removed, an attribute whose default is
    the older behaviour; ``alters`` names the nodes whose meaning changes anyway) or
    :data:`MEANING` (what it computes), ``what`` in words."""

    op_type: str
    version: int
    kind: str
    what: str
    alters: Alters | None = field(default=None, compare=False)

    def refusal(self, node: onnx.NodeProto, types: Types) -> str | None:
        """Why ``node`` cannot cross this change, or None when it means the same."""
        if self.kind == MEANING:
            return f"opset {self.version} changed it: {self.what}"
        reason = self.alters(node, types) if self.alters else None
        return f"opset {self.version} changed it: {reason}" if reason else None


def _elem_type(types: Types, name: str) -> int | None:
    value = types.get(name)
    return value.tensor_type.elem_type if value is not None and value.HasField(
        "tensor_type") else None


def _ceil_mode(node: onnx.NodeProto, types: Types) -> str | None:
    if attribute_value(node, "ceil_mode", 0):
        return ("with ceil_mode=1 a window that would start in the right padding is ignored "
                "(the output can be one element shorter than before)")
    return None


_FNUZ = (onnx.TensorProto.FLOAT8E4M3FNUZ, onnx.TensorProto.FLOAT8E5M2FNUZ)


def _fnuz_saturation(node: onnx.NodeProto, types: Types) -> str | None:
    to = (attribute_value(node, "to") if node.op_type == "Cast"
          else _elem_type(types, node.input[1]) if len(node.input) > 1 else None)
    if to in _FNUZ and attribute_value(node, "saturate", 1):
        return ("a saturating cast of +-Inf to float8e4m3fnuz or float8e5m2fnuz gives "
                "+-FLT_MAX, where the version before gave NaN")
    return None


_FLOATS = frozenset({onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16,
                     onnx.TensorProto.BFLOAT16})


def _float_floor_mod(node: onnx.NodeProto, types: Types) -> str | None:
    if not attribute_value(node, "fmod", 0) and _elem_type(types, node.input[0]) in _FLOATS:
        return ("fmod=0 on floating-point inputs is defined (floor modulo, A - floor(A / B) "
                "* B), where the version before allowed fmod=0 on integers only")
    return None


def _same(kind: str, version: int, what: str, ops: str,
          alters: Alters | None = None) -> dict[tuple[str, int], Change]:
    return {(op, version): Change(op, version, kind, what, alters) for op in ops.split()}


_CONTROL = "If Loop Scan"
_SHAPING = ("Cast CastLike Constant ConstantOfShape Flatten Identity Pad Reshape Shape Size "
            "Squeeze Transpose Unsqueeze")

#: The change of every op version after opset 21 whose op opset 21 has (module docstring).
CHANGES: dict[tuple[str, int], Change] = {
    **_same(TYPES, 22, "bfloat16 added",
            "Acos Acosh Asin Asinh Atan Atanh Bernoulli Conv ConvTranspose Cos Cosh DeformConv "
            "Det Dropout Elu EyeLike GRU GlobalAveragePool GlobalLpPool GlobalMaxPool "
            "GridSample HardSigmoid HardSwish InstanceNormalization LSTM LpNormalization LpPool "
            "MaxRoiPool MaxUnpool Mish Multinomial NegativeLogLikelihoodLoss RNN RandomNormal "
            "RandomNormalLike RandomUniform RandomUniformLike RoiAlign Round Selu Sin Sinh "
            "Softplus Softsign Tan ThresholdedRelu"),
    **_same(TYPES, 22, "bfloat16 added; with ceil_mode=1 a window starting in the right "
                       "padding is ignored", "AveragePool MaxPool", _ceil_mode),
    **_same(TYPES, 23, "float4e2m1 added", f"{_SHAPING} {_CONTROL}"),
    **_same(TYPES, 23, "float4e2m1 added, and output_dtype (by default x_scale's type, the "
                       "only one before)", "DequantizeLinear"),
    **_same(TYPES, 23, "float4e2m1 added, x and y_scale of different types (one type "
                       "before), and precision (by default y_scale's type)", "QuantizeLinear"),
    **_same(TYPES, 24, "float8e8m0 added",
            f"{_SHAPING.replace('Cast CastLike ', '')} {_CONTROL} DequantizeLinear "
            "QuantizeLinear"),
    **_same(TYPES, 24, "bfloat16 added", "SplitToSequence TopK"),
    **_same(TYPES, 24, "float8e8m0 added with round_mode (by default 'up'); a saturating cast "
                       "of +-Inf to float8e4m3fnuz or float8e5m2fnuz gives +-FLT_MAX, not NaN",
            "Cast CastLike", _fnuz_saturation),
    **_same(TYPES, 25, "int2 and uint2 added",
            f"{_SHAPING} {_CONTROL} DequantizeLinear QuantizeLinear"),
    **_same(TYPES, 27, "float16 and bfloat16 added, and stash_type for them", "Range"),
    **_same(TYPES, 28, "float6e2m3 and float6e3m2 added", "Cast DequantizeLinear QuantizeLinear"),
    **_same(TYPES, 28, "bfloat16 added", "Compress Einsum OneHot ReverseSequence Unique"),
    **_same(TYPES, 28, "bfloat16, float16 and double added", "Celu"),
    **_same(TYPES, 28, "more element types in sequences and optionals",
            "Optional OptionalGetElement OptionalHasElement"),
    **_same(TYPES, 28, "integer types removed", "ReduceLogSum ReduceLogSumExp"),
    **_same(TYPES, 28, "a function body added, nothing else", "DepthToSpace"),
    **_same(TYPES, 28, "mode added (by default 'DCR', the order before)", "SpaceToDepth"),
    **_same(TYPES, 28, "fmod=0 defined on floating-point types", "Mod", _float_floor_mod),
    **_same(MEANING, 28, "signed types added, and a shift by a negative amount or by the "
                         "type's width or more defined, which the version before left "
                         "undefined", "BitShift"),
}

#: The ops onnx added after opset 21, by the opset that added them: a model that uses one
#: cannot be lowered below it.
NEW_OPS: dict[str, int] = {
    "Attention": 23, "RMSNormalization": 23, "RotaryEmbedding": 23, "Swish": 24,
    "TensorScatter": 24, "BitCast": 26, "CumProd": 26, "CausalConvWithState": 27,
    "LinearAttention": 27, "SwiGLU": 28,
}


@functools.cache
def op_versions(op_type: str) -> tuple[int, ...]:
    """The opsets in which ai.onnx ``op_type`` got a new version, oldest first."""
    return tuple(sorted({s.since_version for s in onnx.defs.get_all_schemas_with_history()
                         if s.name == op_type and s.domain == ""}))


@functools.lru_cache(maxsize=4096)
def _schema(op_type: str, version: int) -> onnx.defs.OpSchema | None:
    try:
        return onnx.defs.get_schema(op_type, version, "")
    except onnx.defs.SchemaError:
        return None


def changes_between(op_type: str, older: int, newer: int) -> list[Change | int]:
    """The changes of ``op_type`` between opsets ``older`` (excluded) and ``newer``
    (included), oldest first; a version not in :data:`CHANGES` is given as its number."""
    return [CHANGES.get((op_type, v), v) for v in op_versions(op_type) if older < v <= newer]


@dataclass
class OpsetMove:
    """What :func:`to_opset` did: the model's ``ai.onnx`` opset (the newest it imported)
    moved to ``result``; ``imported`` lists every version its opset_import gave (more than
    one: duplicate entries, made one); ``crossed`` the op versions crossed, by op;
    ``dropped`` the attributes removed as their defaults ("Cast node 'c': round_mode")."""

    source: int
    result: int
    imported: tuple[int, ...] = ()
    crossed: dict[str, list[str]] = field(default_factory=dict)
    dropped: list[str] = field(default_factory=list)

    @property
    def direction(self) -> str:
        """``"lowered"``, ``"raised"`` or ``"kept"``."""
        return ("lowered" if self.result < self.source else
                "raised" if self.result > self.source else "kept")

    def __str__(self) -> str:
        if self.direction == "kept":
            duplicates = (f" (its opset_import listed ai.onnx {len(self.imported)} times, "
                          "now once)" if len(self.imported) > 1 else "")
            return f"ai.onnx opset {self.source} kept{duplicates}"
        text = f"ai.onnx opset {self.source} {self.direction} to {self.result}"
        if self.direction == "raised":
            return text + " by onnx's version converter"
        if not self.crossed:
            return text + ": none of its ai.onnx ops changed in between"
        changed = "; ".join(f"{op} {', '.join(whats)}" for op, whats in self.crossed.items())
        return text + f": its ops mean the same there ({changed})"


def to_opset(model: onnx.ModelProto, version: int, advice: str = "",
             newer_advice: str = "") -> OpsetMove:
    """Move ``model`` (in place) to ``ai.onnx`` opset ``version`` where every op keeps
    its meaning (module docstring); an :class:`UnsupportedModelError` naming the node, the
    op and the change otherwise, ending with ``advice`` (and ``newer_advice``, how to keep
    the model's opset, where the refusal is not about an element type, which a runtime
    loading the opset need not run either). Duplicate entries of the default domain become
    one. Other domains are left as they are."""
    imported = tuple(o.version for o in model.opset_import if canonical_domain(o.domain) == "")
    if not imported:
        raise UnsupportedModelError(
            "The model imports no 'ai.onnx' opset. Add one, e.g. "
            "model.opset_import.append(onnx.helper.make_opsetid('', 17)).")
    source = max(imported)
    newest = onnx.defs.onnx_opset_version()
    if source > newest:
        raise UnsupportedModelError(
            f"The model imports ai.onnx opset {source}, and this onnx ({onnx.__version__}) "
            f"defines opsets up to {newest}: what its ops mean there is unknown here. Export "
            f"it at ai.onnx opset {newest} or older.")
    if min(imported) < source:  # which version were the nodes written for?
        _check_nodes(model, source, min(imported), "", rewrite=False,
                     conflict=_conflict_advice(imported))
    move = OpsetMove(source, version, imported if len(imported) > 1 else ())
    _set_default_opset(model, source)
    if version < source:
        _check_nodes(model, source, version, advice, rewrite=True, move=move,
                     newer_advice=newer_advice)
        _set_default_opset(model, version)
    elif version > source:
        _raise(model, version, advice)
    return move


def _conflict_advice(imported: tuple[int, ...]) -> str:
    return (f"The model imports the domain 'ai.onnx' twice, as opsets "
            f"{' and '.join(map(str, imported))}, and its nodes do not mean the same under "
            "both, so no one can tell which one they follow "
            "(onnx.version_converter.convert_version changes only the first entry)")


def _set_default_opset(model: onnx.ModelProto, version: int) -> None:
    """One ``ai.onnx`` entry, at ``version``, where the first one was; other domains kept."""
    entries = [(canonical_domain(o.domain), o.version) for o in model.opset_import]
    first = next(i for i, (domain, _) in enumerate(entries) if domain == "")
    kept = [(d, v) for i, (d, v) in enumerate(entries) if d != "" or i == first]
    del model.opset_import[:]
    model.opset_import.extend(onnx.helper.make_opsetid(d, version if d == "" else v)
                              for d, v in kept)


def _raise(model: onnx.ModelProto, version: int, advice: str) -> None:
    """onnx's version converter, its result checked; the model's value_info kept."""
    for graph in all_graphs(model.graph):
        for node in graph.node:
            if canonical_domain(node.domain) == "" and _schema(node.op_type, version) is None:
                label = _label(node)
                raise UnsupportedModelError(
                    f"{label[0].upper()}{label[1:]} cannot move from ai.onnx opset "
                    f"{_default_version(model)} to {version}: opset {version} has no "
                    f"{node.op_type} (an experimental op onnx removed). {advice}".rstrip())
    try:
        converted = onnx.version_converter.convert_version(model, version)
        onnx.checker.check_model(without_weight_data(converted)[0], full_check=True)
    except Exception as exc:  # noqa: BLE001  the converter raises RuntimeError, ValueError...
        detail = " ".join(str(exc).split()) or type(exc).__name__
        detail = detail.split(" failed: ", 1)[-1].replace("'%s'", "an op")  # C++ assertion
        raise UnsupportedModelError(
            f"The model is ai.onnx opset {_default_version(model)}, older than opset "
            f"{version}, and onnx's version converter could not raise it: {detail.rstrip('.')}. "
            f"{advice}".rstrip()) from None
    produced = {o for g in all_graphs(converted.graph) for n in g.node for o in n.output}
    value_info = [v for v in model.graph.value_info if v.name in produced]
    del converted.graph.value_info[:]
    converted.graph.value_info.extend(value_info)
    model.CopyFrom(converted)


def _default_version(model: onnx.ModelProto) -> int:
    return max(o.version for o in model.opset_import if canonical_domain(o.domain) == "")


def to_target(model: onnx.ModelProto, target: Target | None = None) -> OpsetMove | None:
    """Move ``model`` (in place) into the ``ai.onnx`` opsets ``target`` loads (default: the
    active target): lowered to its newest, raised to its oldest, duplicate entries made one
    (:func:`to_opset`). None when the model imports no ``ai.onnx`` opset
    (:func:`lossgraph.target.check_opset` names that)."""
    target = target or active_target()
    imported = [o.version for o in model.opset_import if canonical_domain(o.domain) == ""]
    if not imported:
        return None
    source = max(imported)
    version = min(max(source, target.min_opset), target.max_opset)
    if version == source and len(imported) == 1:
        return OpsetMove(source, source)
    lowering = version < source
    advice = (f"Export the model at ai.onnx opset {version} or "
              f"{'older' if lowering else 'newer'} (skl2onnx: to_onnx(..., "
              f"target_opset={version}); torch: torch.onnx.export(..., "
              f"opset_version={version})).")
    return to_opset(model, version, advice,
                    newer_targets_hint(source).strip() if lowering else "")


# -- lowering -----------------------------------------------------------------------------
def _type_string(value: onnx.TypeProto) -> str | None:
    """``"tensor(float)"``, ``"seq(tensor(int64))"``, ... as schemas spell types; None when
    unknown."""
    kind = value.WhichOneof("value")
    if kind == "tensor_type":
        elem = value.tensor_type.elem_type
        return f"tensor({onnx.TensorProto.DataType.Name(elem).lower()})" if elem else None
    if kind == "sequence_type":
        inner = _type_string(value.sequence_type.elem_type)
        return f"seq({inner})" if inner else None
    if kind == "optional_type":
        inner = _type_string(value.optional_type.elem_type)
        return f"optional({inner})" if inner else None
    return None


def _label(node: onnx.NodeProto) -> str:
    """The node in words, to begin a sentence with."""
    return (f"node {node.name!r} (ai.onnx {node.op_type})" if node.name else
            f"the ai.onnx {node.op_type} node making {node.output[0]!r}" if node.output
            else f"an ai.onnx {node.op_type} node")


def _check_nodes(model: onnx.ModelProto, source: int, version: int, advice: str,
                 rewrite: bool, move: OpsetMove | None = None, conflict: str = "",
                 newer_advice: str = "") -> None:
    """Every default-domain node of ``model`` (subgraphs and local functions of the same
    opset included) means at opset ``version`` what it means at ``source``; with
    ``rewrite``, attributes ``version`` lacks that hold their default are dropped. With
    ``conflict`` (the model imports both opsets), a node that differs is an
    :class:`InvalidModelError` saying so."""
    bodies: list[tuple[onnx.GraphProto | onnx.FunctionProto, int]] = [
        (graph, source) for graph in all_graphs(model.graph)]
    for function in model.functions:
        own = [o.version for o in function.opset_import if canonical_domain(o.domain) == ""]
        if own and max(own) > version:
            bodies.append((function, max(own)))
            bodies.extend((g, max(own)) for node in function.node
                          for sub in subgraphs(node) for g in all_graphs(sub))
    types: dict[str, onnx.TypeProto] | None = None
    for body, body_version in bodies:
        for node in body.node:
            if canonical_domain(node.domain) != "":
                continue
            now, then = _schema(node.op_type, body_version), _schema(node.op_type, version)
            if now is None or (then is not None and then.since_version == now.since_version):
                continue  # an op onnx does not know is the checker's; unchanged ops are fine
            if types is None:
                types = all_value_types(model)
            reason, of_types = _refusal(node, now, then, version, types, rewrite, move)
            if reason and conflict:
                raise InvalidModelError(
                    f"{conflict}: for {_label(node)}, {reason}. Keep the one entry its nodes "
                    "were written for: del model.opset_import[i] for the other.")
            if reason:
                label = _label(node)
                raise UnsupportedModelError(
                    f"{label[0].upper()}{label[1:]} cannot move from ai.onnx opset "
                    f"{body_version} to {version}: {reason}. {advice}"
                    f"{'' if of_types else ' ' + newer_advice}".rstrip())
    if move is not None and rewrite:
        for function in model.functions:
            for entry in function.opset_import:
                if canonical_domain(entry.domain) == "" and entry.version > version:
                    entry.version = version


def _refusal(node: onnx.NodeProto, now: onnx.defs.OpSchema, then: onnx.defs.OpSchema | None,
             version: int, types: Types, rewrite: bool,
             move: OpsetMove | None) -> tuple[str | None, bool]:
    """Why ``node`` (its op's schema ``now``) cannot take its version of opset ``version``
    (``then``), or None, after dropping the attributes ``then`` lacks that hold defaults;
    and whether the reason is an element type."""
    if then is None:
        added = NEW_OPS.get(node.op_type, now.since_version)
        return (f"{node.op_type} is an op of opset {added}, which opset {version} does not "
                "have"), False
    for change in changes_between(node.op_type, then.since_version, now.since_version):
        if isinstance(change, int):
            return (f"lossgraph does not know whether the version of {node.op_type} that "
                    f"opset {change} added computes what the version of opset "
                    f"{then.since_version} does"), False
        reason = change.refusal(node, types)
        if reason:
            return reason, False
        if move is not None:
            move.crossed.setdefault(node.op_type, [])
            entry = f"opset {change.version}: {change.what}"
            if entry not in move.crossed[node.op_type]:
                move.crossed[node.op_type].append(entry)
    reason = _attribute_refusal(node, now, then, rewrite, move) or _arity_refusal(node, then)
    if reason:
        return reason, False
    reason = _type_refusal(node, then, types)
    return reason, reason is not None


def _attribute_refusal(node: onnx.NodeProto, now: onnx.defs.OpSchema,
                       then: onnx.defs.OpSchema, rewrite: bool,
                       move: OpsetMove | None) -> str | None:
    kept = []
    for attribute in node.attribute:
        if attribute.name in then.attributes:
            kept.append(attribute)
            continue
        declared = now.attributes.get(attribute.name)
        default = declared.default_value if declared is not None else None
        if default is None or not default.name or not _same_value(attribute, default):
            return (f"it sets {attribute.name}={_attribute_text(attribute)}, an attribute "
                    f"that opset {then.since_version}'s {node.op_type} does not have (only "
                    "its default keeps the older behaviour)")
        if move is not None:
            move.dropped.append(f"{_label(node)}: {attribute.name}, its default")
    if rewrite and len(kept) < len(node.attribute):
        del node.attribute[:]
        node.attribute.extend(kept)
    return None


def _same_value(attribute: onnx.AttributeProto, default: onnx.AttributeProto) -> bool:
    return onnx.helper.get_attribute_value(attribute) == onnx.helper.get_attribute_value(default)


def _attribute_text(attribute: onnx.AttributeProto) -> str:
    value = onnx.helper.get_attribute_value(attribute)
    return repr(value.decode() if isinstance(value, bytes) else value)


def _arity_refusal(node: onnx.NodeProto, then: onnx.defs.OpSchema) -> str | None:
    inputs = len(node.input) - next((i for i, name in enumerate(reversed(node.input)) if name),
                                    len(node.input))
    if inputs > then.max_input:
        return (f"it has {inputs} inputs, and opset {then.since_version}'s {node.op_type} "
                f"takes at most {then.max_input}")
    if len(node.output) > then.max_output:
        return (f"it has {len(node.output)} outputs, and opset {then.since_version}'s "
                f"{node.op_type} gives at most {then.max_output}")
    return None


def _type_refusal(node: onnx.NodeProto, then: onnx.defs.OpSchema, types: Types) -> str | None:
    """The element types the node uses, checked against ``then``'s constraints (each type
    variable bound to one type, where the schema says so)."""
    allowed = {c.type_param_str: set(c.allowed_type_strs) for c in then.type_constraints}
    bound: dict[str, str] = {}
    for values, formals, what in ((node.input, then.inputs, "input"),
                                  (node.output, then.outputs, "output")):
        for position, name in enumerate(values):
            if not name or not formals:
                continue
            formal = formals[min(position, len(formals) - 1)]
            actual = _type_string(types[name]) if name in types else None
            if actual is None:
                continue
            accepted = allowed.get(formal.type_str, {formal.type_str})
            if actual not in accepted:
                return (f"its {what} {name!r} is {actual}, which opset "
                        f"{then.since_version}'s {node.op_type} does not take")
            if formal.type_str in allowed and formal.is_homogeneous:
                first = bound.setdefault(formal.type_str, actual)
                if first != actual:
                    return (f"it mixes {first} and {actual} where opset "
                            f"{then.since_version}'s {node.op_type} takes one type "
                            f"({formal.type_str})")
    return None
