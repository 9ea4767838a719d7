"""ConvertOpset: a model moved to an ``ai.onnx`` opset its target loads, where its ops keep
their meaning::

    opset newer than the target's newest  ->  lowered to it: every op version crossed adds
                                              element types only (for the types the node
                                              uses), or an attribute that holds its default
                                              (dropped); a change of meaning is an error
                                              naming the node, the op and the opset
    opset older than the target's oldest  ->  raised to it by onnx's version converter
    ai.onnx imported twice                ->  one entry (two versions: the newer, where every
                                              node means the same under both)

skl2onnx 1.20 exports at opset 22 by default (``to_onnx(LinearRegression().fit(X, y),
X[:1])``, listing the default domain twice), and its classifiers with a ZipMap at opset 9;
onnxruntime-training 1.19, the default target, loads opsets 13 to 21. Opset 22 added
bfloat16 to 48 ops and changed nothing else they compute (but AveragePool and MaxPool
with ``ceil_mode=1``), so such models train as they are. :mod:`lossgraph.opsets` holds
the table of changes and their sources.

Every pass runs the same conversion on a model it is given (:class:`Pass`: the contract),
so the model any pass emits imports the target's opset. :func:`~lossgraph.compile_program`
runs this pass first on the model it is given, and its report says what it did.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import onnx

from ..models import ModelLike
from ..opsets import OpsetMove, to_target
from ..target import check_opset
from .contract import Pass, PassResult

__all__ = ["ConvertOpset", "convert_opset"]


@dataclass(frozen=True)
class ConvertOpset(Pass[OpsetMove]):
    """The model at an ``ai.onnx`` opset the active target loads (module docstring). The
    report is the :class:`~lossgraph.opsets.OpsetMove`: the opset before and after, the op
    versions crossed, the attributes dropped."""

    converts_opset: ClassVar[bool] = True

    def call(self, model: onnx.ModelProto) -> PassResult:
        move = to_target(model)
        check_opset(model)  # no ai.onnx import (move is None), two versions of another domain
        changed = move is not None and (move.direction != "kept" or bool(move.imported))
        return PassResult(model, move, changed=changed)


def convert_opset(model: ModelLike) -> onnx.ModelProto:
    """``model`` at an ``ai.onnx`` opset the active target loads (:class:`ConvertOpset`)."""
    return ConvertOpset()(model).model
