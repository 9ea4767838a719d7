"""The passes of the lossgraph compiler, one module each.

Every pass keeps the contract of :mod:`lossgraph.passes.contract`: pure, valid,
deterministic, honest errors. In pipeline order:

- :func:`lower_ml_ops`: ``ai.onnx.ml`` linear models into standard ops
- :func:`add_loss_output`: a scalar loss (and penalty) as the first output
- :func:`alphabetize_initializers`: weights renamed so their names sort in graph order
- :func:`weights_to_inputs`: trainable initializers become graph inputs
- :func:`gradient`: gradients or vector-Jacobian products
- :func:`step_graph`, :func:`epoch_graph`: fusion with the optimizer's update
- :func:`penalty_graph`, :func:`update_graph`: the standalone graphs of ``fuse="separate"``
"""

from .contract import model_pass
from .fuse import epoch_graph, step_graph
from .gradient import gradient
from .loss import add_loss_output
from .lower_ml import lower_ml_ops
from .penalty import penalty_graph
from .rename import alphabetize_initializers
from .update import update_graph
from .weights import weights_to_inputs

__all__ = ["add_loss_output", "alphabetize_initializers", "epoch_graph", "gradient",
           "lower_ml_ops", "model_pass", "penalty_graph", "step_graph", "update_graph",
           "weights_to_inputs"]
