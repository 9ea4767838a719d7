"""Element types, dtypes, shapes and opsets of ONNX values, as lossgraph names them.

``"ai.onnx"`` and ``""`` are the same domain, the default one: :func:`is_default_domain`
and :func:`canonical_domain` are the one test and the one spelling.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import onnx
from onnx import helper

from ..errors import DTypeMismatchError, UnsupportedModelError, UnsupportedOptionError

__all__ = ["FLOAT_TYPES", "Shape", "elem_type_name", "np_dtype", "weights_dtype",
           "opset_version", "is_default_domain", "canonical_domain", "is_onnx_op"]

#: Element types lossgraph differentiates and trains.
FLOAT_TYPES = frozenset({onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE})

#: A static shape: ints for known dims, strings for symbolic ones, None for unknown.
Shape = tuple[int | str | None, ...]


def weights_dtype(weights: Mapping[str, np.ndarray], what: str) -> np.dtype:
    """The one float dtype (float32 or float64) all ``weights`` share."""
    if not weights:
        raise UnsupportedOptionError(f"{what} needs at least one weight; none was given.")
    dtypes: dict[np.dtype, str] = {}
    for name, value in weights.items():
        dtype = np.asarray(value).dtype
        if helper.np_dtype_to_tensor_dtype(dtype) not in FLOAT_TYPES:
            raise DTypeMismatchError(
                f"Weight {name!r} is {dtype}; {what} works on float32 or float64 weights."
            )
        dtypes.setdefault(dtype, name)
    if len(dtypes) > 1:
        listing = ", ".join(f"{name!r} is {dtype}" for dtype, name in dtypes.items())
        raise UnsupportedModelError(
            f"{what} needs weights of one float type, but {listing}. Cast the model's "
            "weights to one type first."
        )
    return next(iter(dtypes))


def elem_type_name(elem_type: int) -> str:
    """'float', 'double', 'int64'... for an ONNX element type; 'undefined' for 0 and
    'element type 99' for a number ONNX does not define (a damaged model's), so that the
    message about it can be written."""
    if elem_type in onnx.TensorProto.DataType.values():
        return onnx.TensorProto.DataType.Name(elem_type).lower()
    return f"element type {elem_type}"


def np_dtype(elem_type: int) -> np.dtype:
    """The numpy dtype of an ONNX element type."""
    return helper.tensor_dtype_to_np_dtype(elem_type)


def opset_version(model: onnx.ModelProto, domain: str = "") -> int | None:
    """The version of ``domain`` the model imports (``None`` when it does not)."""
    aliases = {"", "ai.onnx"} if domain in ("", "ai.onnx") else {domain}
    versions = [op.version for op in model.opset_import if op.domain in aliases]
    return max(versions) if versions else None


def is_default_domain(domain: str) -> bool:
    """Whether ``domain`` is ONNX's default operator domain, spelled ``""`` or ``"ai.onnx"``."""
    return domain in ("", "ai.onnx")


def canonical_domain(domain: str) -> str:
    """``domain``, with the default one spelled ``""``."""
    return "" if domain == "ai.onnx" else domain


def is_onnx_op(node: onnx.NodeProto, *op_types: str) -> bool:
    """Whether ``node`` is one of the standard ONNX ops ``op_types`` (default domain)."""
    return node.op_type in op_types and is_default_domain(node.domain)
