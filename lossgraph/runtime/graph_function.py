"""An ONNX graph as a differentiable function that another framework (torch, a hand-written
loop) trains: what :mod:`lossgraph.torch` and onnxcustom's forward/backward object
(:class:`lossgraph.compat.GraphFunction`) run.

``GraphFunction(model)`` turns the inputs ``x`` and the weights ``W`` of ``model`` into a
function object (:meth:`GraphFunction.new_instance`)::

    forward(x, W, training=False) -> y                  predict only
    forward(x, W, training=True)  -> y                  and keep what backward needs
    backward(y_grad)              -> (x_grad, W_grad)   for the last such forward

Each ``forward(..., training=True)`` pushes its state on the function object's stack and
each ``backward`` pops one, last in first out, as ``torch.autograd.Function`` does.
Two backends build the graphs behind it, with the same public behaviour:

- ``backend="onnx"`` (default): lossgraph's gradient pass writes the vector-Jacobian
  graph in standard ONNX ops and :func:`lossgraph.surgery.split_gradient` cuts it into
  ``forward (x, W) -> (y, residuals)`` and ``backward (residuals, y_grad) -> (x_grad,
  W_grad)``, plus ``predict (x, W) -> y``; they run on any onnxruntime.
- ``backend="ort"``: onnxruntime-training's ``OrtModuleGraphBuilder`` builds one
  gradient graph (forward, a ``YieldOp``, backward) that its ``TrainingAgent`` runs in
  two halves: ``run_forward`` with a fresh ``PartialGraphExecutionState`` per training
  forward, ``run_backward`` with the state popped. Predictions run the builder's forward
  model (``get_forward_model``, what onnxruntime-training 1.19.2 has in place of the
  onnxcustom's ``get_inference_optimized_model``). It needs the training build
  (``onnxruntime-training-cpu`` 1.19.2), reached through
  ``onnxruntime.capi._pybind_state`` without torch; elsewhere it raises
  :class:`~lossgraph.errors.RuntimeUnavailableError`. The builder orders the weights as
  its configuration's ``initializer_names_to_train``; the function object maps them by
  name, so its inputs keep the order given here whatever the builder's order is.

``ai.onnx.ml`` linear operators (``LinearRegressor``, ...) are first lowered to standard
ops (:mod:`lossgraph.passes.lower_ml`), so their coefficients become the weights
``coef`` and ``intercept``. A model exported with a fixed batch (torch's default export)
has it freed (:class:`~lossgraph.passes.GeneralizeBatch`), or is refused with why and how
to export it again: a function takes batches of any size.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import onnx

from .. import training_build
from ..analysis import default_weights
from ..data import converted, declared
from ..errors import (
    InternalError,
    InvalidDataError,
    MissingGradientError,
    ProviderError,
    ShapeMismatchError,
    UnknownNameError,
    UnsupportedModelError,
    UnsupportedOptionError,
    suggest,
)
from ..graphs import FLOAT_TYPES, np_dtype
from ..models import ModelLike, as_model
from ..options import names
from ..passes.contract import Pipeline
from ..passes.fixed_batch import GeneralizeBatch, fixed_batch
from ..passes.gradient import BACKENDS, Gradient
from ..passes.lower_ml import LowerMlOps
from ..passes.plan import Plan, Planned, PlanRunner
from ..passes.running_stats import RunningStatistics, buffer_names
from ..passes.sequences import SequencesToTensors, holds_splits
from ..passes.strip import InferenceMode
from ..passes.weights import WeightsToInputs
from ..surgery import GradientHalves, split_gradient
from ..validation import check_trainable_model
from .separate_step import HalvesRunner
from .session import (
    checked_providers,
    cpu_device,
    create_session,
    onnxruntime_module,
    ortvalue,
)

__all__ = ["GraphFunction", "GraphFunctionCall", "device_providers"]

#: The highest IR version onnxruntime-training 1.19 loads.
_TRAINING_BUILD_IR = 10
#: The attributes of an ``OrtModuleGraphBuilderConfiguration`` (kept when pickling).
_CONFIG_FIELDS = ("initializer_names", "initializer_names_to_train", "input_names_require_grad",
                  "build_gradient_graph", "enable_caching", "loglevel",
                  "use_memory_efficient_gradient")


def device_providers(device: Any) -> list[str] | None:
    """onnxruntime providers for a device name (``"cpu"``, ``"cuda"``, ``"cuda:1"``),
    or a :class:`~lossgraph.errors.ProviderError` when this onnxruntime lacks it."""
    if not isinstance(device, str):
        raise ProviderError(f"device={device!r} must be a string: 'cpu' or 'cuda[:index]'.")
    kind = device.split(":", 1)[0]
    if kind == "cpu":
        return None
    if kind in ("cuda", "gpu"):
        onnxruntime = onnxruntime_module()
        if "CUDAExecutionProvider" not in onnxruntime.get_available_providers():
            raise ProviderError(
                f"device={device!r} needs onnxruntime's CUDAExecutionProvider, which this "
                f"onnxruntime does not have (it has {onnxruntime.get_available_providers()}); "
                "use device='cpu'.")
        return ["CUDAExecutionProvider"]
    raise ProviderError(f"Unknown device {device!r}: use 'cpu' or 'cuda[:index]'.")


class GraphFunction:
    """The forward and backward graphs of an inference model, and the function object
    that runs them (module docstring).

    ``weights_to_train``: the initializers differentiated (default
    :func:`~lossgraph.trainable_initializers`, or the ``initializer_names_to_train`` of a
    ``graph_builder_config``); ``input_names`` and ``output_names``: the inputs taken and
    the outputs returned (default all, outputs in the order given). The function's
    inputs are the inputs, then the weights, in these orders; gradients come back in the
    same order, ``None`` for an input of an integer type (and, with ``backend="ort"``,
    for an input that ``graph_builder_config.input_names_require_grad`` leaves out).
    ``onnx_model`` is the model given, its ``ai.onnx.ml`` linear operators lowered;
    :meth:`get_initializer` gives the weights' initial values.

    ``backend="ort"`` builds with onnxruntime-training's ``OrtModuleGraphBuilder``;
    ``graph_builder_config`` (an ``OrtModuleGraphBuilderConfiguration``) replaces the
    configuration made from the names above, and must train the same weights.
    ``sess_options`` and ``providers`` go to every session; ``run_options`` to the
    predictions; ``device_index`` is the TrainingAgent's device rank; ``enable_logging``
    logs the builder's messages at info level. Outputs and gradients are numpy arrays on
    the CPU.
    """

    def __init__(self, onnx_model: ModelLike, weights_to_train: Sequence[str] | None = None,
                 input_names: Sequence[str] | None = None,
                 output_names: Sequence[str] | None = None, *, sess_options: Any = None,
                 providers: Any = None, run_options: Any = None,
                 graph_builder_config: Any = None, device_index: int = 0,
                 enable_logging: bool = False, backend: str = "onnx") -> None:
        if backend not in BACKENDS:
            raise UnsupportedOptionError(
                f"backend={backend!r} is not one of {', '.join(map(repr, BACKENDS))}.")
        if graph_builder_config is not None and backend != "ort":
            raise UnsupportedOptionError(
                "graph_builder_config configures onnxruntime-training's builder: pass "
                "backend='ort' with it.")
        if backend == "ort":  # before any work: a clear error on plain onnxruntime
            training_build.bindings(f"{type(self).__name__}(backend='ort')")
        given = as_model(onnx_model)
        check_trainable_model(given)
        model = LowerMlOps()(given).model
        if fixed_batch(model) is not None:  # torch's default export: free it, or say why not
            model = GeneralizeBatch(strict=True)(model).model
        self.onnx_model = model
        self.graph_builder_config = graph_builder_config
        self.weights_to_train = (_configured_weights(weights_to_train, graph_builder_config)
                                 or default_weights(model))
        initializers = {t.name for t in model.graph.initializer}
        data_inputs = [i.name for i in model.graph.input if i.name not in initializers]
        outputs = [o.name for o in model.graph.output]
        self.input_names = _chosen("input_names", input_names, data_inputs)
        self.output_names = _chosen("output_names", output_names, outputs)
        self.sess_options = sess_options
        self.providers = (device_providers(providers) if isinstance(providers, str) else
                          checked_providers(providers))
        self.run_options = run_options
        self.device_index = device_index
        self.enable_logging = enable_logging
        self.backend = backend
        #: The training-mode BatchNormalization layers' running means and variances: the
        #: state that each ``forward(..., training=True)`` updates as torch does and that
        #: ``forward(..., training=False)`` normalizes with.
        self.running_statistics = {name: self.get_initializer(name)
                                   for name in buffer_names(model)}
        if self.running_statistics and backend == "ort":
            raise UnsupportedModelError(
                f"The model has training-mode BatchNormalization layers (running statistics "
                f"{', '.join(self.running_statistics)}): backend='ort' runs onnxruntime's "
                "training-mode kernel, which never updates them for lossgraph. Use "
                "backend='onnx', or export the model in inference mode.")
        self._build()

    def _build(self) -> None:
        """The inference model with the weights as inputs and only the outputs chosen (in
        their order), then the backend's graphs and sessions."""
        model = self.onnx_model
        types = {v.name: v.type.tensor_type.elem_type
                 for v in (*model.graph.input, *model.graph.output)}
        self.grad_input_names = [*self.input_names, *self.weights_to_train]
        self.differentiable_outputs = [n for n in self.output_names
                                       if types.get(n) in FLOAT_TYPES]
        if not self.differentiable_outputs:
            raise UnsupportedOptionError(
                f"None of the outputs {self.output_names} is a float tensor: nothing to "
                "differentiate.")
        lifted = WeightsToInputs((*self.weights_to_train, *self.running_statistics))(
            model).model
        by_name = {o.name: o for o in lifted.graph.output}
        del lifted.graph.output[:]
        lifted.graph.output.extend(by_name[name] for name in self.output_names)
        declared = {v.name: v for v in (*lifted.graph.input, *lifted.graph.output)}
        self._declared = {name: (np_dtype(declared[name].type.tensor_type.elem_type),
                                 _static_shape(declared[name]))
                          for name in (*self.grad_input_names, *self.output_names)}
        self._engine: _OnnxGraphs | _OrtGraphs = (
            _OrtGraphs(self, lifted) if self.backend == "ort" else _OnnxGraphs(self, lifted))

    @property
    def plan(self) -> Plan:
        """How lossgraph builds this function's graphs (``print`` shows every pass with its
        options): ``predict`` (:attr:`eval_onnx`) and ``gradient``
        (:attr:`gradient_onnx`, which :func:`~lossgraph.surgery.split_gradient` cuts into
        :attr:`forward_onnx` and :attr:`backward_onnx`), each from the model with its
        weights as inputs and the chosen outputs. ``backend="ort"`` has none: onnxruntime's
        builder makes its graphs."""
        if not isinstance(self._engine, _OnnxGraphs):
            raise UnsupportedOptionError(
                "backend='ort' has no lossgraph plan: onnxruntime-training's "
                "OrtModuleGraphBuilder builds its graphs.")
        return self._engine.plan

    @property
    def eval_onnx(self) -> onnx.ModelProto:
        """The graph ``forward(..., training=False)`` runs: inputs and weights -> outputs."""
        return self._engine.eval_onnx

    @property
    def gradient_onnx(self) -> onnx.ModelProto:
        """The whole gradient graph: lossgraph's vector-Jacobian graph (``"onnx"``), or the
        builder's graph with its ``YieldOp`` between forward and backward (``"ort"``)."""
        return self._engine.gradient_onnx

    @property
    def forward_onnx(self) -> onnx.ModelProto:
        """The forward graph: inputs and weights -> outputs, then the residuals
        (``backend="onnx"``; ``"ort"`` runs the halves of :attr:`gradient_onnx`)."""
        return self._split("forward").forward

    @property
    def backward_onnx(self) -> onnx.ModelProto:
        """The backward graph: residuals, reused inputs, output gradients -> gradients
        (``backend="onnx"``; ``"ort"`` runs the halves of :attr:`gradient_onnx`)."""
        return self._split("backward").backward

    def _split(self, half: str) -> GradientHalves:
        if not isinstance(self._engine, _OnnxGraphs):
            raise UnsupportedOptionError(
                f"backend='ort' has no separate {half} graph: its TrainingAgent runs the two "
                "halves of gradient_onnx, split at its YieldOp.")
        return self._engine.split

    def new_instance(self) -> GraphFunctionCall:
        """A function object with ``forward``, ``backward`` and ``saved_tensors``."""
        return GraphFunctionCall(self)

    def get_initializer(self, name: str, exc: bool = True) -> np.ndarray | None:
        """The value of initializer ``name`` in the model (``None`` when missing and
        ``exc`` is False): the weights' initial values, to feed to ``forward``."""
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
        """Everything but sessions and native objects; the builder's configuration as a
        dict of its fields."""
        state = {k: v for k, v in self.__dict__.items()
                 if k not in ("_engine", "_declared", "sess_options", "run_options")}
        config = self.graph_builder_config
        if config is not None:
            state["graph_builder_config"] = {
                field: (int(getattr(config, field)) if field == "loglevel"
                        else getattr(config, field)) for field in _CONFIG_FIELDS}
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Restore the options (``sess_options`` and ``run_options`` are lost) and build
        again."""
        self.__dict__.update(state, sess_options=None, run_options=None)
        if isinstance(self.graph_builder_config, Mapping):
            self.graph_builder_config = _builder_config(self.graph_builder_config)
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


def _configured_weights(given: Sequence[str] | None, config: Any) -> list[str] | None:
    """``weights_to_train`` checked against a builder configuration's weights, or the
    configuration's when it is None (None when neither names any)."""
    chosen = names("weights_to_train", given)
    if config is None:
        return chosen
    if not hasattr(config, "initializer_names_to_train"):
        raise UnsupportedOptionError(
            f"graph_builder_config={config!r} must be an onnxruntime "
            "OrtModuleGraphBuilderConfiguration.")
    configured = names("graph_builder_config.initializer_names_to_train",
                       list(config.initializer_names_to_train))
    if chosen is not None and set(chosen) != set(configured):
        raise UnsupportedOptionError(
            f"weights_to_train={chosen} and graph_builder_config.initializer_names_to_train="
            f"{configured} name different weights: give the same names, or leave "
            "weights_to_train=None to train the configuration's.")
    return chosen or configured


def _static_shape(value: onnx.ValueInfoProto) -> tuple[int | None, ...] | None:
    """A declared shape, ``None`` for a free dimension; ``None`` when no shape is declared."""
    tensor = value.type.tensor_type
    if not tensor.HasField("shape"):
        return None
    return tuple(d.dim_value if d.HasField("dim_value") else None for d in tensor.shape.dim)


def _detail(exc: Exception) -> str:
    """onnxruntime's message without its C++ source location, on one line."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    for marker in ("was false. ", " : FAIL : ", " : INVALID_ARGUMENT : "):
        text = text.rsplit(marker, 1)[-1]
    return text.rstrip(".")


def _builder_config(fields: Mapping[str, Any]) -> Any:
    """An ``OrtModuleGraphBuilderConfiguration`` with these fields (a pickled one)."""
    C = training_build.bindings("backend='ort'")
    config = C.OrtModuleGraphBuilderConfiguration()
    for field, value in fields.items():
        setattr(config, field, C.Severity(value) if field == "loglevel" else value)
    return config


#: The start of backend 'onnx''s plan: the model with its weights (and running statistics)
#: as inputs, and only the outputs chosen, in their order.
LIFTED = "lifted model"


def _onnx_plan(owner: GraphFunction, lifted: onnx.ModelProto) -> Plan:
    """``predict`` (:attr:`GraphFunction.eval_onnx`) and ``gradient`` (the vector-Jacobian
    graph whose halves are ``forward_onnx`` and ``backward_onnx``), from the lifted model."""
    floats = {v.name for v in lifted.graph.input
              if v.type.tensor_type.elem_type in FLOAT_TYPES}
    wrt = (*[n for n in owner.input_names if n in floats], *owner.weights_to_train)
    # training runs the layers in training mode and outputs the running statistics'
    # update after the outputs; predictions run them in inference mode
    update = (RunningStatistics(),) if owner.running_statistics else ()
    # a split written as a sequence becomes a Split: gradients pass tensors only
    splits = (SequencesToTensors(),) if holds_splits(lifted) else ()
    return Plan({
        "predict": Planned(LIFTED, Pipeline((InferenceMode(),))),
        "gradient": Planned(LIFTED, Pipeline((*update, *splits, Gradient(
            wrt, outputs=tuple(owner.differentiable_outputs), backend="onnx")))),
    })


class _OnnxGraphs:
    """``backend="onnx"``: the split vector-Jacobian graphs in standard ONNX ops, and
    their sessions."""

    def __init__(self, owner: GraphFunction, lifted: onnx.ModelProto) -> None:
        self.plan = _onnx_plan(owner, lifted)
        built = PlanRunner({LIFTED: lifted}).build_all(self.plan)
        vjp = built["gradient"]
        updated = vjp.report.get(RunningStatistics, {})
        self._updated = list(updated)
        seeds = [f"{o}_grad" for o in owner.differentiable_outputs]
        self.eval_onnx = built["predict"].model
        self.gradient_onnx = vjp.model
        self.split = split_gradient(vjp.model, [*owner.output_names, *updated.values()], seeds)
        by_gradient = {g: n for n, g in vjp.report.of(Gradient).items()}
        self._gradient_of = [by_gradient.get(g) for g in self.split.gradients]
        self._seeds = dict(zip(owner.differentiable_outputs, seeds))
        self._output_names = owner.output_names

        def make(model: onnx.ModelProto) -> Any:
            return create_session(model, owner.providers, owner.sess_options)

        self._predict = make(self.eval_onnx)
        self._run_options = owner.run_options
        self._runner = HalvesRunner(self.split, make)
        self._statistics = owner.running_statistics

    def predict(self, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        """The outputs, from the inference graph."""
        return self._predict.run(self._output_names, {**feeds, **self._statistics},
                                 self._run_options)

    def forward(self, feeds: dict[str, np.ndarray]) -> tuple[list[np.ndarray], Any]:
        """The outputs and what ``backward`` needs: the residuals and reused inputs. The
        running statistics take this batch's update."""
        device = cpu_device()
        values = {name: ortvalue(array, device)
                  for name, array in {**feeds, **self._statistics}.items()}
        computed, residuals = self._runner.forward(values)
        reused = {name: values[name] for name in self.split.reused}
        arrays = [np.array(value.numpy()) for value in computed]
        count = len(self._output_names)
        self._statistics.update(zip(self._updated, arrays[count:]))
        return arrays[:count], (residuals, reused)

    def backward(self, token: Any, grads: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The gradients by input or weight name, for one forward's ``token``."""
        residuals, reused = token
        device = cpu_device()
        seeds = {self._seeds[name]: ortvalue(array, device) for name, array in grads.items()}
        values = self._runner.backward(residuals, reused, seeds)
        return {name: np.array(value.numpy())
                for name, value in zip(self._gradient_of, values) if name is not None}


class _OrtGraphs:
    """``backend="ort"``: onnxruntime-training's OrtModuleGraphBuilder graph, run by its
    TrainingAgent, and the builder's forward model for predictions.

    The builder's graph takes its inputs and returns its gradients in an order of its
    own (the user inputs, then the configuration's weights); what is what comes from
    the graph's input and output names and ``get_graph_info()``.
    """

    def __init__(self, owner: GraphFunction, lifted: onnx.ModelProto) -> None:
        C = training_build.bindings(f"{type(owner).__name__}(backend='ort')")
        config = owner.graph_builder_config or self._default_config(owner, lifted, C)
        self._check_config(owner, config)
        work = onnx.ModelProto()
        work.CopyFrom(lifted)
        work.ir_version = min(work.ir_version, _TRAINING_BUILD_IR)
        builder = C.OrtModuleGraphBuilder()
        try:
            builder.initialize(work.SerializeToString(), config)
            builder.build(C.TrainingGraphTransformerConfiguration())
        except Exception as exc:  # the builder raises RuntimeError with its own message
            detail = _detail(exc)
            error = (MissingGradientError if "has not been registered" in detail
                     else UnsupportedModelError)
            raise error(
                f"onnxruntime-training's OrtModuleGraphBuilder failed: {detail}. Use "
                "backend='onnx', or train only weights whose path to the outputs it "
                "supports.") from None
        info = builder.get_graph_info()
        self.graph_info = info
        self.gradient_onnx = onnx.load_model_from_string(builder.get_gradient_model())
        self.eval_onnx = onnx.load_model_from_string(builder.get_forward_model())
        self._feed_names = [i.name for i in self.gradient_onnx.graph.input]
        fetches = [o.name for o in self.gradient_onnx.graph.output]
        self._constants = self._constant_feeds(owner)
        # which gradient each output of the backward half is
        gradient_of = {grad: name for name, grad in info.user_input_grad_names.items()}
        gradient_of.update(zip(info.initializer_grad_names_to_train,
                               info.initializer_names_to_train))
        self._gradient_of = [gradient_of.get(name) for name in fetches]
        missing = [w for w in owner.weights_to_train if w not in self._gradient_of]
        if missing:
            raise MissingGradientError(
                f"onnxruntime-training's OrtModuleGraphBuilder returned no gradient for "
                f"{missing} (its gradients: {fetches}). Use backend='onnx'.")
        # which outputs the backward half takes a gradient for, in its order
        self._outputs = list(info.user_output_names)
        if sorted(self._outputs) != sorted(owner.output_names):
            raise InternalError(
                f"OrtModuleGraphBuilder's outputs {self._outputs} are not the outputs "
                f"chosen, {owner.output_names}.")
        fixed = set(info.output_grad_indices_non_differentiable)
        self._seeded = [name for i, name in enumerate(self._outputs) if i not in fixed]
        stray = [n for n in self._seeded if n not in owner.differentiable_outputs]
        if stray:
            raise InternalError(f"OrtModuleGraphBuilder differentiates the outputs {stray}, "
                                "which are not float tensors.")
        self._output_names = owner.output_names
        device = cpu_device()  # outputs and gradients come back to the CPU, as numpy
        forward_count = len(self._outputs) + len(info.frontier_node_arg_map)
        session = create_session(self.gradient_onnx, owner.providers, owner.sess_options)
        self._session = session  # the agent runs this session's graph
        self._agent = C.TrainingAgent(session._sess, self._feed_names,
                                      [device] * forward_count, fetches,
                                      [device] * len(fetches), owner.device_index)
        self._cache = C.OrtValueCache()
        self._predict = create_session(self.eval_onnx, owner.providers, owner.sess_options)
        self._run_options = owner.run_options
        self._C = C

    @staticmethod
    def _default_config(owner: GraphFunction, lifted: onnx.ModelProto,
                        C: Any) -> Any:
        """Train ``weights_to_train`` (in that order) and the float inputs."""
        floats = {v.name for v in lifted.graph.input
                  if v.type.tensor_type.elem_type in FLOAT_TYPES}
        config = C.OrtModuleGraphBuilderConfiguration()
        config.initializer_names = list(owner.weights_to_train)
        config.initializer_names_to_train = list(owner.weights_to_train)
        config.input_names_require_grad = [n for n in owner.input_names if n in floats]
        config.build_gradient_graph = True
        config.loglevel = C.Severity.INFO if owner.enable_logging else C.Severity.WARNING
        return config

    @staticmethod
    def _check_config(owner: GraphFunction, config: Any) -> None:
        """A configuration the function object can run: a gradient graph, of inputs it
        takes."""
        if not config.build_gradient_graph:
            raise UnsupportedOptionError(
                "graph_builder_config.build_gradient_graph is False: backward needs the "
                "gradient graph; set it to True.")
        for name in config.input_names_require_grad:
            if name not in owner.input_names:
                raise UnknownNameError(
                    f"graph_builder_config.input_names_require_grad names {name!r}, which is "
                    "not among the inputs taken." + suggest(name, owner.input_names, "inputs"))

    def _constant_feeds(self, owner: GraphFunction) -> dict[str, np.ndarray]:
        """Builder inputs the function does not take: initializers the configuration
        named (fed their values); a data input left out of input_names is an error."""
        constants = {}
        taken = set(owner.grad_input_names)
        for name in self._feed_names:
            if name in taken:
                continue
            value = owner.get_initializer(name, exc=False)
            if value is None:
                raise UnsupportedOptionError(
                    f"The model's input {name!r} is not in input_names={owner.input_names}, "
                    "but backend='ort' runs the whole graph: add it to input_names.")
            constants[name] = value if value.flags.c_contiguous else value.copy(order="C")
        return constants

    def _vector(self, arrays: Sequence[np.ndarray]) -> Any:
        device = cpu_device()
        vector = self._C.OrtValueVector()
        vector.reserve(len(arrays))
        for array in arrays:
            vector.push_back(ortvalue(array, device))
        return vector

    def predict(self, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        """The outputs, from the builder's forward model."""
        return self._predict.run(self._output_names, {**self._constants, **feeds},
                                 self._run_options)

    def _run_forward(self, inputs: Any) -> tuple[Any, Any]:
        """``TrainingAgent.run_forward`` with a fresh state: (outputs, state)."""
        outputs = self._C.OrtValueVector()
        state = self._C.PartialGraphExecutionState()
        self._agent.run_forward(inputs, outputs, state, self._cache)
        return outputs, state

    def forward(self, feeds: dict[str, np.ndarray]) -> tuple[list[np.ndarray], Any]:
        """The outputs; the token is the run's state and inputs (:class:`_AgentRun`)."""
        every = {**self._constants, **feeds}
        inputs = self._vector([every[name] for name in self._feed_names])
        outputs, state = self._run_forward(inputs)
        values = {name: np.array(outputs[i].numpy()) for i, name in enumerate(self._outputs)}
        return [values[name] for name in self._output_names], _AgentRun(state, inputs)

    def backward(self, token: _AgentRun, grads: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """``TrainingAgent.run_backward`` on one forward's state. A state answers one
        backward only: a token answered before (put back on the stack, as
        :mod:`lossgraph.torch` does for ``retain_graph=True``) runs its forward again."""
        if token.answered:
            _, token.state = self._run_forward(token.inputs)
        token.answered = True
        inputs = self._vector([grads[name] for name in self._seeded])
        outputs = self._C.OrtValueVector()
        self._agent.run_backward(inputs, outputs, token.state)
        return {name: np.array(outputs[i].numpy())
                for i, name in enumerate(self._gradient_of) if name is not None}


class _AgentRun:
    """One training forward of the TrainingAgent: its PartialGraphExecutionState, its
    inputs (OrtValues over the function object's arrays), and whether a backward used
    the state already."""

    __slots__ = ("state", "inputs", "answered")

    def __init__(self, state: Any, inputs: Any) -> None:
        self.state = state
        self.inputs = inputs
        self.answered = False


class GraphFunctionCall:
    """Runs one :class:`GraphFunction`: ``forward`` then ``backward``.

    Inputs are numpy arrays (or anything ``numpy.asarray`` takes) in the order of
    ``grad_input_names``; outputs and gradients are numpy arrays. ``states_`` is the
    stack of training forwards not yet answered by a ``backward``.
    """

    def __init__(self, owner: GraphFunction) -> None:
        self.owner = owner
        self.states_: list[tuple[Any, list[np.ndarray], dict[str, tuple[int, ...]]]] = []
        self.saved_tensors_: list[Any] | None = None

    def _array(self, name: str, value: Any, what: str, shaped: bool = True) -> np.ndarray:
        """``value`` as a contiguous array of ``name``'s declared dtype (and shape when
        ``shaped``): numbers of another dtype converted as the Trainer converts them
        (:func:`lossgraph.data.converted`: float64 for float32 cast, overflow refused)."""
        array = np.asarray(value.numpy() if hasattr(value, "numpy") and not
                           isinstance(value, np.ndarray) else value)
        dtype, shape = self.owner._declared[name]
        of = "output" if name in self.owner.output_names else "input"
        array = converted(array, dtype, f"{what} {name!r}", declared(name, dtype, shape, of))
        if not array.flags.c_contiguous:  # (not ascontiguousarray: it makes 0-d arrays 1-d)
            array = array.copy(order="C")
        if shaped and shape is not None and (len(shape) != array.ndim or any(
                d is not None and d != n for d, n in zip(shape, array.shape))):
            expected = ", ".join("?" if d is None else str(d) for d in shape)
            raise ShapeMismatchError(
                f"{what} {name!r} has shape {array.shape}; the model takes ({expected}).")
        return array

    def _arrays(self, inputs: Sequence[Any]) -> list[np.ndarray]:
        names_ = self.owner.grad_input_names
        if len(inputs) != len(names_):
            raise InvalidDataError(
                f"forward takes {len(names_)} inputs ({', '.join(names_)}: the inputs, then the "
                f"weights), got {len(inputs)}.")
        return [self._array(name, value, "Input") for name, value in zip(names_, inputs)]

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
        engine = self.owner._engine
        feeds = dict(zip(self.owner.grad_input_names, arrays))
        try:
            if not training:
                return engine.predict(feeds)
            outputs, token = engine.forward(feeds)
        except Exception as exc:  # onnxruntime's message names the mismatching value
            raise ShapeMismatchError(
                f"forward could not run on the inputs given ({_detail(exc)}). Each input must "
                "fit the model's shapes.") from None
        shapes = {name: output.shape for name, output in zip(self.owner.output_names, outputs)}
        self.states_.append((token, arrays, shapes))  # arrays: the OrtValues' memory
        self.save_for_backward(inputs)
        return outputs

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
        token, arrays, shapes = self.states_[-1]
        grads = {}
        for name, value in zip(expected, grad_outputs):
            array = self._array(name, value, "The gradient of output", shaped=False)
            if array.shape != shapes[name]:
                raise ShapeMismatchError(
                    f"The gradient of output {name!r} has shape {array.shape}; the output's "
                    f"shape in the forward pass was {shapes[name]}.")
            grads[name] = array
        self.states_.pop()
        try:
            by_name = owner._engine.backward(token, grads)
        except Exception as exc:  # onnxruntime's message names the mismatching input
            raise ShapeMismatchError(
                f"backward could not run on the gradients given ({_detail(exc)}). Each "
                "gradient must have its output's shape and dtype.") from None
        del arrays, grads  # the OrtValues aliasing them are gone
        return [by_name.get(name) for name in owner.grad_input_names]
