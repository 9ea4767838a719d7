"""Running a vector-Jacobian graph cut in two (:func:`lossgraph.separate.split_gradient`).

:class:`ForwardBackwardRunner` runs the forward half once and hands its residuals to
the backward half as OrtValues, never through numpy: the forward pass is not
computed twice and nothing is copied between the halves. :class:`SeparateStep`
chains it with a ``fuse="separate"`` program's loss, penalty and update graphs, the
reference documents' training step.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import onnx

from ..optimize import SpecializeBatch
from ..program import TrainingProgram
from ..separate import ForwardBackward, split_gradient
from .buffers import GraphRunner, StateBuffers
from .session import cpu_device, evaluation_error, ortvalue

__all__ = ["ForwardBackwardRunner", "SeparateStep"]

SessionFactory = Callable[[onnx.ModelProto], Any]


class _Bound:
    """One session with a reusable IOBinding whose outputs onnxruntime allocates."""

    def __init__(self, session: Any, outputs: Sequence[str], graph: str) -> None:
        from onnxruntime.capi import _pybind_state as C

        self.graph = graph
        self._session = session._sess
        self._binding = C.SessionIOBinding(self._session)
        self._run_options = C.RunOptions()
        self._outputs = list(outputs)
        self._device = cpu_device()

    def run(self, inputs: Mapping[str, Any]) -> list[Any]:
        """Run on ``inputs`` (OrtValues by name); the outputs (OrtValues, in the order
        given at construction) stay valid after the next run."""
        binding = self._binding
        for name, value in inputs.items():
            binding.bind_ortvalue_input(name, value)
        binding.clear_binding_outputs()  # else the next run writes into the last outputs
        for name in self._outputs:
            binding.bind_output(name, self._device)
        try:
            self._session.run_with_iobinding(binding, self._run_options)
        except Exception as exc:  # onnxruntime's errors derive from Exception only
            raise evaluation_error(self.graph, exc) from None
        values = binding.get_outputs()
        # by index: iterating an OrtValueVector ends on a C++ exception (about 20 us)
        return [values[i] for i in range(len(self._outputs))]


class ForwardBackwardRunner:
    """The two halves of a split vector-Jacobian graph, run with OrtValues."""

    def __init__(self, split: ForwardBackward, make_session: SessionFactory) -> None:
        self.split = split
        self._forward_outputs = [o.name for o in split.forward.graph.output]
        self._forward = _Bound(make_session(split.forward), self._forward_outputs, "forward")
        self._backward = _Bound(make_session(split.backward), split.gradients, "backward")

    def forward(self, inputs: Mapping[str, Any]) -> tuple[list[Any], dict[str, Any]]:
        """The forward outputs and the residuals the backward half needs (OrtValues)."""
        values = dict(zip(self._forward_outputs, self._forward.run(inputs)))
        return ([values[name] for name in self.split.outputs],
                {name: values[name] for name in self.split.residuals})

    def backward(self, residuals: Mapping[str, Any], reused: Mapping[str, Any],
                 seeds: Mapping[str, Any]) -> list[Any]:
        """The gradients (OrtValues in :attr:`ForwardBackward.gradients` order)
        from a forward run's residuals, the forward inputs the backward half reads again
        and the seeds (the outputs' gradients)."""
        return self._backward.run({**residuals, **reused, **seeds})


class SeparateStep:
    """One training step of a ``fuse="separate"`` program::

        forward(x, W) -> prediction;  loss(prediction, y[, w]) -> loss, prediction_grad
        backward(prediction_grad) -> W_grad;  penalty(W) -> penalty, W_penalty_grad
        update(W, W_grad (+ W_penalty_grad), states) -> W', states'

    Weights and states stay in ``buffers``; the update writes the next state into the
    other buffer set (the caller swaps them after a finite loss). With ``batch``, the
    step takes batches of that many rows only, and runs graphs specialized to it.
    """

    def __init__(self, program: TrainingProgram, buffers: StateBuffers,
                 make_session: SessionFactory, update: GraphRunner,
                 batch: int | None = None) -> None:
        io = program.io
        graphs = dict(program.graphs)
        if batch is not None:  # static shapes: no shape arithmetic at run time
            for name in ("gradient", "loss"):
                graphs[name] = SpecializeBatch(batch)(graphs[name]).model
        self._buffers = buffers
        self._update = update
        self.prediction = io("gradient", "prediction")[0]
        prediction_grad = io("gradient", "prediction_grad")[0]
        split = split_gradient(graphs["gradient"], [self.prediction], [prediction_grad])
        self._model = ForwardBackwardRunner(split, make_session)
        self._seed = prediction_grad
        self._weights = program.weights
        self._features = [i.name for i in split.forward.graph.input
                          if i.name not in self._weights]
        self._index = {name: i for i, name in enumerate(buffers.names)}
        self._loss_prediction = io("loss", "prediction")[0]
        self._loss = _Bound(make_session(graphs["loss"]),
                            io("loss", "loss") + io("loss", "prediction_grad"), "loss")
        self._loss_data = io("loss", "label") + io("loss", "sample_weight")
        self._penalized = io("penalty", "weight") if "penalty" in program.graphs else []
        self._penalty = (_Bound(make_session(program.graphs["penalty"]),
                                io("penalty", "penalty") + io("penalty", "penalty_gradient"),
                                "penalty")
                         if self._penalized else None)
        self._update_gradients = dict(zip(program.weights, io("update", "gradient")))
        self._device = cpu_device()

    def run(self, batch: Mapping[str, np.ndarray]) -> float:
        """One step on ``batch`` (C-contiguous arrays by input name); the loss."""
        device = self._device
        data = {name: ortvalue(array, device) for name, array in batch.items()}
        live = self._buffers.values[self._buffers.current]
        weights = {w: live[self._index[w]] for w in self._weights}
        (prediction,), residuals = self._model.forward(
            {**{n: data[n] for n in self._features}, **weights})
        loss, prediction_grad = self._loss.run(
            {self._loss_prediction: prediction, **{n: data[n] for n in self._loss_data}})
        reused = {n: data[n] if n in data else weights[n] for n in self._model.split.reused}
        grads = self._model.backward(residuals, reused, {self._seed: prediction_grad})
        total = float(loss.numpy())
        gradients = dict(zip(self._weights, grads))
        if self._penalty is not None:
            penalty, *extra = self._penalty.run({w: weights[w] for w in self._penalized})
            total += float(penalty.numpy())
            for weight, grad in zip(self._penalized, extra):
                summed = gradients[weight].numpy() + grad.numpy()
                gradients[weight] = summed
        self._update.run({self._update_gradients[w]: g for w, g in gradients.items()})
        return total
