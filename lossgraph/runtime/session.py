"""onnxruntime sessions and the low-level bindings the trainer drives.

The trainer talks to onnxruntime through ``onnxruntime.capi._pybind_state``
(``SessionIOBinding``, ``OrtValue``), which costs about a third of the Python-level
wrappers per call and is the same in onnxruntime-training 1.19 and onnxruntime 1.31.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import onnx
from onnx import helper

from ..errors import (
    EvaluationError,
    LossgraphError,
    RuntimeUnavailableError,
    UnsupportedOptionError,
    suggest,
)
from ..graphs import all_graphs, stored_tensors, with_weight_data
from ..graphs.held import held_tensors
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
    and planned buffer reuse (:func:`create_session` says why). Start from these to change
    one setting and keep the rest of lossgraph's defaults."""
    return quiet_session_options(**{"enable_mem_pattern": False, "enable_mem_reuse": False,
                                     **settings})


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
    weights) become inputs of its main graph, which the session feeds on every run from
    the store's arrays (:class:`FedSession`): onnxruntime copies every initializer it is
    given, ``add_external_initializers``' included, so that a session of BERT-base's LoRA
    step held its 418 MiB of frozen weights a second time. As inputs, they are not
    constant-folded or prepacked either (both copies again). With a user's
    ``SessionOptions`` (never changed) they are copied into the model.

    By default without onnxruntime's memory pattern: it allocates a run's values as one
    block from the second run on, beside the arena that holds the first run's, so a
    training step's memory grew from the first step to the second (by 22% on a 4-layer
    BERT's step, 300 to 383 MiB; BERT-base's step peak 2,677 MiB with it, 2,486 without;
    no slower, there or on a linear model's 1,000 steps).

    And without onnxruntime's planned buffer reuse (``enable_mem_reuse``): its planner
    gives each value the buffer of an earlier dead one of the same size, for the whole
    session, so a buffer stays held, idle, from its first value to its last one's end, and
    each size's buffers add up to the most of that size ever alive at once: a training
    step held its forward's buffers through the backward (BERT-base's step 1,186 ->
    1,112 MiB without it, with ``recompute="auto"`` 767 -> 661; GPT-2 small's 1,493 ->
    1,328; the same values bit for bit, the step times within 2%). Without it, the arena
    gives each value a free block when it is made, and takes it back after its last
    reader.
    """
    check_loadable(model, f"The {graph!r} graph")
    if session_options is None or isinstance(session_options, Mapping):
        options = default_session_options(**(session_options or {}))  # fresh, for this one
        model, frozen = _frozen_as_inputs(model)
    else:
        options, frozen = session_options, {}
        model = with_weight_data(model)
    try:
        session = _fed_session_type()(
            model.SerializeToString(), options,
            providers=list(providers or ["CPUExecutionProvider"]))
    except Exception as exc:  # onnxruntime's errors derive from Exception only
        detail = " ".join(str(exc).split()).rsplit(" : ", 1)[-1].rstrip(".")
        raise EvaluationError(
            f"{installed_runtime()} could not load the {graph!r} graph: {detail}.") from None
    session.feed_frozen(frozen)
    return session


def _frozen_as_inputs(model: onnx.ModelProto) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """``model`` with its held weights as inputs of its main graph instead of initializers
    (a nested graph, an epoch's Scan body, reads them from its outer scope: names are
    unique across graphs), and their arrays by name."""
    held = {tensor.name: (tensor, store.array(key))
            for tensor, store, key in held_tensors(stored_tensors(model))}
    if not held:
        return model, {}
    fed = onnx.ModelProto()
    fed.CopyFrom(model)  # a light model: its held weights' data is not in it
    for graph in all_graphs(fed.graph):
        kept = [tensor for tensor in graph.initializer if tensor.name not in held]
        del graph.initializer[:]
        graph.initializer.extend(kept)
    fed.graph.input.extend(helper.make_tensor_value_info(name, tensor.data_type, tensor.dims)
                           for name, (tensor, _) in held.items())
    return fed, {name: array for name, (_, array) in held.items()}


@functools.cache
def _fed_session_type() -> type:
    """:class:`FedSession` over the installed onnxruntime's ``InferenceSession``."""
    base = onnxruntime_module().InferenceSession

    class FedSession(base):
        """An onnxruntime ``InferenceSession`` that feeds a light model's frozen weights
        (:func:`create_session`'s inputs instead of initializers) from the arrays that
        hold them, without a copy: :meth:`run` adds them to the feeds, and
        :meth:`bind_frozen` binds them to an IOBinding; :meth:`get_inputs` lists the
        other inputs, those a caller feeds. ``frozen``: the arrays by input name;
        ``frozen_values``: the OrtValues over them that bindings take."""

        frozen: Mapping[str, np.ndarray] = {}
        frozen_values: Mapping[str, Any] = {}

        def feed_frozen(self, frozen: Mapping[str, np.ndarray]) -> None:
            """Feed ``frozen`` (arrays by input name, kept alive here) on every run."""
            self.frozen = dict(frozen)
            self.frozen_values = {name: ortvalue(array) for name, array in frozen.items()}

        def run(self, output_names, input_feed, run_options=None):
            return super().run(output_names, {**input_feed, **self.frozen}, run_options)

        def get_inputs(self):
            return [value for value in super().get_inputs() if value.name not in self.frozen]

        def bind_frozen(self, binding: Any) -> None:
            """Bind the frozen weights to ``binding`` (a ``SessionIOBinding`` of this
            session's ``_sess``)."""
            for name, value in self.frozen_values.items():
                binding.bind_ortvalue_input(name, value)

    FedSession.__qualname__ = FedSession.__name__
    return FedSession


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
