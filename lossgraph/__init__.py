"""lossgraph: compile ONNX inference models into ONNX training graphs.

The public surface (docs/concepts.md gives its vocabulary):

- passes, each a model in and a model out: :func:`add_loss_output`, :func:`gradient`,
  :func:`convert_opset`, :func:`lower_ml_ops`, :func:`alphabetize_initializers`,
  :func:`stabilize_numerics`, :func:`strip_training`, :func:`straight_through_quantization`,
  :func:`add_lora` (LoRA adapters: :class:`LoRA`, :func:`lora_candidates`,
  :func:`merge_adapters` in :mod:`lossgraph.adapters`)
  (their pass classes, and the pipeline machinery, in :mod:`lossgraph.passes`)
- gradients: :func:`grad_rule` (register a rule), :func:`supported_ops`
- training: :func:`compile_program` -> :class:`TrainingProgram`, :class:`Trainer` (on the
  engine :class:`Engine`), optimizers in :mod:`lossgraph.optim` (their learning-rate
  schedules in :mod:`lossgraph.schedules`); :class:`EarlyStopping`, metrics in
  :mod:`lossgraph.runtime.metrics`, fusion modes in
  :mod:`lossgraph.modes`; :func:`describe_plan` shows what compiling runs
- analyses: :func:`trainable_initializers`, :func:`get_roles`; the class weights of
  training labels: :func:`balanced_class_weight`
- errors: :class:`LossgraphError` and its subclasses in :mod:`lossgraph.errors`
- onnxcustom's classes (:mod:`lossgraph.compat`): :class:`OrtGradientOptimizer`,
  :class:`OrtGradientForwardBackwardOptimizer`, :class:`OrtGradientForwardBackward`, the
  learning rates, losses and penalties
- deployment: :mod:`lossgraph.export` (adapter files: :func:`export_adapters`,
  :func:`load_adapters`); data-parallel training: :mod:`lossgraph.parallel`
  (and :mod:`lossgraph.ray`); a graph as a torch layer: :mod:`lossgraph.torch`

Each name is loaded on first use (:mod:`lossgraph.lazy`): ``import lossgraph`` imports
neither numpy, onnx nor onnxruntime, so the command line answers ``--help`` and
argument errors at once; ``lossgraph.Trainer``, ``from lossgraph import Trainer`` and
every submodule as an attribute (``lossgraph.passes``) work as with an eager import.
"""

from .deprecation import moved_names as _moved_names
from .lazy import lazy_names as _lazy_names

__version__ = "0.1.0"

#: Public name -> the module that defines it.
_HOMES = {
    "CSVLogger": ".runtime.callbacks",
    "Callback": ".runtime.callbacks",
    "EarlyStopping": ".runtime.early_stopping",
    "Engine": ".runtime.engine",
    "LossgraphError": ".errors",
    "Trainer": ".runtime.trainer",
    "TensorBoard": ".runtime.callbacks",
    "TrainingProgram": ".program",
    "LoRA": ".adapters",
    "add_loss_output": ".passes",
    "add_lora": ".passes",
    "alphabetize_initializers": ".passes",
    "balanced_class_weight": ".passes.loss",
    "compile_program": ".compiler",
    "convert_opset": ".passes",
    "describe_plan": ".compiler",
    "export_adapters": ".export.adapters",
    "get_roles": ".roles",
    "grad_rule": ".autodiff",
    "gradient": ".passes",
    "latest_checkpoint": ".paths",
    "load_adapters": ".export.adapters",
    "lora_candidates": ".adapters",
    "merge_adapters": ".adapters",
    "lower_ml_ops": ".passes",
    "optim": ".optim",
    "schedules": ".schedules",
    "stabilize_numerics": ".passes",
    "straight_through_quantization": ".passes",
    "strip_training": ".passes",
    "supported_ops": ".autodiff",
    "trainable_initializers": ".analysis",
    **{name: ".compat" for name in (
        "AbsoluteLearningLoss", "BaseLearningLoss", "BaseLearningPenalty", "BaseLearningRate",
        "ElasticLearningLoss", "ElasticLearningPenalty", "LearningRateSGD",
        "LearningRateSGDNesterov", "NegLogLearningLoss", "NoLearningPenalty",
        "OrtGradientForwardBackward", "OrtGradientForwardBackwardOptimizer",
        "OrtGradientOptimizer", "SquareLearningLoss")},
}

__all__ = [*_HOMES, "__version__"]

#: ``lossgraph.compile``, the previous release's name of :func:`compile_program`.
__getattr__ = _lazy_names(__name__, _HOMES, fallback=_moved_names(
    "lossgraph", {"compile": "lossgraph:compile_program"}))


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
