"""The graphs of ``fuse="separate"``: the reference documents' forward/backward design.

A separate-mode program trains with four graphs that a runner chains itself::

    gradient (x, weights..., prediction_grad) -> (prediction, <w>_grad...)     model VJP
    loss     (prediction, label[, weight])    -> (loss, prediction_grad)
    penalty  (penalized weights...)           -> (penalty, <w>_penalty_grad...)   optional
    update   (learning_rate, step, <w>, <w>_grad, <w states>...) -> (<w>_new, <state>_new...)

with the penalty and the update (:mod:`lossgraph.optim`)::

    penalty(W)      = a sum|W| + b sum W^2       penalty_grad(W) = a sign(W) + 2 b W

``update`` is IR 10 and standard ONNX ops only, so it runs on onnxruntime-training 1.19
and on current onnxruntime alike.

A runner may run ``update`` *packed* (:func:`packed_update`): the same graph built for one
flat vector holding every weight end to end (its gradient and each state likewise). The
optimizers' updates are elementwise, so it gives the per-weight graph's numbers to the
last bit, in a handful of kernels instead of a handful per weight (at batch 15 on the
reference documents' MLP, 6 kernels in 6 us instead of 36 in 15 us). It may run several
graphs as one session (:func:`chain_graphs`): the Trainer runs the forward half, the
loss and the backward half of a full batch in one run.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import onnx

from .metadata import GRADIENTS_KEY, read_json
from .optim import Optimizer, build_update
from .optimize import SumRowsByProduct
from .passes.contract import Pipeline
from .passes.gradient import Gradient
from .passes.loss import program_loss_graph
from .penalties import build_penalty
from .signature import Signature

__all__ = ["separate_graphs"]


def separate_graphs(predict: onnx.ModelProto, roles: Mapping[str, str], loss: str,
                    options: Mapping[str, Any], penalty: Mapping[str, Any] | None,
                    initial: Mapping[str, np.ndarray], optimizer: Optimizer, backend: str,
                    signature: Signature
                    ) -> tuple[dict[str, onnx.ModelProto], dict[str, dict[str, str]]]:
    """The four graphs for ``predict`` (weights as inputs) and ``loss`` with ``options``,
    and the role of each input and output of each (the manifest's roles, by graph).

    ``signature`` is completed with the names the graphs chose. Every name lossgraph
    invents (a gradient, a state, ``learning_rate``, ``step``, ``penalty``) is a free one:
    a weight or input of the model named alike keeps its name, and the invented one gets
    a suffix.
    """
    prediction = roles["prediction"]
    weights = list(initial)
    model_gradient = Pipeline((Gradient(weights, outputs=[prediction], backend=backend),
                               SumRowsByProduct()))(predict).model
    model_gradient = SumRowsByProduct()(model_gradient).model  # OPTIMIZE: sum-rows helper
    gradients = read_json(model_gradient, GRADIENTS_KEY)
    value = next(o for o in predict.graph.output if o.name == prediction)
    loss_step = program_loss_graph(value, roles["label"], loss, options, backend)
    # the model's own names, so that a name the update invents means one thing program-wide
    taken = {v.name for v in (*model_gradient.graph.input, *model_gradient.graph.output)
             if v.name not in gradients.values()}
    taken.update(roles.values())
    update = build_update(optimizer, initial, taken=taken)
    graphs = {"gradient": model_gradient, "loss": loss_step.model, "update": update.model}
    seed = loss_step.report[prediction]
    graph_roles = {
        "gradient": {prediction: "prediction", seed: "prediction_grad",
                     **{g: "gradient" for g in gradients.values()}},
        "loss": {prediction: "prediction", seed: "prediction_grad"},
        "update": update.roles,
    }
    if penalty:
        built = build_penalty(initial, penalty)
        graphs["penalty"], graph_roles["penalty"] = built.model, built.roles
    signature.gradients = dict(gradients)
    signature.learning_rate, signature.step = update.learning_rate, update.step
    signature.states = update.states
    signature.new = dict(update.new)
    signature.prediction = prediction
    signature.prediction_grad = seed
    return graphs, graph_roles
