"""Loading and checking the models users bring.

:func:`as_model` takes a ModelProto, serialized bytes, a file path or an
``onnx_graphsurgeon.Graph`` and returns a private copy, or an
:class:`~lossgraph.errors.InvalidModelError` naming the file and what is wrong with it:
missing, a folder, empty, not ONNX or cut short, external data missing or not loaded.
External data is read only from inside the model file's folder: a location that is
absolute, leads out of the folder (``..``) or through a link out of it is refused before
anything is read. An in-memory model (ModelProto or bytes) whose tensors still point to
external files is refused too: onnx would look
for those files in the current directory.

An onnx-graphsurgeon graph is exported with ``gs.export_onnx``, keeping the order of
initializers that export writes; onnx-graphsurgeon is imported only when such a graph is
given, so it stays optional.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Union

import onnx
from google.protobuf.message import DecodeError
from onnx.external_data_helper import load_external_data_for_tensor, uses_external_data

from .errors import InternalError, InvalidModelError
from .graphs import HeldWeights, elem_type_name, is_held, stored_tensors, without_weight_data
from .graphs.spans import OpenedFiles, model_without_raw_data
from .paths import model_file
from .target import finalize

if TYPE_CHECKING:
    import onnx_graphsurgeon

__all__ = ["ModelLike", "as_model", "check_model", "check_declared_outputs", "check_emitted",
           "non_text_field"]

#: What every public function accepts as a model.
ModelLike = Union[onnx.ModelProto, bytes, str, os.PathLike, "onnx_graphsurgeon.Graph"]

_REEXPORT = "Export or download the model again"


def as_model(model: ModelLike, held: HeldWeights | None = None) -> onnx.ModelProto:
    """Accept a ModelProto, serialized bytes, a path or an onnx-graphsurgeon graph; never
    return the caller's object. ``held``: a store that takes the data of the model's large
    weights (:class:`~lossgraph.graphs.HeldWeights`), so that the copy is light and the
    caller's weights are copied once, into the store."""
    if _is_graphsurgeon_graph(model):
        return _held(_checked(_export_graphsurgeon(model), "The onnx-graphsurgeon graph",
                              folder=None), held)
    if isinstance(model, onnx.ModelProto):
        # a damaged model is copied as it is, for the check to name what is wrong
        copy = _held(model, held) if held is not None and model.HasField("graph") \
            and not non_text_field(model, "model") else model
        if copy is model:
            copy = onnx.ModelProto()
            copy.CopyFrom(model)
        return _checked(copy, "The model", folder=None)
    if isinstance(model, (bytes, bytearray, memoryview)):
        return _held(_checked(_parse(bytes(model), "The serialized model"),
                              "The serialized model", folder=None), held)
    if isinstance(model, (str, os.PathLike)):
        path = Path(os.fspath(model))
        what = f"The model file {str(path)!r}"
        model_file(path)
        parsed = _parsed_light(path, held) if held is not None else None
        if parsed is None:
            parsed = _parse(_read(path), what)
        return _held(_checked(parsed, what, folder=path.parent), held)
    raise InvalidModelError(
        f"Expected an onnx.ModelProto, serialized bytes, a file path or an "
        f"onnx_graphsurgeon.Graph, got {type(model).__name__}.")


def _held(model: onnx.ModelProto, held: HeldWeights | None) -> onnx.ModelProto:
    """``model`` with its large weights' data in ``held`` (None: as it is)."""
    return model if held is None else held.hold(model)


def _is_graphsurgeon_graph(model: object) -> bool:
    """Whether ``model`` is an ``onnx_graphsurgeon.Graph``, told without importing it."""
    return any(cls.__name__ == "Graph" and cls.__module__.startswith("onnx_graphsurgeon.")
               for cls in type(model).__mro__)


def _export_graphsurgeon(graph: onnx_graphsurgeon.Graph) -> onnx.ModelProto:
    """``gs.export_onnx(graph)``, its nodes in dependency order; the graph is not changed."""
    import onnx_graphsurgeon as gs

    untyped = [f"{kind} {t.name!r}" for kind, tensors in (("input", graph.inputs),
                                                          ("output", graph.outputs))
               for t in tensors if t.dtype is None]
    if untyped:
        raise InvalidModelError(
            f"The onnx-graphsurgeon graph's {', '.join(untyped)} has no dtype, and every input "
            "and output of a model needs one. Import the model with its shapes inferred, "
            "gs.import_onnx(onnx.shape_inference.infer_shapes(model)), before cutting it, or "
            "set the tensor's dtype (and shape) yourself.")
    try:
        model = gs.export_onnx(graph)
        if not _in_dependency_order(model.graph):  # nodes added after the ones they read
            model = gs.export_onnx(graph.copy().toposort())
    except Exception as exc:  # gs raises its own exceptions, and plain ones
        raise InvalidModelError(
            f"onnx-graphsurgeon could not export the graph: {exc}") from None
    return model


def _in_dependency_order(graph: onnx.GraphProto) -> bool:
    """Whether every node of ``graph`` comes after the nodes whose outputs it reads."""
    later = {name for node in graph.node for name in node.output if name}
    for node in graph.node:
        if any(name in later for name in node.input):
            return False
        later.difference_update(node.output)
    return True


def _read(path: Path) -> bytes:
    """The file's bytes, or an error saying why there are none."""
    model_file(path)
    try:
        return path.read_bytes()
    except OSError as exc:
        raise InvalidModelError(f"Cannot read {str(path)!r}: {exc.strerror or exc}.") from None


def _parsed_light(path: Path, held: HeldWeights) -> onnx.ModelProto | None:
    """The model file at ``path`` parsed without its initializers' data, which ``held``
    takes from the file one weight at a time (:meth:`HeldWeights.take`), so that the
    weights are in memory once, not as the file's bytes and protobuf's copy of them too;
    None where the file is not one to read so (:func:`graphs.spans.model_without_raw_data`),
    or is no model: read whole, its errors told as such."""
    found = model_without_raw_data(path)
    if found is None:
        return None
    serialized, spans = found
    try:
        model = onnx.load_model_from_string(serialized)
    except DecodeError:
        return None
    with OpenedFiles() as files:
        for tensor in model.graph.initializer:
            span = spans.get(tensor.name)
            if span is not None:
                data = files.read(span)
                if data is None:
                    return None
                held.take(model, tensor, data)
    return model


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
    damaged = non_text_field(model, "model")
    if damaged:
        raise InvalidModelError(
            f"{what} is damaged: {damaged} is not UTF-8 text, as ONNX's names and strings "
            f"must be (a bit flipped in a copy or a download?). {_REEXPORT}.")
    for tensor in stored_tensors(model):
        if uses_external_data(tensor) and not is_held(tensor):  # held: data in memory
            _load_external(tensor, what, folder)
    return model


def non_text_field(message: Any, path: str) -> str | None:
    """The first string field under ``message`` that is not UTF-8, as a path (protobuf
    parses it and hands it out as bytes; onnx's checker passes it, and copying it into
    another message fails), or None. Tensors' data is not read."""
    if isinstance(message, onnx.TensorProto):
        named = [("name", message.name), ("doc_string", message.doc_string)]
        for index, entry in enumerate(message.external_data):
            named += [(f"external_data[{index}].key", entry.key),
                      (f"external_data[{index}].value", entry.value)]
        return next((f"{path}.{key}" for key, value in named if isinstance(value, bytes)), None)
    for field, value in message.ListFields():
        # protobuf 7 has is_repeated, older ones label
        repeated = field.is_repeated if hasattr(field, "is_repeated") \
            else field.label == field.LABEL_REPEATED
        items = list(value) if repeated else [value]
        for index, item in enumerate(items):
            where = f"{path}.{field.name}" + (f"[{index}]" if repeated else "")
            if field.type == field.TYPE_STRING and isinstance(item, bytes):
                return where
            if field.type == field.TYPE_MESSAGE:
                found = non_text_field(item, where)
                if found:
                    return found
    return None


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
    """Run the ONNX checker with strict shape inference, and check that every stored tensor
    holds as many values as its shape says; raise InvalidModelError on failure."""
    light, aside = without_weight_data(model)
    try:
        onnx.checker.check_model(light, full_check=True)
    except Exception as exc:  # noqa: BLE001  the checker raises ValueError too (a Cast to 0)
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        first_line = first_line.rstrip(".")
        raise InvalidModelError(
            f"{what} is not a valid ONNX model: {first_line}. "
            "Check it with onnx.checker.check_model(model, full_check=True) and fix the "
            "exporter's output before passing it to lossgraph."
        ) from exc
    # the weights set aside were proven of their exact size (not read again: no copies)
    _check_tensor_sizes(model, what, {t.name for t in aside})


#: The value field each element type stores its values in, and values per element
#: (onnx.proto: complex numbers take two).
_VALUE_FIELDS = {
    onnx.TensorProto.FLOAT: ("float_data", 1), onnx.TensorProto.COMPLEX64: ("float_data", 2),
    onnx.TensorProto.DOUBLE: ("double_data", 1), onnx.TensorProto.COMPLEX128: ("double_data", 2),
    onnx.TensorProto.INT64: ("int64_data", 1), onnx.TensorProto.UINT32: ("uint64_data", 1),
    onnx.TensorProto.UINT64: ("uint64_data", 1), onnx.TensorProto.STRING: ("string_data", 1),
    **{t: ("int32_data", 1) for t in (
        onnx.TensorProto.INT32, onnx.TensorProto.INT16, onnx.TensorProto.INT8,
        onnx.TensorProto.UINT16, onnx.TensorProto.UINT8, onnx.TensorProto.BOOL,
        onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16)},
}


def _check_tensor_sizes(model: onnx.ModelProto, what: str, proven: set[str]) -> None:
    """Every stored tensor (initializers, attribute tensors) of a whole-byte type holds
    exactly as many values as its dims say, but the main graph's initializers named in
    ``proven``. onnx's checker finds raw data too short only: longer raw data and value
    fields of another length pass it, and then numpy cannot shape the tensor (a raw
    ValueError deep inside a pass) or onnxruntime refuses it."""
    main = len(model.graph.initializer)  # stored_tensors yields them first
    for index, tensor in enumerate(stored_tensors(model)):
        if index < main and tensor.name in proven:
            continue
        if tensor.data_location == onnx.TensorProto.EXTERNAL or any(d < 0 for d in tensor.dims):
            continue  # external data is checked when loaded; negative dims by the checker
        count = math.prod(tensor.dims)
        shape = f"{elem_type_name(tensor.data_type)}{list(tensor.dims)}"
        if tensor.HasField("raw_data"):
            try:
                itemsize = onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize
            except (KeyError, ValueError, TypeError):
                continue  # an unknown element type: the checker's to name
            if tensor.data_type in _VALUE_FIELDS and tensor.data_type != onnx.TensorProto.STRING \
                    and len(tensor.raw_data) != count * itemsize:
                raise InvalidModelError(
                    f"{what} stores the tensor {tensor.name!r} ({shape}, {count * itemsize} "
                    f"bytes) in {len(tensor.raw_data)} bytes: the file is damaged, or its "
                    f"exporter wrote a shape that does not fit the data. {_REEXPORT}.")
            continue
        field, per_element = _VALUE_FIELDS.get(tensor.data_type, (None, 0))
        if field is None:
            continue
        stored = len(getattr(tensor, field))
        if stored != count * per_element:
            raise InvalidModelError(
                f"{what} stores the tensor {tensor.name!r} ({shape}, {count * per_element} "
                f"values) with {stored} values in {field}: the file is damaged, or its "
                f"exporter wrote a shape that does not fit the data. {_REEXPORT}.")


def _dims(value_type: onnx.TypeProto) -> list[int | str | None] | None:
    """A tensor type's dims (an int, a symbol, or None), or None for an unknown rank."""
    tensor = value_type.tensor_type
    if not value_type.HasField("tensor_type") or not tensor.HasField("shape"):
        return None
    return [d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
            for d in tensor.shape.dim]


def _shape_words(dims: list[int | str | None]) -> str:
    return "a scalar" if not dims else (
        "shape (" + ", ".join("?" if d is None else str(d) for d in dims) + ")")


def _contradicts(computed: list[int | str | None], declared: list[int | str | None],
                 batch: set[str], free: bool) -> bool:
    """Whether a computed shape contradicts the declared one: another rank, another size,
    a fixed size where a batch axis is declared: a dim named like the inputs' first, or
    the first when the inputs' batch is ``free``."""
    if len(computed) != len(declared):
        return True
    return any(isinstance(a, int) and (isinstance(b, int) and a != b or b in batch
                                       or free and index == 0 and not isinstance(b, int))
               for index, (a, b) in enumerate(zip(computed, declared)))


def check_declared_outputs(model: onnx.ModelProto,
                           producers: Mapping[str, str] | None = None) -> None:
    """The shapes ``model`` declares for its outputs are the shapes its nodes compute.

    onnx's checker compares declared and inferred dims only where both are numbers, and
    infers nothing for ``ai.onnx.ml`` operators; lossgraph builds the label from the
    declared shape, and specializing a graph to a batch size makes every dim named like
    the batch axis a number. So an output declared of another rank, another size, or
    with a free batch axis (or the inputs' batch symbol) where the graph computes a fixed
    size is an :class:`InvalidModelError` naming the output. ``producers`` restricts the check to
    these outputs, each with the words naming the node that computes it.
    """
    graph = model.graph
    checked = {v.name: v.type for v in graph.output
               if (producers is None or v.name in producers) and _dims(v.type) is not None}
    if not checked:
        return
    weights = {t.name for t in graph.initializer}
    leading = [dims[0] for v in graph.input
               if v.name not in weights and (dims := _dims(v.type))]
    batch = {d for d in leading if isinstance(d, str)}
    free = any(not isinstance(d, int) for d in leading)
    probe = onnx.ModelProto()
    probe.CopyFrom(without_weight_data(model)[0])
    kept = [v for v in probe.graph.output if v.name not in checked]
    del probe.graph.output[:]
    probe.graph.output.extend(kept)
    try:
        inferred = onnx.shape_inference.infer_shapes(probe).graph.value_info
    except Exception:  # noqa: BLE001  the model's check names what is wrong
        return
    for value in inferred:
        if value.name not in checked:
            continue
        computed, declared = _dims(value.type), _dims(checked[value.name])
        if computed is None or declared is None:
            continue
        if not _contradicts(computed, declared, batch, free):
            continue
        node = (producers or {}).get(value.name) or next(
            (f"the {n.op_type} node {n.name!r}" if n.name else f"the {n.op_type} node"
             for n in graph.node if value.name in n.output), "the graph")
        raise InvalidModelError(
            f"Output {value.name!r} is declared of {_shape_words(declared)}, but "
            f"{node} computes it of {_shape_words(computed)}"
            + (f" ({', '.join(map(repr, sorted(batch)))} names the batch axis)" if batch else "")
            + ". Fix the output's declared shape in the exporter's output.")


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
