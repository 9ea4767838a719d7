"""Models whose shapes are known at run time only.

- Ranks lossgraph finds where onnx's shape inference gives up (ForwardFacts): shape
  arithmetic on constants that onnx does not evaluate, and ops whose definition fixes
  their output's rank from their inputs' ranks and lengths; a rank that is not fixed
  stays unknown.
- Gradients that take at run time what the static shapes cannot tell (Expand's broadcast
  axes, MatMul's and Einsum's broadcast batch axes, the reductions' computed axes, Tile's
  computed repeats), against finite differences.
- torch's exports of attention, by the legacy (TorchScript) and the dynamo exporter, with
  a free batch axis and a free sequence axis: their gradients equal torch autograd's in
  float64, and SGD trains them like torch.optim.SGD step for step on batches of
  differing sizes.
"""

from __future__ import annotations

import functools
import io
import warnings

import numpy as np
import onnx
import pytest
from support.gradcheck import check_gradients, cotangent, loss_model, to_float64
from support.models import model
from support.torch_steps import assert_sgd_steps_like_torch

import lossgraph
from lossgraph.graphs import ForwardFacts
from lossgraph.optim import SGD
from lossgraph.runtime.session import create_session


def _onnx_rank(net: onnx.ModelProto, name: str) -> int | None:
    """The rank onnx's shape inference (with data propagation) alone gives ``name``."""
    inferred = onnx.shape_inference.infer_shapes(net, data_prop=True).graph
    for value in (*inferred.value_info, *inferred.output):
        if value.name == name and value.type.tensor_type.HasField("shape"):
            return len(value.type.tensor_type.shape.dim)
    return None


def _lossgraph_rank(net: onnx.ModelProto, name: str) -> int | None:
    shape = ForwardFacts.of(net).shapes.get(name)
    return None if shape is None else len(shape)


def _graph(inputs: str, body: str, output: str, rank: int) -> onnx.ModelProto:
    """The model of ``body`` whose result ``output`` is declared of ``rank`` symbolic dims
    (a graph output needs a shape; the rank checked is that of an intermediate value)."""
    dims = ", ".join(f"d{i}" for i in range(rank))
    declared = f"double[{dims}] {output}" if rank else f"double {output}"
    return model(f"({inputs}) => ({declared})", body, opset=17)


#: -1 mod 2 = 1 (onnx does not evaluate Mod): the Reshape target is Shape(x)[:1] ++ (2, 3),
#: as torch's legacy exporter writes ``unflatten``
UNFLATTEN = ("minus_one = Constant <value = int64[1] {-1}> () "
             "two = Constant <value = int64[1] {2}> () "
             "zero = Constant <value = int64[1] {0}> () "
             "sizes = Constant <value = int64[2] {2, 3}> () "
             "s = Shape(x) "
             "m = Mod(minus_one, two) "
             "head = Slice(s, zero, m) "
             "target = Concat <axis = 0> (head, sizes) "
             "t = Reshape(x, target) ")
#: a value of a rank no rule can tell: two computed axes could be one axis twice
UNRANKED_U = "u = Squeeze(v, pair) "
THEN_UNSQUEEZE = "then_branch = g1 () => (double[] a1) { a1 = Unsqueeze(x, a) }"

#: form: (inputs, the nodes computing t, the rank of t)
RANK_FORMS = {
    "Reshape to a target built from constants onnx does not fold": (
        "double[N, 6] x", UNFLATTEN, 3),
    "Squeeze over one computed axis": (
        "double[N, 1, 3] x, int64[1] a", "t = Squeeze(x, a) ", 2),
    "Unsqueeze over two computed axes": (
        "double[N, 3] x, int64[2] a", "t = Unsqueeze(x, a) ", 4),
    "ReduceSum over computed axes, keepdims": (
        "double[N, 3] x, int64[2] a", "t = ReduceSum(x, a) ", 2),
    "ReduceSum over one computed axis, no keepdims": (
        "double[N, 3] x, int64[1] a", "t = ReduceSum <keepdims = 0> (x, a) ", 1),
    "ReduceSum over no computed axes, no keepdims (all axes)": (
        "double[N, 3] x, int64[0] a", "t = ReduceSum <keepdims = 0> (x, a) ", 0),
    "ReduceSum over no computed axes, no keepdims, noop": (
        "double[N, 3] x, int64[0] a",
        "t = ReduceSum <keepdims = 0, noop_with_empty_axes = 1> (x, a) ", 2),
    "Concat with one input of known rank": (
        "double[N, 3] x, double[M, 1, 1, 3] v, int64[2] pair",
        UNRANKED_U + "t = Concat <axis = 0> (x, u) ", 2),
    "GatherElements of data of known rank": (
        "double[N, 3] x, int64[M, 1, 1, 3] v, int64[2] pair",
        UNRANKED_U + "t = GatherElements(x, u) ", 2),
    "If whose branches agree, one with a rank onnx leaves unknown": (
        "double[N, 3] x, bool c, int64[1] a, int64[3] s",
        f"t = If(c) <{THEN_UNSQUEEZE}, "
        "else_branch = g2 () => (double[] a2) { a2 = Reshape(x, s) }> ", 3),
}

NOT_STATIC = {
    # onnxruntime squeezes or reduces a repeated axis once: the rank depends on the values
    "Squeeze over two computed axes": (
        "double[N, 1, 1] x, int64[2] a", "t = Squeeze(x, a) "),
    "ReduceSum over two computed axes, no keepdims": (
        "double[N, 3] x, int64[2] a", "t = ReduceSum <keepdims = 0> (x, a) "),
    "Reshape to a target of unknown length": (
        "double[N, 3] x, double[M, 1, 1] v, int64[2] pair",
        "u = Squeeze(v, pair) n = Cast <to = 7> (u) t = Reshape(x, n) "),
    "Concat of inputs of unknown rank": (
        "double[M, 1, 1, 3] v, int64[2] pair",
        UNRANKED_U + "t = Concat <axis = 0> (u, u) "),
    "If whose branches give different ranks": (
        "double[N, 3] x, bool c, int64[1] a",
        f"t = If(c) <{THEN_UNSQUEEZE}, "
        "else_branch = g2 () => (double[] a2) { a2 = Neg(x) }> "),
}


@pytest.mark.parametrize("form", list(RANK_FORMS))
def test_lossgraph_finds_a_static_rank_onnx_leaves_unknown(form):
    inputs, body, rank = RANK_FORMS[form]
    net = _graph(inputs, body + "y = Identity(t)", "y", rank)
    assert _onnx_rank(net, "t") is None
    assert _lossgraph_rank(net, "t") == rank


@pytest.mark.parametrize("form", list(NOT_STATIC))
def test_a_rank_its_inputs_do_not_fix_stays_unknown(form):
    inputs, body = NOT_STATIC[form]
    assert _lossgraph_rank(_graph(inputs, body + "y = Identity(t)", "y", 2), "t") is None


def test_the_folded_shape_arithmetic_stays_in_the_model():
    """The constants computed to find ranks serve shape inference only: the nodes that
    compute them are still there, and ForwardFacts does not take them for constants."""
    net = _graph("double[N, 6] x", UNFLATTEN + "y = Identity(t)", "y", 3)
    facts = ForwardFacts.of(net)
    assert [n.op_type for n in facts._graph.node] == [n.op_type for n in net.graph.node]
    assert "m" not in facts.constants and "target" not in facts.constants


def _rand(rng, *shape):
    return rng.normal(size=shape)


@pytest.mark.parametrize("inputs, body, output, feeds", [
    ("double[N, 6] x, double[2, 3] w", UNFLATTEN, "double[N, 2, 3] y",
     {"x": (4, 6), "w": (2, 3)}),
    ("double[N, 1, 3] x, int64[1] a, double[3] w", "t = Squeeze(x, a) ", "double[N, 3] y",
     {"x": (4, 1, 3), "a": [1], "w": (3,)}),
    ("double[N, 3] x, int64[2] a, double[3] w", "t = Unsqueeze(x, a) ",
     "double[N, 1, 1, 3] y", {"x": (4, 3), "a": [-2, 1], "w": (3,)}),
    ("double[N, 3] x, int64[1] a, double[3] w", "t = ReduceSum <keepdims = 0> (x, a) ",
     "double[3] y", {"x": (4, 3), "a": [0], "w": (3,)}),
    ("double[N, 3] x, int64[0] a, double[3] w", "t = ReduceSum <keepdims = 0> (x, a) ",
     "double[3] y", {"x": (4, 3), "a": [], "w": (3,)}),
    ("double[N, 3] x, int64[0] a, double[3] w",
     "t = ReduceSum <keepdims = 0, noop_with_empty_axes = 1> (x, a) ",
     "double[N, 3] y", {"x": (4, 3), "a": [], "w": (3,)}),
    ("double[N, 3] x, int64[1] a, double[N] w", "t = ReduceMean <keepdims = 0> (x, a) ",
     "double[N] y", {"x": (4, 3), "a": [-1], "w": (4,)}),
    ("double[N, 3] x, double[M, 1, 1, 3] v, int64[2] pair, double[3] w",
     UNRANKED_U + "t = Concat <axis = 0> (x, u) ", "double[K, 3] y",
     {"x": (4, 3), "v": (2, 1, 1, 3), "pair": [1, 2], "w": (3,)}),
    ("double[N, 3] x, bool c, int64[1] a, int64[3] s, double[3] w",
     f"t = If(c) <{THEN_UNSQUEEZE}, "
     "else_branch = g2 () => (double[] a2) { a2 = Reshape(x, s) }> ", "double[N, 1, 3] y",
     {"x": (4, 3), "c": True, "a": [1], "s": [2, 2, 3], "w": (3,)}),
], ids=["unflatten", "squeeze", "unsqueeze", "reduce_sum", "reduce_sum_all", "reduce_sum_none",
        "reduce_mean", "concat", "if"])
def test_gradients_through_the_ranks_lossgraph_finds(rng, inputs, body, output, feeds):
    """Each form, differentiated where onnx alone would leave the gradient no rank,
    against finite differences."""
    net = model(f"({inputs}) => ({output})", body + "y = Mul(t, w)", opset=18)
    values = {name: _rand(rng, *value) if isinstance(value, tuple)
              else np.array(value, dtype=np.int64 if isinstance(value, list) else None)
              for name, value in feeds.items()}
    floats = [name for name, value in values.items() if value.dtype == np.float64]
    check_gradients(net, values, wrt=floats, ort=False)


# -- broadcast axes found at run time ---------------------------------------------------------

EXPAND = "(double[a, b] x, int64[3] s) => (double[c, d, e] y)"


@pytest.mark.parametrize("x_shape, target", [
    ((1, 4), [2, 3, 4]),   # a leading axis and a 1 that broadcasts
    ((3, 1), [2, 3, 4]),   # the last axis broadcast
    ((3, 4), [2, 1, 1]),   # the target's 1s take x's dims: only the leading axis
    ((1, 1), [1, 1, 1]),   # nothing broadcast but the new leading 1
])
def test_expand_gradient_finds_the_broadcast_axes_at_run_time(rng, x_shape, target):
    """x's dims are symbolic: which of them broadcast is known at run time only."""
    net = model(EXPAND, "y = Expand(x, s)", opset=13)
    check_gradients(net, {"x": _rand(rng, *x_shape), "s": np.array(target)}, wrt=["x"],
                    ort=False)


def test_expand_of_an_input_of_one_symbolic_dim(rng):
    net = model("(double[N] x, int64[2] s) => (double[3, M] y)", "y = Expand(x, s)", opset=13)
    for size in (4, 1):
        check_gradients(net, {"x": _rand(rng, size), "s": np.array([3, 4])}, wrt=["x"],
                        ort=False)


def test_expand_before_opset_13_is_raised_to_the_opset_its_gradient_needs(rng):
    """Summing over axes picked at run time takes ReduceSum's axes input (opset 13): the
    gradient pass raises an opset 12 model to opset 13 (ConvertOpset, the pass contract)
    first. Checked against finite differences only: onnxruntime's own Expand_Grad fails
    on the opset 12 model at this broadcast ("cannot be reshaped")."""
    net = model(EXPAND, "y = Expand(x, s)", opset=12)
    check_gradients(net, {"x": _rand(rng, 1, 4), "s": np.array([2, 3, 4])}, wrt=["x"],
                    ort=False)


@pytest.mark.parametrize("a_batch, b_batch", [(1, 2), (2, 1), (2, 2)])
@pytest.mark.parametrize("product", ["MatMul", 'Einsum <equation = "...ij,...jk->...ik">'])
def test_products_sum_batch_axes_broadcast_at_run_time(rng, product, a_batch, b_batch):
    """Batch dims of different symbols: either operand may be the one broadcast (a
    gradient shaped like the product's batch would be wrong)."""
    net = model("(double[p, 3, 4] a, double[q, 4, 5] b) => (double[r, 3, 5] y)",
                f"y = {product} (a, b)", opset=17)
    check_gradients(net, {"a": _rand(rng, a_batch, 3, 4), "b": _rand(rng, b_batch, 4, 5)},
                    ort=False)


@pytest.mark.parametrize("x_shape, repeats", [((2, 3), [2, 1]), ((1, 3), [1, 1]), ((2, 1), [3, 4])])
def test_tile_over_repeats_computed_at_run_time(rng, x_shape, repeats):
    net = model("(double[a, b] x, int64[2] r) => (double[c, d] y)", "y = Tile(x, r)", opset=13)
    check_gradients(net, {"x": _rand(rng, *x_shape), "r": np.array(repeats)}, wrt=["x"],
                    ort=False)


# -- torch's exports of attention -------------------------------------------------------------

D_MODEL, HEADS, EXAMPLE_ROWS, EXAMPLE_LENGTH = 16, 2, 2, 4
MODULES = ["encoder", "encoder_norm_first", "attention", "attention_masked"]
EXPORTERS = ["legacy", pytest.param("dynamo", marks=pytest.mark.slow)]
AXES = {"batch": ("N",), "batch_and_sequence": ("N", "S")}


def _net(torch, module: str):
    """A torch module ending in a Linear head, every weight perturbed so that no two
    initializers are equal (the exporters would merge them: the encoder's layers are
    copies)."""
    nn = torch.nn

    class Encoder(nn.Module):
        def __init__(self, norm_first: bool) -> None:
            super().__init__()
            layer = nn.TransformerEncoderLayer(D_MODEL, HEADS, 2 * D_MODEL, dropout=0.0,
                                               batch_first=True, norm_first=norm_first)
            self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
            self.head = nn.Linear(D_MODEL, 1)

        def forward(self, x):
            return self.head(self.encoder(x)).mean(dim=1)

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attention = nn.MultiheadAttention(D_MODEL, HEADS, batch_first=True)
            self.head = nn.Linear(D_MODEL, 1)

        def forward(self, x, padding=None):
            y, _ = self.attention(x, x, x, key_padding_mask=padding, need_weights=False)
            return self.head(y).mean(dim=1)

    torch.manual_seed(0)
    net = Attention() if module.startswith("attention") else Encoder(module.endswith("first"))
    with torch.no_grad():
        for parameter in net.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.1)
    return net


def _inputs(module: str, rows: int, length: int, dtype=np.float64) -> dict[str, np.ndarray]:
    """Features (and a padding mask: the last ``row % 3`` positions of each row padded)."""
    rng = np.random.default_rng(rows * 100 + length)
    inputs = {"x": rng.normal(size=(rows, length, D_MODEL)).astype(dtype)}
    if module == "attention_masked":
        inputs["padding"] = np.arange(length)[None, :] >= length - np.arange(rows)[:, None] % 3
    return inputs


@functools.cache
def _exported(module: str, exporter: str, axes: str, dtype: str = "float32") -> onnx.ModelProto:
    """:func:`_net` in ``dtype`` exported with the ``axes`` of its inputs free: by the
    legacy exporter at opset 17, by the dynamo exporter at its own opset (one export per
    case, shared by the tests: read it, never change it)."""
    import torch

    net = _net(torch, module).to(getattr(torch, dtype))
    example = _inputs(module, EXAMPLE_ROWS, EXAMPLE_LENGTH, np.dtype(dtype))
    args = tuple(torch.from_numpy(v) for v in example.values())
    names, free = list(example), AXES[axes]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation warning
        if exporter == "legacy":
            buffer = io.BytesIO()
            torch.onnx.export(net, args, buffer, dynamo=False, opset_version=17,
                              input_names=names, output_names=["y"],
                              dynamic_axes={**{n: dict(enumerate(free)) for n in names},
                                            "y": {0: "N"}})
            return onnx.load_from_string(buffer.getvalue())
        dims = {a: torch.export.Dim(a, min=2) for a in free}
        program = torch.onnx.export(
            net, args, dynamo=True, input_names=names, output_names=["y"],
            dynamic_shapes=tuple({i: dims[a] for i, a in enumerate(free)} for _ in names),
            verbose=False)
        return program.model_proto


def _float64_export(module: str, exporter: str, axes: str) -> onnx.ModelProto:
    """The float64 export; torch's legacy exporter cannot export the masked attention in
    float64 (its attention mask must be float32 or bool): there, its float32 export made
    float64 (its constants are computed in the graph, so it is the same function)."""
    if exporter == "legacy" and module == "attention_masked":
        return to_float64(_exported(module, exporter, axes))
    return _exported(module, exporter, axes, "float64")


def _length(exporter: str, axes: str) -> int:
    """The sequence length the tests run: longer than the example's where the sequence
    axis is free, except for the legacy exporter, which writes the example's length into
    MultiheadAttention's Reshape targets (its model runs at that length only)."""
    free = axes == "batch_and_sequence" and exporter == "dynamo"
    return EXAMPLE_LENGTH + 2 if free else EXAMPLE_LENGTH


def _holders(exported: onnx.ModelProto, net) -> dict[str, tuple[str, bool]]:
    """Each torch parameter's initializer in the export, and whether it is stored
    transposed (the exporters fold a Linear's weight transpose into it), found by value."""
    initializers = {t.name: onnx.numpy_helper.to_array(t) for t in exported.graph.initializer}
    holders = {}
    for name, parameter in net.named_parameters():
        value = parameter.detach().numpy()
        found = [(key, False) for key, array in initializers.items()
                 if array.shape == value.shape and np.array_equal(array, value)]
        found += [(key, True) for key, array in initializers.items()
                  if value.ndim == 2 and array.shape == value.T.shape
                  and np.array_equal(array, value.T)]
        assert len(found) == 1, f"{name}: held by {found}"
        holders[name] = found[0]
    return holders


@pytest.mark.torch
@pytest.mark.parametrize("axes", list(AXES))
@pytest.mark.parametrize("exporter", EXPORTERS)
@pytest.mark.parametrize("module", MODULES)
def test_gradients_equal_torch_autograd_in_float64(module, exporter, axes):
    """The gradient of ``sum(y * R)`` with respect to every weight, at another batch size
    than the export's example (and, with a free sequence axis, another length)."""
    import torch

    net = _net(torch, module).double()
    exported = _float64_export(module, exporter, axes)
    inputs = _inputs(module, 3, _length(exporter, axes))
    holders = _holders(exported, net)
    with_loss = loss_model(exported, inputs)
    weights = [key for key, _ in holders.values()]
    graph = lossgraph.gradient(with_loss, weights=weights, loss_name="gradcheck_loss")
    grads = dict(zip(weights, create_session(graph).run([f"{w}_grad" for w in weights],
                                                        inputs)))

    y = net(*(torch.from_numpy(v) for v in inputs.values()))
    (y * torch.from_numpy(cotangent(tuple(y.shape), np.float64))).sum().backward()
    for name, parameter in net.named_parameters():
        key, transposed = holders[name]
        expected = parameter.grad.numpy()
        np.testing.assert_allclose(grads[key], expected.T if transposed else expected,
                                   rtol=1e-7, atol=1e-10, err_msg=f"d/d {name} ({key})")


@pytest.mark.torch
@pytest.mark.parametrize("axes", list(AXES))
@pytest.mark.parametrize("exporter", EXPORTERS)
@pytest.mark.parametrize("module", ["encoder", "encoder_norm_first", "attention"])
def test_sgd_steps_equal_torch_on_batches_of_differing_sizes(module, exporter, axes):
    """The export compiles and trains like torch.optim.SGD, step for step, on batches of
    8, 5 and 3 rows (and, with a free sequence axis, sequences longer than the example).

    The weights trained are the initializers holding torch's parameters: the dynamo
    exporter also stores constants as initializers (the attention's scale), which are
    not weights."""
    import torch

    net = _net(torch, module)
    X = _inputs(module, 16, _length(exporter, axes), np.float32)["x"]
    y = np.tanh(X[:, :, :2].sum(axis=(1, 2)))[:, None].astype(np.float32)
    exported = _exported(module, exporter, axes)
    weights = [key for key, _ in _holders(exported, net).values()]
    program = lossgraph.compile_program(exported, weights=weights, optimizer=SGD(0.1))
    trainer = lossgraph.Trainer(program)
    assert_sgd_steps_like_torch(trainer, net, 0.1, X, y, rows=(8, 5, 3))
