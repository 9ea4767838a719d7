"""Key-value caches written in place (opset 24).

    TensorScatter(past, u, w; axis, mode)
        y = past, with y[b, ..., w_b + s, ...] = u[b, ..., s, ...] along ``axis``
        (s < S <= L, the update's and the cache's lengths; positions mod L when
        mode = circular; write_indices w default 0):
        dpast = TensorScatter(dy, zeros like u, w)      (0 where u was written)
        du    = GatherElements(dy, w_b + s [mod L], axis)
        dw: none (integer positions)
"""

from __future__ import annotations

import numpy as np

from ...graphs import attribute_values
from ..registry import grad_rule


@grad_rule("TensorScatter", since=24, nondiff=(2,),
           notes="linear and circular modes")
def tensor_scatter(g, node, dy):
    past, update = node.inputs[:2]
    writes = node.input(2)
    attributes = attribute_values(node.proto)
    rank = g.rank(past)
    axis = node.attr("axis", -2) % rank
    dpast = dupdate = None
    if past in node.wanted:
        zeros = g.filled(g.Shape(update), 0, update, hint="zeros")
        dpast = g.TensorScatter(dy, zeros, *([writes] if writes else []), hint="dpast",
                                **attributes)
    if update in node.wanted:
        length = g.dims(update, axis, axis + 1, hint="update_length")
        steps = g.Range(g.const(0, np.int64, "zero"), g.Squeeze(length),
                        g.const(1, np.int64, "one"))
        shape = [1] * rank
        shape[axis] = -1
        positions = g.Reshape(steps, g.ints(shape, "along_axis"))
        if writes:
            batch = [-1] + [1] * (rank - 1)
            positions = g.Add(positions, g.Reshape(writes, g.ints(batch, "per_batch")))
        if node.attr("mode", "linear") == "circular":
            positions = g.Mod(positions, g.dims(past, axis, axis + 1, hint="cache_length"))
        index = g.Expand(positions, g.Shape(update))
        dupdate = g.GatherElements(dy, index, axis=axis, hint="dupdate")
    return node.grads(dpast, dupdate)
