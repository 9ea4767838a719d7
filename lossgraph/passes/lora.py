"""AddLoRA: LoRA adapters beside the weights of a model's products.

For each target weight ``W`` whose product computes ``Y = X @ W_eff``
(:mod:`lossgraph.adapters` says what ``W_eff`` may be and how targets are chosen)::

    Y = MatMul(X, W_eff)      ->  Y_base = MatMul(X, W_eff)
                                  Y = Add(Y_base, Mul(MatMul(MatMul(dropout(X), A), B), scale))
    Y = Gemm(X, W, C)         ->  the same on the Gemm's output, X transposed for transA
    Y = Conv(X, W, b)         ->  Y = Add(Y_base, Mul(Conv(Conv(dropout(X), A), B), scale))
                                  A: a Conv with W's kernel, strides, pads and dilations,
                                  B: a 1x1 Conv (PEFT's conv LoRA)

``scale = alpha / rank``; ``A`` starts as PEFT draws it, ``B`` at zero, so the model's
outputs are unchanged. ``dropout(X)`` is a Dropout in training mode (``dropout > 0``), which
:class:`~lossgraph.passes.StripTraining` and :class:`~lossgraph.passes.InferenceMode` turn
off for inference and evaluation. The base weights stay initializers (frozen); ``A`` and
``B`` are initializers named ``<module>.lora_A`` / ``<module>.lora_B`` (the torch module
path, else the weight's name). Each adapter is recorded
(:class:`~lossgraph.adapters.Adapter`) under the model's ``lossgraph.adapters``, which
``compile_program`` reads to train the adapters alone, and
:func:`~lossgraph.adapters.merge_adapters` to fold them back.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..adapters import (
    Adapter,
    LoRA,
    Site,
    Targets,
    read_adapters,
    select_sites,
    write_adapters,
)
from ..graphs import attribute_value, is_onnx_op, np_dtype
from ..models import ModelLike
from ..names import NameAuthority
from .contract import Pass, PassResult

__all__ = ["AddLoRA", "add_lora"]

#: The attributes of a base Conv that its adapter's ``A`` Conv takes.
_CONV_ATTRIBUTES = ("auto_pad", "dilations", "kernel_shape", "pads", "strides")


@dataclass(frozen=True)
class AddLoRA(Pass[tuple[Adapter, ...]]):
    """LoRA adapters beside the weights ``options`` targets (module doc); the report is the
    adapters written, in graph order."""

    options: LoRA = field(default_factory=LoRA)

    def call(self, model: onnx.ModelProto) -> PassResult:
        sites = select_sites(model, self.options)
        names = NameAuthority.for_model(model)
        rng = np.random.default_rng(self.options.seed)
        branches: dict[int, list[onnx.NodeProto]] = {}
        adapters = []
        for site in sites:
            adapter, nodes, tensors = _adapter(site, self.options, names, rng)
            adapters.append(adapter)
            branches[id(site.node)] = nodes
            model.graph.initializer.extend(tensors)
        nodes = [n for node in model.graph.node for n in (node, *branches.get(id(node), ()))]
        del model.graph.node[:]
        model.graph.node.extend(nodes)
        write_adapters(model, (*read_adapters(model), *adapters))
        return PassResult(model, tuple(adapters))


def add_lora(model: ModelLike, targets: Targets = None, rank: int = 8, alpha: float = 16,
             dropout: float = 0.0, init: str = "kaiming", seed: int = 0,
             ops: Sequence[str] | None = None) -> onnx.ModelProto:
    """``model`` with LoRA adapters beside the weights ``targets`` selects
    (:class:`AddLoRA`, :class:`~lossgraph.adapters.LoRA` for the options)."""
    options = LoRA(rank, alpha, targets, dropout, init, tuple(ops) if ops else None, seed)
    return AddLoRA(options)(model).model


def _adapter(site: Site, options: LoRA, names: NameAuthority, rng: np.random.Generator
             ) -> tuple[Adapter, list[onnx.NodeProto], list[onnx.TensorProto]]:
    """The adapter of ``site``: its record, the branch's nodes (to go right after the
    product) and its tensors ``A`` and ``B``."""
    candidate, product = site.candidate, site.node
    prefix = candidate.module or candidate.weight
    a_name, b_name = names.fresh(f"{prefix}.lora_A"), names.fresh(f"{prefix}.lora_B")
    dtype = np_dtype(site.elem_type)
    rank, (features_in, features_out) = options.rank, site.features
    kernel = tuple(candidate.shape[2:]) if site.kind == "conv" else ()
    a_shape = (rank, features_in, *kernel) if kernel else (features_in, rank)
    b_shape = (features_out, rank, *(1,) * len(kernel)) if kernel else (rank, features_out)
    a = _initial_a(options, a_shape, features_in * math.prod(kernel), rng).astype(dtype)
    b = np.zeros(b_shape, dtype)
    node = _NodeMaker(names, prefix)
    x = site.x
    if is_onnx_op(product, "Gemm") and attribute_value(product, "transA", 0):
        x = node("Transpose", [x], "input_t", perm=[1, 0])
    if options.dropout:
        ratio = node("Constant", [], "dropout_ratio", value=numpy_helper.from_array(
            np.asarray(options.dropout, dtype), "ratio"))
        training = node("Constant", [], "dropout_training",
                        value=numpy_helper.from_array(np.asarray(True), "training"))
        x = node("Dropout", [x, ratio, training], "dropout")
    if kernel:
        conv = {k: attribute_value(product, k) for k in _CONV_ATTRIBUTES
                if attribute_value(product, k) is not None}
        down = node("Conv", [x, a_name], "down", **conv)
        up = node("Conv", [down, b_name], "up")
    else:
        up = node("MatMul", [node("MatMul", [x, a_name], "down"), b_name], "up")
    scale = node("Constant", [], "scale", value=numpy_helper.from_array(
        np.asarray(options.scale, dtype), "scale"))
    output = product.output[0]
    base = names.fresh(f"{output}_base")
    product.output[0] = base
    node("Add", [base, node("Mul", [up, scale], "scaled")], "output", output=output)
    adapter = Adapter(candidate.weight, candidate.module, a_name, b_name, site.kind, rank,
                      options.alpha, site.layout)
    return adapter, node.made, [numpy_helper.from_array(a, a_name),
                                numpy_helper.from_array(b, b_name)]


def _initial_a(options: LoRA, shape: tuple[int, ...], fan_in: int, rng: np.random.Generator
               ) -> np.ndarray:
    """``A`` as PEFT draws it: kaiming uniform (bound 1/sqrt(fan_in)), normal with std
    1/rank, or zeros."""
    if options.init == "kaiming":
        bound = 1 / math.sqrt(fan_in)
        return rng.uniform(-bound, bound, shape)
    if options.init == "gaussian":
        return rng.normal(0.0, 1 / options.rank, shape)
    return np.zeros(shape)


class _NodeMaker:
    """Makes the nodes of one branch in the order made, values named
    ``<prefix>.lora_<what>``, nodes ``<prefix>/lora/<what>``."""

    def __init__(self, names: NameAuthority, prefix: str) -> None:
        self.names, self.prefix = names, prefix
        self.made: list[onnx.NodeProto] = []

    def __call__(self, op_type: str, inputs: list[str], what: str, output: str | None = None,
                 **attributes: object) -> str:
        output = output or self.names.fresh(f"{self.prefix}.lora_{what}")
        self.made.append(helper.make_node(op_type, inputs, [output],
                                          name=self.names.fresh(f"{self.prefix}/lora/{what}"),
                                          **attributes))
        return output
