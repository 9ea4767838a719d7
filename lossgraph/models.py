"""Loading and checking the models users bring."""

from __future__ import annotations

import os

import onnx

from .errors import InvalidModelError

__all__ = ["ModelLike", "as_model", "check_model"]

#: What every public function accepts as a model.
ModelLike = onnx.ModelProto | bytes | str | os.PathLike


def as_model(model: ModelLike) -> onnx.ModelProto:
    """Accept a ModelProto, serialized bytes or a path; never return the caller's object."""
    if isinstance(model, onnx.ModelProto):
        copy = onnx.ModelProto()
        copy.CopyFrom(model)
        return copy
    try:
        if isinstance(model, bytes):
            return onnx.load_model_from_string(model)
        if isinstance(model, (str, os.PathLike)):
            return onnx.load(os.fspath(model))
    except FileNotFoundError:
        raise InvalidModelError(f"No ONNX file at {os.fspath(model)!r}.") from None
    except Exception as exc:  # protobuf raises DecodeError and friends
        raise InvalidModelError(f"Could not parse an ONNX model: {exc}") from None
    raise InvalidModelError(
        f"Expected an onnx.ModelProto, serialized bytes or a file path, got {type(model).__name__}."
    )


def check_model(model: onnx.ModelProto, what: str = "The model") -> None:
    """Run the ONNX checker with strict shape inference; raise InvalidModelError on failure."""
    try:
        onnx.checker.check_model(model, full_check=True)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as exc:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise InvalidModelError(
            f"{what} is not a valid ONNX model: {first_line}. "
            "Check it with onnx.checker.check_model(model, full_check=True) and fix the "
            "exporter's output before passing it to lossgraph."
        ) from exc
