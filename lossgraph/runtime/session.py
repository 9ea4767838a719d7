"""onnxruntime sessions and the low-level bindings the trainer drives.

The trainer talks to onnxruntime through ``onnxruntime.capi._pybind_state``
(``SessionIOBinding``, ``OrtValue``), which costs about a third of the Python-level
wrappers per call and is the same in onnxruntime-training 1.19 and onnxruntime 1.31.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import onnx

from ..errors import (
    EvaluationError,
    LossgraphError,
    RuntimeUnavailableError,
    UnsupportedOptionError,
    suggest,
)
from ..graphs import all_graphs, stored_tensors, with_weight_data
from ..graphs.held import copy_fields, held_tensors
from ..target import check_loads, release_target
from ..training_build import available as training_build_available
from ..training_build import import_onnxruntime

__all__ = ["check_loadable", "check_session_options", "checked_providers", "create_session",
           "cpu_device", "default_session_options", "evaluation_error", "installed_runtime",
           "onnxruntime_module", "ortvalue", "quiet_session_options",
           "training_build_available"]


def onnxruntime_module():
    """The onnxruntime module (imported without the training build's torch-based Python
    package, :func:`lossgraph.training_build.import_onnxruntime`), or a clear error."""
    try:
        return import_onnxruntime()
    except ImportError as exc:
        raise RuntimeUnavailableError(
            "Training needs onnxruntime: pip install 'lossgraph[runtime]' (current onnxruntime) "
            "or 'lossgraph[training]' (onnxruntime-training 1.19.2), not both."
        ) from exc


def checked_providers(providers: Any) -> list | None:
    """onnxruntime execution providers, each a name (or ``(name, options)``) the installed
    onnxruntime has; ``None`` (CPU) stays ``None``."""
    if providers is None:
        return None
    listed = [providers] if isinstance(providers, str) else providers
    if not isinstance(listed, (list, tuple)):
        raise UnsupportedOptionError(
            f"providers={providers!r} must be a list of onnxruntime execution provider names, "
            "e.g. ['CPUExecutionProvider'].")
    available = onnxruntime_module().get_available_providers()
    for provider in listed:
        name = provider[0] if isinstance(provider, tuple) and provider else provider
        if name not in available:
            raise UnsupportedOptionError(
                f"providers names {name!r}, which this onnxruntime does not have."
                + suggest(str(name), available, "providers"))
    return list(listed)


def quiet_session_options(**settings: Any):
    """onnxruntime ``SessionOptions`` logging errors only, with ``settings`` set on them
    (e.g. ``intra_op_num_threads=1``); a key with a dot is a configuration entry
    (``**{"session.disable_prepacking": "1"}``: ``add_session_config_entry``)."""
    options = onnxruntime_module().SessionOptions()
    options.log_severity_level = 3
    for key, value in settings.items():
        if not isinstance(key, str) or ("." not in key and not hasattr(options, key)):
            raise UnsupportedOptionError(
                f"onnxruntime's SessionOptions has no {key!r}: name one of its attributes "
                "(e.g. 'intra_op_num_threads') or a configuration entry (e.g. "
                "'session.disable_prepacking').")
        if "." in key:
            options.add_session_config_entry(key, str(value))
        else:
            setattr(options, key, value)
    return options


def default_session_options(**settings: Any):
    """lossgraph's ``SessionOptions`` for the sessions it runs, with ``settings`` set on
    them (e.g. ``intra_op_num_threads=1``): quiet, and without onnxruntime's memory pattern
    (:func:`create_session` says why). Start from these to change one setting and keep the
    rest of lossgraph's defaults."""
    return quiet_session_options(**{"enable_mem_pattern": False, **settings})


def check_session_options(session_options: Any) -> None:
    """An UnsupportedOptionError, before any work, unless ``session_options`` is None, a
    dict of settings :func:`default_session_options` takes, or onnxruntime's
    ``SessionOptions``."""
    if session_options is None or isinstance(session_options, Mapping):
        default_session_options(**(session_options or {}))
    elif not isinstance(session_options, onnxruntime_module().SessionOptions):
        raise UnsupportedOptionError(
            f"session_options={session_options!r} must be a dict of settings (e.g. "
            "{'intra_op_num_threads': 1}) or onnxruntime's SessionOptions.")


def installed_runtime() -> str:
    """The installed onnxruntime, as messages name it: ``"onnxruntime-training 1.19.2"``."""
    onnxruntime = onnxruntime_module()
    kind = "onnxruntime-training" if training_build_available() else "onnxruntime"
    return f"{kind} {onnxruntime.__version__}"


def check_loadable(model: onnx.ModelProto, what: str) -> None:
    """An UnsupportedModelError, before any work, when the installed onnxruntime cannot
    load ``model`` (named ``what``): its IR version or opset is newer than it reads.
    Releases newer than those measured (:mod:`lossgraph.target`) are not checked."""
    runtime = release_target(onnxruntime_module().__version__, training_build_available())
    if runtime is not None:
        check_loads(model, runtime, what, installed_runtime())


def create_session(model: onnx.ModelProto, providers: Sequence[str] | None = None,
                   session_options: Any = None, graph: str = "model"):
    """An InferenceSession for ``model`` (CPU by default), quiet unless told otherwise;
    a model the installed onnxruntime cannot load (named ``graph`` in messages) is a
    lossgraph error, never onnxruntime's.

    ``session_options``: None (:func:`default_session_options`), a dict of settings (those
    options with them), or onnxruntime's ``SessionOptions``, used as given.
    A light model's weights (:class:`~lossgraph.graphs.HeldWeights`: a program's frozen
    weights) are handed to onnxruntime as they are, never copied
    (``add_external_initializers``, on options made for this session: a user's
    ``SessionOptions`` is never changed, so with one they are copied into the model).

    By default without onnxruntime's memory pattern: it allocates a run's values as one
    block from the second run on, beside the arena that holds the first run's, so a
    training step's memory grew from the first step to the second (by 22% on a 4-layer
    BERT's step, 300 to 383 MiB; BERT-base's step peak 2,677 MiB with it, 2,486 without;
    no slower, there or on a linear model's 1,000 steps).
    """
    onnxruntime = onnxruntime_module()
    check_loadable(model, f"The {graph!r} graph")
    if session_options is None or isinstance(session_options, Mapping):
        options = default_session_options(**(session_options or {}))  # fresh, for this one
        model, frozen = _frozen_apart(model)
        # onnxruntime's own OrtValues, which keep their array alive
        values = [onnxruntime.OrtValue.ortvalue_from_numpy(array) for array in frozen.values()]
        if frozen:
            options.add_external_initializers(list(frozen), values)
    else:
        options, frozen, values = session_options, {}, []
        model = with_weight_data(model)
    try:
        session = onnxruntime.InferenceSession(
            model.SerializeToString(), options,
            providers=list(providers or ["CPUExecutionProvider"]))
    except Exception as exc:  # onnxruntime's errors derive from Exception only
        detail = " ".join(str(exc).split()).rsplit(" : ", 1)[-1].rstrip(".")
        raise EvaluationError(
            f"{installed_runtime()} could not load the {graph!r} graph: {detail}.") from None
    # the session reads the arrays the OrtValues alias: they live as long as it does
    session.lossgraph_frozen = (frozen, values)
    return session


def _frozen_apart(model: onnx.ModelProto) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """``model`` with its held weights as initializers of the main graph (onnxruntime
    takes external initializers there only; a nested graph, an epoch's Scan body, reads
    them from its outer scope: names are unique across graphs), and their arrays."""
    frozen = {tensor.name: store.array(key)
              for tensor, store, key in held_tensors(stored_tensors(model))}
    nested = {tensor.name for sub in list(all_graphs(model.graph))[1:] for tensor in sub.initializer
              if tensor.name in frozen}
    if not nested:
        return model, frozen
    hoisted = onnx.ModelProto()
    copy_fields(model, hoisted, skip="graph")
    copy_fields(model.graph, hoisted.graph, skip="initializer")
    hoisted.graph.initializer.extend(model.graph.initializer)
    for sub in list(all_graphs(hoisted.graph))[1:]:
        kept = [t for t in sub.initializer if t.name not in nested]
        hoisted.graph.initializer.extend(t for t in sub.initializer if t.name in nested)
        del sub.initializer[:]
        sub.initializer.extend(kept)
    return hoisted, frozen


def cpu_device():
    """The CPU device, for OrtValues."""
    C = onnxruntime_module().capi._pybind_state

    return C.OrtDevice(C.OrtDevice.cpu(), C.OrtDevice.default_memory(), 0)


def ortvalue(array: np.ndarray, device=None):
    """An OrtValue aliasing ``array``'s memory: the caller keeps ``array`` alive meanwhile."""
    C = onnxruntime_module().capi._pybind_state

    return C.OrtValue.ortvalue_from_numpy(array, device or cpu_device())


def evaluation_error(graph: str, exc: Exception) -> Exception:
    """The error for onnxruntime failing to run ``graph`` (its message's first line, without
    the C++ source location); a lossgraph error is returned as it is."""
    if isinstance(exc, LossgraphError):
        return exc
    detail = " ".join(str(exc).split()) or type(exc).__name__
    detail = detail.rsplit(" : ", 1)[-1].rstrip(".")  # after "[ONNXRuntimeError] : 2 : ..."
    return EvaluationError(
        f"onnxruntime could not run the {graph!r} graph: {detail}. Check the data's shapes and "
        "dtypes against the graph's inputs (TrainingProgram.manifest lists them).")
