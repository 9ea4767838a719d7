"""The folders and data files lossgraph reads and writes, checked on the way in and out.

A **program folder** (``TrainingProgram.save``, ``lossgraph compile -o``) holds::

    manifest.json     the manifest (lossgraph.manifest), plus "files": {name: sha256}
    <graph>.onnx      one file per graph, named by the manifest
    state.npz         initial weights, optimizer states and buffers
    inference.onnx    the inference model the weights and buffers are written back into

A **checkpoint folder** (``Trainer.save_checkpoint``) holds ``trainer.json`` (counters,
losses and metrics, the shuffling generator, early stopping's record), a program folder
``program/`` with the state reached and, when early stopping keeps one, ``best_state.npz``
(the best epoch's state, its checksum in ``trainer.json``).

Writing goes through :mod:`lossgraph.fileio` (atomic, never over foreign files).
Reading trusts nothing: every file must be a plain name inside the folder (no ``..``,
no absolute path, no link leading out), match its checksum, parse, and agree with the
manifest in names, types and shapes; arrays are read without pickle. A large state's
arrays are read from ``state.npz``, kept open, when asked for, not held (their bytes
checked as the checksum found them: :meth:`~lossgraph.initial_state.InitialState.
archived`). Any failure is an
:class:`~lossgraph.errors.InvalidProgramError` (or, for data files,
:class:`~lossgraph.errors.InvalidDataError`) naming the file and the problem, raised
before any training.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import zipfile
from collections.abc import Container, Mapping
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import onnx
from onnx.external_data_helper import uses_external_data

from .errors import InvalidDataError, InvalidProgramError
from .fileio import replace_directory, serialize
from .graphs import all_graphs, stored_tensors
from .graphs.held import HOLD_MIN_BYTES
from .graphs.spans import OpenedFile, Span
from .initial_state import ArchivedArray, InitialState
from .manifest import check_manifest
from .models import non_text_field
from .paths import (
    BEST_STATE_FILE,
    CHECKPOINT,
    CHECKPOINT_FOLDER,
    CHECKPOINT_FORMAT,
    INFERENCE_FILE,
    MANIFEST_FILE,
    PROGRAM,
    PROGRAM_FOLDER,
    PROGRAM_SUBFOLDER,
    STATE_FILE,
    TRAINER_FILE,
    data_source,
    is_checkpoint_record,
    is_plain,
    saved_folder,
)

__all__ = ["PROGRAM_FOLDER", "CHECKPOINT_FOLDER", "Program", "ProgramParts", "save_program",
           "read_program", "save_checkpoint", "read_checkpoint", "read_saved", "read_arrays",
           "member_file", "read_json_file"]

_CHECKSUMS = "files"  # manifest key of the checksums, present on disk only


class Program(Protocol):
    """What a program folder stores: a TrainingProgram, or anything with these attributes."""

    graphs: dict[str, onnx.ModelProto]
    manifest: dict[str, Any]
    state: dict[str, np.ndarray]
    inference_model: onnx.ModelProto


#: ``(graphs, manifest, state, inference_model)``, as read from a program folder.
ProgramParts = tuple[dict[str, onnx.ModelProto], dict[str, Any], dict[str, np.ndarray],
                     onnx.ModelProto]


# -- names inside a folder ---------------------------------------------------------------------


def member_file(folder: Path, name: Any, where: str) -> Path:
    """``folder / name``, once it is a regular file inside ``folder``; else InvalidProgramError."""
    if not is_plain(name):
        raise InvalidProgramError(
            f"{where} names the file {name!r}, which is not a plain file name inside the "
            f"folder {str(folder)!r}; lossgraph never reads outside the folder it is given.")
    path = folder / name
    if not path.exists() and not path.is_symlink():
        raise InvalidProgramError(f"{str(folder)!r} has no file {name!r} ({where} needs it): "
                                  "the folder is incomplete. Save the program again.")
    if path.is_symlink() or not path.is_file():
        raise InvalidProgramError(
            f"{str(path)!r} is a link or not a regular file; lossgraph reads only the plain "
            "files it wrote.")
    return path


# -- writing -------------------------------------------------------------------------------------


def _checksum(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _write_program(folder: Path, program: Program) -> None:
    """Write ``program`` into the empty staging ``folder``."""
    written: dict[str, bytes] = {}
    for name, entry in program.manifest["graphs"].items():
        if not is_plain(entry["file"]):
            raise InvalidProgramError(
                f"The manifest names the file {entry['file']!r} for graph {name!r}, which is "
                "not a plain file name; lossgraph writes only inside the program folder.")
        written[entry["file"]] = serialize(program.graphs[name])
    written[INFERENCE_FILE] = serialize(program.inference_model)
    state = io.BytesIO()
    np.savez(state, **program.state)
    written[STATE_FILE] = state.getvalue()
    for name, data in written.items():
        (folder / name).write_bytes(data)
    manifest = {**program.manifest,
                _CHECKSUMS: {name: _checksum(data) for name, data in sorted(written.items())}}
    (folder / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n")


def save_program(path: str | os.PathLike, program: Program) -> Path:
    """Write ``program`` as a program folder at ``path``, atomically (see lossgraph.fileio)."""
    with replace_directory(path, PROGRAM_FOLDER) as staging:
        _write_program(staging, program)
    return Path(path)


def save_checkpoint(path: str | os.PathLike, program: Program, record: Mapping[str, Any],
                    best_state: Mapping[str, np.ndarray] | None = None) -> Path:
    """Write a checkpoint folder: ``program`` (with the reached state), ``record`` and the
    ``best_state`` of early stopping, if any."""
    record = {"format": CHECKPOINT_FORMAT, **record}
    with replace_directory(path, CHECKPOINT_FOLDER) as staging:
        os.mkdir(staging / PROGRAM_SUBFOLDER, 0o777)
        _write_program(staging / PROGRAM_SUBFOLDER, program)
        if best_state is not None:
            arrays = io.BytesIO()
            np.savez(arrays, **best_state)
            (staging / BEST_STATE_FILE).write_bytes(arrays.getvalue())
            record["best_state"] = _checksum(arrays.getvalue())
        (staging / TRAINER_FILE).write_text(json.dumps(record, indent=2) + "\n")
    return Path(path)


# -- reading -------------------------------------------------------------------------------------


def read_json_file(folder: Path, name: str, what: str) -> Any:
    """The JSON of the plain file ``name`` inside ``folder`` (:func:`member_file`), ``what``
    the folder is in messages; damaged text or JSON is an InvalidProgramError."""
    path = member_file(folder, name, what)
    try:
        return json.loads(path.read_text())
    except UnicodeDecodeError:
        raise InvalidProgramError(f"{str(path)!r} is not text: the {what} is damaged.") from None
    except ValueError as exc:
        raise InvalidProgramError(
            f"{str(path)!r} is not valid JSON ({exc}): the {what} is damaged.") from None


def _verified_bytes(folder: Path, name: str, checksums: Mapping[str, str], where: str) -> bytes:
    return _verified(member_file(folder, name, where).read_bytes(), folder / name, checksums)


def _verified(data: bytes | None, path: Path, checksums: Mapping[str, str]) -> bytes:
    """``data``, the bytes of ``path`` in its folder (None: cut short as it was read), once
    they match the checksum the manifest recorded for the file."""
    expected = checksums.get(path.name)
    if data is None or (expected is not None and _checksum(data) != expected):
        raise InvalidProgramError(
            f"{str(path)!r} does not match the checksum the manifest recorded for it: "
            "the file was changed or damaged (truncated?) after the program was saved.")
    return data


#: The ai.onnx.ml operators compile_program lowers into standard ops (lossgraph.passes.
#: lower_ml): never in a program's graphs. onnxruntime 1.19 dies of a segmentation fault
#: on a LinearClassifier without intercepts (measured), so a folder holding one is refused
#: before any session is made.
_LOWERED = ("LinearClassifier", "LinearRegressor", "Normalizer")


def _parse_onnx(data: bytes, path: Path) -> onnx.ModelProto:
    if not data:
        raise InvalidProgramError(f"{str(path)!r} is empty; it should hold an ONNX model.")
    try:
        model = onnx.load_model_from_string(data)
    except Exception:  # protobuf's DecodeError and friends
        raise InvalidProgramError(
            f"{str(path)!r} is not a valid ONNX model (truncated or corrupt).") from None
    external = [t.name for t in stored_tensors(model) if uses_external_data(t)]
    if external:
        raise InvalidProgramError(
            f"{str(path)!r} keeps tensor {external[0]!r} in external data; the graphs of a "
            "program folder hold their tensors themselves, and lossgraph does not follow "
            "external paths out of it.")
    damaged = non_text_field(model, "model")
    if damaged:
        raise InvalidProgramError(
            f"{str(path)!r} is not a valid ONNX model: a name or text in it is not UTF-8 "
            f"({damaged}; damaged bytes).")
    lowered = next((node for graph in all_graphs(model.graph) for node in graph.node
                    if node.domain == "ai.onnx.ml" and node.op_type in _LOWERED), None)
    if lowered is not None:
        raise InvalidProgramError(
            f"{str(path)!r} holds an ai.onnx.ml {lowered.op_type} node, which lossgraph "
            "never writes into a program (compile_program rewrites them into standard ops): "
            "the file was not written by lossgraph, and onnxruntime 1.19 crashes on some of "
            "them. Save the program again.")
    try:
        onnx.checker.check_model(model)
    except Exception as exc:  # noqa: BLE001  ValidationError, and whatever else it raises
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise InvalidProgramError(f"{str(path)!r} is not a valid ONNX model: {first}") from None
    return model


def _dtype_name(value: onnx.ValueInfoProto) -> str:
    elem_type = value.type.tensor_type.elem_type
    try:
        return onnx.helper.tensor_dtype_to_np_dtype(elem_type).name
    except (KeyError, ValueError):  # a damaged graph's element type: no numpy dtype
        return f"element type {elem_type}"


def _dims(value: onnx.ValueInfoProto) -> list[int | str | None]:
    """The dims as the manifest writes them (lossgraph.manifest.build_manifest)."""
    return [d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
            for d in value.type.tensor_type.shape.dim]


def _check_graph_io(model: onnx.ModelProto, entry: Mapping[str, Any], path: Path) -> None:
    """The graph's inputs and outputs are those the manifest describes, in order, type
    and shape (the Trainer reads the shapes from the manifest)."""
    for key, values in (("inputs", model.graph.input), ("outputs", model.graph.output)):
        described = [(io["name"], io["dtype"]) for io in entry[key]]
        actual = [(v.name, _dtype_name(v) if v.type.HasField("tensor_type") else "?")
                  for v in values]
        if described != actual:
            raise InvalidProgramError(
                f"{str(path)!r} has the {key} {actual}, but the manifest describes {described}: "
                "the graph and the manifest do not belong together.")
        for described_io, value in zip(entry[key], values):
            if list(described_io["shape"]) != _dims(value):
                raise InvalidProgramError(
                    f"{str(path)!r} declares its {key[:-1]} {value.name!r} of shape "
                    f"{_dims(value)}, but the manifest describes {described_io['shape']}: the "
                    "graph and the manifest do not belong together.")


def _program_state(folder: Path, checksums: Mapping[str, str], at: str) -> InitialState:
    """The program folder's state archive, checked against its checksum; where its large
    arrays (:func:`_archived_arrays`) come to ``READ_MIN_BYTES``, they are read from the
    file, kept open, when asked for, not held (:meth:`InitialState.archived`)."""
    path = member_file(folder, STATE_FILE, at)
    try:
        archive = OpenedFile(path)
    except OSError as exc:
        raise InvalidProgramError(f"Cannot read {str(path)!r}: {exc.strerror or exc}.") from None
    data = _verified(archive.read(Span(path, 0, path.stat().st_size)), path, checksums)
    members = _archived_arrays(data, path)
    return InitialState.archived(_read_state(data, path, skip=members), archive, members)


def _archived_arrays(data: bytes, path: Path) -> dict[str, ArchivedArray]:
    """The arrays of the ``.npz`` archive ``data`` (the bytes of ``path``) of
    :data:`HOLD_MIN_BYTES` and more that lie in it as they are (stored, not compressed;
    little-endian, C order, a plain dtype), by name: where their bytes are."""
    found = {}
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            infos = archive.infolist()
    except (zipfile.BadZipFile, OSError, ValueError):
        return {}  # _read_state says what is wrong
    for info in infos:
        name = info.filename.removesuffix(".npy")
        local = data[info.header_offset:info.header_offset + 30]
        if (info.compress_type != zipfile.ZIP_STORED or name == info.filename
                or len(local) < 30 or local[:4] != b"PK\x03\x04"):
            continue
        start = info.header_offset + 30 + int.from_bytes(local[26:28], "little") \
            + int.from_bytes(local[28:30], "little")
        stream = io.BytesIO(data[start:start + min(info.file_size, 1 << 16)])
        try:
            version = np.lib.format.read_magic(stream)
            header = {(1, 0): np.lib.format.read_array_header_1_0,
                      (2, 0): np.lib.format.read_array_header_2_0}[version]
            shape, fortran, dtype = header(stream)
        except (KeyError, ValueError, OSError):
            continue
        offset, nbytes = stream.tell(), math.prod(shape) * dtype.itemsize
        if (fortran or dtype.hasobject or dtype.byteorder == ">" or nbytes < HOLD_MIN_BYTES
                or offset + nbytes != info.file_size):
            continue
        span = Span(path, start + offset, nbytes)
        found[name] = ArchivedArray(span, dtype, tuple(shape), hashlib.sha256(
            memoryview(data)[span.offset:span.offset + nbytes]).digest())
    return found


def _read_state(data: bytes, path: Path, skip: Container[str] = frozenset()
                ) -> dict[str, np.ndarray]:
    """The arrays of the ``.npz`` archive ``data`` (the bytes of ``path``) by name, but
    those in ``skip``."""
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as stored:
            if not isinstance(stored, np.lib.npyio.NpzFile):
                raise ValueError("not an .npz archive")
            return {name: stored[name] for name in stored.files if name not in skip}
    except ValueError as exc:
        reason = ("it holds object arrays, which lossgraph never loads (loading them would run "
                  "pickled code)" if "pickle" in str(exc) else f"{exc}")
        raise InvalidProgramError(f"{str(path)!r} cannot be read: {reason}.") from None
    except (OSError, EOFError, zipfile.BadZipFile) as exc:
        raise InvalidProgramError(
            f"{str(path)!r} is not a readable .npz archive ({exc}).") from None


def _check_state(state: InitialState, manifest: Mapping[str, Any], path: Path) -> None:
    """The state holds exactly the manifest's weights, states and buffers, typed and shaped as
    the graphs take them."""
    expected = [w["name"] for w in manifest["weights"]]
    expected += [s["name"] for w in manifest["weights"] for s in w["states"]]
    expected += [b["name"] for b in manifest.get("buffers", [])]
    missing = [n for n in expected if n not in state]
    extra = sorted(set(state) - set(expected))
    if missing or extra:
        raise InvalidProgramError(
            f"{str(path)!r} does not match the manifest: "
            + "; ".join(filter(None, [missing and f"missing {missing}",
                                      extra and f"unexpected {extra}"])) + ".")
    declared = {io["name"]: io for entry in manifest["graphs"].values() for io in entry["inputs"]
                if io["role"] in ("weight", "state", "buffer")}
    for name in expected:
        array, io = state.like(name), declared.get(name)  # its shape and dtype, not read
        if io is None:
            continue
        dims = io["shape"]
        if (array.dtype != np.dtype(io["dtype"]) or array.ndim != len(dims)
                or any(isinstance(d, int) and d != n for d, n in zip(dims, array.shape))):
            raise InvalidProgramError(
                f"{str(path)!r} holds {name!r} as {array.dtype}{list(array.shape)}, but the "
                f"graphs take {io['dtype']}{dims}.")


#: The roles each graph's inputs and outputs include, as build_manifest writes them (the
#: runtime finds its inputs by role: a graph without them is not the graph it is named).
_GRAPH_ROLES: dict[str, tuple[set[str], set[str]]] = {
    "evaluate": ({"feature", "label"}, {"loss"}),
    "predict": ({"feature"}, set()),
    "train_step": ({"feature", "label", "step"}, {"loss"}),
    "train_epoch": ({"feature", "label", "step", "permutation"}, {"losses"}),
    "train_epoch_ordered": ({"feature", "label", "step"}, {"losses"}),
    "gradient": ({"feature", "prediction_grad"}, {"prediction", "gradient"}),
    "loss": ({"prediction", "label"}, {"loss", "prediction_grad"}),
    "update": ({"step", "weight", "gradient"}, {"new_weight"}),
    "penalty": ({"weight"}, {"penalty"}),
}


def _check_roles(manifest: Mapping[str, Any], at: str) -> None:
    """Each graph has the roles its name promises (:data:`_GRAPH_ROLES`), and the
    manifest's roles (loss, label, prediction, sample weight) name the evaluate graph's
    inputs and outputs of those roles (the Trainer reads the roles)."""
    for graph, (inputs, outputs) in _GRAPH_ROLES.items():
        entry = manifest["graphs"].get(graph)
        if entry is None:
            continue
        lacking = sorted((inputs - {io["role"] for io in entry["inputs"]})
                         | (outputs - {io["role"] for io in entry["outputs"]}))
        if lacking:
            raise InvalidProgramError(
                f"{at}: the graph {graph!r} ({entry['file']!r}) has no input or output of the "
                f"role {lacking[0]!r}, which every {graph!r} graph has: the program folder is "
                "damaged. Save it again (TrainingProgram.save or lossgraph compile -o).")
    evaluate = manifest["graphs"]["evaluate"]
    roles = {io["name"]: io["role"] for io in (*evaluate["inputs"], *evaluate["outputs"])}
    # the prediction is an output of role "prediction" in fuse="separate", "output" else;
    # the sample weight's role may have its previous release's name (lossgraph.roles)
    allowed = {"loss": ("loss",), "label": ("label",),
               "sample_weight": ("sample_weight", "weight"),
               "prediction": ("prediction", "output")}
    for role, name in manifest["roles"].items():
        if role in allowed and roles.get(name) not in allowed[role]:
            found = f"its {roles[name]}" if name in roles else "none of its inputs and outputs"
            raise InvalidProgramError(
                f"{at}: the roles name {name!r} as the {role}, but in the evaluate graph "
                f"{name!r} is {found}: the program folder is damaged. Save it again "
                "(TrainingProgram.save or lossgraph compile -o).")


def read_program(path: str | os.PathLike) -> ProgramParts:
    """Read and check the program folder at ``path`` (see the module docstring)."""
    folder = saved_folder(path, PROGRAM)
    at = str(folder / MANIFEST_FILE)
    manifest = read_json_file(folder, MANIFEST_FILE, "lossgraph program folder")
    checksums = manifest.pop(_CHECKSUMS, {}) if isinstance(manifest, dict) else {}
    if not isinstance(checksums, dict):
        raise InvalidProgramError(f"{at}: 'files' must map file names to checksums.")
    check_manifest(manifest, at)
    _check_roles(manifest, at)
    graphs = {}
    for name, entry in manifest["graphs"].items():
        where = f"{at} (graph {name!r})"
        data = _verified_bytes(folder, entry["file"], checksums, where)
        graphs[name] = _parse_onnx(data, folder / entry["file"])
        _check_graph_io(graphs[name], entry, folder / entry["file"])
    state = _program_state(folder, checksums, at)
    _check_state(state, manifest, folder / STATE_FILE)
    inference = _parse_onnx(_verified_bytes(folder, INFERENCE_FILE, checksums, at),
                            folder / INFERENCE_FILE)
    initializers = {t.name for t in inference.graph.initializer}
    lacking = [v["name"] for v in (*manifest["weights"], *manifest.get("buffers", []))
               if v["name"] not in initializers]
    if lacking:
        raise InvalidProgramError(
            f"{str(folder / INFERENCE_FILE)!r} has no initializer {lacking[0]!r} to write the "
            "trained weight back into: it is not this program's inference model.")
    return graphs, manifest, state, inference


def _non_negative_int(record: Mapping[str, Any], key: str, at: str) -> int:
    value = record.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidProgramError(f"{at}: {key!r} must be a count (an int >= 0), found {value!r}.")
    return value


def _losses(record: Mapping[str, Any], key: str, at: str) -> list[float]:
    values = record.get(key)
    if not isinstance(values, list) or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        raise InvalidProgramError(f"{at}: {key!r} must be a list of numbers.")
    return [float(v) for v in values]


def read_saved(path: str | os.PathLike) -> ProgramParts:
    """The program of a program folder, or of a checkpoint folder (its trainer file marks
    it): :func:`read_program` or :func:`read_checkpoint`'s."""
    folder = Path(path)
    if (folder / TRAINER_FILE).exists() or (folder / TRAINER_FILE).is_symlink():
        return read_checkpoint(folder)[0]
    return read_program(folder)


def read_checkpoint(path: str | os.PathLike) -> tuple[ProgramParts, dict[str, Any]]:
    """Read and check a checkpoint folder: its program, and its record with ``steps``,
    ``epochs``, ``train_losses``, ``validation_losses``, ``metrics`` (lists by name),
    ``rng`` (a Generator or None), ``early_stopping`` (its record or None) and
    ``best_state`` (arrays by name, or None)."""
    folder = saved_folder(path, CHECKPOINT)
    at = str(folder / TRAINER_FILE)
    record = read_json_file(folder, TRAINER_FILE, "lossgraph checkpoint folder")
    if not isinstance(record, dict) or not is_checkpoint_record(record):
        raise InvalidProgramError(f"{at} is not a lossgraph checkpoint record.")
    if record.get("format", CHECKPOINT_FORMAT) != CHECKPOINT_FORMAT:
        raise InvalidProgramError(f"{at}: the checkpoint has format {record['format']!r}; this "
                                  f"lossgraph reads {CHECKPOINT_FORMAT!r}.")
    subfolder = folder / PROGRAM_SUBFOLDER
    if subfolder.is_symlink():
        raise InvalidProgramError(f"{str(subfolder)!r} is a link; lossgraph reads only the "
                                  "folders it wrote.")
    program = read_program(subfolder)
    checked = {"steps": _non_negative_int(record, "steps", at),
               "epochs": _non_negative_int(record, "epochs", at),
               "train_losses": _losses(record, "train_losses", at),
               "validation_losses": _losses(record, "validation_losses", at),
               "rng": _generator(record.get("rng"), at)}
    metrics = record.get("metrics", {})
    if not isinstance(metrics, dict):
        raise InvalidProgramError(f"{at}: 'metrics' must be a dict of lists of numbers.")
    checked["metrics"] = {str(name): _losses(metrics, name, at) for name in metrics}
    checked["early_stopping"] = record.get("early_stopping")
    checked["best_state"] = None
    if "best_state" in record:
        checksums = {BEST_STATE_FILE: record["best_state"]}
        data = _verified_bytes(folder, BEST_STATE_FILE, checksums, at)
        checked["best_state"] = _read_state(data, folder / BEST_STATE_FILE)
    return program, checked


def _generator(state: Any, at: str) -> np.random.Generator | None:
    if state is None:
        return None
    generator = np.random.default_rng()
    try:
        generator.bit_generator.state = state
    except (TypeError, ValueError, KeyError, OverflowError) as exc:
        raise InvalidProgramError(
            f"{at}: 'rng' is not the state of numpy's default generator ({exc}).") from None
    return generator


# -- data files --------------------------------------------------------------------------------


def read_arrays(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """The arrays of an ``.npz`` file, or of the ``.npy`` files of a folder, by name.

    Read without pickle; links leading out of the folder are refused.
    """
    source = data_source(path)
    if source.is_dir():
        arrays = {}
        for file in sorted(source.glob("*.npy")):
            inside = file.resolve().is_relative_to(source.resolve())
            if file.is_symlink() and not inside or not file.is_file():
                raise InvalidDataError(f"{str(file)!r} leads out of {str(source)!r} or is not a "
                                       "regular file; lossgraph reads only files in the folder.")
            arrays[file.stem] = _load_array(file, np.ndarray)
        if not arrays:
            raise InvalidDataError(f"The folder {str(source)!r} holds no .npy files.")
        return arrays
    stored = _load_array(source, np.lib.npyio.NpzFile)
    with stored:
        try:
            return {name: stored[name] for name in stored.files}
        except ValueError as exc:
            raise _unreadable(source, exc) from None
        except (OSError, EOFError, zipfile.BadZipFile) as exc:
            raise InvalidDataError(f"{str(source)!r} is a damaged .npz archive ({exc}).") from None


_MAGIC = {np.ndarray: (b"\x93NUMPY", "a .npy array file"),
          np.lib.npyio.NpzFile: (b"PK\x03\x04", "an .npz archive")}


def _load_array(path: Path, kind: type) -> Any:
    """``np.load`` of ``path`` without pickle, expecting ``kind`` (an array or an archive)."""
    magic, wanted = _MAGIC[kind]
    with open(path, "rb") as stream:
        head = stream.read(8)
    if not head.startswith(magic):
        other = next((w for m, w in _MAGIC.values() if head.startswith(m)), None)
        found = f"it is {other}" if other else "it does not start like one (text? pickle?)"
        raise InvalidDataError(f"{str(path)!r} is not {wanted}: {found}. Save the arrays with "
                               "np.savez (one .npz) or np.save (one .npy per array).")
    try:
        return np.load(path, allow_pickle=False)
    except ValueError as exc:
        raise _unreadable(path, exc) from None
    except (OSError, EOFError, zipfile.BadZipFile) as exc:
        raise InvalidDataError(f"{str(path)!r} cannot be read ({exc}).") from None


def _unreadable(path: Path, exc: ValueError) -> InvalidDataError:
    if "pickle" in str(exc):
        return InvalidDataError(
            f"{str(path)!r} holds object arrays (pickled Python objects), which lossgraph never "
            "loads: unpickling runs code. Save plain numeric arrays with np.savez.")
    return InvalidDataError(f"{str(path)!r} cannot be read as numpy data ({exc}).")
