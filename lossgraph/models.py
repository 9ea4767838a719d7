"""Loading and checking the models users bring.

:func:`as_model` takes a ModelProto, serialized bytes or a file path and returns a
private copy, or an :class:`~lossgraph.errors.InvalidModelError` naming the file and
what is wrong with it: missing, a folder, empty, not ONNX or cut short, external data
missing or not loaded. External data is read only from inside the model file's
folder: a location that is absolute, leads out of the folder (``..``) or through a
link out of it is refused before anything is read. An in-memory model (ModelProto or
bytes) whose tensors still point to external files is refused too: onnx would look
for those files in the current directory.
"""

from __future__ import annotations

import os
from pathlib import Path

import onnx
from google.protobuf.message import DecodeError
from onnx.external_data_helper import load_external_data_for_tensor, uses_external_data

from .errors import InternalError, InvalidModelError
from .graphs import stored_tensors, without_weight_data
from .target import finalize

__all__ = ["ModelLike", "as_model", "check_model", "check_emitted"]

#: What every public function accepts as a model.
ModelLike = onnx.ModelProto | bytes | str | os.PathLike

_REEXPORT = "Export or download the model again"


def as_model(model: ModelLike) -> onnx.ModelProto:
    """Accept a ModelProto, serialized bytes or a path; never return the caller's object."""
    if isinstance(model, onnx.ModelProto):
        copy = onnx.ModelProto()
        copy.CopyFrom(model)
        return _checked(copy, "The model", folder=None)
    if isinstance(model, (bytes, bytearray, memoryview)):
        return _checked(_parse(bytes(model), "The serialized model"), "The serialized model",
                        folder=None)
    if isinstance(model, (str, os.PathLike)):
        path = Path(os.fspath(model))
        what = f"The model file {str(path)!r}"
        return _checked(_parse(_read(path), what), what, folder=path.parent)
    raise InvalidModelError(
        f"Expected an onnx.ModelProto, serialized bytes or a file path, got "
        f"{type(model).__name__}.")


def _read(path: Path) -> bytes:
    """The file's bytes, or an error saying why there are none."""
    if os.path.isdir(path):
        raise InvalidModelError(
            f"{str(path)!r} is a folder, not an ONNX file. A saved TrainingProgram loads with "
            "lossgraph.TrainingProgram.load(folder); a model is a .onnx file.")
    if not os.path.isfile(path):
        hint = (" It looks like ONNX text: parse it with onnx.parser.parse_model(text) first."
                if str(path).lstrip().startswith("<") else "")
        raise InvalidModelError(f"No ONNX file at {str(path)!r} (current directory: "
                                f"{os.getcwd()!r}).{hint}")
    try:
        return path.read_bytes()
    except OSError as exc:
        raise InvalidModelError(f"Cannot read {str(path)!r}: {exc.strerror or exc}.") from None


def _parse(data: bytes, what: str) -> onnx.ModelProto:
    if not data:
        raise InvalidModelError(f"{what} is empty (0 bytes): it holds no ONNX model. "
                                f"{_REEXPORT}.")
    try:
        return onnx.load_model_from_string(data)
    except DecodeError:
        raise InvalidModelError(
            f"{what} is not an ONNX model, or is cut short ({len(data)} bytes that protobuf "
            f"cannot parse as onnx.ModelProto). {_REEXPORT}; a truncated download or copy "
            "gives this error.") from None


def _checked(model: onnx.ModelProto, what: str, folder: Path | None) -> onnx.ModelProto:
    """``model`` with its external data loaded from ``folder`` (None: not allowed)."""
    if not model.HasField("graph"):
        fields = ", ".join(f.name for f, _ in model.ListFields())
        raise InvalidModelError(
            f"{what} is not an ONNX model: it has no graph "
            f"({f'only {fields}' if fields else 'no ONNX field at all'}). {_REEXPORT}.")
    for tensor in stored_tensors(model):
        if uses_external_data(tensor):
            _load_external(tensor, what, folder)
    return model


def _load_external(tensor: onnx.TensorProto, what: str, folder: Path | None) -> None:
    """Load one tensor's external data, only from a regular file inside ``folder``."""
    location = {e.key: e.value for e in tensor.external_data}.get("location", "")
    culprit = (f"Tensor {tensor.name!r} of {what[0].lower()}{what[1:]} keeps its data in "
               f"the external file {location!r}")
    if folder is None:
        raise InvalidModelError(
            f"{culprit}, which was not loaded. Pass the model's file path instead (lossgraph "
            "loads external data from the model's folder), or load it first: "
            "onnx.load(path) or onnx.external_data_helper.load_external_data_for_model(model, "
            "folder).")
    if os.path.isabs(location) or not location:
        raise InvalidModelError(
            f"{culprit}: an external data location must be a file name relative to the "
            "model's folder. Save the model again with onnx.save_model(model, path, "
            "save_as_external_data=True).")
    base = folder.resolve()
    target = (folder / location).resolve()
    if not target.is_relative_to(base):
        raise InvalidModelError(
            f"{culprit}, which lies outside the model's folder {str(base)!r}: lossgraph reads "
            "external data only from inside it. Move the data file next to the model and "
            "save the model again.")
    if not target.is_file():
        raise InvalidModelError(
            f"{culprit}, which does not exist in {str(base)!r}. Copy the data file next to "
            "the model (external data travels with it).")
    try:
        load_external_data_for_tensor(tensor, str(folder))
    except (onnx.checker.ValidationError, OSError, ValueError) as exc:
        raise InvalidModelError(f"{culprit}, which cannot be read: {exc}") from None


def check_model(model: onnx.ModelProto, what: str = "The model") -> None:
    """Run the ONNX checker with strict shape inference; raise InvalidModelError on failure."""
    try:
        _full_check(model)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as exc:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise InvalidModelError(
            f"{what} is not a valid ONNX model: {first_line}. "
            "Check it with onnx.checker.check_model(model, full_check=True) and fix the "
            "exporter's output before passing it to lossgraph."
        ) from exc


def check_emitted(model: onnx.ModelProto, what: str) -> None:
    """Give ``model`` its IR version and opsets for the active target, and prove it valid
    (full check); an invalid model is a lossgraph bug, an :class:`InternalError`."""
    finalize(model)
    try:
        _full_check(model)
    except Exception as exc:
        raise InternalError(
            f"{what} emitted an invalid model ({exc}). This is a bug in lossgraph; "
            "please report it with the input model."
        ) from exc


def _full_check(model: onnx.ModelProto) -> None:
    """``onnx.checker.check_model(model, full_check=True)``, without serializing the weights'
    data on each call: the checker sees the model's weights as inputs of the same types
    (:func:`~lossgraph.graphs.without_weight_data` sets aside only data it would accept)."""
    onnx.checker.check_model(without_weight_data(model)[0], full_check=True)
