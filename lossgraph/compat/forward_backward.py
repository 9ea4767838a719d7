"""onnxcustom's forward/backward object, ``OrtGradientForwardBackward``: an ONNX graph as a
differentiable function another framework trains (``new_instance()``, then ``forward``
and ``backward``), with onnxcustom's constructor.

The function is :class:`lossgraph.runtime.graph_function.GraphFunction` (both backends,
the running statistics, pickling); these classes add onnxcustom's names and the
arguments its signature had (``class_name``, ``provider_options``, ``debug``), which
change nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..models import ModelLike
from ..runtime.graph_function import GraphFunction, GraphFunctionCall, device_providers

__all__ = ["OrtGradientForwardBackward", "OrtGradientForwardBackwardFunction",
           "device_providers"]


class OrtGradientForwardBackward(GraphFunction):
    """onnxcustom's forward/backward object (:class:`GraphFunction`, with onnxcustom's
    positional signature). ``class_name``, ``provider_options`` and ``debug`` are kept
    for the signature; ``new_instance()`` gives an
    :class:`OrtGradientForwardBackwardFunction`."""

    def __init__(self, onnx_model: ModelLike, weights_to_train: Sequence[str] | None = None,
                 input_names: Sequence[str] | None = None,
                 output_names: Sequence[str] | None = None, class_name: str | None = None,
                 sess_options: Any = None, providers: Any = None,
                 provider_options: Any = None, run_options: Any = None,
                 graph_builder_config: Any = None, device_index: int = 0,
                 enable_logging: bool = False, debug: bool = False,
                 backend: str = "onnx") -> None:
        self.class_name = class_name or f"OrtGradientForwardBackwardFunction_{id(self)}"
        self.provider_options = provider_options
        self.debug = debug
        super().__init__(onnx_model, weights_to_train, input_names, output_names,
                         sess_options=sess_options, providers=providers,
                         run_options=run_options, graph_builder_config=graph_builder_config,
                         device_index=device_index, enable_logging=enable_logging,
                         backend=backend)

    def new_instance(self) -> OrtGradientForwardBackwardFunction:
        """A function object with ``forward``, ``backward`` and ``saved_tensors``."""
        return OrtGradientForwardBackwardFunction(self)


class OrtGradientForwardBackwardFunction(GraphFunctionCall):
    """onnxcustom's function object: :class:`GraphFunctionCall`."""
