"""An ONNX graph as a torch layer: the partial-training document's network whose first
layer is torch and second is ONNX, trained by a torch optimizer.

:class:`OnnxModule` is an ``nn.Module`` over an ONNX inference model; each trained ONNX
initializer is one of its ``nn.Parameter`` objects, so ``torch.optim``, ``state_dict`` and
``model.parameters()`` see them as any torch weight::

    layer = OnnxModule(onnx_model)               # weights: trainable_initializers(model)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), layer)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    ...                                           # train as usual
    trained = layer.to_onnx()                     # the inference model, weights written back

:class:`OnnxFunction` is the ``torch.autograd.Function`` under it, over
:class:`~lossgraph.runtime.graph_function.GraphFunction`'s forward and
backward graphs (standard ONNX ops, any onnxruntime). Tensors cross to onnxruntime as
numpy arrays on the CPU; outputs come back on the device of the first input.

torch is optional: importing this module without it raises
:class:`~lossgraph.errors.RuntimeUnavailableError`, and ``import lossgraph`` never
imports it.
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np
import onnx

from .errors import InvalidDataError, RuntimeUnavailableError, ShapeMismatchError

# torch first: without it, the error says what to install before anything else can fail.
try:
    import torch
    from torch.autograd.function import once_differentiable
except (ImportError, OSError) as _exc:  # OSError: a torch whose binaries do not load
    raise RuntimeUnavailableError(
        f"lossgraph.torch needs torch, which does not import here ({_exc}): "
        "pip install torch==2.13.0") from _exc

from .graphs import np_dtype
from .models import ModelLike
from .program import with_weights
from .runtime.graph_function import GraphFunction, GraphFunctionCall

__all__ = ["OnnxFunction", "OnnxModule"]


# ------------------------------------------------------------------ signatures
class _Signature:
    """What the graphs take, read once per forward/backward object: each input's torch
    dtype and declared shape (``None`` for a free axis); which outputs are differentiable."""

    def __init__(self, owner: GraphFunction) -> None:
        graph = owner.eval_onnx.graph
        declared = {v.name: v for v in graph.input}
        self.names = list(owner.grad_input_names)
        self.weights = set(owner.weights_to_train)
        self.dtypes = [_torch_dtype(np_dtype(declared[n].type.tensor_type.elem_type))
                       for n in self.names]
        self.shapes = [_shape(declared[n]) for n in self.names]
        differentiable = set(owner.differentiable_outputs)
        self.differentiable = [n in differentiable for n in owner.output_names]


def _shape(value: onnx.ValueInfoProto) -> tuple[int | None, ...] | None:
    tensor = value.type.tensor_type
    if not tensor.HasField("shape"):
        return None
    return tuple(d.dim_value if d.HasField("dim_value") else None for d in tensor.shape.dim)


_SIGNATURES: weakref.WeakKeyDictionary[GraphFunction, _Signature] = (
    weakref.WeakKeyDictionary())


def _signature(owner: GraphFunction) -> _Signature:
    signature = _SIGNATURES.get(owner)
    if signature is None:
        signature = _SIGNATURES[owner] = _Signature(owner)
    return signature


def _owner(function: Any) -> GraphFunction:
    """The forward/backward object behind ``function`` (itself, or a function object's
    owner: every call runs a fresh function object, see :class:`OnnxFunction`)."""
    if isinstance(function, GraphFunctionCall):
        return function.owner
    if isinstance(function, GraphFunction):
        return function
    raise InvalidDataError(
        f"OnnxFunction.apply takes a GraphFunction (lossgraph.runtime.graph_function; "
        f"onnxcustom's OrtGradientForwardBackward is one) or one of its function objects "
        f"first, then the tensors; got {type(function).__name__}.")


def _to_numpy(signature: _Signature, tensors: Sequence[Any]) -> list[np.ndarray]:
    """``tensors`` as CPU numpy arrays (sharing memory where they can), checked against
    the graph inputs' count, dtypes and declared shapes."""
    names = signature.names
    if len(tensors) != len(names):
        raise InvalidDataError(
            f"The ONNX function takes {len(names)} tensors ({', '.join(names)}: the inputs, "
            f"then the weights), got {len(tensors)}.")
    arrays = []
    for name, expected, shape, tensor in zip(names, signature.dtypes, signature.shapes,
                                             tensors):
        what = f"{'Weight' if name in signature.weights else 'Input'} {name!r}"
        if not isinstance(tensor, torch.Tensor):
            raise InvalidDataError(f"{what} is a {type(tensor).__name__}, not a torch.Tensor: "
                                   "wrap it with torch.as_tensor.")
        if tensor.dtype != expected:
            raise InvalidDataError(f"{what} is {tensor.dtype}; the ONNX model takes {expected} "
                                   f"(convert it with .to({expected})).")
        if shape is not None and (len(shape) != tensor.dim() or any(
                d is not None and d != s for d, s in zip(shape, tensor.shape))):
            declared = ", ".join("?" if d is None else str(d) for d in shape)
            raise ShapeMismatchError(
                f"{what} has shape {list(tensor.shape)}; the ONNX model declares [{declared}] "
                "('?' is a free axis).")
        arrays.append(tensor.detach().cpu().contiguous().numpy())
    return arrays


def _torch_dtype(dtype: np.dtype) -> torch.dtype:
    return torch.from_numpy(np.empty(0, dtype)).dtype


def _to_torch(array: np.ndarray, device: torch.device) -> torch.Tensor:
    if not array.flags.writeable:  # torch.from_numpy warns on read-only memory
        array = array.copy()
    if not array.flags.c_contiguous:
        array = np.ascontiguousarray(array)  # (not always: it makes a 0-d array 1-d)
    tensor = torch.from_numpy(array)
    return tensor if device.type == "cpu" else tensor.to(device)


def _outputs_of(arrays: Sequence[np.ndarray], tensors: Sequence[torch.Tensor]
                ) -> tuple[torch.Tensor, ...]:
    device = tensors[0].device if tensors else torch.device("cpu")
    return tuple(_to_torch(np.asarray(a), device) for a in arrays)


# ------------------------------------------------------------------ the function
class OnnxFunction(torch.autograd.Function):
    """``OnnxFunction.apply(forward_backward, *tensors)``: the outputs of the ONNX graphs
    of ``forward_backward`` (a :class:`GraphFunction`) as a tuple of
    tensors, differentiable by torch autograd.

    ``tensors`` are the model inputs then the weights (``grad_input_names`` order), of
    the dtypes the model declares. Each call runs a fresh function object that keeps its
    own residuals, so several forward passes may be answered by backward passes in any
    order (or never). Integer outputs are marked non-differentiable; integer inputs get
    no gradient. Backward is once-differentiable: a second-order gradient raises.
    """

    @staticmethod
    def forward(ctx: Any, function: Any, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        owner = _owner(function)
        signature = _signature(owner)
        arrays = _to_numpy(signature, tensors)
        instance = owner.new_instance()
        outputs = _outputs_of(instance.forward(arrays, training=True), tensors)
        # This call's residuals live in ctx, not on the instance's stack: backward puts them
        # back for one backward run, so retain_graph=True can run it again.
        ctx.instance, ctx.state, ctx.signature = instance, instance.states_.pop(), signature
        ctx.devices = [t.device for t in tensors]
        # Saved so that torch raises if an input is modified in place before backward:
        # the backward graph reads some inputs again, from memory shared with the tensors.
        ctx.save_for_backward(*tensors)
        ctx.mark_non_differentiable(*(o for o, d in zip(outputs, signature.differentiable)
                                      if not d))
        return outputs

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, *grad_outputs: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        ctx.saved_tensors  # noqa: B018 -- reading them runs torch's in-place check
        seeds = [grad.detach().cpu().contiguous().numpy()
                 for grad, wanted in zip(grad_outputs, ctx.signature.differentiable) if wanted]
        ctx.instance.states_.append(ctx.state)
        grads = ctx.instance.backward(seeds)  # pops ctx.state again
        result: list[torch.Tensor | None] = [None]
        for grad, needed, device in zip(grads, ctx.needs_input_grad[1:], ctx.devices):
            result.append(_to_torch(grad, device) if needed and grad is not None else None)
        return tuple(result)


# ------------------------------------------------------------------ the module
_ILLEGAL = re.compile(r"[^0-9A-Za-z_]")


class OnnxModule(torch.nn.Module):
    """An ONNX inference model as a torch layer whose ONNX weights are ``nn.Parameter``.

    ``weights_to_train``: the initializers that become parameters (default
    :func:`~lossgraph.trainable_initializers`); the others stay constants of the graph.
    ``input_names`` / ``output_names``: the inputs :meth:`forward` takes, in order, and
    the outputs it returns (default all). Further keyword arguments go to
    :class:`GraphFunction` (``backend``, ``providers``, ``sess_options``).

    A parameter is named after its initializer with every character other than a
    letter, digit or ``_`` replaced by ``_`` (torch forbids ``.``), and a suffix where
    that name is taken; :attr:`parameter_names` maps initializer to parameter names.
    """

    def __init__(self, model: ModelLike, weights_to_train: Sequence[str] | None = None,
                 input_names: Sequence[str] | None = None,
                 output_names: Sequence[str] | None = None, **options: Any) -> None:
        super().__init__()
        self.forward_backward = GraphFunction(
            model, weights_to_train, input_names, output_names, **options)
        self.parameter_names: dict[str, str] = {}
        taken: set[str] = set()
        for name in self.forward_backward.weights_to_train:
            value = self.forward_backward.get_initializer(name)
            torch_name = self._free_name(_ILLEGAL.sub("_", name) or "weight", taken)
            taken.add(torch_name)
            self.parameter_names[name] = torch_name
            self.register_parameter(torch_name, torch.nn.Parameter(
                torch.from_numpy(np.array(value, copy=True))))

    def _free_name(self, base: str, taken: set[str]) -> str:
        name, index = base, 0
        while name in taken or hasattr(self, name):
            index += 1
            name = f"{base}_{index}"
        return name

    @property
    def input_names(self) -> list[str]:
        """The inputs :meth:`forward` takes, in order."""
        return list(self.forward_backward.input_names)

    @property
    def output_names(self) -> list[str]:
        """The outputs :meth:`forward` returns, in order."""
        return list(self.forward_backward.output_names)

    def onnx_parameters(self) -> dict[str, torch.nn.Parameter]:
        """The parameters by ONNX initializer name."""
        return {name: getattr(self, torch_name)
                for name, torch_name in self.parameter_names.items()}

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """The model's outputs for ``inputs``: one tensor, or a tuple when the model has
        several outputs.

        When autograd needs nothing (``torch.no_grad``, ``torch.inference_mode``, or no
        tensor requires a gradient), the prediction graph runs and nothing is kept for
        a backward pass. ``eval()`` alone changes nothing: an ONNX inference graph has
        no training mode, and gradients in eval mode flow as they do through torch layers.
        """
        owner = self.forward_backward
        if len(inputs) != len(owner.input_names):
            raise InvalidDataError(
                f"The ONNX layer takes {len(owner.input_names)} input(s) "
                f"({', '.join(owner.input_names)}), got {len(inputs)}.")
        tensors = [*inputs, *(getattr(self, self.parameter_names[w])
                              for w in owner.weights_to_train)]
        if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad
                                           for t in tensors):
            outputs = OnnxFunction.apply(owner, *tensors)
        else:
            arrays = _to_numpy(_signature(owner), tensors)
            outputs = _outputs_of(owner.new_instance().forward(arrays, training=False),
                                  tensors)
        return outputs[0] if len(outputs) == 1 else tuple(outputs)

    def to_onnx(self) -> onnx.ModelProto:
        """The ONNX inference model with the parameters' current values as its
        initializers (a new model; the one given at construction is unchanged)."""
        return with_weights(self.forward_backward.onnx_model, {
            name: parameter.detach().cpu().numpy()
            for name, parameter in self.onnx_parameters().items()})

    def extra_repr(self) -> str:
        owner = self.forward_backward
        return (f"inputs={owner.input_names}, outputs={owner.output_names}, "
                f"weights={owner.weights_to_train}")
