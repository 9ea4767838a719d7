"""The reference documents' forward/backward object: an ONNX graph as a differentiable
function that another framework (torch, a hand-written loop) trains.

``OrtGradientForwardBackward(model)`` builds, for the inputs ``x`` and the weights ``W``
of ``model``, the graphs (:func:`lossgraph.separate.split_gradient`)::

    forward  (x, W) -> (y, residuals)            forward(inputs, training=True)
    backward (residuals, y_grad) -> (x_grad, W_grad)                backward(grad_outputs)
    predict  (x, W) -> y                          forward(inputs, training=False)

in standard ONNX ops, so they run on any onnxruntime; ``backend="ort"`` builds them with
onnxruntime-training's builder instead (its gradient ops run on the training build
only). :meth:`OrtGradientForwardBackward.new_instance` returns the function object:
each ``forward(..., training=True)`` keeps what its ``backward`` needs, last in first
out, as ``torch.autograd.Function`` does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import onnx

from ..analysis import trainable_initializers
from ..errors import (
    InvalidDataError,
    ProviderError,
    ShapeMismatchError,
    UnknownNameError,
    UnsupportedOptionError,
    suggest,
)
from ..graphs import FLOAT_TYPES, np_dtype
from ..models import ModelLike, as_model
from ..passes.contract import Pipeline
from ..passes.gradient import BACKENDS, Gradient
from ..passes.weights import WeightsToInputs
from ..runtime.forward_backward import ForwardBackwardRunner
from ..runtime.session import checked_providers, cpu_device, create_session, ortvalue
from ..separate import split_gradient
from ..validation import check_trainable_model, names

__all__ = ["OrtGradientForwardBackward", "OrtGradientForwardBackwardFunction",
           "device_providers"]


def device_providers(device: Any) -> list[str] | None:
    """onnxruntime providers for a device name (``"cpu"``, ``"cuda"``, ``"cuda:1"``),
    or a :class:`~lossgraph.errors.ProviderError` when this onnxruntime lacks it."""
    if not isinstance(device, str):
        raise ProviderError(f"device={device!r} must be a string: 'cpu' or 'cuda[:index]'.")
    kind = device.split(":", 1)[0]
    if kind == "cpu":
        return None
    if kind in ("cuda", "gpu"):
        import onnxruntime

        if "CUDAExecutionProvider" not in onnxruntime.get_available_providers():
            raise ProviderError(
                f"device={device!r} needs onnxruntime's CUDAExecutionProvider, which this "
                f"onnxruntime does not have (it has {onnxruntime.get_available_providers()}); "
                "use device='cpu'.")
        return ["CUDAExecutionProvider"]
    raise ProviderError(f"Unknown device {device!r}: use 'cpu' or 'cuda[:index]'.")


class OrtGradientForwardBackward:
    """The forward and backward graphs of an inference model, and the function object
    that runs them (module docstring).

    ``weights_to_train``: the initializers differentiated (default
    :func:`~lossgraph.trainable_initializers`); ``input_names`` and ``output_names``:
    the inputs taken and outputs returned (default all). The function's inputs are the
    inputs, then the weights, in these orders; gradients come back in the same order,
    ``None`` for an input of an integer type.
    """

    def __init__(self, onnx_model: ModelLike, weights_to_train: Sequence[str] | None = None,
                 input_names: Sequence[str] | None = None,
                 output_names: Sequence[str] | None = None, class_name: str | None = None,
                 sess_options: Any = None, providers: Any = None,
                 provider_options: Any = None, run_options: Any = None,
                 graph_builder_config: Any = None, device_index: int = 0,
                 enable_logging: bool = False, debug: bool = False,
                 backend: str = "onnx") -> None:
        if backend not in BACKENDS:
            raise UnsupportedOptionError(
                f"backend={backend!r} is not one of {', '.join(map(repr, BACKENDS))}.")
        if graph_builder_config is not None and backend != "ort":
            raise UnsupportedOptionError(
                "graph_builder_config configures onnxruntime-training's builder: pass "
                "backend='ort' with it.")
        model = as_model(onnx_model)
        check_trainable_model(model)
        self.onnx_model = model
        self.weights_to_train = (names("weights_to_train", weights_to_train)
                                 or trainable_initializers(model))
        initializers = {t.name for t in model.graph.initializer}
        data_inputs = [i.name for i in model.graph.input if i.name not in initializers]
        outputs = [o.name for o in model.graph.output]
        self.input_names = _chosen("input_names", input_names, data_inputs)
        self.output_names = _chosen("output_names", output_names, outputs)
        self.class_name = class_name or f"OrtGradientForwardBackwardFunction_{id(self)}"
        self.sess_options = sess_options
        self.providers = (device_providers(providers) if isinstance(providers, str) else
                          checked_providers(providers))
        self.provider_options = provider_options
        self.run_options = run_options
        self.graph_builder_config = graph_builder_config
        self.device_index = device_index
        self.enable_logging = enable_logging
        self.debug = debug
        self.backend = backend
        self._build()

    def _build(self) -> None:
        model = self.onnx_model
        types = {v.name: v.type.tensor_type.elem_type
                 for v in (*model.graph.input, *model.graph.output)}
        self.grad_input_names = [*self.input_names, *self.weights_to_train]
        differentiable = [n for n in self.input_names if types.get(n) in FLOAT_TYPES]
        self.differentiable_outputs = [n for n in self.output_names
                                       if types.get(n) in FLOAT_TYPES]
        if not self.differentiable_outputs:
            raise UnsupportedOptionError(
                f"None of the outputs {self.output_names} is a float tensor: nothing to "
                "differentiate.")
        lifted = WeightsToInputs(tuple(self.weights_to_train))(model).model
        kept = [o for o in lifted.graph.output if o.name in self.output_names]
        del lifted.graph.output[:]
        lifted.graph.output.extend(kept)
        self.eval_onnx = lifted
        wrt = (*differentiable, *self.weights_to_train)
        vjp = Pipeline((Gradient(wrt, outputs=self.differentiable_outputs,
                                 backend=self.backend),))(lifted)
        grads = vjp.report["Gradient"]
        seeds = [f"{o}_grad" for o in self.differentiable_outputs]
        self.gradient_onnx = vjp.model
        self._split = split_gradient(vjp.model, self.output_names, seeds)
        by_gradient = {g: n for n, g in grads.items()}
        self._gradient_of = [by_gradient.get(g) for g in self._split.gradients]
        self._sessions = _Sessions(self)

    @property
    def forward_onnx(self) -> onnx.ModelProto:
        """The forward graph: inputs and weights -> outputs, then the residuals."""
        return self._split.forward

    @property
    def backward_onnx(self) -> onnx.ModelProto:
        """The backward graph: residuals, reused inputs, output gradients -> gradients."""
        return self._split.backward

    def new_instance(self) -> OrtGradientForwardBackwardFunction:
        """A function object with ``forward``, ``backward`` and ``saved_tensors``."""
        return OrtGradientForwardBackwardFunction(self)

    def get_initializer(self, name: str, exc: bool = True) -> np.ndarray | None:
        """The value of initializer ``name`` in the model (``None`` when missing and
        ``exc`` is False)."""
        for tensor in self.onnx_model.graph.initializer:
            if tensor.name == name:
                return onnx.numpy_helper.to_array(tensor)
        if exc:
            raise UnknownNameError(f"{name!r} is not an initializer of the model."
                                   + suggest(name, [t.name for t in
                                                    self.onnx_model.graph.initializer],
                                             "initializers"))
        return None

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items()
                if k not in ("_sessions", "_split", "eval_onnx", "gradient_onnx",
                             "sess_options", "run_options")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, sess_options=None, run_options=None)
        self._build()

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(weights_to_train={self.weights_to_train!r}, "
                f"input_names={self.input_names!r}, output_names={self.output_names!r}, "
                f"backend={self.backend!r})")


def _chosen(option: str, given: Sequence[str] | None, available: list[str]) -> list[str]:
    chosen = names(option, given)
    if chosen is None:
        return list(available)
    for name in chosen:
        if name not in available:
            raise UnknownNameError(f"{option} names {name!r}, which the model does not have."
                                   + suggest(name, available, "names"))
    return chosen


class _Sessions:
    """The sessions of one OrtGradientForwardBackward, made once and shared by its
    function objects."""

    def __init__(self, owner: OrtGradientForwardBackward) -> None:
        def make(model: onnx.ModelProto) -> Any:
            return create_session(model, owner.providers, owner.sess_options)

        self.predict = make(owner.eval_onnx)
        self.runner = ForwardBackwardRunner(owner._split, make)


class OrtGradientForwardBackwardFunction:
    """Runs one :class:`OrtGradientForwardBackward`: ``forward`` then ``backward``.

    Inputs are numpy arrays (or anything ``numpy.asarray`` takes) in the order of
    ``grad_input_names``; outputs and gradients are numpy arrays.
    """

    def __init__(self, owner: OrtGradientForwardBackward) -> None:
        self.owner = owner
        self.states_: list[tuple[dict[str, Any], dict[str, Any], list[np.ndarray]]] = []
        self.saved_tensors_: list[Any] | None = None

    def _arrays(self, inputs: Sequence[Any]) -> list[np.ndarray]:
        names_ = self.owner.grad_input_names
        if len(inputs) != len(names_):
            raise InvalidDataError(
                f"forward takes {len(names_)} inputs ({', '.join(names_)}: the inputs, then the "
                f"weights), got {len(inputs)}.")
        model = self.owner.eval_onnx
        types = {v.name: np_dtype(v.type.tensor_type.elem_type) for v in model.graph.input}
        arrays = []
        for name, value in zip(names_, inputs):
            array = value.numpy() if hasattr(value, "numpy") and not isinstance(
                value, np.ndarray) else np.asarray(value)
            if array.dtype != types[name]:
                raise InvalidDataError(
                    f"Input {name!r} is {array.dtype}; the model takes {types[name]}.")
            arrays.append(np.ascontiguousarray(array))
        return arrays

    def save_for_backward(self, inputs: Sequence[Any]) -> None:
        """Keep ``inputs`` for :attr:`saved_tensors` (a shallow copy of the list)."""
        self.saved_tensors_ = list(inputs)

    @property
    def saved_tensors(self) -> list[Any]:
        """The inputs of the last ``forward(..., training=True)``."""
        if self.saved_tensors_ is None:
            raise InvalidDataError("No tensors were saved: call forward(..., training=True) "
                                   "before reading saved_tensors.")
        return self.saved_tensors_

    def forward(self, inputs: Sequence[Any], training: bool = False) -> list[np.ndarray]:
        """The outputs for ``inputs``; with ``training=True`` it keeps what the next
        ``backward`` needs."""
        arrays = self._arrays(inputs)
        owner, sessions = self.owner, self.owner._sessions
        feeds = dict(zip(owner.grad_input_names, arrays))
        if not training:
            return sessions.predict.run(owner.output_names, feeds)
        device = cpu_device()
        values = {name: ortvalue(array, device) for name, array in feeds.items()}
        outputs, residuals = sessions.runner.forward(values)
        reused = {name: values[name] for name in owner._split.reused}
        self.states_.append((residuals, reused, arrays))  # arrays: the OrtValues' memory
        self.save_for_backward(inputs)
        return [np.array(value.numpy()) for value in outputs]

    def backward(self, grad_outputs: Sequence[Any]) -> list[np.ndarray | None]:
        """The gradients of the inputs, then of the weights, given the gradients of the
        float outputs (in ``differentiable_outputs`` order) for the last unanswered
        ``forward(..., training=True)``."""
        owner = self.owner
        if not self.states_:
            raise InvalidDataError(
                "backward has no forward pass to answer: call forward(inputs, training=True) "
                "first (each backward consumes the last such forward).")
        expected = owner.differentiable_outputs
        if len(grad_outputs) != len(expected):
            raise InvalidDataError(
                f"backward takes one gradient per float output ({', '.join(expected)}), got "
                f"{len(grad_outputs)}.")
        residuals, reused, arrays = self.states_[-1]
        device = cpu_device()
        seeds, keep = {}, []
        types = {o.name: np_dtype(o.type.tensor_type.elem_type)
                 for o in owner.eval_onnx.graph.output}
        for name, value in zip(expected, grad_outputs):
            array = np.ascontiguousarray(value.numpy() if hasattr(value, "numpy") and not
                                         isinstance(value, np.ndarray) else np.asarray(value))
            if array.dtype != types[name]:
                raise InvalidDataError(
                    f"The gradient of output {name!r} is {array.dtype}; it must be "
                    f"{types[name]}, the output's dtype.")
            keep.append(array)
            seeds[f"{name}_grad"] = ortvalue(array, device)
        self.states_.pop()
        try:
            grads = owner._sessions.runner.backward(residuals, reused, seeds)
        except Exception as exc:  # onnxruntime's message names the mismatching input
            raise ShapeMismatchError(
                f"backward could not run on the gradients given ({exc}). Each gradient must "
                "have its output's shape and dtype.") from None
        by_name = {name: np.array(value.numpy()) for name, value in
                   zip(owner._gradient_of, grads) if name is not None}
        del keep, arrays
        return [by_name.get(name) for name in owner.grad_input_names]
