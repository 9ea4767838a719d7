"""Adapter files: a program's LoRA adapters written alone, and read back into a program.

    export_adapters(source, path, format=None, *, peft_config=False, overwrite=False) -> path
    load_adapters(target, path, format=None) -> {initializer name: array loaded}

``source`` is a :class:`~lossgraph.Trainer` (its live state), a
:class:`~lossgraph.TrainingProgram` (its ``state``) or a program or checkpoint folder;
``target`` a Trainer (its live state is set) or a TrainingProgram (its ``state`` is). Only
the adapters' tensors are written (``TrainingProgram.adapters``: each adapter's ``A`` and
``B``), never the base model. The format follows the suffix (or ``format=``):

``.safetensors``
    the format PEFT and transformers save (:mod:`lossgraph.export.safetensors`). Each
    adapter whose torch module path is known is named and laid out as PEFT names it:
    ``base_model.model.{module}.lora_A.weight`` ``[rank, in]`` and ``...lora_B.weight``
    ``[out, rank]`` (a linear adapter's ``A`` and ``B`` transposed; a conv adapter's as
    they are, PEFT's shapes). An adapter on a weight of no known module keeps its ONNX
    initializer names and layout. ``peft_config=True`` also writes PEFT's
    ``adapter_config.json`` beside the file, which must then be named
    ``adapter_model.safetensors``: ``peft.PeftModel.from_pretrained(model, folder)`` loads
    the folder. :func:`load_adapters` reads such a folder (or its file) as PEFT's
    ``save_pretrained`` writes it.
``.npz``
    numpy's archive, one array per adapter tensor under its ONNX initializer name, for any
    model.
``.onnx_adapter``
    onnxruntime's multi-LoRA format (``onnxruntime.AdapterFormat``, onnxruntime 1.20 or
    later), tensors under their ONNX initializer names: the adapter inputs of
    :func:`with_adapter_inputs`'s model, so that
    ``RunOptions.add_active_adapter(onnxruntime.LoraAdapter...)`` runs the model with them.

**The base model.** What the adapters fit is recorded in the file: for each adapter its
module path (or, with none, its base weight's name), kind, rank, alpha, shapes and dtype,
and a digest of that list (safetensors' ``__metadata__`` and the ``.npz``'s
:data:`RECORD_ENTRY` hold the list and the digest, an ``.onnx_adapter``'s ``model_version``
the digest's first 31 bits). :func:`load_adapters` refuses a file made for another base
model or other LoRA options (targets, rank, alpha) with an
:class:`~lossgraph.errors.AdapterMismatchError` naming the difference, raised before
anything is set; every adapter of the target must be in the file, and nothing else. A
file PEFT wrote carries no record: names and shapes are checked, and rank and alpha
against the ``adapter_config.json`` beside it when there is one.

**Resuming.** Loading sets the adapters and resets their optimizer states to the
program's initial ones (an optimizer starts afresh on loaded adapters, as with PEFT): a
fresh trainer of the same program then trains on (``fit(..., warm_start=True)``) exactly as
the one that wrote the file with a stateless optimizer (SGD); a checkpoint keeps the
moments too.

Files are written atomically and replace only a file of the same format that lossgraph
wrote (or with ``overwrite=True``); PEFT's ``adapter_config.json`` only beside a
safetensors file lossgraph wrote (:mod:`lossgraph.fileio`).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import tempfile
import zipfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx
from onnx import helper

from ..adapters import Adapter, module_matches, read_adapters
from ..errors import (
    AdapterMismatchError,
    InvalidProgramError,
    RuntimeUnavailableError,
    UnsupportedModelError,
    UnsupportedOptionError,
    suggest,
)
from ..fileio import check_file_target, write_file
from ..options import choice, flag
from ..storage import member_file, read_json_file, read_saved
from .safetensors import parse_safetensors, read_safetensors_metadata, safetensors_bytes

if TYPE_CHECKING:
    from ..program import TrainingProgram
    from ..runtime.trainer import Trainer

__all__ = ["FORMATS", "RECORD_FORMAT", "RECORD_ENTRY", "PEFT_FILE", "PEFT_CONFIG",
           "ORT_ADAPTER_MARK", "export_adapters", "load_adapters", "check_adapters_target",
           "with_adapter_inputs", "base_record",
           "file_tensors", "loaded_values"]

#: The formats, by the suffix that selects them.
FORMATS = (".safetensors", ".npz", ".onnx_adapter")
#: The version of the record of the base model the adapters fit.
RECORD_FORMAT = "lossgraph-adapters/1"
#: The safetensors metadata keys and the ``.npz`` entry of lossgraph's record.
RECORD_KEY, DIGEST_KEY, WRITTEN_BY = "lossgraph.adapters", "lossgraph.base", "lossgraph.written_by"
RECORD_ENTRY = "__lossgraph__"
#: The names PEFT's ``save_pretrained`` gives the adapter file and its configuration.
PEFT_FILE, PEFT_CONFIG = "adapter_model.safetensors", "adapter_config.json"
#: The ``adapter_version`` that marks an ``.onnx_adapter`` file lossgraph wrote ("LG").
ORT_ADAPTER_MARK = 0x4C47
#: The first onnxruntime with ``AdapterFormat``.
ORT_ADAPTER_VERSION = "1.20"


# -- which tensor goes where ----------------------------------------------------------------


@dataclass(frozen=True)
class _Slot:
    """One adapter tensor: its initializer name, its name in the file, and whether the file
    holds it transposed (PEFT's ``[rank, in]`` / ``[out, rank]`` of a linear adapter)."""

    tensor: str
    name: str
    transposed: bool


def _slots(adapter: Adapter, peft_names: bool) -> tuple[_Slot, _Slot]:
    """Where ``adapter``'s A and B go in a file (PEFT's names where asked and known)."""
    names = adapter.peft_names() if peft_names else None
    if names is None:
        return _Slot(adapter.a, adapter.a, False), _Slot(adapter.b, adapter.b, False)
    transposed = adapter.kind == "linear"
    return (_Slot(adapter.a, names[0], transposed), _Slot(adapter.b, names[1], transposed))


def _known_by(entry: Mapping[str, Any]) -> str:
    """What an adapter of :func:`base_record` is known by across exports of one model (a
    legacy and a dynamo export name their weights differently): its module, else its
    weight."""
    return entry["module"] or entry["weight"]


def base_record(adapters: Sequence[Adapter], state: Mapping[str, np.ndarray]
                ) -> list[dict[str, Any]]:
    """What the adapters fit, one entry per adapter in a stable order: the fingerprint of the
    base model and the LoRA options recorded in a file and compared on loading."""
    entries = [{"module": a.module, "weight": None if a.module is not None else a.weight,
                "kind": a.kind, "rank": int(a.rank), "alpha": float(a.alpha),
                "a": list(state[a.a].shape), "b": list(state[a.b].shape),
                "dtype": str(state[a.a].dtype)} for a in adapters]
    return sorted(entries, key=_known_by)


def _digest(record: list[dict[str, Any]]) -> str:
    """The SHA-256 of ``record`` in a canonical JSON form (hex)."""
    text = json.dumps(record, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def file_tensors(adapters: Sequence[Adapter], state: Mapping[str, np.ndarray], peft_names: bool
                 ) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """The tensors a file holds, by their names in it, and lossgraph's record of the base."""
    tensors = {}
    for adapter in adapters:
        for slot in _slots(adapter, peft_names):
            value = np.asarray(state[slot.tensor])
            tensors[slot.name] = np.ascontiguousarray(value.T if slot.transposed else value)
    record = base_record(adapters, state)
    metadata = {WRITTEN_BY: "lossgraph", RECORD_KEY: json.dumps(
        {"format": RECORD_FORMAT, "adapters": record}), DIGEST_KEY: _digest(record)}
    return tensors, metadata


# -- the formats ------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Format:
    """How one kind of file is written, read and recognised as lossgraph's."""

    suffix: str
    peft_names: bool
    write: Callable[[dict[str, np.ndarray], dict[str, str]], bytes]
    read: Callable[[Path], tuple[dict[str, np.ndarray], dict[str, str]]]
    owned: Callable[[Path], bool]


def _read_safetensors(path: Path) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    return parse_safetensors(path.read_bytes(), repr(str(path)))


def _owned_safetensors(path: Path) -> bool:
    metadata = read_safetensors_metadata(path) if path.is_file() else None
    return bool(metadata) and metadata.get(WRITTEN_BY) == "lossgraph"


def _npz_bytes(tensors: dict[str, np.ndarray], metadata: dict[str, str]) -> bytes:
    if RECORD_ENTRY in tensors:
        raise UnsupportedOptionError(f"An adapter tensor is named {RECORD_ENTRY!r}, the entry "
                                     "lossgraph keeps its record in: rename it.")
    stream = io.BytesIO()
    np.savez(stream, **tensors, **{RECORD_ENTRY: np.array(json.dumps(metadata))})
    return stream.getvalue()


def _read_npz(path: Path) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    try:
        with np.load(path, allow_pickle=False) as archive:
            arrays = {name: archive[name] for name in archive.files}
    except (OSError, ValueError, zipfile.BadZipFile) as exc:
        raise InvalidProgramError(f"{str(path)!r} is not a numpy .npz archive of arrays "
                                  f"({exc}).") from None
    text = arrays.pop(RECORD_ENTRY, None)
    try:
        metadata = json.loads(str(text)) if text is not None else {}
    except ValueError:
        metadata = None
    if not isinstance(metadata, dict):
        raise InvalidProgramError(f"{str(path)!r}: its {RECORD_ENTRY!r} entry is not "
                                  "lossgraph's record.")
    return arrays, metadata


def _owned_npz(path: Path) -> bool:
    try:
        with zipfile.ZipFile(path) as archive:
            return f"{RECORD_ENTRY}.npy" in archive.namelist()
    except (OSError, zipfile.BadZipFile):
        return False


def _ort_adapter_format() -> Any:
    """onnxruntime's AdapterFormat, or a RuntimeUnavailableError saying which has it."""
    import onnxruntime

    format_ = getattr(onnxruntime, "AdapterFormat", None)
    if format_ is None:
        raise RuntimeUnavailableError(
            f"The .onnx_adapter format needs onnxruntime {ORT_ADAPTER_VERSION} or later "
            f"(onnxruntime.AdapterFormat); this is onnxruntime {onnxruntime.__version__} (the "
            "training build stops at 1.19). Write .safetensors or .npz here, or export in an "
            f"environment with onnxruntime>={ORT_ADAPTER_VERSION}.")
    return format_


def _ort_adapter_bytes(tensors: dict[str, np.ndarray], metadata: dict[str, str]) -> bytes:
    import onnxruntime

    adapter = _ort_adapter_format()()
    adapter.set_adapter_version(ORT_ADAPTER_MARK)
    adapter.set_model_version(int(metadata[DIGEST_KEY][:8], 16) & 0x7FFFFFFF)
    kept = {name: np.ascontiguousarray(value) for name, value in tensors.items()}  # alive
    adapter.set_parameters({name: onnxruntime.OrtValue.ortvalue_from_numpy(value)
                            for name, value in kept.items()})
    with tempfile.TemporaryDirectory(prefix="lossgraph-adapter-") as folder:
        path = os.path.join(folder, "adapter.onnx_adapter")
        adapter.export_adapter(path)
        return Path(path).read_bytes()


def _read_ort_adapter(path: Path) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    try:
        adapter = _ort_adapter_format().read_adapter(str(path))
    except RuntimeUnavailableError:
        raise
    except Exception as exc:  # onnxruntime's own errors: a malformed file
        raise InvalidProgramError(f"{str(path)!r} is not an onnxruntime adapter file "
                                  f"({exc}).") from None
    tensors = {name: np.array(value.numpy()) for name, value in
               adapter.get_parameters().items()}
    marked = adapter.get_adapter_version() == ORT_ADAPTER_MARK
    return tensors, ({WRITTEN_BY: "lossgraph",
                      "model_version": str(adapter.get_model_version())} if marked else {})


def _owned_ort_adapter(path: Path) -> bool:
    """Whether lossgraph wrote the adapter file at ``path``: its mark, no tensor read."""
    try:
        return _ort_adapter_format().read_adapter(str(path)).get_adapter_version() \
            == ORT_ADAPTER_MARK
    except Exception:  # no onnxruntime 1.20, or its own error: a malformed file
        return False


_FORMATS = {
    ".safetensors": _Format(".safetensors", True, safetensors_bytes, _read_safetensors,
                            _owned_safetensors),
    ".npz": _Format(".npz", False, _npz_bytes, _read_npz, _owned_npz),
    ".onnx_adapter": _Format(".onnx_adapter", False, _ort_adapter_bytes, _read_ort_adapter,
                             _owned_ort_adapter),
}


def _format(path: Path, format: str | None) -> _Format:
    """The format ``format=`` names (a suffix, with or without its dot), else ``path``'s."""
    if format is not None:
        given = format if not isinstance(format, str) or format.startswith(".") else f".{format}"
        return _FORMATS[choice("format", given, FORMATS)]
    if path.suffix not in _FORMATS:
        raise UnsupportedOptionError(
            f"Cannot tell the adapter format of {str(path)!r} from its suffix "
            f"{path.suffix or '(none)'!r}: name the file *.safetensors, *.npz or "
            "*.onnx_adapter, or pass format=.")
    return _FORMATS[path.suffix]


# -- sources and targets ---------------------------------------------------------------------


def _program_and_state(source: Any) -> tuple[TrainingProgram, Mapping[str, np.ndarray]]:
    """The program whose adapters are written, and the state their values come from."""
    from ..program import TrainingProgram
    from ..runtime.trainer import Trainer

    if isinstance(source, Trainer):
        return source.program, source.state
    if isinstance(source, TrainingProgram):
        return source, source.state
    if isinstance(source, (str, os.PathLike)) and Path(source).is_dir():
        program = TrainingProgram(*read_saved(source))
        return program, program.state
    raise UnsupportedOptionError(
        f"Cannot export the adapters of a {type(source).__name__}: pass a Trainer, a "
        "TrainingProgram or the path of a program or checkpoint folder.")


def _adapters(program: TrainingProgram) -> tuple[Adapter, ...]:
    adapters = program.adapters
    if not adapters:
        raise UnsupportedOptionError(
            "The program has no adapters: compile it with adapters=lossgraph.LoRA(...) to train "
            "LoRA adapters (or export the whole model with to_inference_model).")
    return adapters


# -- export -----------------------------------------------------------------------------------


def export_adapters(source: Trainer | TrainingProgram | str | os.PathLike,
                    path: str | os.PathLike, format: str | None = None, *,
                    peft_config: bool = False, overwrite: bool = False) -> Path:
    """Write the adapters of ``source`` to ``path`` (see the module docstring); returns the
    file's absolute path. Everything is checked before anything is written."""
    kind, target, config = check_adapters_target(path, format, peft_config, overwrite)
    program, state = _program_and_state(source)
    adapters = _adapters(program)
    settings = _peft_settings(adapters) if config is not None else None
    tensors, metadata = file_tensors(adapters, state, kind.peft_names)
    # PEFT's configuration is lossgraph's where the adapters beside it were, before this write
    config_owned = config is not None and _owned_safetensors(target)
    written = write_file(target, kind.write(tensors, metadata), kind.owned, overwrite)
    if config is not None:
        text = json.dumps(settings, indent=2, sort_keys=True) + "\n"
        write_file(config, text.encode(), lambda _: config_owned, overwrite)
    return written


def check_adapters_target(path: str | os.PathLike, format: str | None = None,
                          peft_config: bool = False, overwrite: bool = False
                          ) -> tuple[_Format, Path, Path | None]:
    """The format, the file's absolute path and PEFT's configuration's (None: not asked for),
    once it is clear they may be written (:mod:`lossgraph.fileio`); before any work."""
    path = Path(path)
    kind = _format(path, format)
    if kind.suffix == ".onnx_adapter":
        _ort_adapter_format()  # onnxruntime 1.20 or later, or an error now
    flag("overwrite", overwrite)
    config = _peft_config_path(path, kind, flag("peft_config", peft_config))
    target = check_file_target(path, kind.owned, overwrite)
    if config is not None:
        config = check_file_target(config, lambda _: _owned_safetensors(target), overwrite)
    return kind, target, config


def _peft_config_path(path: Path, kind: _Format, wanted: bool) -> Path | None:
    """Where PEFT's configuration goes (None: not asked for); checked before any work."""
    if not wanted:
        return None
    if kind.suffix != ".safetensors" or path.name != PEFT_FILE:
        raise UnsupportedOptionError(
            f"peft_config=True writes {PEFT_CONFIG} beside the adapters for "
            f"peft.PeftModel.from_pretrained, which reads only a folder's {PEFT_FILE}: name the "
            f"file {PEFT_FILE} (e.g. 'adapter/{PEFT_FILE}'), not {path.name!r}.")
    return path.with_name(PEFT_CONFIG)


def _peft_settings(adapters: Sequence[Adapter]) -> dict[str, Any]:
    """PEFT's ``LoraConfig`` of ``adapters`` (its ``to_dict`` fields), modules by full path."""
    unnamed = [a.weight for a in adapters if a.module is None]
    if unnamed:
        raise UnsupportedOptionError(
            f"peft_config=True: the adapter on {unnamed[0]!r} has no torch module path, so PEFT "
            "cannot place it. Export such models' adapters without peft_config (they keep "
            "their ONNX names), or compile an export that records module paths.")
    ranks = {a.module: int(a.rank) for a in adapters}
    alphas = {a.module: float(a.alpha) for a in adapters}
    rank = max(set(ranks.values()), key=list(ranks.values()).count)
    alpha = max(set(alphas.values()), key=list(alphas.values()).count)
    return {"peft_type": "LORA", "task_type": None, "base_model_name_or_path": None,
            "r": rank, "lora_alpha": alpha, "target_modules": sorted(ranks),
            "rank_pattern": {m: r for m, r in ranks.items() if r != rank},
            "alpha_pattern": {m: a for m, a in alphas.items() if a != alpha},
            "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
            "init_lora_weights": True, "modules_to_save": None, "use_rslora": False,
            "use_dora": False, "inference_mode": True}


def with_adapter_inputs(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``model`` (an inference model that keeps its adapter branch:
    ``to_inference_model(merge=False)``) whose adapter tensors are graph inputs as well as
    initializers: onnxruntime feeds an active adapter's tensors to them
    (``RunOptions.add_active_adapter``, an ``.onnx_adapter`` file) and runs with the
    initializers' values, the trained adapters, without one."""
    adapters = read_adapters(model)
    if not adapters:
        raise UnsupportedOptionError(
            "The model has no adapters to feed: pass the inference model of a program "
            "compiled with adapters=lossgraph.LoRA(...), exported with merge=False.")
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    tensors = {t.name: t for t in copy.graph.initializer}
    listed = {i.name for i in copy.graph.input}
    for adapter in adapters:
        for name in (adapter.a, adapter.b):
            if name not in tensors:
                raise UnsupportedModelError(
                    f"The adapter tensor {name!r} is not an initializer of the model (merged "
                    "already?): export the inference model with merge=False.")
            if name not in listed:
                copy.graph.input.append(helper.make_tensor_value_info(
                    name, tensors[name].data_type, list(tensors[name].dims)))
    return copy


# -- load -------------------------------------------------------------------------------------


def load_adapters(target: Trainer | TrainingProgram, path: str | os.PathLike,
                  format: str | None = None) -> dict[str, np.ndarray]:
    """Set ``target``'s adapters to those of the file at ``path`` (a PEFT folder: its
    ``adapter_model.safetensors``); returns the values set by initializer name.

    Every adapter of the target must be in the file, with the same shape and dtype, made
    for the same base model and LoRA options: else an AdapterMismatchError, before anything
    is set. The adapters' optimizer states go back to the program's initial ones.
    """
    from ..program import TrainingProgram
    from ..runtime.trainer import Trainer

    if not isinstance(target, (Trainer, TrainingProgram)):
        raise UnsupportedOptionError(
            f"Cannot load adapters into a {type(target).__name__}: pass a Trainer or a "
            "TrainingProgram (compiled with adapters=lossgraph.LoRA(...)).")
    path = Path(path)
    if path.is_dir():  # a PEFT folder: its file, never a link out of it
        path = member_file(path, PEFT_FILE, "A PEFT adapter folder")
    if not path.is_file():
        raise InvalidProgramError(f"There is no adapter file at {str(path)!r}.")
    kind = _format(path, format)
    program = target.program if isinstance(target, Trainer) else target
    adapters = _adapters(program)
    state = target.state if isinstance(target, Trainer) else program.state
    tensors, metadata = kind.read(path)
    values = loaded_values(adapters, state, tensors, metadata, kind.peft_names,
                           _peft_file_settings(path, metadata), str(path))
    if isinstance(target, TrainingProgram):  # its optimizer states are the initial ones
        target.state.update(values)
        return values
    trained = {t for adapter in adapters for t in (adapter.a, adapter.b)}
    fresh = {s["name"]: program.state[s["name"]] for w in program.manifest["weights"]
             if w["name"] in trained for s in w["states"]}
    target.set_state({**values, **fresh})
    return values


def _peft_file_settings(path: Path, metadata: Mapping[str, str]) -> dict[str, Any] | None:
    """The PEFT ``adapter_config.json`` beside a file lossgraph did not write, if any."""
    config = path.with_name(PEFT_CONFIG)
    if metadata.get(WRITTEN_BY) == "lossgraph" or not (config.is_file() or config.is_symlink()):
        return None
    settings = read_json_file(path.parent, PEFT_CONFIG, "PEFT adapter configuration")
    if not isinstance(settings, dict):
        raise InvalidProgramError(f"{str(config)!r} is not a PEFT adapter configuration.")
    return settings


def loaded_values(adapters: Sequence[Adapter], state: Mapping[str, np.ndarray],
                  tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str],
                  peft_names: bool, peft_settings: Mapping[str, Any] | None = None,
                  where: str = "The file") -> dict[str, np.ndarray]:
    """The adapters' values in a file's ``tensors``, by initializer name, once the file is
    shown to fit ``adapters`` (an AdapterMismatchError naming what differs otherwise)."""
    _check_base(adapters, state, metadata, where)
    if peft_settings is not None:
        _check_peft_settings(adapters, peft_settings, where)
    slots = [slot for adapter in adapters for slot in _slots(adapter, peft_names)]
    expected = {slot.name for slot in slots}
    missing = [slot.name for slot in slots if slot.name not in tensors]
    if missing:
        raise AdapterMismatchError(
            f"{where} has no tensor {missing[0]!r} ({len(missing)} of the program's "
            f"{len(slots)} adapter tensors missing): it holds adapters for another model or "
            "other targets." + suggest(missing[0], list(tensors), "tensors in the file"))
    extra = [name for name in tensors if name not in expected]
    if extra:
        raise AdapterMismatchError(
            f"{where} holds {extra[0]!r} ({len(extra)} tensors in all), which is no adapter of "
            "the program: it was written for other targets (or holds trained base weights, "
            "PEFT's modules_to_save, which load_adapters does not set).")
    values = {}
    for slot in slots:
        value = tensors[slot.name]
        value = value.T if slot.transposed else value
        own = state[slot.tensor]
        if value.shape != own.shape or value.dtype != own.dtype:
            shown = value.T.shape if slot.transposed else value.shape
            raise AdapterMismatchError(
                f"{where}: {slot.name!r} is {value.dtype}{list(shown)}; the program's adapter "
                f"{slot.tensor!r} needs {own.dtype}"
                f"{list(own.T.shape if slot.transposed else own.shape)} (another base model "
                "or rank).")
        values[slot.tensor] = np.array(value)
    return values


def _check_base(adapters: Sequence[Adapter], state: Mapping[str, np.ndarray],
                metadata: Mapping[str, str], where: str) -> None:
    """Refuse a file lossgraph wrote for another base model or other LoRA options."""
    own = base_record(adapters, state)
    if "model_version" in metadata:  # an .onnx_adapter: the digest's first 31 bits
        if int(metadata["model_version"]) != int(_digest(own)[:8], 16) & 0x7FFFFFFF:
            raise AdapterMismatchError(
                f"{where} was written for another base model or other LoRA options (its "
                "model_version differs from this program's: targets, rank, alpha or shapes).")
        return
    text = metadata.get(RECORD_KEY)
    if text is None:
        return  # not lossgraph's (PEFT's): names and shapes are checked
    try:
        record = json.loads(text)
        theirs = {_known_by(e): e for e in record["adapters"]}
    except (ValueError, KeyError, TypeError):
        raise InvalidProgramError(f"{where}: lossgraph's record in it is damaged.") from None
    if record.get("format") != RECORD_FORMAT:
        raise InvalidProgramError(f"{where} has adapter record format {record.get('format')!r}; "
                                  f"this lossgraph reads {RECORD_FORMAT!r}.")
    mine = {_known_by(e): e for e in own}
    if set(mine) != set(theirs):
        lacking = sorted(set(mine) - set(theirs)) or sorted(set(theirs) - set(mine))
        side = "the file has no adapter on" if set(mine) - set(theirs) else \
            "the program has no adapter on"
        raise AdapterMismatchError(
            f"{where} was written for another base model or other targets: {side} "
            f"{lacking[0]!r} (the file's adapters: {', '.join(map(repr, sorted(theirs)))}).")
    for key, entry in mine.items():
        differs = [f"{field} {theirs[key].get(field)!r} in the file, {entry[field]!r} here"
                   for field in ("kind", "rank", "alpha", "a", "b", "dtype")
                   if theirs[key].get(field) != entry[field]]
        if differs:
            raise AdapterMismatchError(
                f"{where} was written for another base model or LoRA options: the adapter on "
                f"{key!r} has {'; '.join(differs)}. Compile the program with the options the "
                "file was trained with.")


def _check_peft_settings(adapters: Sequence[Adapter], settings: Mapping[str, Any],
                         where: str) -> None:
    """Refuse a PEFT adapter whose scale differs from the program's adapters'."""
    for option in ("use_rslora", "use_dora"):
        if settings.get(option):
            raise AdapterMismatchError(
                f"{where}: its {PEFT_CONFIG} sets {option}=true, which lossgraph's LoRA does not "
                f"compute (alpha / rank scaling, no magnitude vector).")
    ranks, alphas = settings.get("rank_pattern") or {}, settings.get("alpha_pattern") or {}
    for adapter in adapters:
        module = adapter.module
        rank = next((r for k, r in ranks.items() if module_matches(module, k)),
                    settings.get("r"))
        alpha = next((a for k, a in alphas.items() if module_matches(module, k)),
                     settings.get("lora_alpha"))
        if (rank, alpha) != (None, None) and (rank != adapter.rank or alpha != adapter.alpha):
            raise AdapterMismatchError(
                f"{where}: PEFT's {PEFT_CONFIG} gives {module or adapter.weight!r} rank {rank} "
                f"and alpha {alpha}; the program's adapter has rank {adapter.rank} and alpha "
                f"{adapter.alpha}. Compile with LoRA(rank={rank}, alpha={alpha}).")
