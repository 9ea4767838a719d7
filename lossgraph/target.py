"""Which runtimes an emitted model must load in: IR version, opsets and ops.

A :class:`Target` names the runtimes a model is emitted for: the IR version stamped on
it, the ``ai.onnx`` opsets they load, and whether ``com.microsoft`` training ops run
there. Named targets (:data:`TARGETS`) carry the limits measured on each onnxruntime
release (docs/reference/targets.md has the measurements); ``"ir10-opset21"`` spells
an explicit pair. Every emitted model passes :func:`finalize`, which stamps the IR
version and checks every node against the target (:func:`check_ops`), so a model its
target cannot load is an error at compile time, naming the op, not a load failure later.
"""

from __future__ import annotations

import contextlib
import functools
import re
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field

import onnx
import onnx.defs

from .errors import InvalidModelError, UnsupportedModelError, UnsupportedOptionError, suggest
from .graphs import all_graphs, canonical_domain, opset_version

__all__ = ["Target", "DEFAULT_TARGET", "LATEST", "TARGETS", "active_target", "check_loads",
           "check_ops", "check_opset", "check_opset_option", "finalize", "loading_target",
           "newer_targets_hint", "release_target", "resolve_target", "target_for",
           "use_target"]

#: The oldest ai.onnx opset lossgraph reads (its gradient rules are proven from 13).
MIN_OPSET = 13


@dataclass(frozen=True, kw_only=True)
class Target:
    """The runtimes a model is emitted for: the IR version stamped on it, the ``ai.onnx``
    opsets they load, and which ``com.microsoft`` ops run there.

    ``Target(ir_version=10, max_opset=21)`` is an explicit pair (also spelled
    ``"ir10-opset21"``); the named targets of :data:`TARGETS` fill in the rest.
    """

    ir_version: int
    max_opset: int
    min_opset: int = MIN_OPSET
    #: onnxruntime's training build: ``com.microsoft`` training ops (the ``"ort"``
    #: backend's ReluGrad, ..., the artifacts' optimizers) run there.
    training: bool = False
    #: The ``com.microsoft`` ops the runtime runs on CPU (measured); ``None``: not checked.
    microsoft_ops: frozenset[str] | None = field(default=None, repr=False)
    #: The name the target is known by (``"onnxruntime-1.23"``, ``"ir10-opset21"``).
    name: str = ""
    description: str = ""

    def __post_init__(self) -> None:
        for option in ("ir_version", "max_opset", "min_opset"):
            value = getattr(self, option)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UnsupportedOptionError(
                    f"Target({option}={value!r}): must be a positive int.")
        if self.max_opset < self.min_opset:
            raise UnsupportedOptionError(
                f"Target(max_opset={self.max_opset}): lossgraph emits ai.onnx opset "
                f"{self.min_opset} or newer, so max_opset must be at least {self.min_opset}.")
        floor = onnx.helper.find_min_ir_version_for([onnx.helper.make_opsetid("",
                                                                              self.min_opset)])
        if self.ir_version < floor:
            raise UnsupportedOptionError(
                f"Target(ir_version={self.ir_version}): ai.onnx opset {self.min_opset} "
                f"needs IR version {floor} or newer.")
        if not self.name:
            object.__setattr__(self, "name", self.pair)

    @property
    def pair(self) -> str:
        """The explicit spelling of the target's limits, ``"ir10-opset21"``."""
        return f"ir{self.ir_version}-opset{self.max_opset}"

    def supports(self, opset: int) -> bool:
        """True when the target's runtimes load ``ai.onnx`` opset ``opset``."""
        return self.min_opset <= opset <= self.max_opset

    def __str__(self) -> str:
        limits = (f"IR {self.ir_version}, ai.onnx opsets {self.min_opset} to "
                  f"{self.max_opset}")
        return f"target {self.name!r} ({self.description}: {limits})" if self.description \
            else f"target {self.name!r} ({limits})"


# -- measurements --------------------------------------------------------------------------
#: Per plain onnxruntime release (measured on the patch release in the comment, docs/
#: reference/targets.md): the newest IR version and ai.onnx opset an InferenceSession
#: loads, and the com.microsoft ops whose CPU kernels the release added
#: (``onnxruntime.capi._pybind_state.get_all_opkernel_def()``; each release keeps the
#: previous one's).
_RELEASES: tuple[tuple[str, int, int, str], ...] = (
    ("1.19", 10, 21,  # 1.19.2
     "Attention AttnLSTM BeamSearch BiasGelu BifurcationDetector CDist "
     "ConvTransposeWithDynamicPads CropAndResize DequantizeLinear DynamicQuantizeLSTM "
     "DynamicQuantizeMatMul EmbedLayerNormalization ExpandDims FastGelu FusedConv FusedGemm "
     "FusedMatMul GatherND Gelu GreedySearch GridSample GroupQueryAttention Inverse MatMulBnb4 "
     "MatMulFpQ4 MatMulInteger16 MatMulIntegerToFloat MatMulNBits MaxpoolWithMask "
     "MultiHeadAttention MurmurHash3 NGramRepeatBlock NhwcMaxPool Pad QAttention "
     "QEmbedLayerNormalization QGemm QLinearAdd QLinearAveragePool QLinearConcat QLinearConv "
     "QLinearGlobalAveragePool QLinearLeakyRelu QLinearMul QLinearSigmoid QLinearSoftmax "
     "QLinearWhere QuantizeLinear QuickGelu Range RotaryEmbedding SampleOp Sampling "
     "SkipLayerNormalization SkipSimplifiedLayerNormalization SparseAttention "
     "SparseToDenseMatMul Tokenizer TransposeMatMul Trilu Unique WhisperBeamSearch "
     "WordConvEmbedding"),
    ("1.20", 10, 21,  # 1.20.1
     "DecoderMaskedMultiHeadAttention DynamicTimeWarping GatherBlockQuantized UnfoldTensor"),
    ("1.21", 10, 22, ""),  # 1.21.1
    ("1.22", 10, 22, ""),  # 1.22.1
    ("1.23", 11, 23, "MoE QMoE"),  # 1.23.2
    ("1.24", 13, 25, ""),  # 1.24.4
    ("1.25", 13, 26, "CausalConvWithState LinearAttention"),  # 1.25.1
    ("1.26", 13, 26, ""),  # 1.26.0
    ("1.27", 13, 26, ""),  # 1.27.0
    ("1.28", 13, 26, ""),  # 1.28.0 (knows opset 27's schemas, refuses a model stamped 27)
    ("1.29", 13, 26, "MRotaryEmbedding"),  # 1.29.0
    ("1.30", 13, 26, "EngramGate GatedAdd GatedRMSNorm LinearAttentionGate "
                     "NGramHashMapping"),  # 1.30.0
    ("1.31", 13, 26, "BranchwiseRMSNorm HyperConnectionPostMix HyperConnectionPreMix "
                     "ScaledSiLU VarlenNGramHashMapping"),  # 1.31.1
    ("1.32", 14, 28, "GatedDeltaNet GatherPacked MoEGroupRouter "
                     "VarlenCausalConvWithState"),  # 1.32.0
)


def _release_targets() -> dict[str, Target]:
    targets: dict[str, Target] = {}
    ops: frozenset[str] = frozenset()
    for release, ir_version, max_opset, added in _RELEASES:
        ops = ops | frozenset(added.split())
        name = f"onnxruntime-{release}"
        targets[name] = Target(
            ir_version=ir_version, max_opset=max_opset, microsoft_ops=ops, name=name,
            description=f"onnxruntime {release} and later")
    return targets


_PLAIN = _release_targets()

#: onnxruntime-training-cpu 1.19.2, the last training build: IR 10, opset 21 (measured),
#: and the com.microsoft training ops. A graph in standard ops emitted for it loads in
#: every plain onnxruntime since 1.19 too.
DEFAULT_TARGET = Target(
    ir_version=10, max_opset=21, training=True, name="onnxruntime-training-1.19",
    description="onnxruntime-training 1.19, and every onnxruntime since 1.19 for graphs "
                "in standard ops")

#: The newest onnxruntime release measured (``"onnxruntime-latest"``).
LATEST = _PLAIN[f"onnxruntime-{_RELEASES[-1][0]}"]

#: The runtimes a model can be emitted for, by name (``compile_program(..., target=name)``),
#: most widely loadable first.
TARGETS: dict[str, Target] = {
    "default": DEFAULT_TARGET,
    "onnxruntime-training-1.19": DEFAULT_TARGET,
    **_PLAIN,
    "onnxruntime-latest": LATEST,
    # lossgraph's first name for plain onnxruntime, kept: IR 10 with opsets up to 25,
    # which onnxruntime 1.24 and later load.
    "onnxruntime": Target(
        ir_version=10, max_opset=25, microsoft_ops=_PLAIN["onnxruntime-1.24"].microsoft_ops,
        name="onnxruntime",
        description="onnxruntime 1.24 and later"),
}

_PAIR = re.compile(r"ir(\d+)-opset(\d+)")

#: The target set by :func:`use_target`; None outside any (then :data:`DEFAULT_TARGET`).
_ACTIVE: ContextVar[Target | None] = ContextVar("lossgraph_target", default=None)


def resolve_target(target: Target | str | None) -> Target:
    """A :class:`Target` from a Target, a name of :data:`TARGETS`, an explicit pair
    ``"ir<IR>-opset<opset>"``, or ``None`` (the default)."""
    if target is None:
        return DEFAULT_TARGET
    if isinstance(target, str):
        pair = _PAIR.fullmatch(target)
        if target in TARGETS:
            resolved = TARGETS[target]
        elif pair:
            resolved = Target(ir_version=int(pair[1]), max_opset=int(pair[2]))
        else:
            raise UnsupportedOptionError(
                f"Unknown target {target!r}." + suggest(target, list(TARGETS), "targets")
                + " Or an explicit pair of IR version and newest ai.onnx opset, such as "
                  "'ir10-opset21' (docs/reference/targets.md).")
    elif isinstance(target, Target):
        resolved = target
    else:
        raise UnsupportedOptionError(
            f"target={target!r} must be a name of lossgraph.target.TARGETS "
            f"({', '.join(map(repr, TARGETS))}), a pair such as 'ir10-opset21' or a "
            "lossgraph.target.Target.")
    if resolved.ir_version > onnx.IR_VERSION:
        raise UnsupportedOptionError(
            f"{resolved} stamps IR version {resolved.ir_version}, newer than this onnx "
            f"({onnx.__version__}) writes (IR {onnx.IR_VERSION}): upgrade onnx, or pick an "
            "older target.")
    return resolved


def active_target() -> Target:
    """The target the passes emit for now (see :func:`use_target`)."""
    return _ACTIVE.get() or DEFAULT_TARGET


def loading_target(model: onnx.ModelProto) -> Target:
    """The first of :data:`TARGETS` (the most widely loadable) that loads ``model``'s
    ai.onnx opset, else :data:`DEFAULT_TARGET` (whose check then names the problem); where
    a target loading the opset has the model's own IR version, no newer than the first's,
    that one: a graph derived from a compiled program's (cut, or specialized to a batch)
    so keeps the program's IR version."""
    version = opset_version(model)
    loading = [target for target in TARGETS.values()
               if version is not None and target.supports(version)]
    if not loading:
        return DEFAULT_TARGET
    return next((target for target in loading if target.ir_version == model.ir_version
                 <= loading[0].ir_version), loading[0])


def target_for(model: onnx.ModelProto) -> Target:
    """The target set by :func:`use_target`, else the :func:`loading_target` of ``model``
    (a graph of a compiled program, handled after compile: the program was checked for
    its own target then)."""
    return _ACTIVE.get() or loading_target(model)


def release_target(version: str, training: bool = False) -> Target | None:
    """The target of an installed onnxruntime ``version`` (``"1.19.2"``): what it loads,
    measured; the training build's for ``training``; None for a release newer than the
    measured ones (what it loads is not known here)."""
    if training:
        return DEFAULT_TARGET
    release = ".".join(version.split(".")[:2])
    return _PLAIN.get(f"onnxruntime-{release}")


def check_loads(model: onnx.ModelProto, runtime: Target, what: str, installed: str) -> None:
    """An UnsupportedModelError, before any work, when the ``runtime`` (the target of the
    onnxruntime ``installed``, e.g. ``"onnxruntime-training 1.19.2"``) cannot load
    ``model`` (``what`` names it): its IR version or ai.onnx opset is newer."""
    version = opset_version(model)
    too_new = []
    if model.ir_version > runtime.ir_version:
        too_new.append(f"IR version {model.ir_version} (it loads up to {runtime.ir_version})")
    if version is not None and version > runtime.max_opset:
        too_new.append(f"ai.onnx opset {version} (it loads up to {runtime.max_opset})")
    if not too_new:
        return
    loaders = [name for name, target in _PLAIN.items()
               if target.ir_version >= model.ir_version
               and (version is None or target.supports(version))]
    where = (f"{loaders[0].replace('-', ' ')} or later loads it (pip install "
             f"'onnxruntime>={loaders[0].split('-')[1]}' in an environment without the training "
             "build: pip install 'lossgraph[runtime]')" if loaders else
             "no measured onnxruntime release loads it")
    convert = (f" (which lowers a newer model to ai.onnx opset {runtime.max_opset} where its "
               "ops mean the same there)"
               if version is not None and version > runtime.max_opset else "")
    raise UnsupportedModelError(
        f"{what} is {' and '.join(too_new)}, newer than the installed {installed} "
        f"loads: {where}. Or compile for a target this onnxruntime loads: "
        f"compile_program(..., target={runtime.name!r}){convert}; see "
        "docs/reference/targets.md.")


@contextlib.contextmanager
def use_target(target: Target | str | None) -> Iterator[Target]:
    """Run the passes inside the block for ``target``."""
    resolved = resolve_target(target)
    token = _ACTIVE.set(resolved)
    try:
        yield resolved
    finally:
        _ACTIVE.reset(token)


def newer_targets_hint(version: int) -> str:
    """How to emit for the runtimes that load ai.onnx ``version``, and which runtimes those
    are, or "" when none does."""
    name = next((name for name, target in TARGETS.items() if target.supports(version)), None)
    if name is None:
        return ""
    legacy = TARGETS["onnxruntime"]
    also = (f" or target='onnxruntime' ({legacy.description}, IR {legacy.ir_version})"
            if version > DEFAULT_TARGET.max_opset and legacy.supports(version) else "")
    runs = (f" Its graphs run on {TARGETS[name].description}, not on onnxruntime's training "
            f"build (onnxruntime-training 1.19 loads opsets up to {DEFAULT_TARGET.max_opset})."
            if version > DEFAULT_TARGET.max_opset else "")
    return (f" Or emit for a target that loads opset {version}: compile_program(..., "
            f"target='{name}'){also}, or with lossgraph.target.use_target('{name}'): ... "
            f"(on the command line: --target {name}; docs/reference/targets.md).{runs}")


#: The versions of the other domains onnx defines (or onnxruntime adds) that onnxruntime
#: loads: 1 to this, in 1.19.2 and 1.32.0 alike (measured); onnx 1.23 defines no newer.
#: onnx's checker takes any version, and onnxruntime then refuses to load the model.
DOMAIN_VERSIONS = {"ai.onnx.ml": 5, "ai.onnx.preview.training": 1, "com.microsoft": 1}


def check_opset(model: onnx.ModelProto, target: Target | None = None) -> int:
    """The model's ``ai.onnx`` opset, checked to lie in the range the target supports (and
    the versions of the domains of :data:`DOMAIN_VERSIONS` to lie in theirs)."""
    target = target or active_target()
    versions: dict[str, int] = {}
    for opset in model.opset_import:
        domain = canonical_domain(opset.domain)
        if versions.setdefault(domain, opset.version) != opset.version:
            raise InvalidModelError(
                f"The model imports the domain {opset.domain or 'ai.onnx'!r} twice, as "
                f"opsets {versions[domain]} and {opset.version}: no one can tell which "
                "version its ops follow. Keep one opset_import entry per domain.")
        newest = DOMAIN_VERSIONS.get(opset.domain)
        if newest is not None and not 1 <= opset.version <= newest:
            raise UnsupportedModelError(
                f"The model imports version {opset.version} of the domain {opset.domain!r}; "
                f"onnx defines versions 1 to {newest} of it, and onnxruntime loads no other. "
                f"Import a version it defines, e.g. onnx.helper.make_opsetid({opset.domain!r}, "
                f"{newest}).")
    version = opset_version(model)
    if version is None:
        raise UnsupportedModelError(
            "The model imports no 'ai.onnx' opset. Add one, e.g. "
            "model.opset_import.append(onnx.helper.make_opsetid('', 17))."
        )
    if not target.supports(version):
        raise UnsupportedModelError(
            f"The model uses ai.onnx opset {version}; lossgraph emits models for "
            f"{target}, which needs opset {target.min_opset} to {target.max_opset}. "
            "Convert it first with lossgraph.convert_opset(model) (every pass and "
            "compile_program do so with the model they are given), which moves it there "
            "where its ops keep their meaning."
            + (newer_targets_hint(version) if version > target.max_opset else "")
        )
    return version


def check_opset_option(opset: int, target: Target | None = None) -> int:
    """An ``opset=`` option of a graph lossgraph builds from scratch, checked like a model's."""
    target = target or active_target()
    if not target.supports(opset):
        raise UnsupportedOptionError(
            f"opset={opset} is outside {target.min_opset}..{target.max_opset}, "
            f"the range {target} loads."
        )
    return opset


@functools.lru_cache(maxsize=4096)
def _since(op_type: str, version: int) -> int | None:
    """The opset that defined ``op_type`` as ai.onnx ``version`` resolves it, or None
    when onnx knows no such op at that version (the checker's case, not the target's)."""
    try:
        return onnx.defs.get_schema(op_type, version, "").since_version
    except onnx.defs.SchemaError:
        return None


def _node_label(node: onnx.NodeProto, graph: onnx.GraphProto) -> str:
    if node.name:
        return f"Node {node.name!r}"
    made = f" making {node.output[0]!r}" if node.output and node.output[0] else ""
    return f"The {node.op_type} node{made} in graph {graph.name!r}"


def check_ops(model: onnx.ModelProto, target: Target | None = None) -> None:
    """Every node of ``model`` (main graph, subgraphs, functions) exists in ``target``.

    An ``ai.onnx`` op resolves to the version its opset import gives; one defined
    after the target's newest opset (``Swish`` of opset 24 for a target at 23), or an
    import newer than the target loads, is an :class:`UnsupportedModelError` naming
    the op, the node and the target. On a plain onnxruntime target a ``com.microsoft``
    op the release runs no CPU kernel for (the training build's ``ReluGrad``, ...) is
    one too. Other domains are left to the runtime. One schema lookup per op type
    (cached), one set lookup per node.
    """
    target = target or active_target()
    model_version = opset_version(model)
    local = {(f.domain, f.name) for f in model.functions}
    bodies: list[tuple[onnx.GraphProto | onnx.FunctionProto, int | None]] = [
        (g, model_version) for g in all_graphs(model.graph)]
    for function in model.functions:
        version = opset_version(function) or model_version  # type: ignore[arg-type]
        bodies.append((function, version))
        bodies.extend((g, version) for node in function.node for g in _node_graphs(node))
    seen: set[tuple[str, str, int | None]] = set()
    for body, version in bodies:
        for node in body.node:
            domain = canonical_domain(node.domain)
            key = (domain, node.op_type, version)
            if key in seen or (node.domain, node.op_type) in local:
                continue
            seen.add(key)
            if domain == "" and version is not None:
                since = _since(node.op_type, version)
                if since is not None and since > target.max_opset:
                    raise UnsupportedModelError(
                        f"{_node_label(node, body)} is ai.onnx {node.op_type}, defined "
                        f"in opset {since}; {target} loads opsets up to "
                        f"{target.max_opset}, so the model would fail to load there."
                        + newer_targets_hint(since))
            elif (domain == "com.microsoft" and not target.training
                  and target.microsoft_ops is not None
                  and node.op_type not in target.microsoft_ops):
                raise UnsupportedModelError(
                    f"{_node_label(node, body)} is com.microsoft {node.op_type}, which "
                    f"{target} has no kernel for: it runs on onnxruntime's training build. "
                    "Emit standard ops (backend='onnx'), or emit for the training build "
                    "(target='onnxruntime-training-1.19').")
    if model_version is not None and model_version > target.max_opset:
        raise UnsupportedModelError(
            f"The model imports ai.onnx opset {model_version}; {target} loads opsets up "
            f"to {target.max_opset}." + newer_targets_hint(model_version))


def _node_graphs(node: onnx.NodeProto) -> Iterator[onnx.GraphProto]:
    for attribute in node.attribute:
        for graph in ([attribute.g] if attribute.type == onnx.AttributeProto.GRAPH
                      else attribute.graphs):
            yield from all_graphs(graph)


def finalize(model: onnx.ModelProto, target: Target | None = None) -> None:
    """Set the IR version and a clean opset list (one entry per domain) in place, and
    check every node against the target (:func:`check_ops`).

    The target is ``target``, else the one :func:`use_target` set; outside any (a
    graph of a compiled program cut or specialized later, e.g. by the Trainer), the
    :func:`loading_target` of the model: the program was checked for its own target
    when it was compiled. Domains no node uses any more (e.g. ``ai.onnx.ml`` after
    :func:`lower_ml_ops`) are dropped, so the model loads where that domain is unknown.
    """
    target = target or target_for(model)
    bodies = [*all_graphs(model.graph), *model.functions]
    used = {node.domain or "" for body in bodies for node in body.node} | {""}
    versions: dict[str, int] = {}
    for opset in model.opset_import:
        domain = canonical_domain(opset.domain)
        if domain in used:
            versions[domain] = max(versions.get(domain, 0), opset.version)
    del model.opset_import[:]
    model.opset_import.extend(onnx.helper.make_opsetid(d, v) for d, v in sorted(versions.items()))
    model.ir_version = target.ir_version
    check_ops(model, target)
