"""The speed rewrites of lossgraph.speed: each on a tiny graph, for structure and
numbers, and as the compiler and the Trainer apply them."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from conftest import GOLDEN_MODELS
from linear_data import LINEAR, linear_data
from models import model

import lossgraph
from lossgraph.errors import UnsupportedOptionError
from lossgraph.graphs import all_graphs, known_shapes
from lossgraph.optim import Adam, Momentum
from lossgraph.speed import (
    FoldStaticShapes,
    SpecializeBatch,
    SplitRowProducts,
    SumRowsByProduct,
    WidenScalarConstants,
)
from lossgraph.speed.split_row_products import gradient_product_parts, row_product_parts


def ops(graph: onnx.GraphProto) -> list[str]:
    return [node.op_type for node in graph.node]


def scan_body(graph: onnx.ModelProto) -> onnx.GraphProto:
    return next(n for n in graph.graph.node if n.op_type == "Scan").attribute[0].g


# -- WidenScalarConstants ---------------------------------------------------------------

SCALARS = """
    <ir_version: 8, opset_import: ["" : 18]>
    scalars (float[N, 1] column, float[N] row) => (float[N, 1] a, float[N] b, float[N, 1] c)
    <float two = {2.0}, float[1] three = {3.0}>
    {
        a = Mul(column, two)
        b = Mul(row, two)
        c = Add(three, column)
    }
"""


def test_scalar_constants_take_the_rank_of_what_they_broadcast_against(run_model):
    given = onnx.parser.parse_model(SCALARS)
    result = WidenScalarConstants()(given)
    assert result.changed
    shapes = {t.name: list(t.dims) for t in result.model.graph.initializer}
    a, b, c = result.model.graph.node
    assert shapes[a.input[1]] == [1, 1] and shapes[c.input[0]] == [1, 1]
    assert b.input[1] == "two"  # against a vector a scalar is fast: left alone
    feeds = {"column": np.arange(6, dtype=np.float32).reshape(6, 1),
             "row": np.arange(6, dtype=np.float32)}
    expected = run_model(given, feeds)
    for name, value in run_model(result.model, feeds).items():
        assert value.shape == expected[name].shape
        np.testing.assert_array_equal(value, expected[name], err_msg=name)


def test_widening_nothing_to_widen_says_it_changed_nothing():
    given = model("(float[N, 3] x) => (float[N, 3] y) <float[1, 3] k = {1, 2, 3}>",
                  "y = Mul(x, k)")
    result = WidenScalarConstants()(given)
    assert not result.changed
    assert result.model.graph.node[0].input[1] == "k"


def test_compiled_epoch_graphs_have_their_scalars_widened_in_the_scan():
    program = lossgraph.compile_program(onnx.parser.parse_model(LINEAR), optimizer=Momentum(0.05),
                                fuse="epoch")
    body = scan_body(program.graphs["train_epoch_ordered"])  # compile widens every graph
    assert any(t.name.endswith("_rank2") and list(t.dims) == [1, 1] for t in body.initializer)


# -- FoldStaticShapes ---------------------------------------------------------------------

def test_shapes_of_static_values_fold_to_constants_until_nothing_changes(run_model):
    given = model("(float[4, 3] x) => (float[4, 3] y, int64 n, int64[1] last)",
                  """s = Shape(x)
                     n = Size(x)
                     last = Shape <start = -1> (x)
                     e = Expand(x, s)
                     y = Reshape(e, s)""")
    result = FoldStaticShapes()(given)
    assert result.changed
    assert ops(result.model.graph) == ["Constant", "Constant", "Constant", "Expand", "Identity"]
    x = np.arange(12, dtype=np.float32).reshape(4, 3)
    expected = run_model(given, {"x": x})
    for name, value in run_model(result.model, {"x": x}).items():
        np.testing.assert_array_equal(value, expected[name], err_msg=name)
    assert not FoldStaticShapes()(result.model).changed


def test_shapes_of_a_symbolic_batch_are_left_to_run_time():
    given = model("(float[N, 3] x) => (int64[2] s)", "s = Shape(x)")
    result = FoldStaticShapes()(given)
    assert not result.changed and ops(result.model.graph) == ["Shape"]


# -- SplitRowProducts ------------------------------------------------------------------------

@pytest.mark.parametrize("rows, parts", [(1000, 4), (2000, 8), (1009, None), (500, None),
                                         (100, None)])
def test_row_product_parts_are_the_most_that_keep_250_rows_each(rows, parts):
    assert row_product_parts(rows) == parts


@pytest.mark.parametrize("rows, parts", [(1000, 4), (500, None)])
def test_a_long_one_row_product_is_a_sum_of_batched_parts(run_model, rows, parts):
    given = model(f"(float[1, {rows}] row, float[{rows}, 3] m) => (float[1, 3] y)",
                  "y = MatMul(row, m)")
    result = SplitRowProducts()(given)
    assert result.changed == bool(parts)
    if parts:
        assert ops(result.model.graph) == ["Reshape", "Reshape", "MatMul", "ReduceSum"]
        shapes = [onnx.numpy_helper.to_array(t).tolist() for t in result.model.graph.initializer]
        assert [parts, 1, rows // parts] in shapes and [parts, rows // parts, 3] in shapes
    rng = np.random.default_rng(0)
    feeds = {"row": rng.normal(size=(1, rows)).astype(np.float32),
             "m": rng.normal(size=(rows, 3)).astype(np.float32)}
    np.testing.assert_allclose(run_model(result.model, feeds)["y"], feeds["row"] @ feeds["m"],
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows, parts", [(10000, 4), (5000, 2), (7500, 3), (20000, 4),
                                         (4999, None), (1000, None), (100, None)])
def test_gradient_product_parts_keep_2500_rows_each_at_most_4(rows, parts):
    assert gradient_product_parts(rows) == parts


@pytest.mark.parametrize("rows, attributes, parts", [
    (5000, "transA = 1", 2), (10000, "transA = 1, transB = 0, alpha = 1.0", 4),
    (5000, "transA = 1, alpha = 2.0", None), (1000, "transA = 1", None)])
def test_a_long_weight_gradient_product_is_a_sum_of_batched_parts(run_model, rows, attributes,
                                                                  parts):
    given = model(f"(float[{rows}, 5] a, float[{rows}, 3] b) => (float[5, 3] y)",
                  f"y = Gemm <{attributes}> (a, b)")
    result = SplitRowProducts()(given)
    assert result.changed == bool(parts)
    if parts:
        assert ops(result.model.graph) == ["Reshape", "Transpose", "Reshape", "MatMul",
                                           "ReduceSum"]
    rng = np.random.default_rng(0)
    feeds = {"a": rng.normal(size=(rows, 5)).astype(np.float32),
             "b": rng.normal(size=(rows, 3)).astype(np.float32)}
    alpha = 2.0 if "alpha = 2.0" in attributes else 1.0
    np.testing.assert_allclose(run_model(result.model, feeds)["y"],
                               alpha * feeds["a"].T @ feeds["b"], rtol=1e-4, atol=1e-4)


def test_a_row_of_ones_from_a_constant_shape_is_split_too(run_model):
    """SumRowsByProduct's ``ones`` comes from ConstantOfShape(Concat(...)): its shape is
    known only by propagating the constant's value."""
    given = model("(float[1000, 3] m) => (float[1, 3] y) <int64[1] one = {1}, "
                  "int64[1] n = {1000}>",
                  """shape = Concat <axis = 0> (one, n)
                     ones = ConstantOfShape <value = float[1] {1.0}> (shape)
                     y = MatMul(ones, m)""")
    result = SplitRowProducts()(given)
    assert result.changed and "ReduceSum" in ops(result.model.graph)
    m = np.random.default_rng(0).normal(size=(1000, 3)).astype(np.float32)
    np.testing.assert_allclose(run_model(result.model, {"m": m})["y"], m.sum(0, keepdims=True),
                               rtol=1e-4, atol=1e-4)


# -- SumRowsByProduct ------------------------------------------------------------------------

def sum_model(x_type: str, axes: str, target: str, out_type: str, *, keepdims: int = 0,
              opset: int = 18) -> onnx.ModelProto:
    """``y = Reshape(ReduceSum(x, axes, keepdims), target)``: the sum a bias gradient is."""
    return model(f"({x_type} x) => ({out_type} y) <int64[{axes.count(',') + 1}] axes = {{{axes}}},"
                 f" int64[{target.count(',') + 1 if target else 0}] target = {{{target}}}>",
                 f"""t = ReduceSum <keepdims = {keepdims}> (x, axes)
                     y = Reshape(t, target)""", opset=opset)


@pytest.mark.parametrize("x_shape, axes, target, expected_ops", [
    ((7, 3), "0", "3", ["Shape", "Concat", "ConstantOfShape", "MatMul", "Reshape"]),
    ((7, 3), "0", "1, 3", ["Shape", "Concat", "ConstantOfShape", "MatMul"]),
    ((7, 5, 2), "0, 1", "2", ["Reshape", "Shape", "ReduceProd", "Concat", "ConstantOfShape",
                              "MatMul", "Reshape"]),
    ((7, 4, 3), "0", "4, 3", ["Reshape", "Shape", "Concat", "ConstantOfShape", "MatMul",
                              "Reshape"]),
    ((7, 1), "0", "1", ["ReduceSum", "Reshape"]),
    ((7,), "0", "", ["ReduceSum"]),
])
def test_a_sum_over_leading_axes_becomes_a_product_with_a_row_of_ones(run_model, x_shape, axes,
                                                                       target, expected_ops):
    x_type = f"float[N, {', '.join(map(str, x_shape[1:]))}]" if len(x_shape) > 1 else "float[N]"
    out_type = f"float[{target}]" if target else "float"
    given = sum_model(x_type, axes, target, out_type)
    result = SumRowsByProduct()(given)
    assert result.changed
    assert ops(result.model.graph) == expected_ops
    assert {t.name for t in result.model.graph.initializer}.isdisjoint({"axes", "target"})
    x = np.random.default_rng(1).normal(size=x_shape).astype(np.float32)
    got = run_model(result.model, {"x": x})["y"]
    leading = len(axes.split(","))
    want = x.sum(axis=tuple(range(leading))).reshape([int(d) for d in target.split(",")]
                                                     if target else [])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_the_product_computes_bit_for_bit_what_ones_times_rows_does(run_model):
    """The rewrite is exactly the bias-sum form: a row of ones times the rows."""
    rewritten = SumRowsByProduct()(sum_model("float[N, 3]", "0", "3", "float[3]")).model
    by_hand = model("(float[N, 3] x) => (float[3] y) <int64[1] one = {1}, int64[1] three = {3}>",
                    """n = Shape <start = 0, end = 1> (x)
                       size = Concat <axis = 0> (one, n)
                       ones = ConstantOfShape <value = float[1] {1}> (size)
                       total = MatMul(ones, x)
                       y = Reshape(total, three)""")
    x = np.random.default_rng(2).normal(size=(1000, 3)).astype(np.float32)
    np.testing.assert_array_equal(run_model(rewritten, {"x": x})["y"],
                                  run_model(by_hand, {"x": x})["y"])


def test_sums_of_rows_of_the_same_batch_share_their_row_of_ones():
    given = model("(float[N, 3] x, float[N, 2] z) => (float[3] a, float[2] b) "
                  "<int64[1] axes = {0}, int64[1] three = {3}, int64[1] two = {2}>",
                  """s = ReduceSum <keepdims = 0> (x, axes)
                     a = Reshape(s, three)
                     t = ReduceSum <keepdims = 0> (z, axes)
                     b = Reshape(t, two)""")
    rewritten = SumRowsByProduct()(given).model
    assert ops(rewritten.graph).count("ConstantOfShape") == 1
    assert ops(rewritten.graph).count("MatMul") == 2


@pytest.mark.parametrize("why, signature, body", [
    ("keepdims=1", "(float[N, 3] x) => (float[3] y)",
     "t = ReduceSum <keepdims = 1> (x, axes)\n y = Reshape(t, target)"),
    ("not the leading axes", "(float[N, 3] x) => (float[N] y)",
     "t = ReduceSum <keepdims = 0> (x, last)\n y = Reshape(t, rows)"),
    ("no Reshape after it", "(float[N, 3] x) => (float[3] y)",
     "y = ReduceSum <keepdims = 0> (x, axes)"),
    ("read twice", "(float[N, 3] x) => (float[3] y, float[3] t)",
     "t = ReduceSum <keepdims = 0> (x, axes)\n y = Reshape(t, target)"),
    ("shape computed at run time", "(float[N, 3] x, int64[1] shape) => (float[3] y)",
     "t = ReduceSum <keepdims = 0> (x, axes)\n y = Reshape(t, shape)"),
    ("a -1 in the shape", "(float[N, 3] x) => (float[3] y)",
     "t = ReduceSum <keepdims = 0> (x, axes)\n y = Reshape(t, any)"),
    ("integers", "(int64[N, 3] x) => (int64[3] y)",
     "t = ReduceSum <keepdims = 0> (x, axes)\n y = Reshape(t, target)"),
])
def test_other_sums_are_left_as_they_are(why, signature, body):
    given = model(f"{signature} <int64[1] axes = {{0}}, int64[1] last = {{1}}, "
                  "int64[1] target = {3}, int64[1] rows = {-1}, int64[1] any = {-1}>", body)
    result = SumRowsByProduct()(given)
    assert not result.changed, why
    assert ops(result.model.graph) == ops(given.graph)


@pytest.mark.parametrize("outputs, fast_ops", [
    (3, ["Shape", "Concat", "ConstantOfShape", "MatMul", "Reshape"]),
    (1, ["ReduceSum", "Reshape"]),  # one column: summed whole
])
def test_a_bias_gradient_is_a_plain_sum_until_the_pass_rewrites_it(run_model, outputs,
                                                                   fast_ops):
    """The rule emits the mathematics, ``Reshape(ReduceSum(dy, axes=0), b's shape)``;
    the pass turns it into the form onnxruntime runs fastest, which compile applies."""
    w = ", ".join(str(v) for v in range(4 * outputs))
    b = ", ".join(str(v / 10) for v in range(outputs))
    given = model(f"(float[N, 4] x) => (float[N, {outputs}] y) "
                  f"<float[4, {outputs}] w = {{{w}}}, float[{outputs}] b = {{{b}}}>",
                  "h = MatMul(x, w)\n y = Add(h, b)")
    plain = lossgraph.gradient(given, outputs=["y"], weights=["b"])
    assert ops(plain.graph) == ["MatMul", "Add", "ReduceSum", "Reshape"]
    reduce_sum = plain.graph.node[2]
    assert reduce_sum.input[0] == "y_grad"
    assert onnx.helper.get_attribute_value(reduce_sum.attribute[0]) == 0  # keepdims
    fast = SumRowsByProduct()(plain).model
    assert ops(fast.graph) == ["MatMul", "Add", *fast_ops]
    rng = np.random.default_rng(3)
    feeds = {"x": rng.normal(size=(50, 4)).astype(np.float32),
             "y_grad": rng.normal(size=(50, outputs)).astype(np.float32)}
    np.testing.assert_allclose(run_model(fast, feeds)["b_grad"], feeds["y_grad"].sum(axis=0),
                               rtol=1e-5, atol=1e-5)
    compiled = lossgraph.compile_program(given, optimizer=Momentum(0.1)).graphs["train_step"]
    assert ("ConstantOfShape" in ops(compiled.graph)) == (outputs > 1)  # compile runs the pass


# -- SpecializeBatch ---------------------------------------------------------------------------

def _epoch_feeds(program, graph, X, y, batch, batches, sample_weight=None):
    rows = batch * batches
    data = {"x": X[:rows], "label": y[:rows].reshape(-1, 1)}
    if sample_weight is not None:
        data["w"] = sample_weight[:rows]
    feeds = {**data, **program.state}
    feeds[program.io(graph, "learning_rates")[0]] = np.full(batches, 0.05, np.float32)
    feeds[program.io(graph, "step")[0]] = np.array(1, np.int64)
    return feeds


@pytest.mark.parametrize("weighted", [False, True])
def test_specialized_epoch_has_no_shape_arithmetic_and_computes_the_same(run_model, weighted):
    X, y = linear_data(120, seed=3)
    weights = np.linspace(0.5, 1.5, 120, dtype=np.float32) if weighted else None
    program = lossgraph.compile_program(onnx.parser.parse_model(LINEAR), optimizer=Adam(0.05),
                                loss_options={"weight_name": "w"} if weighted else None,
                                fuse="epoch")
    general = program.graphs["train_epoch_ordered"]
    result = SpecializeBatch(20)(general)
    assert result.changed
    assert not [n for n in scan_body(result.model).node if n.op_type in ("Shape", "Size")]
    assert any(n.op_type in ("Shape", "Size") for n in scan_body(general).node)  # untouched
    feeds = _epoch_feeds(program, "train_epoch_ordered", X, y, 20, 6, weights)
    expected = run_model(general, feeds)
    for name, value in run_model(result.model, feeds).items():
        np.testing.assert_array_equal(value, expected[name], err_msg=name)


def test_specialization_is_a_pipeline_of_the_rewrites():
    assert str(SpecializeBatch(16)) == "SpecializeBatch(batch=16)"
    with pytest.raises(UnsupportedOptionError, match="batch size must be an int >= 1"):
        SpecializeBatch(0)


def test_a_trainer_switching_batch_sizes_equals_step_by_step_training():
    X, y = linear_data(100, seed=4)
    states = []
    for mode in ("step", "epoch"):
        program = lossgraph.compile_program(onnx.parser.parse_model(LINEAR),
                                    optimizer=Momentum(0.02, momentum=0.9), fuse=mode)
        trainer = lossgraph.Trainer(program)
        for batch in (32, 10, 32):  # a new batch size replaces the specialized session
            trainer.fit(X, y, epochs=1, batch_size=batch, shuffle=True, random_state=batch,
                        progress=False, warm_start=True)
        states.append(trainer.state)
    for name, value in states[0].items():
        np.testing.assert_allclose(states[1][name], value, rtol=1e-6, atol=1e-7, err_msg=name)


def test_a_reshape_to_the_shape_a_value_already_has_becomes_identity(run_model):
    given = onnx.parser.parse_model("""
        <ir_version: 8, opset_import: ["" : 18]>
        reshaped (float[N, 4] x) => (float[N, 1] y)
        <float[4, 1] coef = {0.1, -0.2, 0.3, 0.0}, float[1] intercept = {0.5},
         int64[2] column = {-1, 1}>
        {
            h = MatMul(x, coef)
            t = Add(h, intercept)
            y = Reshape(t, column)
        }
    """)
    program = lossgraph.compile_program(given, optimizer=Momentum(0.05), fuse="epoch")
    specialized = SpecializeBatch(10)(program.graphs["train_epoch_ordered"]).model
    (forward,) = [n for n in scan_body(specialized).node if n.input and n.input[0] == "t_in_step"]
    assert forward.op_type == "Identity"
    X, y = linear_data(40, seed=5)
    feeds = _epoch_feeds(program, "train_epoch_ordered", X, y, 10, 4)
    expected = run_model(program.graphs["train_epoch_ordered"], feeds)
    for name, value in run_model(specialized, feeds).items():
        np.testing.assert_array_equal(value, expected[name], err_msg=name)


def test_specialized_step_graph_folds_its_shapes_and_computes_the_same(run_model):
    program = lossgraph.compile_program(onnx.parser.parse_model(LINEAR), optimizer=Adam(0.05),
                                fuse="step")
    general = program.graphs["train_step"]
    specialized = SpecializeBatch(16)(general).model
    assert [i.type.tensor_type.shape.dim[0].dim_value for i in specialized.graph.input
            if i.name in ("x", "label")] == [16, 16]
    assert any(n.op_type in ("Shape", "Size") for n in general.graph.node)
    assert not [n for n in specialized.graph.node if n.op_type in ("Shape", "Size")]
    X, y = linear_data(16, seed=6)
    feeds = {"x": X, "label": y.reshape(-1, 1), **program.state,
             program.io("train_step", "learning_rate")[0]: np.array(0.05, np.float32),
             program.io("train_step", "step")[0]: np.array(1, np.int64)}
    expected = run_model(general, feeds)
    for name, value in run_model(specialized, feeds).items():
        np.testing.assert_array_equal(value, expected[name], err_msg=name)


def test_a_long_batch_splits_the_weight_gradients_and_computes_the_same(run_model):
    """At 5000 rows the hidden layer's ``x^T @ dz`` and its bias gradient's row of ones are
    split across threads (SplitRowProducts); the step's numbers stay the general graph's to
    float rounding."""
    program = lossgraph.compile_program(onnx.load(GOLDEN_MODELS / "skl_mlp_regressor.onnx"),
                                        optimizer=Adam(0.05), fuse="step")
    general = program.graphs["train_step"]
    specialized = SpecializeBatch(5000)(general).model
    splits = {n.name.split("/split/")[0] for n in specialized.graph.node if "/split/" in n.name}
    assert len(splits) == 3  # x^T dz, the bias gradient's ones @ dz, and h^T g (one column)
    rng = np.random.default_rng(7)
    X = rng.normal(size=(5000, 5)).astype(np.float32)
    feeds = {"X": X, "label": rng.normal(size=(5000, 1)).astype(np.float32), **program.state,
             program.io("train_step", "learning_rate")[0]: np.array(0.05, np.float32),
             program.io("train_step", "step")[0]: np.array(1, np.int64)}
    expected = run_model(general, feeds)
    for name, value in run_model(specialized, feeds).items():
        np.testing.assert_allclose(value, expected[name], rtol=1e-5, atol=1e-6, err_msg=name)


def test_a_step_graph_for_current_onnxruntime_alone_specializes_too():
    newer = LINEAR.replace('"" : 18', '"" : 23')
    program = lossgraph.compile_program(onnx.parser.parse_model(newer), target="onnxruntime",
                                optimizer=Momentum(0.05))
    specialized = SpecializeBatch(16)(program.graphs["train_step"]).model
    assert specialized.opset_import[0].version == 23


def test_only_full_batches_of_an_array_fit_run_a_specialized_step_graph():
    X, y = linear_data(100, seed=7)
    program = lossgraph.compile_program(onnx.parser.parse_model(LINEAR), optimizer=Momentum(0.02),
                                fuse="step")
    trainer = lossgraph.Trainer(program)
    trainer.fit(X, y, epochs=1, batch_size=32, shuffle=False, progress=False)
    specialized = [("train_step", 32), ("train_step", None)]
    assert sorted(trainer.engine.open_sessions, key=str) == specialized
    streamed = [(X[a:b], y[a:b]) for a, b in [(0, 7), (7, 30), (30, 100)]]
    trainer.fit(streamed, epochs=2, progress=False, warm_start=True)  # no session per size
    assert sorted(trainer.engine.open_sessions, key=str) == specialized


@pytest.mark.parametrize("batch, parts", [(1000, 4), (2000, 8), (1009, None), (500, None)])
def test_a_long_one_row_product_of_a_specialized_epoch_is_split(run_model, batch, parts):
    """The weight gradient of a one-output layer, ``row[1, batch] @ x[batch, 4]``, runs as
    ``parts`` products of ``batch / parts`` rows summed (onnxruntime threads those), when
    the batch is long enough and divides into parts of at least 250 rows."""
    program = lossgraph.compile_program(onnx.parser.parse_model(LINEAR),
                                optimizer=Momentum(0.02, momentum=0.9), fuse="epoch")
    general = program.graphs["train_epoch_ordered"]
    specialized = SpecializeBatch(batch)(general).model
    body = scan_body(specialized)
    shapes = [onnx.numpy_helper.to_array(i).tolist() for i in body.initializer]
    split = [s for s in shapes if isinstance(s, list) and len(s) == 3 and s[1] == 1]
    assert split == ([[parts, 1, batch // parts]] if parts else [])
    X, y = linear_data(2 * batch, seed=8)
    feeds = _epoch_feeds(program, "train_epoch_ordered", X, y, batch, 2)
    expected = run_model(general, feeds)
    for name, value in run_model(specialized, feeds).items():
        np.testing.assert_allclose(value, expected[name], rtol=1e-5, atol=1e-6, err_msg=name)


def test_specializing_a_named_batch_fixes_it_in_the_outputs_too():
    """A dimension name stands for one size in the whole graph: the outputs that carry the
    inputs' batch name get the batch size, the others keep theirs."""
    model = onnx.parser.parse_model("""<ir_version: 8, opset_import: ["" : 18]>
        g (float[N, 3] x, float[M, 3] z) => (float[N, 3] y, float[M, 3] w, float[K] k)
        { y = Relu(x)  w = Relu(z)  k = Shape(x) }""")
    model.graph.output[2].type.tensor_type.elem_type = onnx.TensorProto.INT64
    special = SpecializeBatch(4)(model).model
    dims = {o.name: [d.dim_value or d.dim_param for d in o.type.tensor_type.shape.dim]
            for o in special.graph.output}
    assert dims == {"y": [4, 3], "w": [4, 3], "k": ["K"]}


def test_a_scalar_read_only_in_its_wide_form_is_not_left_behind():
    """onnxruntime warns of initializers no node reads: widening leaves none."""
    from lossgraph.graphs import all_graphs, values_read

    model = onnx.load(GOLDEN_MODELS / "skl_mlp_regressor.onnx")
    for fuse in ("step", "epoch", "separate"):
        program = lossgraph.compile_program(model, fuse=fuse)
        for name, graph in program.graphs.items():
            read = values_read(graph.graph)
            for body in all_graphs(graph.graph):
                unread = [t.name for t in body.initializer if t.name not in read]
                assert not unread, (fuse, name, unread)


def test_a_scan_of_the_model_itself_is_not_taken_for_the_epoch_scan():
    """Only the epoch graph's Scan (its signature names the learning rates it scans) gets
    the batch size on its scanned inputs; a step graph holding a Scan of its own (a
    recurrent layer's) is specialized on its data inputs."""
    body = onnx.helper.make_graph(
        [onnx.helper.make_node("Add", ["s", "e"], ["s_new"]),
         onnx.helper.make_node("Identity", ["s_new"], ["o"])], "body",
        [onnx.helper.make_tensor_value_info("s", onnx.TensorProto.FLOAT, ["B", 3]),
         onnx.helper.make_tensor_value_info("e", onnx.TensorProto.FLOAT, ["B", 3])],
        [onnx.helper.make_tensor_value_info("s_new", onnx.TensorProto.FLOAT, ["B", 3]),
         onnx.helper.make_tensor_value_info("o", onnx.TensorProto.FLOAT, ["B", 3])])
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("Scan", ["s0", "x"], ["s", "ys"], body=body,
                               num_scan_inputs=1)], "g",
        [onnx.helper.make_tensor_value_info("s0", onnx.TensorProto.FLOAT, ["B", 3]),
         onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["T", "B", 3])],
        [onnx.helper.make_tensor_value_info("s", onnx.TensorProto.FLOAT, ["B", 3]),
         onnx.helper.make_tensor_value_info("ys", onnx.TensorProto.FLOAT, ["T", "B", 3])])
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 18)])
    model.ir_version = 8
    special = SpecializeBatch(5)(model).model
    dims = [[d.dim_value or d.dim_param for d in i.type.tensor_type.shape.dim]
            for i in special.graph.input]
    assert dims == [[5, 3], [5, "B", 3]]  # the graph's own inputs, not the body's
    body_dims = [[d.dim_value or d.dim_param for d in i.type.tensor_type.shape.dim]
                 for i in special.graph.node[0].attribute[0].g.input]
    assert body_dims == [["B", 3], ["B", 3]]


# -- shape inference with data propagation, the packed weights kept out ---------------------

def _wide_program(fuse: str = "epoch") -> lossgraph.TrainingProgram:
    """A layer of 80 x 64 weights, then one output: its epoch graph packs 5,249 values,
    more than LONG_VECTOR."""
    rng = np.random.default_rng(0)
    weights = {"w1": (80, 64), "b1": (64,), "w2": (64, 1)}
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("MatMul", ["x", "w1"], ["h"]),
         onnx.helper.make_node("Add", ["h", "b1"], ["a"]),
         onnx.helper.make_node("Relu", ["a"], ["r"]),
         onnx.helper.make_node("MatMul", ["r", "w2"], ["y"])], "wide",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["N", 80])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["N", 1])],
        [onnx.numpy_helper.from_array(rng.normal(size=shape).astype(np.float32) * 0.1, name)
         for name, shape in weights.items()])
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 18)],
                                   ir_version=8)
    return lossgraph.compile_program(model, optimizer=Adam(0.01), fuse=fuse)


def _types(model: onnx.ModelProto) -> list[dict[str, bytes]]:
    """The declared type of every value, by graph (subgraphs included)."""
    return [{v.name: v.type.SerializeToString() for v in (*g.value_info, *g.input, *g.output)}
            for g in all_graphs(model.graph)]


def _nodes(model: onnx.ModelProto) -> list[tuple]:
    """Every node of every graph: op, inputs, outputs, attributes but graphs."""
    return [(n.op_type, tuple(n.input), tuple(n.output),
             tuple(a.SerializeToString() for a in n.attribute if not a.g.node))
            for g in all_graphs(model.graph) for n in g.node]


#: onnx's data propagation costs in proportion to a static 1-D tensor's length from here
#: (lossgraph.graphs.LONG_VECTOR)
LONG = 4096


def _recording_data_propagation(monkeypatch) -> list[onnx.ModelProto]:
    """The models onnx's shape inference with data propagation is called on, from now."""
    seen: list[onnx.ModelProto] = []
    real = onnx.shape_inference.infer_shapes

    def recording(model, *args, **kwargs):
        if kwargs.get("data_prop"):
            seen.append(model)
        return real(model, *args, **kwargs)

    monkeypatch.setattr(onnx.shape_inference, "infer_shapes", recording)
    return seen


def _long_vectors(models: list[onnx.ModelProto]) -> list[str]:
    """The outputs of nodes (not Constants) of ``models`` that are 1-D of LONG values or more."""
    found = []
    for given in models:
        plain = onnx.shape_inference.infer_shapes(given)
        for graph, shaped in zip(all_graphs(given.graph), all_graphs(plain.graph)):
            shapes = known_shapes(shaped)
            found += [n.output[0] for n in graph.node if n.op_type != "Constant"
                      and len(n.output) == 1 and len(shapes.get(n.output[0]) or []) == 1
                      and (shapes[n.output[0]][0] or 0) >= LONG]
    return found


def test_specializing_never_propagates_data_through_the_packed_weights(monkeypatch):
    """onnx's data propagation holds every static 1-D tensor element by element: on
    ResNet-18's epoch graph (11 million packed weights) each of SpecializeBatch's three
    calls took 5 s, against 0.01 s on its step graph. The packing and the update of the
    packed vectors never reach it."""
    epoch = _wide_program().graphs["train_epoch"]
    seen = _recording_data_propagation(monkeypatch)
    SpecializeBatch(8)(epoch)
    monkeypatch.undo()
    assert seen and not _long_vectors(seen), _long_vectors(seen)


def test_shape_inference_with_data_gives_onnxs_types_and_the_models_nodes():
    from lossgraph.graphs import LONG_VECTOR, infer_shapes_with_data

    assert LONG_VECTOR == LONG
    epoch = _wide_program().graphs["train_epoch"]
    inferred = infer_shapes_with_data(epoch)
    assert _types(inferred) == _types(onnx.shape_inference.infer_shapes(epoch, data_prop=True))
    assert _nodes(inferred) == _nodes(epoch)


@pytest.mark.parametrize("graph", ["train_step", "train_epoch", "train_epoch_ordered"])
@pytest.mark.parametrize("batch", [8, 3000])
def test_specializing_without_the_long_vectors_gives_the_same_graph(monkeypatch, graph, batch):
    """SpecializeBatch folds and splits exactly what onnx's own data propagation over the
    packed vectors lets it fold and split, byte for byte."""
    import lossgraph.speed.scopes as scopes

    general = _wide_program().graphs[graph]
    fast = SpecializeBatch(batch)(general).model
    monkeypatch.setattr(scopes, "infer_shapes_with_data",
                        lambda m: onnx.shape_inference.infer_shapes(m, data_prop=True))
    assert fast.SerializeToString() == SpecializeBatch(batch)(general).model.SerializeToString()


def test_a_vector_whose_length_only_data_propagation_finds_is_kept_out_too(monkeypatch):
    """A packed gradient can hold a part whose length only data propagation finds (a
    depthwise convolution's weight gradient, computed from shapes): its Concat, and what is
    computed from it, stand first as vectors of unknown length, then of the length onnx's
    inference of the node gives; the types are onnx's all the same."""
    from lossgraph.graphs import infer_shapes_with_data

    model = onnx.parser.parse_model("""<ir_version: 8, opset_import: ["" : 18]>
        g (float[N, 4] x, float[5000] v) => (float[M] y) {
            s = Shape(x)  i = Constant <value = int64[1] {1}> ()  n = Gather(s, i)
            t = ConstantOfShape <value = float[1] {1}> (n)
            c = Concat <axis = 0> (v, t)  y = Mul(c, c) }""")
    plain = {v.name: v.type for v in onnx.shape_inference.infer_shapes(model).graph.value_info}
    assert not plain["c"].tensor_type.shape.dim[0].HasField("dim_value")  # the case
    expected = onnx.shape_inference.infer_shapes(model, data_prop=True)
    seen = _recording_data_propagation(monkeypatch)
    inferred = infer_shapes_with_data(model)
    monkeypatch.undo()
    assert _types(inferred) == _types(expected)
    assert {v.name: v.type.tensor_type.shape.dim[0].dim_value
            for v in (*inferred.graph.value_info, *inferred.graph.output)
            if v.name in "cty"} == {"t": 4, "c": 5004, "y": 5004}
    assert _nodes(inferred) == _nodes(model)
    assert len(seen) == 2 and not _long_vectors(seen)
