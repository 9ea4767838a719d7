"""The passes of the lossgraph compiler, one module each.

Every pass is a :class:`~lossgraph.passes.contract.Pass` (pure, checked, deterministic;
it returns a :class:`~lossgraph.passes.contract.PassResult`). In pipeline order:

- :class:`ConvertOpset`: the model at an ``ai.onnx`` opset the target loads, where its ops
  keep their meaning (every pass does so with the model it is given)
- :class:`LowerMlOps`: ``ai.onnx.ml`` linear models into standard ops
- :class:`GeneralizeBatch`: a fixed-batch export (torch's default) freed to take any
  number of rows, where the graph proves which shape constants hold the batch
- :class:`ZipMapToTensor`: a classifier's ZipMap output replaced by the probability tensor
  it zips, which the loss reads
- :class:`AddLossOutput`: a scalar loss (and penalty) as the first output;
  :class:`RemoveLossOutput` undoes it (the inference model inside a loss model)
- :class:`ConstantsToInitializers`: ``Constant`` nodes named as weights become initializers
- :class:`UntieWeights`: an initializer several layers read (an exporter merged equal
  values), one copy per layer
- :class:`AlphabetizeInitializers`: weights renamed so their names sort in graph order
- :class:`WeightsToInputs`: trainable initializers become graph inputs
- :class:`RunningStatistics`: a training-mode BatchNormalization as one node of the function
  ``lossgraph.BatchNormalizationTraining`` (batch statistics, differentiated in closed
  form), and its running statistics (the program's buffers) updated as torch does
- :class:`SequencesToTensors`: a ``SplitToSequence`` read at constant positions rewritten
  into a ``Split`` before differentiation (lossgraph differentiates tensors only)
- :class:`StabilizeNumerics`: overflowing forms (``1 / (1 + Exp(-s))``, ``Log(Softmax)``,
  ``Log(Sigmoid)``, ...) rewritten into stable ones before differentiation
- :class:`StraightThroughQuantization` (run by the user, before compiling): fake
  quantization (QuantizeLinear -> DequantizeLinear) differentiated with the straight-through
  estimator, for quantization-aware training
- :class:`AddLoRA` (run by the user, or by ``compile_program(adapters=...)``): LoRA
  adapters beside the weights of products, the base weights frozen
- :class:`Gradient`: gradients or vector-Jacobian products
- :class:`Recompute`: the backward reads kept values only (boundaries), the activations
  between them recomputed, the graph form of ``torch.utils.checkpoint``
- :class:`PackWeights`, :class:`StepGraph`, :class:`EpochGraph`: fusion with the
  optimizer's update
- :class:`SumGradients`, :class:`GroupGradients`: gradient accumulation, a running
  sum of scaled micro-batch gradients, and a Scan of it over a group of micro-batches
- :class:`StripTraining`: nothing of training left (loss, roles, BatchNormalization and
  Dropout in training mode), for the inference export; :class:`InferenceMode` the layers'
  part alone, for eval graphs

The onnxruntime optimization passes live in :mod:`lossgraph.speed`.

Each pass a user runs alone also has a function form, the model in and the model out
(:func:`add_loss_output`, :func:`gradient`, ...), importable from ``lossgraph`` itself.
"""

from .accumulate import GroupGradients, SumGradients
from .contract import Pass, PassResult, Pipeline, Reports, Requirement
from .expand_functions import ExpandFunctions
from .fixed_batch import GeneralizeBatch
from .fuse import EpochGraph, PackWeights, StepGraph
from .gradient import Gradient, gradient
from .lora import AddLoRA, add_lora
from .loss import AddLossOutput, RemoveLossOutput, add_loss_output
from .lower_ml import LowerMlOps, lower_ml_ops
from .opset import ConvertOpset, convert_opset
from .quantization import StraightThroughQuantization, straight_through_quantization
from .recompute import Recompute
from .rename import AlphabetizeInitializers, alphabetize_initializers
from .running_stats import RunningStatistics
from .sequences import SequencesToTensors
from .stabilize import StabilizeNumerics, stabilize_numerics
from .strip import InferenceMode, StripTraining, strip_training
from .untie import UntieWeights
from .weights import ConstantsToInitializers, WeightsToInputs
from .zipmap import ZipMapToTensor

__all__ = ["AddLoRA", "AddLossOutput", "AlphabetizeInitializers", "ConstantsToInitializers",
           "ConvertOpset",
           "EpochGraph", "ExpandFunctions", "GeneralizeBatch", "Gradient", "GroupGradients",
           "InferenceMode",
           "Recompute",
           "LowerMlOps", "PackWeights", "Pass", "PassResult", "Pipeline", "RemoveLossOutput",
           "Reports", "Requirement", "RunningStatistics", "SequencesToTensors",
           "StabilizeNumerics", "StepGraph", "StraightThroughQuantization", "StripTraining",
           "SumGradients",
           "UntieWeights", "WeightsToInputs", "ZipMapToTensor", "add_loss_output", "add_lora",
           "alphabetize_initializers", "convert_opset", "gradient", "lower_ml_ops",
           "stabilize_numerics", "straight_through_quantization", "strip_training"]
