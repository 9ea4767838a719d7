"""onnxcustom's two optimizers, as scikit-learn estimators on lossgraph.

- :class:`OrtGradientOptimizer`, the whole-graph API: a model that carries its loss
  (:func:`~lossgraph.add_loss_output`) compiled with ``fuse="epoch"``, one run of
  onnxruntime per epoch.
- :class:`OrtGradientForwardBackwardOptimizer`, the forward/backward API: an inference
  model compiled with ``fuse="separate"``, whose loss, penalty and update graphs come
  from the ``learning_loss``, ``learning_penalty`` and ``learning_rate`` objects; a
  step runs the model's forward graph, the loss graph, the model's backward graph,
  the penalty graph and the update graph.

Both are thin: :func:`~lossgraph.compile_program` builds the graphs and a
:class:`~lossgraph.Trainer` runs them. The learning rate is stepped once per epoch
(``Trainer.fit(epoch_learning_rate=...)``); for momentum the velocities are rescaled
between epochs so that the updates are scikit-learn's ``SGDOptimizer``'s
(:mod:`lossgraph.compat.learning_rate`). Training starts from the model's own
initializers; ``warm_start=True`` continues the last fit, and ``partial_fit`` trains one
epoch at a time on the data it is given (incremental learning, ``dask_ml``'s
``Incremental``). Pickling keeps the training's progress; the onnxruntime sessions are
made again after unpickling.
"""

from __future__ import annotations

import inspect
import logging
import math
import numbers
import os
import reprlib
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from ..analysis import default_weights
from ..compiler import compile_program
from ..data import split_rows, validation_fraction
from ..errors import (
    ConvergenceError,
    ConvergenceWarning,
    EvaluationError,
    InvalidDataError,
    MissingFolderError,
    NotFittedError,
    UnknownNameError,
    UnsupportedModelError,
    UnsupportedOptionError,
    suggest,
)
from ..fileio import check_file_target, save_model, serialize
from ..models import ModelLike, as_model
from ..options import count, flag, names, non_negative
from ..passes.loss import loss_graph
from ..passes.lower_ml import lower_ml_ops
from ..program import TrainingProgram, with_weights
from ..roles import get_roles
from ..runtime.graph_function import device_providers
from ..runtime.session import create_session
from ..runtime.trainer import Trainer
from ..surgery import split_gradient
from .learning_loss import BaseLearningLoss
from .learning_penalty import BaseLearningPenalty
from .learning_rate import BaseLearningRate, LearningRateSGDNesterov

__all__ = ["BaseEstimator", "OrtGradientOptimizer", "OrtGradientForwardBackwardOptimizer"]

#: The optimizer onnxcustom's classes run (both support it alone).
TRAINING_OPTIMIZERS = ("SGDOptimizer",)


class Resolved:
    """A constructor parameter whose attribute is the object ``select`` makes of the value
    given (onnxcustom's attributes: ``opt.learning_rate`` is a learning-rate object for
    ``learning_rate="Nesterov"``), while ``get_params`` returns the value as given
    (scikit-learn's ``clone`` rebuilds the estimator from it and checks it is kept). Set by
    the constructor, ``set_params`` and plain assignment alike."""

    def __init__(self, select: Callable[[Any], Any]) -> None:
        self._select = select

    def __set_name__(self, owner: type, name: str) -> None:
        self._name = name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self
        try:
            return obj.__dict__[self._name]
        except KeyError:
            raise AttributeError(self._name) from None

    def __set__(self, obj: Any, value: Any) -> None:
        resolved = self._select(value)  # a bad value raises before anything changes
        obj.__dict__.setdefault("_given", {})[self._name] = value
        obj.__dict__[self._name] = resolved


class BaseEstimator:
    """scikit-learn's estimator conventions without importing scikit-learn:
    ``get_params``/``set_params`` from the constructor's signature, a readable repr,
    pickling that keeps the trained state and rebuilds the onnxruntime sessions.
    :class:`Resolved` parameters are objects as attributes and given values in
    ``get_params``."""

    @classmethod
    def _get_param_names(cls) -> list[str]:
        return [p.name for p in inspect.signature(cls.__init__).parameters.values()
                if p.name != "self" and p.kind != p.VAR_KEYWORD]

    def _keep_params(self, values: Mapping[str, Any]) -> None:
        """Store each constructor argument under its own name, as given (scikit-learn's
        ``clone`` compares them by identity)."""
        for name in self._get_param_names():
            setattr(self, name, values[name])

    def get_params(self, deep: bool = True) -> dict[str, Any]:
        """The constructor's arguments, by name, as given (a learning rate's name, not the
        object the attribute holds)."""
        given = self.__dict__.get("_given", {})
        return {name: given[name] if name in given else getattr(self, name)
                for name in self._get_param_names()}

    def set_params(self, **params: Any) -> BaseEstimator:
        """Change constructor arguments; the next ``fit`` compiles again."""
        valid = self._get_param_names()
        for name, value in params.items():
            if name not in valid:
                raise UnsupportedOptionError(
                    f"{type(self).__name__} has no parameter {name!r}."
                    + suggest(name, valid, "parameters"))
            setattr(self, name, value)
        return self

    def __repr__(self) -> str:
        """The parameters given other than their defaults, and every :class:`Resolved` one
        as the object it stands for (onnxcustom's repr: ``learning_rate=0.001`` shows as
        ``LearningRateSGD(eta0=0.001, ..., learning_rate='invscaling')``)."""
        defaults = {p.name: p.default for p in
                    inspect.signature(type(self).__init__).parameters.values()}
        given = self.get_params()
        shown = []
        for name in self._get_param_names():
            value = getattr(self, name)
            if isinstance(value, onnx.ModelProto):
                shown.append(f"{name}=<ModelProto {value.graph.name!r}>")
            elif (defaults[name] is inspect.Parameter.empty
                  or isinstance(getattr(type(self), name, None), Resolved)
                  or not _same(given[name], defaults[name])):
                shown.append(f"{name}={value!r}")
        return f"{type(self).__name__}({', '.join(shown)})"

    def __sklearn_tags__(self) -> Any:
        from sklearn.utils import ClassifierTags, RegressorTags, Tags, TargetTags

        classifier = self._is_classifier()
        return Tags(estimator_type="classifier" if classifier else "regressor",
                    target_tags=TargetTags(required=True),
                    classifier_tags=ClassifierTags() if classifier else None,
                    regressor_tags=None if classifier else RegressorTags())

    def _is_classifier(self) -> bool:
        return False


def _same(value: Any, default: Any) -> bool:
    try:
        return bool(value == default)
    except Exception:
        return False


class _TrainingEstimator(BaseEstimator):
    """What both optimizers share: compile once per set of parameters, fit epoch by
    epoch with the per-epoch rate, keep the losses, export the trained model. A pickled
    estimator keeps its Trainer's program, state and progress, so a warm start after
    unpickling continues as it would have (optimizer states, the schedule's epoch, the
    shuffling generator, the losses)."""

    #: Attributes a fit sets; pickled with the parameters.
    _FITTED = ("train_losses_", "validation_losses_", "trained_coef_", "n_iter_",
               "best_loss_", "best_validation_score_", "validation_scores_")

    # -- compiling ---------------------------------------------------------------------
    def _program(self) -> TrainingProgram:
        raise NotImplementedError

    def _compile_key(self) -> tuple:
        """What the compiled program depends on (a changed parameter recompiles)."""
        given = self.__dict__.get("_given", {})
        return tuple((name, id(given.get(name, getattr(self, name))), repr(getattr(self, name)))
                     for name in self._COMPILE_PARAMS)

    def _trainer(self, continuing: bool = False) -> Trainer:
        """The Trainer of the current parameters, compiled when they changed. A new one
        starts from the trained weights, if any; ``continuing`` (``partial_fit``, a warm
        start) carries over the optimizer states of the same names and shapes and the
        progress too (epoch and step counts, shuffling generator, losses)."""
        key = self._compile_key()
        if getattr(self, "_compiled_key", None) != key:
            providers = device_providers(self.device)
            previous = getattr(self, "train_session_", None) if continuing else None
            self._rate = self.learning_rate
            self.train_session_ = Trainer(self._program(), providers=providers)
            self._compiled_key = key
            if previous is not None:
                self.train_session_.set_state(self._restorable(previous.state))
                self.train_session_.restore_progress(previous.progress())
            elif hasattr(self, "trained_coef_"):  # parameters changed after fit
                self.train_session_.set_state(self._restorable(self.trained_coef_))
        return self.train_session_

    def _restorable(self, state: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        live = self.train_session_.state
        return {k: v for k, v in state.items()
                if k in live and np.shape(v) == live[k].shape and v.dtype == live[k].dtype}

    # -- checks --------------------------------------------------------------------------
    def _check_params(self) -> None:
        count("max_iter", self.max_iter, 1)
        count("batch_size", self.batch_size, 1)
        flag("warm_start", self.warm_start)
        if self.training_optimizer_name not in TRAINING_OPTIMIZERS:
            raise UnsupportedOptionError(
                f"training_optimizer_name={self.training_optimizer_name!r}: the reference "
                "documents' classes run 'SGDOptimizer' only; pick momentum with "
                "learning_rate=LearningRateSGDNesterov(...), or use lossgraph.compile_program "
                "with lossgraph.optim.Adam for Adam.")
        if isinstance(self.verbose, bool) or not isinstance(self.verbose, numbers.Integral):
            raise UnsupportedOptionError(f"verbose={self.verbose!r} must be an int (0: silent).")
        every = self.validation_every
        if isinstance(every, bool) or not isinstance(every, numbers.Real) or not (
                math.isfinite(every) and every > 0):
            raise UnsupportedOptionError(
                f"validation_every={every!r} must be a number > 0: a fraction of max_iter "
                "(below 1) or a number of epochs.")
        flag("early_stopping", self.early_stopping)
        count("n_iter_no_change", self.n_iter_no_change, 1)
        if self.tol is not None:
            non_negative("tol", self.tol)
        if self.early_stopping:
            validation_fraction(self.validation_fraction)
            if self.tol is None:
                raise UnsupportedOptionError(
                    "early_stopping=True stops when the validation score improves by less "
                    "than tol for n_iter_no_change epochs: give tol a number (scikit-learn's "
                    "MLP default is 1e-4).")

    def _validation_period(self) -> int:
        """Epochs between two validation losses: ``validation_every`` epochs, or that
        fraction of ``max_iter`` when below 1 (at least 1: the reference divided by zero
        for ``max_iter < 10``)."""
        every = self.validation_every
        return max(1, int(self.max_iter * every) if every < 1 else int(every))

    # -- training ----------------------------------------------------------------------
    def _check_fit(self, sample_weight: Any) -> None:
        """What this class checks of a fit's or partial_fit's arguments before compiling."""

    def partial_fit(self, X: Any, y: Any, sample_weight: Any = None,
                    classes: Any = None) -> Any:
        """One epoch over ``(X, y)`` in minibatches of ``batch_size``, continuing the
        training so far; returns ``self``.

        scikit-learn's incremental learning (its MLP's ``partial_fit``), for data that
        come in parts (``dask_ml.wrappers.Incremental``, a loop over files): the first call
        compiles and starts from the model's initializers (or from a previous ``fit``);
        each call continues the weights, optimizer states, shuffling generator and loss
        history, and counts as one epoch of the learning-rate schedule
        (``learning_rate.value(t)`` for the t-th call, momentum rescaled between calls).
        ``partial_fit`` k times on the same data trains exactly as ``fit`` with
        ``max_iter=k``; ``max_iter``, ``warm_start`` and validation do not apply.
        ``classes`` (scikit-learn's argument) may be left out: the labels are class
        indices, so when given it must hold each of ``0..C-1`` once, C the model's class
        count where the model fixes it; a regressor takes none.
        """
        return self._fit(X, y, sample_weight, None, None, epochs=1, warm_start=True,
                         classes=classes)

    def _check_classes(self, classes: Any, trainer: Trainer) -> None:
        """``partial_fit``'s ``classes`` against the labels this model takes (class indices,
        ``0..C-1``); errors name what to pass instead."""
        owner = type(self).__name__
        if not self._is_classifier():
            raise UnsupportedOptionError(
                f"classes={reprlib.repr(classes)} was given, but this {owner} is a regressor "
                "(float labels): classes applies to a classifier's integer class labels. Leave "
                "it out.")
        values = np.asarray(classes)
        known = trainer.engine.classes  # None: the model does not fix it
        valid = f"0..{known - 1}" if known else "0..C-1"
        if (values.ndim != 1 or not values.size or values.dtype.kind not in "iu"
                or (known and len(values) != known)
                or not np.array_equal(np.sort(values), np.arange(len(values)))):
            raise InvalidDataError(
                f"classes={reprlib.repr(classes)}: the model's labels are class indices, so "
                f"classes must hold each of {valid} once (in any order). Encode labels with "
                f"sklearn.preprocessing.LabelEncoder and pass classes=range({known or 'C'}), "
                "or leave classes out.")

    def _fit(self, X: Any, y: Any, sample_weight: Any, X_val: Any, y_val: Any, *,
             epochs: int, warm_start: bool, classes: Any = None) -> Any:
        """``epochs`` epochs of training from the start (or, ``warm_start``, from the state
        so far), recorded in the fitted attributes."""
        sample_weight = _row_weights(sample_weight)
        self._check_params()
        self._check_fit(sample_weight)
        trainer = self._trainer(continuing=warm_start)
        if classes is not None:
            self._check_classes(classes, trainer)
        if (X_val is None) != (y_val is None):
            raise UnsupportedOptionError("Pass both X_val and y_val, or neither.")
        rate = self._rate
        callbacks = [self._rescale_velocities(rate)]
        held_out = None
        if self.early_stopping and epochs > 1:  # partial_fit does not stop (scikit-learn's)
            X, y, sample_weight, held_out = self._hold_out(trainer, X, y, sample_weight)
        stopping = _NoImprovement(self, held_out) if self.tol is not None and epochs > 1 \
            else None
        if stopping is not None:
            callbacks.append(stopping)
        if getattr(self, "enable_logging", False):
            callbacks.append(self._log_epoch(rate))
        validation: list[float] = []
        raises = getattr(self, "exc", True)
        if X_val is not None:
            period = self._validation_period()
            trainer.engine.prepare(X_val, y_val, what="validation data ")  # checked before work

            def validate(t: Trainer, epoch: int, logs: dict) -> None:
                if (epoch + 1) % period:
                    return
                loss = t.evaluate(X_val, y_val)
                if not math.isfinite(loss):  # onnxcustom's EvaluationError
                    message = (
                        f"The validation loss is {loss} after epoch {epoch}: the loss on "
                        "(X_val, y_val) is not a finite number (the model overflows on data "
                        "far from the training data, or its weights grew too large).")
                    if raises:
                        self._record(t, X_val, validation)
                        raise EvaluationError(
                            f"{message} Training stopped; the estimator keeps the weights of "
                            "that epoch.")
                    warnings.warn(f"{message} It is recorded as is.", ConvergenceWarning,
                                  stacklevel=2)
                validation.append(loss)

            callbacks.append(validate)
        finite: list[dict[str, np.ndarray]] = []
        if not raises:  # a divergence must leave finite weights: remember the last ones
            finite.append(trainer.state if warm_start else
                          {k: v.copy() for k, v in trainer.program.state.items()})
            callbacks.append(self._remember_finite(finite))
        try:
            trainer.fit(X, y, sample_weight, epochs=epochs, batch_size=self.batch_size,
                        shuffle=True, random_state=self.random_state, callbacks=callbacks,
                        progress=self.verbose > 0, warm_start=warm_start,
                        epoch_learning_rate=rate.value)
        except ConvergenceError as exc:
            if raises:
                self._record(trainer, X_val, validation)  # what was trained until then
                raise
            message = f"{exc} Training stopped."
            if not all(np.isfinite(v).all() for v in trainer.state.values()):
                # an update overflowed before the loss did: back to the last finite weights
                trainer.set_state(finite[0])
                message = (f"{str(exc).split(' The weights are')[0]} Training stopped; the "
                           "weights are those at the end of the last epoch that left them "
                           "finite (the starting weights when none did).")
            warnings.warn(message, ConvergenceWarning, stacklevel=3)
        if stopping is not None:
            stopping.finish(trainer)
        self._record(trainer, X_val, validation)
        return self

    def _hold_out(self, trainer: Trainer, X: Any, y: Any, sample_weight: Any) -> tuple:
        """``validation_fraction`` of the rows held out for early stopping, as scikit-learn's
        SGD estimators split them (``StratifiedShuffleSplit`` for a classifier, else
        ``ShuffleSplit``, seeded by ``random_state``): ``(X, y, sample_weight)`` of the rows
        trained on, and ``(X, y, sample_weight)`` of the held-out ones."""
        data = trainer.engine.prepare(X, y, sample_weight)
        labels = data[trainer.engine.label]
        seed = self.random_state
        if isinstance(seed, np.random.Generator):
            seed = int(seed.integers(2**32))
        train, held = split_rows(len(labels), self.validation_fraction, seed,
                                 labels if self._is_classifier() else None)
        weights = None if sample_weight is None else data[trainer.engine.sample_weight]

        def rows(index: np.ndarray) -> tuple:
            features = {k: v[index] for k, v in data.items()
                        if k not in (trainer.engine.label, trainer.engine.sample_weight)}
            X_part = next(iter(features.values())) if len(features) == 1 else features
            return X_part, labels[index], None if weights is None else weights[index]

        return (*rows(train), rows(held))

    def _record(self, trainer: Trainer, X_val: Any, validation: list[float]) -> None:
        """The fitted attributes, from the trainer after a fit (a stopped one included)."""
        self.n_iter_ = trainer.epochs_
        self.train_losses_ = list(trainer.train_losses_)
        self.validation_losses_ = None if X_val is None else (
            list(getattr(self, "validation_losses_", None) or []) * bool(self.warm_start)
            + validation)
        self.trained_coef_ = self.get_state()

    @staticmethod
    def _remember_finite(finite: list[dict[str, np.ndarray]]):
        """A callback keeping, in ``finite[0]``, the state of the last epoch that ended with
        finite weights and optimizer states."""

        def remember(t: Trainer, epoch: int, logs: dict) -> None:
            state = t.state
            if all(np.isfinite(v).all() for v in state.values()):
                finite[0] = state

        return remember

    def _log_epoch(self, rate: BaseLearningRate):
        """A callback logging each epoch's loss and learning rate to the ``lossgraph``
        logger at INFO level (``enable_logging=True``)."""
        logger = logging.getLogger("lossgraph")
        owner = type(self).__name__

        def log(t: Trainer, epoch: int, logs: dict) -> None:
            logger.info("[%s.fit] epoch %d loss=%g learning_rate=%g", owner, epoch,
                        logs["loss"], rate.value(epoch))

        return log

    def _rescale_velocities(self, rate: BaseLearningRate):
        """A callback giving Momentum's velocities scikit-learn's meaning for the next
        epoch (:meth:`LearningRateSGDNesterov.velocity_scale`)."""

        def rescale(t: Trainer, epoch: int, logs: dict) -> None:
            if not isinstance(rate, LearningRateSGDNesterov) or not t.program.optimizer_states:
                return
            scale = rate.velocity_scale(epoch + 1)
            if scale != 1.0:
                state = t.state
                t.set_state({s: state[s] * state[s].dtype.type(scale)
                             for s in t.program.optimizer_states})

        return rescale

    # -- state and export ---------------------------------------------------------------
    def _fitted(self) -> Trainer:
        if not hasattr(self, "trained_coef_"):
            raise NotFittedError(f"This {type(self).__name__} is not fitted yet: call fit first.")
        return self._trainer()

    def get_state(self) -> dict[str, np.ndarray]:
        """The trained weights, by name (a copy)."""
        trainer = self._trainer() if hasattr(self, "train_session_") else self._fitted()
        state = trainer.state
        return {w: state[w] for w in trainer.program.weights}

    def set_state(self, state: Mapping[str, np.ndarray] | Sequence[np.ndarray]) -> None:
        """Replace the weights: a dict by name, or a list in ``weights_to_train`` order."""
        trainer = self._trainer()
        if not isinstance(state, Mapping):
            weights = trainer.program.weights
            state = list(state)
            if len(state) != len(weights):
                raise UnsupportedOptionError(
                    f"set_state got {len(state)} arrays for the {len(weights)} weights "
                    f"{weights}: give one per weight, or a dict by name.")
            state = dict(zip(weights, state))
        trainer.set_state(state)
        self.trained_coef_ = self.get_state()

    def get_trained_onnx(self, model: ModelLike | None = None) -> onnx.ModelProto:
        """``model`` (default: the model given to the constructor) with the trained
        weights written into its initializers."""
        self._fitted()
        return with_weights(as_model(self.model_onnx if model is None else model),
                            self.get_state())

    def score(self, X: Any, y: Any, sample_weight: Any = None) -> float:
        """The negated loss on ``(X, y)``, so that higher is better (scikit-learn's
        convention)."""
        return -self._fitted().evaluate(X, y, _row_weights(sample_weight))

    def predict(self, X: Any) -> np.ndarray:
        """The model's prediction with the trained weights."""
        return self._fitted().predict(X)

    # -- pickling -------------------------------------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        kept = self.get_params()  # as given: unpickling resolves them again
        kept.update({name: getattr(self, name) for name in self._FITTED if hasattr(self, name)})
        trainer = getattr(self, "train_session_", None)
        if trainer is not None and getattr(self, "_compiled_key", None) == self._compile_key():
            kept["train_session_"] = trainer  # its program, state and progress (no sessions)
        return kept

    def __setstate__(self, state: dict[str, Any]) -> None:
        params = self._get_param_names()
        for name in params:
            setattr(self, name, state[name])
        self.__dict__.update({k: v for k, v in state.items() if k not in params})
        if "train_session_" in state:  # compiled for these very parameters
            self._rate = self.learning_rate
            self._compiled_key = self._compile_key()


class OrtGradientOptimizer(_TrainingEstimator):
    """The whole-graph API: train ``model_onnx``, which carries its loss, with SGD.

    ``model_onnx`` comes from :func:`~lossgraph.add_loss_output` (its loss output is
    ``loss_output_name``, its sample-weight input ``sample_weight_name`` when it has
    one); ``weights_to_train`` names its initializers to train. ``learning_rate`` is a
    :class:`~lossgraph.compat.BaseLearningRate`, its name or a float ``eta0``
    (onnxcustom's ``LearningRateSGD(eta0)``: invscaling), resolved on construction (the
    attribute is the object, ``get_params`` keeps the value given);
    :class:`~lossgraph.compat.LearningRateSGDNesterov` adds (Nesterov) momentum.
    ``max_iter`` epochs of ``batch_size`` rows; ``validation_every`` (epochs, or a
    fraction of ``max_iter`` below 1) spaces the validation losses; ``saved_gradient``,
    a file path, receives the training-step graph; ``verbose > 0`` shows a progress bar
    with the running loss. ``random_state`` (lossgraph's addition) seeds the shuffling.
    ``tol``, ``n_iter_no_change``, ``early_stopping`` and ``validation_fraction`` stop
    training as scikit-learn's MLP does (:class:`_NoImprovement`); ``tol=None``, the
    default, trains ``max_iter`` epochs as onnxcustom did.
    """

    _COMPILE_PARAMS = ("model_onnx", "weights_to_train", "loss_output_name", "learning_rate",
                       "sample_weight_name", "saved_gradient", "device")

    learning_rate = Resolved(BaseLearningRate.select)

    def __init__(self, model_onnx: ModelLike, weights_to_train: Sequence[str] | None,
                 loss_output_name: str = "loss", max_iter: int = 100,
                 training_optimizer_name: str = "SGDOptimizer", batch_size: int = 10,
                 learning_rate: Any = "SGD", device: str = "cpu", warm_start: bool = False,
                 verbose: int = 0, validation_every: float = 0.1,
                 saved_gradient: str | os.PathLike | None = None,
                 sample_weight_name: str = "weight", random_state: Any = None,
                 early_stopping: bool = False, validation_fraction: float = 0.1,
                 n_iter_no_change: int = 10, tol: float | None = None) -> None:
        self._keep_params(locals())

    def _loss_model(self) -> onnx.ModelProto:
        model = as_model(self.model_onnx)
        roles = get_roles(model)
        if "loss" not in roles:
            raise UnsupportedModelError(
                "OrtGradientOptimizer trains a model that carries its loss: build it with "
                "lossgraph.add_loss_output(model, ...), or use "
                "OrtGradientForwardBackwardOptimizer for an inference model.")
        if roles["loss"] != self.loss_output_name:
            raise UnknownNameError(
                f"loss_output_name={self.loss_output_name!r}, but the model's loss output is "
                f"{roles['loss']!r}: pass loss_output_name={roles['loss']!r}.")
        weight = roles.get("sample_weight")
        if weight is not None and weight != self.sample_weight_name:
            raise UnknownNameError(
                f"sample_weight_name={self.sample_weight_name!r}, but the model's sample-weight "
                f"input is {weight!r}: pass sample_weight_name={weight!r}.")
        return model

    def _program(self) -> TrainingProgram:
        program = compile_program(self._loss_model(), weights=self.weights_to_train, loss=None,
                                  optimizer=self.learning_rate.to_optimizer(), fuse="epoch")
        if self.saved_gradient is not None:
            save_model(program.graphs["train_step"], check_file_target(self.saved_gradient))
        return program

    def _is_classifier(self) -> bool:
        model = as_model(self.model_onnx)
        label = get_roles(model).get("label")
        types = {i.name: i.type.tensor_type.elem_type for i in model.graph.input}
        return types.get(label) == onnx.TensorProto.INT64

    def fit(self, X: Any, y: Any, sample_weight: Any = None, X_val: Any = None,
            y_val: Any = None, use_numpy: bool = False) -> OrtGradientOptimizer:
        """Train for ``max_iter`` epochs; returns ``self``.

        ``use_numpy`` is accepted for the reference's signature: lossgraph always binds
        the data's memory directly, which gives the same numbers as copying it.
        """
        flag("use_numpy", use_numpy)
        return self._fit(X, y, sample_weight, X_val, y_val, epochs=self.max_iter,
                         warm_start=self.warm_start)

    def _check_fit(self, sample_weight: Any) -> None:
        if sample_weight is not None and "sample_weight" not in get_roles(self._loss_model()):
            raise UnsupportedOptionError(
                "sample_weight was given, but the model has no sample-weight input: build it "
                f"with add_loss_output(..., weight_name={self.sample_weight_name!r}).")


class OrtGradientForwardBackwardOptimizer(_TrainingEstimator):
    """The forward/backward API: train the inference model ``model_onnx`` with the
    separate graphs of ``learning_loss``, ``learning_penalty`` and ``learning_rate``.

    ``weights_to_train=None`` trains :func:`~lossgraph.analysis.default_weights`;
    ``enable_logging=True`` logs each epoch's loss and rate to the ``lossgraph`` logger;
    ``weight_name`` names the loss graph's sample-weight input (``None``: ``"weight"``,
    made once a fit is given sample weights); ``exc=False`` turns a diverging fit into a
    :class:`~lossgraph.errors.ConvergenceWarning` that stops training with the last
    finite weights. The other parameters are :class:`OrtGradientOptimizer`'s.
    """

    _COMPILE_PARAMS = ("model_onnx", "weights_to_train", "learning_rate", "learning_loss",
                       "_weight_input", "learning_penalty", "loss_output_name", "device")
    _FITTED = (*_TrainingEstimator._FITTED, "_weighted")

    learning_rate = Resolved(BaseLearningRate.select)
    learning_loss = Resolved(BaseLearningLoss.select)
    learning_penalty = Resolved(BaseLearningPenalty.select)

    def __init__(self, model_onnx: ModelLike, weights_to_train: Sequence[str] | None = None,
                 loss_output_name: str = "loss", max_iter: int = 100,
                 training_optimizer_name: str = "SGDOptimizer", batch_size: int = 10,
                 learning_rate: Any = "SGD", device: str = "cpu", warm_start: bool = False,
                 verbose: int = 0, validation_every: float = 0.1,
                 learning_loss: Any = "square_error", enable_logging: bool = False,
                 weight_name: str | None = None, learning_penalty: Any = None,
                 exc: bool = True, random_state: Any = None, early_stopping: bool = False,
                 validation_fraction: float = 0.1, n_iter_no_change: int = 10,
                 tol: float | None = None) -> None:
        self._keep_params(locals())

    @property
    def _weight_input(self) -> str | None:
        """The loss graph's sample-weight input: ``weight_name``, else ``"weight"`` once a
        fit has had sample weights (onnxcustom's tutorial passes them without a name)."""
        if self.weight_name is not None:
            return self.weight_name
        return "weight" if getattr(self, "_weighted", False) else None

    def _program(self) -> TrainingProgram:
        loss, penalty = self.learning_loss, self.learning_penalty
        model = as_model(self.model_onnx)
        if get_roles(model).get("loss"):
            raise UnsupportedModelError(
                "OrtGradientForwardBackwardOptimizer trains an inference model with its own "
                "learning_loss; this model carries a loss already: pass the inference model, "
                "or use OrtGradientOptimizer.")
        loss_options = {**loss.loss_options(), "loss_name": self.loss_output_name}
        if self._weight_input is not None:
            loss_options["weight_name"] = self._weight_input
        # the weights of skl2onnx's ai.onnx.ml linear models appear once they are lowered
        weights = (names("weights_to_train", self.weights_to_train)
                   or default_weights(lower_ml_ops(model)))
        return compile_program(model, weights=weights, loss=loss.loss,
                               loss_options=loss_options, penalty=penalty.penalty(weights),
                               optimizer=self.learning_rate.to_optimizer(), fuse="separate")

    def _is_classifier(self) -> bool:
        return self.learning_loss.loss == "logistic"

    def fit(self, X: Any, y: Any, sample_weight: Any = None, X_val: Any = None,
            y_val: Any = None) -> OrtGradientForwardBackwardOptimizer:
        """Train for ``max_iter`` epochs; returns ``self``."""
        return self._fit(X, y, sample_weight, X_val, y_val, epochs=self.max_iter,
                         warm_start=self.warm_start)

    def _check_fit(self, sample_weight: Any) -> None:
        flag("exc", self.exc)
        flag("enable_logging", self.enable_logging)
        if sample_weight is not None:
            self._weighted = True  # the loss graph gets a sample-weight input

    # -- per-row losses ----------------------------------------------------------------------
    def _row_loss_session(self) -> Any:
        trainer = self._fitted()
        key = self._compiled_key
        if getattr(self, "_row_loss_key", None) != key:
            prediction = trainer.program.manifest["roles"]["prediction"]
            value = next(o for o in trainer.program.light_graphs["predict"].graph.output
                         if o.name == prediction)
            graph = loss_graph(value, self.learning_loss.loss, self.learning_loss.loss_options(),
                               weight_name=self._weight_input, reduction="none").model
            self._row_loss = (graph, create_session(graph, device_providers(self.device)))
            self._row_loss_key = key
        return self._row_loss

    def losses(self, X: Any, y: Any, sample_weight: Any = None) -> np.ndarray:
        """The loss of each row of ``(X, y)`` (times its sample weight), without the
        penalty."""
        trainer = self._fitted()
        graph, session = self._row_loss_session()
        sample_weight = _row_weights(sample_weight)
        if sample_weight is not None and self._weight_input is None:
            raise UnsupportedOptionError(
                "sample_weight was given, but the loss has no sample-weight input: pass "
                "weight_name='weight', or fit with sample weights first.")
        data = trainer.engine.prepare(X, y, sample_weight)
        feeds = {graph.graph.input[0].name: trainer.predict(X)}
        roles = trainer.program.manifest["roles"]
        feeds[graph.graph.input[1].name] = data[roles["label"]]
        if self._weight_input is not None:
            feeds[self._weight_input] = data[roles["sample_weight"]]
        return session.run(None, feeds)[0]

    def score(self, X: Any, y: Any, sample_weight: Any = None) -> float:
        """The negated mean loss per row (weighted by ``sample_weight``), so that higher is
        better."""
        losses = self.losses(X, y, sample_weight)
        total = len(losses) if sample_weight is None else float(np.sum(sample_weight))
        return -float(np.sum(losses, dtype=np.float64) / total)

    # -- the graphs ------------------------------------------------------------------------
    def save_onnx_graph(self, folder: Any, prefix: str | None = None,
                        suffix: str | None = None) -> dict[str, Any]:
        """Every graph this optimizer runs, by attribute: ``{"model_onnx", "forward",
        "backward", "gradient", "predict", "evaluate", "learning_loss": {"loss_grad_onnx"},
        "learning_rate": {"update_onnx"}, "learning_penalty": {"penalty_onnx"}}``
        (``gradient`` is ``forward`` and ``backward`` in one graph).

        ``folder=bytes`` returns the serialized graphs; a folder (which must exist)
        receives ``<prefix><class><suffix>.<attribute>.onnx`` files, written atomically,
        and the dict holds their paths. A file already there is replaced only when
        lossgraph wrote it; every path is checked before anything is written.
        """
        program = self._trainer().program
        halves = split_gradient(program.graphs["gradient"], program.io("gradient", "prediction"),
                                program.io("gradient", "prediction_grad"))
        graphs = {"model_onnx": as_model(self.model_onnx), "forward": halves.forward,
                  "backward": halves.backward, "gradient": program.graphs["gradient"],
                  "predict": program.graphs["predict"], "evaluate": program.graphs["evaluate"],
                  "learning_loss": {"loss_grad_onnx": program.graphs["loss"]},
                  "learning_rate": {"update_onnx": program.graphs["update"]},
                  "learning_penalty": ({"penalty_onnx": program.graphs["penalty"]}
                                       if "penalty" in program.graphs else {})}
        if folder is bytes:
            return _map(graphs, lambda _, graph: serialize(graph))
        if isinstance(folder, (str, os.PathLike)) and not os.path.lexists(folder):
            raise MissingFolderError(
                f"save_onnx_graph: the folder {str(folder)!r} does not exist. Create it first "
                "(the graphs are written into an existing folder), or pass bytes for the "
                "serialized graphs.")
        if not isinstance(folder, (str, os.PathLike)) or not Path(folder).is_dir():
            raise UnsupportedOptionError(
                f"save_onnx_graph(folder={folder!r}): give an existing folder, or bytes for "
                "the serialized graphs.")
        owners = {"learning_loss": self.learning_loss, "learning_rate": self.learning_rate,
                  "learning_penalty": self.learning_penalty}

        def path(key: tuple[str, ...], graph: onnx.ModelProto) -> Path:
            owner = type(owners[key[0]] if len(key) > 1 else self).__name__
            middle = "".join(f".{k}" for k in key[:-1])
            name = f"{prefix or ''}{_short(owner)}{suffix or ''}{middle}.{key[-1]}.onnx"
            return Path(folder) / name

        paths = _map(graphs, path)
        _map(paths, lambda _, p: check_file_target(p))
        return _map(graphs, lambda key, graph: str(save_model(graph, _get(paths, key))))


class _NoImprovement:
    """scikit-learn's MLP stopping rule, a callback of the estimator's fit.

    After every epoch: with ``early_stopping``, the validation score of the held-out rows
    (R2 for a regressor, accuracy for a classifier, scikit-learn's ``score``; a metric graph,
    :mod:`lossgraph.runtime.metrics`) is recorded in ``validation_scores_``; an epoch whose
    score is below the best plus ``tol`` counts as one without improvement (another resets
    the count), and a score above the best becomes the best, its state kept. Without
    ``early_stopping`` the training loss does the same, an epoch counting when its loss is
    above the best minus ``tol``. Training stops when the count exceeds ``n_iter_no_change``;
    with ``early_stopping`` the weights are then the best epoch's. ``n_iter_`` counts the
    epochs run.
    """

    def __init__(self, estimator: _TrainingEstimator, held_out: tuple | None) -> None:
        self.estimator, self.held_out = estimator, held_out
        self.metric = "accuracy" if estimator._is_classifier() else "r2"
        self.count = 0
        self.best_state: dict[str, np.ndarray] | None = None
        if held_out is None:
            estimator.best_loss_ = math.inf
        else:
            estimator.best_validation_score_ = -math.inf
            estimator.validation_scores_ = []

    def __call__(self, trainer: Trainer, epoch: int, logs: dict) -> bool:
        est, tol = self.estimator, self.estimator.tol
        if self.held_out is None:
            loss = logs["loss"]
            self.count = self.count + 1 if loss > est.best_loss_ - tol else 0
            est.best_loss_ = min(est.best_loss_, loss)
        else:
            X, y, w = self.held_out
            score = trainer.evaluate(X, y, w, metrics=[self.metric])[self.metric]
            est.validation_scores_.append(score)
            self.count = self.count + 1 if score < est.best_validation_score_ + tol else 0
            if score > est.best_validation_score_:
                est.best_validation_score_ = score
                self.best_state = trainer.state
        return self.count > est.n_iter_no_change

    def finish(self, trainer: Trainer) -> None:
        """The best epoch's weights, with ``early_stopping`` (scikit-learn's MLP)."""
        if self.best_state is not None:
            trainer.set_state(self.best_state)


def _row_weights(sample_weight: Any) -> Any:
    """Sample weights in one column, ``(N, 1)`` as onnxcustom's tests pass them (its loss
    graphs broadcast ``(N,)`` weights wrongly), as the ``(N,)`` row weights they are."""
    shape = getattr(sample_weight, "shape", None)
    if shape is not None and len(shape) == 2 and shape[1] == 1:
        return np.asarray(sample_weight).reshape(-1)
    return sample_weight


def _short(name: str) -> str:
    """The reference's short file names: Learning -> L, OrtGradient -> Grad,
    GradientHalves -> FB."""
    for long, short in (("Learning", "L"), ("OrtGradient", "Grad"), ("GradientHalves", "FB")):
        name = name.replace(long, short)
    return name


def _map(tree: Mapping[str, Any], fn, key: tuple[str, ...] = ()) -> dict[str, Any]:
    return {k: _map(v, fn, (*key, k)) if isinstance(v, Mapping) else fn((*key, k), v)
            for k, v in tree.items()}


def _get(tree: Mapping[str, Any], key: tuple[str, ...]) -> Any:
    for part in key:
        tree = tree[part]
    return tree


