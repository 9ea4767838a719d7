"""The previous release's home of the separate-mode graph builders, kept for one release.

Each name still works, with a :class:`~lossgraph.errors.LossgraphDeprecationWarning`
naming its new home: the loss graph in :mod:`lossgraph.passes.loss`, the penalty graph in
:mod:`lossgraph.penalties`, the update graph in :mod:`lossgraph.optim`, the graph surgery
in :mod:`lossgraph.surgery`, the packed update in :mod:`lossgraph.runtime.packed`; the
separate mode itself is :mod:`lossgraph.modes.separate`.
"""

from __future__ import annotations

from .deprecation import moved_names

__getattr__ = moved_names("lossgraph.separate", {
    "loss_graph": "lossgraph.passes.loss",
    "program_loss_graph": "lossgraph.passes.loss",
    "penalty_graph": "lossgraph.penalties",
    "update_graph": "lossgraph.optim",
    "split_gradient": "lossgraph.surgery",
    "chain_graphs": "lossgraph.surgery",
    "ForwardBackward": "lossgraph.surgery:GradientHalves",
    "PackedUpdate": "lossgraph.runtime.packed",
    "packed_update": "lossgraph.runtime.packed",
})
