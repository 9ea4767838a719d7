"""LoRA adapters: the options, the record of each adapter, where adapters can go, the merge.

A LoRA adapter (Hu et al. 2021; PEFT's ``LoraConfig``) trains two small matrices beside a
frozen weight ``W`` whose product computes ``Y = X @ W_eff``::

    Y' = Y + scale * MatMul(MatMul(dropout(X), A), B)      scale = alpha / rank
    A: [in, rank]  (PEFT's lora_A.weight transposed)        B: [rank, out]  (lora_B's)

``W_eff`` [in, out] is ``W`` after what the exporter put between the initializer and the
product: ``Transpose``, Gemm's ``transB``, ``Reshape``/``Identity``/``Cast`` that keep its
shape, a ``DequantizeLinear`` of a quantized base (QLoRA's shape). A ``Conv`` gets PEFT's
conv LoRA: ``A`` [rank, in, *kernel] a Conv with the base's kernel, strides and pads
(not its dilations, as PEFT: a dilated kernel is refused), ``B`` [out, rank, 1, ...] a
1x1 Conv. The rewrite is the pass
:class:`lossgraph.passes.AddLoRA`; this module holds what it and the rest of lossgraph
share:

- :class:`LoRA`: the options (rank, alpha, targets, dropout, init, ops, seed);
- :class:`Adapter`: the record of one adapter (its base weight, module path, tensors,
  layout), kept in the model's metadata under ``lossgraph.adapters`` and in a program's
  manifest; :func:`read_adapters` reads it back;
- :func:`lora_candidates`: every weight an adapter could go on (:class:`LoRACandidate`),
  with the torch module path of its product where the export tells it;
- :func:`merge_adapters`: ``W + delta`` folded into the base weights and the branches
  removed: the graph of the model before the rewrite.

Module paths. A target is chosen by the module path of the product node as well as by the
weight's name, since exporters rename the weights of MatMuls (``onnx::MatMul_200``,
``val_37``): the dynamo exporter's node metadata ``pkg.torch.onnx.name_scopes`` (its last
module path), the legacy exporter's node name (``/bert/encoder/layer.0/attention/self/
query/MatMul``), or a weight named like a torch parameter (``classifier.weight``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, NoReturn

import numpy as np
import onnx
from onnx import numpy_helper

from .errors import UnknownNameError, UnsupportedModelError, UnsupportedOptionError, suggest
from .graphs import (
    FLOAT_TYPES,
    GraphIndex,
    attribute_value,
    constant_value,
    is_onnx_op,
    tensor_array,
    torch_name_scopes,
)
from .metadata import ADAPTERS_KEY, read_json, remove_record, write_json
from .options import choice, count, non_negative

__all__ = ["LoRA", "Adapter", "LoRACandidate", "Site", "lora_candidates", "product_sites",
           "select_sites", "read_adapters", "write_adapters", "merge_adapters", "check_merge",
           "fold_adapters", "module_matches",
           "PEFT_DEFAULT_TARGETS", "INITS", "PRODUCT_OPS"]

#: How ``A`` starts (``B`` starts at zero): PEFT's ``init_lora_weights`` True ("kaiming":
#: uniform in +-1/sqrt(fan_in)), "gaussian" (normal, std 1/rank); "zeros" (A and B zero, a
#: placeholder to load adapters into).
INITS = ("kaiming", "gaussian", "zeros")
#: The products an adapter can go beside.
PRODUCT_OPS = ("MatMul", "Gemm", "Conv")
#: PEFT's default target modules of the common architectures, tried in this order: the
#: first whose names the model's module paths end in is the default.
PEFT_DEFAULT_TARGETS = (("query", "value"), ("q_proj", "v_proj"), ("c_attn",),
                        ("q_lin", "v_lin"), ("q", "v"))

Targets = str | Sequence[str] | Callable[["LoRACandidate"], bool] | None


@dataclass(frozen=True)
class LoRA:
    """The options of LoRA adapters (``compile_program(adapters=LoRA(...))``, ``AddLoRA``).

    ``targets``: which weights get an adapter. A str is a regular expression matched in full
    against the module path or the weight name, or ``"all-linear"`` (every 2-D MatMul/Gemm
    weight but the output layer's); a list is PEFT's rule (a module path equal to an entry
    or ending in ``"." + entry``, or a weight named as the entry); a callable takes a
    :class:`LoRACandidate` and returns a bool. ``None`` (default): PEFT's default target
    modules where the model's module paths name them (:data:`PEFT_DEFAULT_TARGETS`), else
    every 2-D MatMul/Gemm weight. ``ops`` keeps the candidates of those ops only
    (``("Conv",)``); default MatMul and Gemm for the default targets, any op otherwise.
    ``dropout``: the rate of a Dropout on the branch's input (training only). ``seed``:
    the random draw of ``A``.
    """

    rank: int = 8
    alpha: float = 16.0
    targets: Targets = None
    dropout: float = 0.0
    init: str = "kaiming"
    ops: tuple[str, ...] | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        count("LoRA: rank", self.rank, 1)
        alpha = non_negative("LoRA: alpha", self.alpha)
        if alpha == 0:
            raise UnsupportedOptionError("LoRA: alpha=0 makes every adapter's update zero: "
                                         "pass alpha > 0 (PEFT's lora_alpha, e.g. 16).")
        object.__setattr__(self, "alpha", alpha)
        rate = non_negative("LoRA: dropout", self.dropout)
        if rate >= 1:
            raise UnsupportedOptionError(f"LoRA: dropout={self.dropout!r} must be in [0, 1).")
        object.__setattr__(self, "dropout", rate)
        choice("LoRA: init", self.init, INITS)
        count("LoRA: seed", self.seed, 0)
        if self.ops is not None:
            ops = (self.ops,) if isinstance(self.ops, str) else self.ops
            if not isinstance(ops, Sequence) or not ops:
                raise UnsupportedOptionError(
                    f"LoRA: ops={self.ops!r} must be a list of op types among "
                    f"{', '.join(PRODUCT_OPS)}, or None.")
            object.__setattr__(self, "ops", tuple(choice("LoRA: ops", op, PRODUCT_OPS)
                                                  for op in ops))
        targets = self.targets
        if isinstance(targets, str):
            if targets != "all-linear":
                _pattern(targets)
        elif targets is not None and not callable(targets):
            if isinstance(targets, Mapping) or not isinstance(targets, Sequence) or not targets \
                    or not all(isinstance(t, str) for t in targets):
                raise UnsupportedOptionError(
                    f"LoRA: targets={targets!r} must be a regular expression, a non-empty list "
                    "of module names (PEFT's target_modules, e.g. ['query', 'value']), "
                    "'all-linear', a callable taking a LoRACandidate, or None.")
            object.__setattr__(self, "targets", tuple(targets))

    @property
    def scale(self) -> float:
        """What the branch is multiplied by: ``alpha / rank``."""
        return self.alpha / self.rank


@dataclass(frozen=True)
class Adapter:
    """One adapter: the base ``weight`` it goes beside (the initializer the product reads,
    through the chain; a quantized base's integer tensor), the torch ``module`` path when
    known, the names of its tensors ``a`` and ``b``, ``kind`` ("linear" or "conv"),
    ``rank``, ``alpha`` and ``layout``: how ``W_eff`` relates to ``W``, "in_out" (``W``
    is [in, out]), "out_in" (``W`` is [out, in], used transposed) or "conv"."""

    weight: str
    module: str | None
    a: str
    b: str
    kind: str
    rank: int
    alpha: float
    layout: str

    @property
    def scale(self) -> float:
        """``alpha / rank``."""
        return self.alpha / self.rank

    def delta(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """``scale * (A @ B)`` laid out as the weight (PEFT's merge for a conv), in the
        adapter's dtype."""
        if self.kind == "conv":  # A [r, in, *k], B [out, r, 1, ...] -> [out, in, *k]
            product = np.tensordot(b.reshape(b.shape[0], b.shape[1]), a, axes=(1, 0))
        else:
            product = a @ b
            product = product.T if self.layout == "out_in" else product
        return (product * np.asarray(self.scale, product.dtype)).astype(a.dtype)

    def peft_names(self) -> tuple[str, str] | None:
        """PEFT's names of ``A`` and ``B`` (``base_model.model.{module}.lora_A.weight``),
        when the module path is known."""
        if self.module is None:
            return None
        prefix = f"base_model.model.{self.module}"
        return f"{prefix}.lora_A.weight", f"{prefix}.lora_B.weight"

    def to_record(self) -> dict[str, Any]:
        """The JSON record (metadata, manifest)."""
        return asdict(self)

    @classmethod
    def from_record(cls, record: Mapping[str, Any], where: str = "the adapters' record"
                    ) -> Adapter:
        """The adapter a :meth:`to_record` record describes; a damaged one is an
        UnsupportedModelError naming ``where``."""
        try:
            adapter = cls(**{f: record[f] for f in _RECORD_FIELDS})
        except (KeyError, TypeError) as exc:
            raise UnsupportedModelError(f"{where} is damaged ({exc!r}): expected the fields "
                                        f"{', '.join(_RECORD_FIELDS)}.") from None
        if adapter.kind not in ("linear", "conv") or adapter.layout not in (
                "in_out", "out_in", "conv") or not all(isinstance(getattr(adapter, n), str)
                                                        for n in ("weight", "a", "b")):
            raise UnsupportedModelError(f"{where} is damaged: {dict(record)!r}.")
        return adapter


_RECORD_FIELDS = ("weight", "module", "a", "b", "kind", "rank", "alpha", "layout")


@dataclass(frozen=True)
class LoRACandidate:
    """A weight an adapter could go on: the initializer ``weight``, the torch ``module``
    path of its product (None when the export does not tell), the product's ``op`` and the
    weight's stored ``shape``."""

    weight: str
    module: str | None
    op: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Site:
    """Where an adapter goes: the candidate, its product node, the value the branch reads
    (the product's input ``X``), the layout, ``W_eff``'s [in, out] (a conv: in channels,
    out channels), the element type of ``W_eff``, and whether the base is quantized."""

    candidate: LoRACandidate
    node: onnx.NodeProto = field(repr=False)
    x: str
    layout: str
    features: tuple[int, int]
    elem_type: int
    quantized: bool

    @property
    def kind(self) -> str:
        """The adapter's kind: "conv" beside a Conv, else "linear"."""
        return "conv" if self.candidate.op == "Conv" else "linear"


def read_adapters(model: onnx.ModelProto) -> tuple[Adapter, ...]:
    """The adapters ``model`` records (``lossgraph.adapters``); empty without any."""
    records = read_json(model, ADAPTERS_KEY)
    if records is None:
        return ()
    if not isinstance(records, list):
        raise UnsupportedModelError(f"The model's {ADAPTERS_KEY!r} record is damaged: expected "
                                    "a list of adapters.")
    return tuple(Adapter.from_record(r, f"The model's {ADAPTERS_KEY!r} record") for r in records)


def write_adapters(model: onnx.ModelProto, adapters: Sequence[Adapter]) -> None:
    """Record ``adapters`` in ``model``'s metadata, in place (none: the record goes)."""
    if adapters:
        write_json(model, ADAPTERS_KEY, [a.to_record() for a in adapters])
    else:
        remove_record(model, ADAPTERS_KEY)


# -- where adapters can go ------------------------------------------------------------------


def lora_candidates(model: onnx.ModelProto) -> list[LoRACandidate]:
    """Every weight an adapter could go on (module doc), in graph order."""
    return [s.candidate for s in product_sites(model)]


def product_sites(model: onnx.ModelProto) -> list[Site]:
    """The :class:`Site` of every product reading an initializer as its weight through a
    chain of layout ops, in graph order; products an adapter already goes beside, and the
    adapters' own products, are left out."""
    graph = model.graph
    tensors = {t.name: t for t in graph.initializer}
    index = GraphIndex(graph.node)
    adapted = {name for a in read_adapters(model) for name in (a.weight, a.a, a.b)}
    calls = _call_paths(graph, tensors)
    sites = []
    for node in graph.node:
        if not is_onnx_op(node, *PRODUCT_OPS) or len(node.input) < 2:
            continue
        site = _site(node, tensors, index, calls)
        if site is not None and site.candidate.weight not in adapted:
            sites.append(site)
    return sites


def _site(node: onnx.NodeProto, tensors: Mapping[str, onnx.TensorProto],
          index: GraphIndex, calls: Mapping[str, str]) -> Site | None:
    """The site of the product ``node`` when its weight input comes from an initializer
    through layout ops that keep its shape (at most one transpose), else None."""
    chain: list[onnx.NodeProto] = []
    value = node.input[1]
    while value not in tensors:
        producer = index.producer(value)
        if producer is None or not is_onnx_op(producer, "Identity", "Cast", "Reshape",
                                              "Transpose", "DequantizeLinear"):
            return None
        chain.insert(0, producer)
        value = producer.input[0]
    weight = tensors[value]
    dims = list(weight.dims)
    transposes = 0
    quantized = False
    elem_type = weight.data_type
    for position, step in enumerate(chain):
        if step.op_type == "DequantizeLinear":
            if position or weight.data_type in FLOAT_TYPES:
                return None
            quantized = True
            scale = tensors.get(step.input[1])
            elem_type = scale.data_type if scale is not None else onnx.TensorProto.FLOAT
        elif step.op_type == "Cast":
            elem_type = attribute_value(step, "to")
        elif step.op_type == "Transpose":
            if len(dims) != 2 or list(attribute_value(step, "perm", [1, 0])) != [1, 0]:
                return None
            dims, transposes = dims[::-1], transposes + 1
        elif step.op_type == "Reshape":
            shape = _constant(step.input[1], tensors, index)
            if shape is None or [int(d) for d in shape] != dims:
                return None
    if elem_type not in FLOAT_TYPES:
        return None
    if node.op_type == "Conv":
        if transposes or len(dims) < 3:
            return None
        layout, features = "conv", (dims[1] * attribute_value(node, "group", 1), dims[0])
    else:
        if len(dims) != 2:
            return None
        if node.op_type == "Gemm" and attribute_value(node, "transB", 0):
            dims, transposes = dims[::-1], transposes + 1
        layout, features = ("out_in" if transposes % 2 else "in_out"), (dims[0], dims[1])
    module = _module_path(node, weight.name, calls)
    candidate = LoRACandidate(weight.name, module, node.op_type, tuple(weight.dims))
    return Site(candidate, node, node.input[0], layout, features, elem_type, quantized)


def _constant(name: str, tensors: Mapping[str, onnx.TensorProto], index: GraphIndex
              ) -> np.ndarray | None:
    """The value of ``name`` when an initializer or a Constant node holds it."""
    if name in tensors:
        return tensor_array(tensors[name])
    producer = index.producer(name)
    return constant_value(producer) if producer is not None and is_onnx_op(
        producer, "Constant") else None


def _module_path(node: onnx.NodeProto, weight: str, calls: Mapping[str, str]) -> str | None:
    """The torch module path of the product ``node`` reading ``weight`` (module doc), or
    None: the dynamo exporter's last module scope, else the module its legacy scope is a
    call of (:func:`_call_paths`), else the weight's name less ``.weight``."""
    module = None
    for scope in torch_name_scopes(node):
        if module is None or not module or scope.startswith(module + "."):
            module = scope
    if module:
        return module
    scope = _legacy_scope(node)
    if scope is not None:
        return calls.get(scope, scope)
    if weight.endswith(".weight") and len(weight) > len(".weight"):
        return weight[:-len(".weight")]
    return None


#: A name torch gives a parameter or buffer: ``encoder.layer.0.query.weight``.
_PARAMETER = re.compile(r"[A-Za-z_]\w*(?:\.\w+)+")


def _legacy_scope(node: onnx.NodeProto) -> str | None:
    """The module scope of a legacy export's node, dotted: ``/encoder/query/Gemm`` ->
    ``encoder.query``; None for a node outside any module or not so named."""
    if node.name.startswith("/") and node.name.count("/") > 1:
        return ".".join(node.name.strip("/").split("/")[:-1])
    return None


def _call_paths(graph: onnx.GraphProto, tensors: Mapping[str, onnx.TensorProto]
                ) -> dict[str, str]:
    """The module path of each legacy scope the parameters its nodes read tell.

    The legacy exporter names a node by the modules on its call stack, each by its own name
    only (``layer.0``, made unique with ``_1``): a module its grandparent calls
    (``self.encoder.query(x)`` in ``Net.forward``) gives the scope ``query``, not
    ``encoder.query``. A parameter its nodes read (``encoder.query.weight``, or the bias a
    MatMul's Add reads: exporters rename the weights of MatMuls) names the full path; a
    scope whose parameters name one such path, ending in the scope's calls, is that path.
    """
    found: dict[str, set[str]] = {}
    for node in graph.node:
        scope = _legacy_scope(node)
        if scope is None:
            continue
        for name in node.input:
            if name in tensors and _PARAMETER.fullmatch(name):
                path = name.rsplit(".", 1)[0]
                if _is_call_of(scope, path):
                    found.setdefault(scope, set()).add(path)
    return {scope: next(iter(paths)) for scope, paths in found.items() if len(paths) == 1}


def _is_call_of(scope: str, path: str) -> bool:
    """Whether the legacy ``scope`` (calls ``/``-joined, as dotted by :func:`_legacy_scope`)
    can be a call stack ending in the module ``path``: each call's name (less a ``_<n>``
    the exporter added) a run of ``path``'s parts, in order, the last one at its end."""
    parts, calls, start = path.split("."), _calls(scope), 0
    for position, call in enumerate(calls):
        last = position == len(calls) - 1
        starts = [len(parts) - len(call)] if last else range(start, len(parts) - len(call) + 1)
        for at in starts:
            if at >= start and _names_call(parts[at:at + len(call)], call):
                start = at + len(call)
                break
        else:
            return False
    return True


def _calls(scope: str) -> list[list[str]]:
    """The calls of a dotted legacy scope, each a list of parts: a numeric part belongs to
    the call before it (``encoder.layer.0.query`` -> ``encoder``, ``layer.0``, ``query``)."""
    calls: list[list[str]] = []
    for part in scope.split("."):
        if part.isdigit() and calls:
            calls[-1].append(part)
        else:
            calls.append([part])
    return calls


def _names_call(parts: list[str], call: list[str]) -> bool:
    """Whether module path ``parts`` are the call's name, or it with the ``_<n>`` suffix the
    legacy exporter adds to a scope's repeated calls."""
    if len(parts) != len(call) or parts[:-1] != call[:-1]:
        return False
    return parts[-1] == call[-1] or re.fullmatch(re.escape(parts[-1]) + r"_\d+",
                                                 call[-1]) is not None


def select_sites(model: onnx.ModelProto, options: LoRA) -> list[Site]:
    """The sites ``options`` targets in ``model``, in graph order; a target that is not a
    product's weight, a pattern matching nothing, a rank above a weight's smaller side, a
    grouped or dilated Conv is an error, raised before any work."""
    sites = product_sites(model)
    if options.ops is not None:
        sites = [s for s in sites if s.candidate.op in options.ops]
    targets = options.targets
    if targets is None:
        targets = _default_targets(sites)
        if targets is None:
            linear = [s for s in sites if s.kind == "linear"] if options.ops is None else sites
            return _checked(linear or _no_match(model, sites, None), options)
    if targets == "all-linear":
        index = GraphIndex(model.graph.node)
        chosen = [s for s in sites if s.kind == "linear" and not _writes_output(model, index, s)]
    elif isinstance(targets, str):
        expression = _pattern(targets)
        chosen = [s for s in sites if expression.fullmatch(s.candidate.weight)
                  or (s.candidate.module is not None
                      and expression.fullmatch(s.candidate.module))]
        if not chosen:
            _refuse_non_products(model, [t.name for t in model.graph.initializer
                                   if expression.fullmatch(t.name)])
    elif callable(targets):
        chosen = [s for s in sites if targets(s.candidate)]
    else:
        chosen = [s for s in sites if any(_peft_match(s.candidate, t) for t in targets)]
        matched = {t for t in targets for s in chosen if _peft_match(s.candidate, t)}
        _refuse_non_products(model, [t for t in targets if t not in matched])
    return _checked(chosen or _no_match(model, sites, targets), options)


def module_matches(module: str | None, entry: str) -> bool:
    """PEFT's rule for a ``target_modules`` entry (and a ``rank_pattern`` key): the module
    path is ``entry`` or ends in ``"." + entry``."""
    return module is not None and (module == entry or module.endswith("." + entry))


def _peft_match(candidate: LoRACandidate, entry: str) -> bool:
    """PEFT's rule (:func:`module_matches`), or the weight named ``entry``."""
    return candidate.weight == entry or module_matches(candidate.module, entry)


def _default_targets(sites: Sequence[Site]) -> tuple[str, ...] | None:
    """PEFT's default target modules that the sites' module paths name, or None."""
    leaves = {s.candidate.module.rsplit(".", 1)[-1] for s in sites if s.candidate.module}
    return next((names for names in PEFT_DEFAULT_TARGETS if leaves & set(names)), None)


def _writes_output(model: onnx.ModelProto, index: GraphIndex, site: Site) -> bool:
    """True when the product's output reaches a graph output through no other product (the
    output layer, which "all-linear" leaves out as PEFT does)."""
    outputs = {o.name for o in model.graph.output}
    pending, seen = list(site.node.output), set()
    while pending:
        value = pending.pop()
        if value in outputs:
            return True
        seen.add(value)
        for reader in index.readers(value):
            if not is_onnx_op(reader, *PRODUCT_OPS):
                pending += [o for o in reader.output if o and o not in seen]
    return False


def _pattern(text: str) -> re.Pattern[str]:
    """``targets`` compiled as a regular expression; a malformed one is an option error."""
    try:
        return re.compile(text)
    except re.error as exc:
        raise UnsupportedOptionError(
            f"LoRA: targets={text!r} is not a regular expression ({exc}).") from None


def _refuse_non_products(model: onnx.ModelProto, names: Sequence[str]) -> None:
    """An UnsupportedModelError for the first of ``names`` that is an initializer but no
    product's weight, naming what reads it."""
    tensors = {t.name for t in model.graph.initializer}
    index = GraphIndex(model.graph.node)
    for name in names:
        if name in tensors:
            readers = [f"{n.op_type} {n.name or n.output[0]!r}" for n in index.readers(name)]
            read = f"read by {', '.join(readers)}" if readers else "read by no node"
            raise UnsupportedModelError(
                f"LoRA targets {name!r}, which is not the weight of a product ({read}): an "
                f"adapter goes beside the weight of a {', '.join(PRODUCT_OPS)} (through "
                "Transpose, Reshape, Cast or DequantizeLinear). lossgraph.lora_candidates(model) "
                "lists them.")


def _no_match(model: onnx.ModelProto, sites: Sequence[Site], targets: Targets) -> NoReturn:
    """Raise the UnknownNameError of targets that match nothing, listing what they could
    match."""
    names = [s.candidate.module or s.candidate.weight for s in sites]
    what = "nothing" if targets is None else f"targets={targets!r}"
    raise UnknownNameError(
        f"LoRA: {what} matches no weight of a product (lossgraph.lora_candidates(model) lists "
        "them by module path or weight name)." + suggest(
            str(targets[0]) if isinstance(targets, (tuple, list)) else str(targets), names,
            "targets"))


def _checked(sites: list[Site], options: LoRA) -> list[Site]:
    """``sites``, once each fits ``options`` (rank) and PEFT's conv LoRA (no groups, no
    dilated kernel)."""
    for site in sites:
        label = site.candidate.module or site.candidate.weight
        if site.kind == "conv" and attribute_value(site.node, "group", 1) != 1:
            raise UnsupportedModelError(
                f"LoRA targets the Conv of {label!r}, which has group="
                f"{attribute_value(site.node, 'group', 1)}: PEFT's conv LoRA neither merges "
                "nor matches a grouped Conv. Leave it out of targets.")
        if site.kind == "conv":
            kernel = site.candidate.shape[2:]
            dilations = attribute_value(site.node, "dilations", [1] * len(kernel))
            if any(d != 1 and k != 1 for d, k in zip(dilations, kernel)):
                raise UnsupportedModelError(
                    f"LoRA targets the Conv of {label!r}, which has dilations="
                    f"{list(dilations)}: PEFT's conv LoRA gives its A Conv the kernel, "
                    "strides and pads but not the dilations, so its update is not the base's "
                    "shape (PEFT fails) or, with padding='same', cannot be merged into it. "
                    "Leave it out of targets.")
        smaller = min(site.features[0] * _kernel_size(site), site.features[1])
        if options.rank > smaller:
            raise UnsupportedOptionError(
                f"LoRA: rank={options.rank} is larger than the smaller side ({smaller}) of "
                f"{label!r} (in {site.features[0]}, out {site.features[1]}): a low-rank "
                f"update of rank {smaller} or less spans it. Pass rank <= {smaller}, or "
                "leave it out of targets.")
    return sites


def _kernel_size(site: Site) -> int:
    """The number of kernel positions of a conv site's weight (1 for a linear one)."""
    return math.prod(site.candidate.shape[2:]) if site.kind == "conv" else 1


# -- the merge ------------------------------------------------------------------------------


def merge_adapters(model: onnx.ModelProto, values: Mapping[str, np.ndarray] | None = None
                   ) -> onnx.ModelProto:
    """A copy of ``model`` with each recorded adapter's ``delta`` folded into its base
    weight and its branch removed: the graph of the model before the rewrite (its nodes,
    names and op count), the adapters' tensors and record gone. ``values`` overrides the
    model's initializers (the adapters' tensors, their base weights). What
    :func:`check_merge` refuses is refused before anything is merged."""
    merged = onnx.ModelProto()
    merged.CopyFrom(model)
    given = dict(values or {})
    arrays = {t.name: t for t in model.graph.initializer}
    fold_adapters(merged, lambda name: given[name] if name in given
                  else tensor_array(arrays[name]))
    return merged


def check_merge(model: onnx.ModelProto) -> None:
    """Refuse, as :func:`merge_adapters` would, a model whose adapters cannot be merged: a
    quantized base (DequantizeLinear before the product: ``W + delta`` is no longer on its
    quantization grid; keep the branch, ``merge=False``), or a base another node reads too
    (the merge would change it). Nothing is computed: a check before any work."""
    index = GraphIndex(model.graph.node)
    for adapter in read_adapters(model):
        _Fold.of(index, adapter)


def fold_adapters(model: onnx.ModelProto, value: Callable[[str], np.ndarray]
                  ) -> dict[str, np.ndarray]:
    """Fold, in ``model`` itself, each recorded adapter into its base weight and remove its
    branch, its tensors (initializers and graph inputs) and the record, once
    :func:`check_merge` passes. A base that is an initializer of ``model`` gets the sum of
    its value and its adapter's ``delta``; the others' sums are returned by name, for the
    caller to write where they live (a large weight kept out of the model while it is
    exported). ``value(name)`` gives the current value of an adapter's tensor or base
    weight."""
    graph = model.graph
    index = GraphIndex(graph.node)
    adapters = read_adapters(model)
    folds = [_Fold.of(index, adapter) for adapter in adapters]
    weights = {}
    for adapter, fold in zip(adapters, folds):
        delta = adapter.delta(np.asarray(value(adapter.a)),
                              np.asarray(value(adapter.b))).astype(np.float64)
        if is_onnx_op(fold.product, "Gemm"):
            delta /= attribute_value(fold.product, "alpha", 1.0)
        weight = np.asarray(value(adapter.weight))
        weights[adapter.weight] = (weight.astype(np.float64) + delta.reshape(weight.shape)
                                   ).astype(weight.dtype)
        outputs = fold.product.output
        outputs[list(outputs).index(fold.base)] = fold.branch[-1].output[0]
    removed = {id(n) for fold in folds for n in fold.branch}
    tensors = {name for adapter in adapters for name in (adapter.a, adapter.b)}
    _keep(graph.node, lambda n: id(n) not in removed)
    _keep(graph.initializer, lambda t: t.name not in tensors)
    _keep(graph.input, lambda i: i.name not in tensors)
    write_adapters(model, ())
    for tensor in graph.initializer:
        if tensor.name in weights:
            tensor.CopyFrom(numpy_helper.from_array(weights.pop(tensor.name), tensor.name))
    return weights


def _keep(items: Any, keep: Callable[[Any], bool]) -> None:
    """Keep the items of a repeated protobuf field that ``keep`` accepts, in order."""
    kept = [item for item in items if keep(item)]
    del items[:]
    items.extend(kept)


@dataclass(frozen=True)
class _Fold:
    """What merging one adapter changes: its ``branch`` (ending with the Add), the
    ``product`` beside it and the value ``base`` the product writes for the Add."""

    branch: list[onnx.NodeProto]
    product: onnx.NodeProto
    base: str

    @classmethod
    def of(cls, index: GraphIndex, adapter: Adapter) -> _Fold:
        """The fold of ``adapter``; an error when it cannot be merged (:func:`check_merge`)."""
        label = adapter.module or adapter.weight
        branch = _branch(index, adapter)
        add = branch[-1]
        base = next(i for i in add.input if i not in branch[-2].output)
        product = index.producer(base)
        chain = _chain_nodes(index, product, adapter.weight)
        readers = [n for value in [adapter.weight, *(c.output[0] for c in chain)]
                   for n in index.readers(value)]
        if any(is_onnx_op(c, "DequantizeLinear") for c in chain):
            raise UnsupportedOptionError(
                f"merge=True on the adapter of {label!r}, whose base {adapter.weight!r} is "
                "quantized (DequantizeLinear): W + delta is not on its quantization grid, and "
                "re-quantizing would lose the update. Export with merge=False (the base "
                "stays quantized, the adapter beside it).")
        if len(readers) != len(chain) + 1:
            raise UnsupportedOptionError(
                f"merge=True on the adapter of {label!r}: other nodes read its base "
                f"{adapter.weight!r} too, and merging would change them. Export with "
                "merge=False.")
        return cls(branch, product, base)


def _branch(index: GraphIndex, adapter: Adapter) -> list[onnx.NodeProto]:
    """The nodes of an adapter's branch, ending with the Add of the product's output: its
    two products, Mul and Add, what lays out its input for it alone (a Dropout, an
    Identity, Gemm's transpose of ``X``) and the constants only it reads."""
    first = index.readers(adapter.a)
    if len(first) != 1:
        raise UnsupportedModelError(f"The adapter {adapter.a!r} is not read by one branch.")
    nodes = [first[0]]
    while not is_onnx_op(nodes[-1], "Add"):
        readers = index.readers(nodes[-1].output[0])
        if len(readers) != 1 or len(nodes) > 3:
            raise UnsupportedModelError(
                f"The branch of the adapter {adapter.a!r} is not the one AddLoRA writes "
                "(MatMul or Conv, MatMul or Conv, Mul, Add).")
        nodes.append(readers[0])
    value = nodes[0].input[0]
    while True:
        producer = index.producer(value)
        if producer is None or not is_onnx_op(producer, "Dropout", "Identity", "Transpose") \
                or len(index.readers(value)) != 1:
            break
        nodes.insert(0, producer)
        value = producer.input[0]
    members = {id(n) for n in nodes}
    for node in list(nodes):  # the branch's constants (its scale, a Dropout's ratio)
        for name in node.input:
            producer = index.producer(name)
            if producer is not None and is_onnx_op(producer, "Constant") \
                    and id(producer) not in members \
                    and all(id(r) in members for r in index.readers(name)):
                nodes.insert(0, producer)
                members.add(id(producer))
    return nodes


def _chain_nodes(index: GraphIndex, product: onnx.NodeProto | None, weight: str
                 ) -> list[onnx.NodeProto]:
    """The layout nodes between the initializer ``weight`` and ``product``'s weight input."""
    if product is None:
        raise UnsupportedModelError(f"No product reads the adapter's base {weight!r}.")
    chain, value = [], product.input[1]
    while value != weight:
        producer = index.producer(value)
        if producer is None:
            raise UnsupportedModelError(f"The product {product.name!r} does not read {weight!r}.")
        chain.append(producer)
        value = producer.input[0]
    return chain
