"""Running a vector-Jacobian graph cut in two (:func:`lossgraph.surgery.split_gradient`).

:class:`HalvesRunner` runs the forward half once and hands its residuals to
the backward half as OrtValues, never through numpy: the forward pass is not
computed twice and nothing is copied between the halves. :class:`SeparateStep`
chains it with a ``fuse="separate"`` program's loss, penalty and update graphs, the
onnxcustom's training step.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx

from ..errors import UnsupportedModelError
from ..graphs import np_dtype
from ..speed import FoldStaticShapes, SpecializeBatch
from ..surgery import GradientHalves, chain_graphs, giving_only, split_gradient
from .packed import PackedUpdate
from .ring import GraphRunner, StateRing
from .session import cpu_device, evaluation_error, ortvalue

if TYPE_CHECKING:  # the program module builds on the fusion modes, which build on this one
    from ..program import TrainingProgram

__all__ = ["HalvesRunner", "SeparateStep"]

SessionFactory = Callable[[onnx.ModelProto], Any]
#: ``make_runner(graph, batch=None, bound=None)``: the Trainer's GraphRunner of a program graph.
RunnerFactory = Callable[..., GraphRunner]


class _Bound:
    """One session with a reusable IOBinding: the outputs given arrays are written into
    them, the others onnxruntime allocates each run."""

    def __init__(self, session: Any, outputs: Sequence[str], graph: str,
                 into: Mapping[str, np.ndarray] | None = None) -> None:
        from onnxruntime.capi import _pybind_state as C

        self.graph = graph
        self._session = session._sess
        self._binding = C.SessionIOBinding(self._session)
        self._bind_frozen = session.bind_frozen
        self._run_options = C.RunOptions()
        self._outputs = list(outputs)
        self._device = cpu_device()
        self._into = {name: ortvalue(array, self._device) for name, array in (into or {}).items()}
        self._arrays = into  # the OrtValues above alias them

    def run(self, inputs: Mapping[str, Any]) -> list[Any]:
        """Run on ``inputs`` (OrtValues by name); the outputs (OrtValues, in the order
        given at construction) stay valid after the next run. The binding holds nothing
        after a run: a step's values live as long as their caller keeps them, never into
        the next step (where they would double the memory of what a step allocates)."""
        binding = self._binding
        for name, value in inputs.items():
            binding.bind_ortvalue_input(name, value)
        self._bind_frozen(binding)
        for name in self._outputs:
            if name in self._into:
                binding.bind_ortvalue_output(name, self._into[name])
            else:
                binding.bind_output(name, self._device)
        try:
            self._session.run_with_iobinding(binding, self._run_options)
            values = binding.get_outputs()
            # by index: iterating an OrtValueVector ends on a C++ exception (about 20 us)
            return [values[i] for i in range(len(self._outputs))]
        except Exception as exc:  # onnxruntime's errors derive from Exception only
            raise evaluation_error(self.graph, exc) from None
        finally:
            binding.clear_binding_inputs()
            binding.clear_binding_outputs()


class HalvesRunner:
    """The two halves of a split vector-Jacobian graph, run with OrtValues."""

    def __init__(self, split: GradientHalves, make_session: SessionFactory,
                 gradients: Mapping[str, np.ndarray] | None = None) -> None:
        """``gradients``: arrays the backward half writes the gradients into, by name (else
        onnxruntime allocates them each run)."""
        self.split = split
        self._forward_outputs = [o.name for o in split.forward.graph.output]
        self._forward = _Bound(make_session(split.forward), self._forward_outputs, "forward")
        self._backward = _Bound(make_session(split.backward), split.gradients, "backward",
                                gradients)

    def forward(self, inputs: Mapping[str, Any]) -> tuple[list[Any], dict[str, Any]]:
        """The forward outputs and the residuals the backward half needs (OrtValues)."""
        values = dict(zip(self._forward_outputs, self._forward.run(inputs)))
        return ([values[name] for name in self.split.outputs],
                {name: values[name] for name in self.split.residuals})

    def backward(self, residuals: Mapping[str, Any], reused: Mapping[str, Any],
                 seeds: Mapping[str, Any]) -> list[Any]:
        """The gradients (OrtValues in :attr:`GradientHalves.gradients` order)
        from a forward run's residuals, the forward inputs the backward half reads again
        and the seeds (the outputs' gradients)."""
        return self._backward.run({**residuals, **reused, **seeds})


class SeparateStep:
    """One training step of a ``fuse="separate"`` program::

        forward(x, W) -> prediction;  loss(prediction, y[, w]) -> loss, prediction_grad
        backward(prediction_grad) -> W_grad;  penalty(W) -> penalty, W_penalty_grad
        update(W, W_grad (+ W_penalty_grad), states) -> W', states'

    Weights and states stay in ``ring``; the update writes the next state into the
    following buffer set (the caller advances to it after a finite loss). A program's buffers
    (the running statistics of a training-mode BatchNormalization) are read by the forward
    half, which also computes their next values (outputs of the ``gradient`` graph, so of
    its forward half): they go into the following buffer set too, as the fused graphs write
    them.

    With ``batch``, the step takes batches of that many rows only and runs graphs
    specialized to it. Every value between the graphs then has a static shape, so each
    lives in one preallocated array bound once, as an output of the graph computing it
    and an input of the graphs reading it: a step binds its data and runs the graphs,
    nothing else. A symbolic dimension of the loss graph's prediction (an axis besides
    the batch that an export left free, GPT-2's sequence) takes the size the forward half
    computes. Without ``batch`` (or where a shape stays unknown), onnxruntime allocates
    the forward values each step, bound as they come and held no longer than the step;
    the gradients, shaped like the weights, go into arrays allocated once.

    With ``packed`` (:func:`~lossgraph.runtime.packed.packed_update`, the weights and states
    packed in ``ring`` as it lays them out), such a step runs the update packed: the
    backward half writes each gradient into its part of one flat vector, and one small
    update graph updates every weight at once, to the same numbers.
    """

    def __init__(self, program: TrainingProgram, ring: StateRing,
                 make_session: SessionFactory, make_runner: RunnerFactory,
                 batch: int | None = None, packed: PackedUpdate | None = None) -> None:
        io = program.io
        graphs = dict(program.light_graphs)
        if batch is not None:  # static shapes: no shape arithmetic at run time
            for name in ("gradient", "loss"):
                graphs[name] = SpecializeBatch(batch)(graphs[name]).model
        self._ring = ring
        self._weights = program.weights
        # the model's buffers, and the gradient graph's outputs with their next values
        self._model_buffers = program.buffers
        new = program.state_updates("gradient")
        self._new_buffers = [new[b] for b in self._model_buffers]
        prediction, seed = io("gradient", "prediction")[0], io("gradient", "prediction_grad")[0]
        split = split_gradient(graphs["gradient"], [prediction, *self._new_buffers], [seed])
        self._split = split
        held = {*self._weights, *self._model_buffers}  # inputs from the state buffers
        self._features = [i.name for i in split.forward.graph.input if i.name not in held]
        self._loss_data = io("loss", "label") + io("loss", "sample_weight")
        self._penalized = io("penalty", "weight") if "penalty" in graphs else []
        update_gradients = dict(zip(program.weights, io("update", "gradient")))
        loss_io = {"prediction": io("loss", "prediction")[0], "loss": io("loss", "loss")[0],
                   "prediction_grad": io("loss", "prediction_grad")[0]}
        self._device = cpu_device()
        if batch is not None:
            graphs["loss"] = _loss_fitted(graphs["loss"], loss_io["prediction"], split.forward,
                                          prediction)
        arrays = _static_values(split, graphs["loss"]) if batch is not None else None
        if arrays is not None:
            _check_prediction_rows(graphs["loss"], loss_io["prediction"],
                                   arrays[prediction].shape, prediction, batch)
        if arrays is None:
            self._static = False
            # the gradients, shaped like the weights, in arrays bound once (as the update's
            # inputs too): a step allocates its activations only, and holds none after it
            self._gradients = {w: np.empty_like(program.state.like(w)) for w in self._weights}
            self._model = HalvesRunner(split, make_session,
                                       dict(zip(split.gradients, self._gradients.values())))
            self._index = {name: i for i, name in enumerate(ring.names)}
            self._seed, self._loss_io = seed, loss_io
            self._loss = _Bound(make_session(graphs["loss"]),
                                [loss_io["loss"], loss_io["prediction_grad"]], "loss")
            self._update = make_runner("update", None, {update_gradients[w]: g
                                                        for w, g in self._gradients.items()})
        else:
            self._static = True
            # the gradients end to end in one vector, for the packed update to read at once
            packs = packed is not None and tuple(self._weights) in ring.blocks
            flat_gradient = _pack_gradients(arrays, split.gradients) if packs else None
            self._arrays = arrays
            self._loss_value = arrays[loss_io["loss"]]
            self._runs = self._gradient_runs(split, graphs["loss"], loss_io, arrays, ring,
                                             make_session)
            self._gradients = dict(zip(self._weights, (arrays[g] for g in split.gradients)))
            self._update = (
                make_runner(packed, batch, {packed.gradient: flat_gradient}) if packs else
                make_runner("update", batch, {update_gradients[w]: g
                                              for w, g in self._gradients.items()}))
        self._penalty = None
        if self._penalized:
            total, *grads = io("penalty", "penalty") + io("penalty", "penalty_gradient")
            self._penalty_total = np.empty((), program.state.like(self._penalized[0]).dtype)
            self._penalty_grads = [np.empty_like(program.state.like(w)) for w in self._penalized]
            self._penalty = GraphRunner(make_session(graphs["penalty"]), ring,
                                        {w: w for w in self._penalized}, {}, {},
                                        {total: self._penalty_total,
                                         **dict(zip(grads, self._penalty_grads))}, "penalty")

    def _gradient_runs(self, split: GradientHalves, loss: onnx.ModelProto,
                       loss_io: Mapping[str, str], arrays: Mapping[str, np.ndarray],
                       ring: StateRing, make_session: SessionFactory
                       ) -> list[tuple[GraphRunner, dict[str, str]]]:
        """The runs of a full batch's forward half, loss and backward half, each with the
        batch inputs it reads (graph input -> batch input): one run of the three graphs
        chained (:func:`~lossgraph.surgery.chain_graphs`), else one run each."""
        seed, prediction = loss_io["prediction_grad"], loss_io["prediction"]
        state_in = {w: w for w in (*self._weights, *self._model_buffers)}
        state_out = dict(zip(self._new_buffers, self._model_buffers))
        features, labels = ({n: n for n in names} for names in (self._features, self._loss_data))
        gradients = {g: arrays[g] for g in split.gradients}
        ahead = chain_graphs(split.forward, loss)
        chained = (chain_graphs(ahead[0], split.backward)
                   if ahead is not None and seed not in ahead[1] else None)
        if chained is not None:  # the seed, the loss's output, is the backward half's input
            (model, renamed), loss_renamed = chained, ahead[1]
            outputs = {loss_renamed.get(loss_io["loss"], loss_io["loss"]): self._loss_value,
                       **{renamed.get(g, g): array for g, array in gradients.items()}}
            runner = GraphRunner(make_session(giving_only(model, [*outputs, *state_out])),
                                 ring, state_in, state_out, {}, outputs, "gradient and loss")
            return [(runner, {**features, **{loss_renamed.get(n, n): n for n in labels}})]
        forward = GraphRunner(make_session(split.forward), ring, state_in, state_out, {},
                              {o.name: arrays[o.name] for o in split.forward.graph.output
                               if o.name not in state_out}, "forward")
        loss_run = GraphRunner(make_session(loss), ring, {}, {},
                               {prediction: arrays[prediction]},
                               {loss_io["loss"]: self._loss_value, seed: arrays[seed]}, "loss")
        backward = GraphRunner(make_session(split.backward), ring,
                               {w: w for w in split.reused if w in state_in}, {},
                               {**{r: arrays[r] for r in split.residuals}, seed: arrays[seed]},
                               gradients, "backward")
        reused = {n: n for n in split.reused if n not in state_in}
        return [(forward, features), (loss_run, labels), (backward, reused)]

    @property
    def static(self) -> bool:
        """Whether every value the graphs exchange lives in one preallocated array (a step
        of the batch size the graphs are specialized to, all shapes static)."""
        return self._static

    @property
    def runs(self) -> int:
        """onnxruntime runs of a step's forward half, loss and backward half (1: chained
        into one session); 0 where the values are not static (bound as they come)."""
        return len(self._runs) if self._static else 0

    def run(self, batch: Mapping[str, np.ndarray]) -> float:
        """One step on ``batch`` (C-contiguous arrays by input name); the loss."""
        loss, gradients = self.gradients(batch)
        return loss + self.update(gradients, loss)

    def gradients(self, batch: Mapping[str, np.ndarray]) -> tuple[float, dict[str, Any]]:
        """Forward, loss and backward on ``batch``: the loss graph's loss and each weight's
        gradient (arrays or OrtValues, valid until the next call or
        :meth:`update`, which may write over them), without the penalty."""
        return self._gradients_static(batch) if self._static else self._gradients_dynamic(batch)

    def update(self, gradients: Mapping[str, Any], loss: float) -> float:
        """Add the penalty's gradients to ``gradients`` (from :meth:`gradients`, or numpy
        arrays shaped like the weights) and run the update graph; the penalty (0 without
        one). The next state waits in the following buffer set. Where ``loss`` plus the
        penalty is not finite, the update is not run: the caller keeps the state, which
        a ring of one set would otherwise have lost."""
        if gradients is not self._gradients:  # the update graph reads the arrays bound once
            for weight, bound in self._gradients.items():
                if gradients[weight] is not bound:
                    np.copyto(bound, gradients[weight])
        penalty = 0.0 if self._penalty is None else self._add_penalty(self._gradients)
        if math.isfinite(loss + penalty):
            self._update.run({})
        return penalty

    def _add_penalty(self, gradients: dict[str, Any]) -> float:
        """Run the penalty graph; add its gradients to ``gradients`` (numpy arrays,
        changed in place); the penalty."""
        self._penalty.run({})
        for weight, grad in zip(self._penalized, self._penalty_grads):
            np.add(gradients[weight], grad, out=gradients[weight])
        return float(self._penalty_total)

    def _gradients_static(self, batch: Mapping[str, np.ndarray]) -> tuple[float, dict[str, Any]]:
        for runner, reads in self._runs:
            runner.run({name: batch[data] for name, data in reads.items()})
        return float(self._loss_value), self._gradients

    def _gradients_dynamic(self, batch: Mapping[str, np.ndarray]) -> tuple[float, dict[str, Any]]:
        device = self._device
        data = {name: ortvalue(array, device) for name, array in batch.items()}
        current = self._ring.current
        live = self._ring.values[current]
        weights = {w: live[self._index[w]] for w in (*self._weights, *self._model_buffers)}
        (prediction, *new_buffers), residuals = self._model.forward(
            {**{n: data[n] for n in self._features}, **weights})
        following = self._ring.arrays[self._ring.following(current)]  # the next state
        for buffer, value in zip(self._model_buffers, new_buffers):
            following[self._index[buffer]][...] = value.numpy()
        loss, prediction_grad = self._loss.run(
            {self._loss_io["prediction"]: prediction, **{n: data[n] for n in self._loss_data}})
        reused = {n: data[n] if n in data else weights[n] for n in self._split.reused}
        self._model.backward(residuals, reused, {self._seed: prediction_grad})
        return float(loss.numpy()), self._gradients


def _pack_gradients(arrays: dict[str, np.ndarray], gradients: Sequence[str]) -> np.ndarray:
    """One flat array holding ``gradients`` end to end; each of their ``arrays`` becomes a
    view of its part."""
    parts = [arrays[g] for g in gradients]
    flat = np.empty(sum(p.size for p in parts), parts[0].dtype)
    end = 0
    for name, part in zip(gradients, parts):
        arrays[name] = flat[end:end + part.size].reshape(part.shape)
        end += part.size
    return flat


def _loss_fitted(loss: onnx.ModelProto, read: str, forward: onnx.ModelProto, computed: str
                 ) -> onnx.ModelProto:
    """The loss graph with the symbolic dimensions of its prediction input ``read`` set to
    the sizes the forward half computes for it (its output ``computed``), in every value
    naming them (a name stands for one size throughout a graph): a model exported with a
    free axis besides the batch (GPT-2's sequence) then exchanges values of static shapes,
    which live in arrays allocated once, not every step. ``loss`` when there is none."""
    def dims(value: onnx.ValueInfoProto) -> Any:
        return value.type.tensor_type.shape.dim

    sizes = [d.dim_value if d.HasField("dim_value") else None
             for d in dims(next(o for o in forward.graph.output if o.name == computed))]
    wanted = dims(next(i for i in loss.graph.input if i.name == read))
    named = {d.dim_param: size for d, size in zip(wanted, sizes) if d.dim_param and size}
    if len(wanted) != len(sizes) or not named:
        return loss
    fitted = onnx.ModelProto()
    fitted.CopyFrom(loss)
    for value in (*fitted.graph.input, *fitted.graph.output, *fitted.graph.value_info):
        for dim in dims(value):
            if dim.dim_param in named:
                size = named[dim.dim_param]
                dim.Clear()
                dim.dim_value = size
    return FoldStaticShapes()(fitted).model


def _check_prediction_rows(loss: onnx.ModelProto, read: str, computed: tuple[int, ...],
                           name: str, batch: int | None) -> None:
    """The forward half computes the prediction in the shape the loss graph reads (the
    label's): a model whose output does not keep the batch axis (its rows are not one per
    input row) is an :class:`~lossgraph.errors.UnsupportedModelError`, not an invalid
    graph built from it."""
    tensor = next(v for v in loss.graph.input if v.name == read).type.tensor_type
    expected = tuple(d.dim_value if d.HasField("dim_value") else None for d in tensor.shape.dim)
    if computed != expected:
        raise UnsupportedModelError(
            f"For a batch of {batch} rows, the model computes its output {name!r} of shape "
            f"{computed}, but the loss compares it with labels of shape {expected}: the "
            "model does not keep the batch axis (one output row per input row), so it "
            "cannot be trained by rows. Fix the model's graph (a Reshape or a broadcast "
            "that mixes rows).")


def _static_values(split: GradientHalves, loss: onnx.ModelProto) -> dict[str, np.ndarray] | None:
    """An array for each value the graphs of a step exchange (the forward outputs, the
    loss's outputs, the gradients), or None when a shape is not static."""
    values = [*split.forward.graph.output, *loss.graph.output, *split.backward.graph.output]
    arrays = {}
    for value in values:
        tensor = value.type.tensor_type
        dims = [d.dim_value if d.HasField("dim_value") else None for d in tensor.shape.dim]
        if not tensor.HasField("shape") or None in dims:
            return None
        arrays[value.name] = np.empty(dims, np_dtype(tensor.elem_type))
    return arrays
