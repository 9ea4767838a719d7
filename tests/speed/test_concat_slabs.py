"""ConcatScatteredSlabs (lossgraph/speed/concat_slabs.py): the gradients of slabs split by
Gathers (an attention's heads) are concatenated, not scattered, and compute the same; slabs
that do not fill the tensor keep their scatters."""

from __future__ import annotations

import numpy as np
import pytest
from support.rewrites import plain_and_rewritten, same_outputs

from lossgraph.autodiff import context
from lossgraph.speed import ConcatScatteredSlabs

F32 = np.float32

SPLIT = """<ir_version: 8, opset_import: ["" : 17]>
g (float[{k}, 4, 2] x) => (float loss) <{indices}> {{
    {body}
    loss = ReduceSum<keepdims=0>(p)
}}"""


def _split_model(indices: list[int], k: int = 3) -> str:
    """``loss = sum(prod_i sin(x[i_j]))`` over Gathers of scalar constants ``i_j``."""
    constants = ", ".join(f"int64 i{j} = {{{i}}}" for j, i in enumerate(indices))
    body = "  ".join(f"a{j} = Gather(x, i{j})  s{j} = Sin(a{j})" for j in range(len(indices)))
    product = "s0"
    for j in range(1, len(indices)):
        body += f"  m{j} = Mul({product}, s{j})"
        product = f"m{j}"
    body += f"  p = Identity({product})"
    return SPLIT.format(k=k, indices=constants, body=body)


@pytest.mark.parametrize("made_at_run_time", [False, True])
@pytest.mark.parametrize("indices", [[0, 1, 2], [2, 0, 1], [-1, 0, 1]])
def test_slabs_split_by_gathers_have_their_gradients_concatenated(rng, indices,
                                                                  made_at_run_time,
                                                                  monkeypatch):
    """Zeros made at each run (a slab of a static shape large enough, here with the
    threshold lowered to x's 24 values) are recognised as zeros too."""
    if made_at_run_time:
        monkeypatch.setattr(context, "RUN_TIME_FILL", 24)
    plain, result = plain_and_rewritten(_split_model(indices), ["x"], ConcatScatteredSlabs())
    assert result.changed
    ops = [n.op_type for n in result.model.graph.node]
    assert "Concat" in ops and "ScatterND" not in ops and "ConstantOfShape" not in ops
    assert ("Slice" in [n.op_type for n in plain.graph.node]) == made_at_run_time
    same_outputs(plain, result.model, {"x": rng.normal(size=(3, 4, 2)).astype(F32)})


@pytest.mark.parametrize("indices", [[0, 1], [0, 1, 1]])
def test_slabs_that_do_not_fill_the_tensor_keep_their_scatters(indices):
    _, result = plain_and_rewritten(_split_model(indices), ["x"], ConcatScatteredSlabs())
    assert not result.changed
