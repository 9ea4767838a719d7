"""Gradients through the control-flow ops (lossgraph/autodiff/rules/control.py).

If: both branches, captured values, nesting.

Scan and Loop: each body is differentiated by the walker, and the loop is run backwards by a
reverse Scan that recomputes every step from the states the forward recorded: checked in
float64 against central finite differences (states, scan inputs and outputs in both
directions and on other axes, weights the body captures, a nested If, a nested Scan;
Loops with a fixed trip count, ended by their condition, running no iteration, with scan
outputs and without states), and end to end: an exported nn.EmbeddingBag (a Loop)
trained by Trainer moves like torch.optim.SGD, step for step.

The Scan and Loop models give each state its own body output: onnxruntime's Scan (1.19 and
1.32) computes wrong values when its body returns a state input as is
(``=> (..., s_in, ...)``).
"""

from __future__ import annotations

import io
import warnings

import numpy as np
import onnx
import onnx.numpy_helper
import pytest
from support.gradcheck import check_gradients
from support.torch_steps import assert_sgd_steps_like_torch

import lossgraph
from lossgraph import gradient
from lossgraph.errors import UnsupportedModelError

# ------------------------------------------------------------------------------ If
TWO_BRANCHES = """
    <ir_version: 8, opset_import: ["" : 18]>
    g (double[3, 4] x, double[4] w, double[4] v, bool c) => (double[3, 4] y) {
        t = Mul(x, w)
        y = If(c) <
            then_branch = g1 () => (double[3, 4] a) {
                s = Tanh(t)
                a = Mul(s, v)
            },
            else_branch = g2 () => (double[3, 4] b) { b = Sub(t, x) }
        >
    }
"""


@pytest.fixture
def values(rng):
    return {"x": rng.normal(size=(3, 4)), "w": rng.normal(size=(4,)),
            "v": rng.normal(size=(4,))}


@pytest.mark.parametrize("flag", [True, False])
def test_if_gradient_follows_the_branch_taken(values, flag):
    grads = check_gradients(TWO_BRANCHES, {**values, "c": np.array(flag)}, wrt=["x", "w", "v"])
    if not flag:  # v is only used by the then-branch
        np.testing.assert_array_equal(grads["v"], np.zeros(4))


@pytest.mark.parametrize("outer, inner", [(True, True), (True, False), (False, True)])
def test_nested_if_gradients(rng, outer, inner):
    check_gradients("""
        <ir_version: 8, opset_import: ["" : 18]>
        g (double[2, 3] x, double[3] w, bool c, bool d) => (double[2, 3] y) {
            y = If(c) <
                then_branch = g1 () => (double[2, 3] a) {
                    a = If(d) <
                        then_branch = h1 () => (double[2, 3] p) { p = Mul(x, w) },
                        else_branch = h2 () => (double[2, 3] q) {
                            e = Exp(w)
                            q = Add(x, e)
                        }
                    >
                },
                else_branch = g2 () => (double[2, 3] b) { b = Sin(x) }
            >
        }
    """, {"x": rng.normal(size=(2, 3)), "w": rng.normal(size=(3,)),
          "c": np.array(outer), "d": np.array(inner)}, wrt=["x", "w"])


def test_if_with_two_outputs_one_unused(rng):
    check_gradients("""
        <ir_version: 8, opset_import: ["" : 18]>
        g (double[5] x, double[5] w, bool c) => (double[5] y) {
            y, z = If(c) <
                then_branch = g1 () => (double[5] a, double[5] b) {
                    a = Mul(x, w)
                    b = Neg(w)
                },
                else_branch = g2 () => (double[5] a2, double[5] b2) {
                    a2 = Div(x, w)
                    b2 = Identity(x)
                }
            >
        }
    """, {"x": rng.normal(size=5), "w": rng.uniform(1, 2, size=5), "c": np.array(False)},
        wrt=["x", "w"])


def test_weights_captured_by_branches_are_trained_by_default(run_model, rng):
    model = onnx.parser.parse_model("""
        <ir_version: 8, opset_import: ["" : 18]>
        g (float[N, 2] x, bool c) => (float loss)
        <float[2] a = {1, 2}>
        {
            y = If(c) <
                then_branch = g1 () => (float[N, 2] t) { t = Mul(x, a) },
                else_branch = g2 () => (float[N, 2] e) { e = Identity(x) }
            >
            loss = ReduceSum <keepdims = 0> (y)
        }
    """)
    result = gradient(model)
    x = rng.normal(size=(3, 2)).astype(np.float32)
    taken = run_model(result, {"x": x, "c": np.array(True)})["a_grad"]
    skipped = run_model(result, {"x": x, "c": np.array(False)})["a_grad"]
    np.testing.assert_allclose(taken, x.sum(axis=0), rtol=1e-6)
    np.testing.assert_array_equal(skipped, np.zeros(2, np.float32))


# ---------------------------------------------------------------------------- Scan
HEADER = '<ir_version: 8, opset_import: ["" : 17]>'


# h_t = tanh(h_{t-1} W + x_t), y_t = h_t * v: an RNN cell that captures W and v
RNN_SCAN = HEADER + """
    g (double[2, 3] h0, double[4, 2, 3] x, double[3, 3] W, double[3] v)
        => (double[2, 3] h, double[4, 2, 3] y) {
        h, y = Scan <num_scan_inputs: int = 1, body = step (double[2, 3] h_in, double[2, 3] x_t)
                                                     => (double[2, 3] h_out, double[2, 3] y_t) {
            p = MatMul(h_in, W)
            a = Add(p, x_t)
            h_out = Tanh(a)
            y_t = Mul(h_out, v)
        }> (h0, x)
    }
"""


def _values(rng, **shapes: tuple[int, ...]) -> dict[str, np.ndarray]:
    return {name: rng.normal(size=shape) for name, shape in shapes.items()}


@pytest.mark.parametrize("opset", [13, 17, 21])
def test_scan_gradients_reach_states_scan_inputs_and_captured_weights(rng, opset):
    model = RNN_SCAN.replace('"" : 17', f'"" : {opset}')
    values = _values(rng, h0=(2, 3), x=(4, 2, 3), W=(3, 3), v=(3,))
    check_gradients(model, values, output="y")
    check_gradients(model, values, output="h")


def test_scan_gradients_with_dims_known_at_run_time_only(rng):
    model = RNN_SCAN.replace("[2, 3]", "[N, 3]").replace("[4, 2, 3]", "[T, N, 3]")
    values = _values(rng, h0=(2, 3), x=(4, 2, 3), W=(3, 3), v=(3,))
    check_gradients(model, values, output="y")


def test_scan_gradients_in_float32(rng):
    model = RNN_SCAN.replace("double", "float")
    values = {k: v.astype(np.float32)
              for k, v in _values(rng, h0=(2, 3), x=(4, 2, 3), W=(3, 3), v=(3,)).items()}
    check_gradients(model, values, output="y")


def test_a_value_read_as_an_input_and_captured_gets_both_contributions(rng):
    model = HEADER + """
        g (double[3] w, double[4, 3] x) => (double[4, 3] y) {
            s, y = Scan <num_scan_inputs: int = 1, body = step (double[3] s_in, double[3] x_t)
                                                           => (double[3] s_out, double[3] y_t) {
                m = Mul(s_in, w)
                s_out = Add(m, x_t)
                y_t = Sin(s_out)
            }> (w, x)
        }
    """
    check_gradients(model, _values(rng, w=(3,), x=(4, 3)))


@pytest.mark.parametrize("in_axis, in_dir, out_axis, out_dir",
                         [(0, 1, 0, 0), (1, 0, 1, 1), (-1, 1, 2, 1), (1, 1, -2, 0)])
def test_scan_directions_and_axes(rng, in_axis, in_dir, out_axis, out_dir):
    shape = {0: (4, 2, 3), 1: (2, 4, 3), -1: (2, 3, 4)}[in_axis]
    out_shape = {0: "4, 2, 3", 1: "2, 4, 3", 2: "2, 3, 4", -2: "2, 4, 3"}[out_axis]
    model = HEADER + f"""
        g (double[2, 3] h0, double[{", ".join(map(str, shape))}] x, double[3, 3] W)
            => (double[2, 3] h, double[{out_shape}] y) {{
            h, y = Scan <num_scan_inputs: int = 1, scan_input_axes: ints = [{in_axis}],
                         scan_input_directions: ints = [{in_dir}],
                         scan_output_axes: ints = [{out_axis}],
                         scan_output_directions: ints = [{out_dir}],
                         body = step (double[2, 3] h_in, double[2, 3] x_t)
                                => (double[2, 3] h_out, double[2, 3] y_t) {{
                p = MatMul(h_in, W)
                a = Add(p, x_t)
                h_out = Tanh(a)
                y_t = Mul(h_out, x_t)
            }}> (h0, x)
        }}
    """
    check_gradients(model, _values(rng, h0=(2, 3), x=shape, W=(3, 3)), output="y")


def test_scan_with_several_states_an_integer_counter_and_two_scan_inputs(rng):
    model = HEADER + """
        g (double[3] s0, double[3] p0, int64 c0, double[5, 3] x, double[3, 5] z, double[3] w)
            => (double[3] s, double[3] p, int64 c, double[3, 5] y) {
            s, p, c, y = Scan <num_scan_inputs: int = 2, scan_input_axes: ints = [0, 1],
                               scan_input_directions: ints = [0, 1],
                               scan_output_axes: ints = [1],
                               body = step (double[3] s_in, double[3] p_in, int64 c_in,
                                            double[3] x_t, double[3] z_t)
                                   => (double[3] s_out, double[3] p_out, int64 c_out,
                                       double[3] y_t) {
                one = Constant <value = int64 {1}> ()
                c_out = Add(c_in, one)
                scale = Cast <to = 11> (c_out)
                xs = Mul(x_t, scale)
                s_out = Add(s_in, xs)
                q = Mul(p_in, z_t)
                p_out = Sin(q)
                m = Mul(s_out, p_out)
                y_t = Mul(m, w)
            }> (s0, p0, c0, x, z)
        }
    """
    values = {**_values(rng, s0=(3,), p0=(3,), x=(5, 3), z=(3, 5), w=(3,)), "c0": np.array(0)}
    wrt = ["s0", "p0", "x", "z", "w"]
    for output in ("y", "s", "p"):
        check_gradients(model, values, wrt, output=output)


def test_scan_without_states_maps_its_body_over_the_slices(rng):
    model = HEADER + """
        g (double[4, 2, 3] x, double[3, 2] W) => (double[4, 2, 2] y) {
            y = Scan <num_scan_inputs: int = 1, body = step (double[2, 3] x_t)
                                                     => (double[2, 2] y_t) {
                p = MatMul(x_t, W)
                y_t = Sigmoid(p)
            }> (x)
        }
    """
    check_gradients(model, _values(rng, x=(4, 2, 3), W=(3, 2)))


def test_scan_with_a_state_its_body_keeps(rng):
    model = HEADER + """
        g (double[3] s0, double[3] w0, double[4, 3] x) => (double[3] s, double[4, 3] y) {
            s, w, y = Scan <num_scan_inputs: int = 1,
                            body = step (double[3] s_in, double[3] w_in, double[3] x_t)
                                   => (double[3] s_out, double[3] w_out, double[3] y_t) {
                w_out = Identity(w_in)
                m = Mul(s_in, w_in)
                s_out = Add(m, x_t)
                y_t = Identity(s_out)
            }> (s0, w0, x)
        }
    """
    values = _values(rng, s0=(3,), w0=(3,), x=(4, 3))
    check_gradients(model, values, output="y")
    check_gradients(model, values, output="s")


@pytest.mark.parametrize("flag", [True, False])
def test_if_nested_in_a_scan_body(rng, flag):
    model = HEADER + """
        g (double[3] s0, double[4, 3] x, double[3] w, bool c) => (double[4, 3] y) {
            s, y = Scan <num_scan_inputs: int = 1, body = step (double[3] s_in, double[3] x_t)
                                                           => (double[3] s_out, double[3] y_t) {
                s_out = If (c) <
                    then_branch = yes () => (double[3] a) {
                        t = Mul(s_in, w)
                        a = Add(t, x_t)
                    },
                    else_branch = no () => (double[3] b) { b = Sub(x_t, s_in) }
                >
                y_t = Tanh(s_out)
            }> (s0, x)
        }
    """
    values = {**_values(rng, s0=(3,), x=(4, 3), w=(3,)), "c": np.array(flag)}
    check_gradients(model, values, ["s0", "x", "w"])


def test_scan_nested_in_a_scan_body(rng):
    model = HEADER + """
        g (double[3] s0, double[2, 4, 3] x, double[3] w) => (double[3] s) {
            s = Scan <num_scan_inputs: int = 1, body = outer (double[3] s_in, double[4, 3] rows)
                                                        => (double[3] s_out) {
                s_out = Scan <num_scan_inputs: int = 1,
                              body = inner (double[3] r_in, double[3] row)
                                     => (double[3] r_out) {
                    t = Mul(r_in, w)
                    u = Add(t, row)
                    r_out = Sin(u)
                }> (s_in, rows)
            }> (s0, x)
        }
    """
    check_gradients(model, _values(rng, s0=(3,), x=(2, 4, 3), w=(3,)))


# ---------------------------------------------------------------------------- Loop
# s_{t+1} = sin(s_t * w + t), y_t = s_{t+1} * x; M iterations, or until sum(s) > limit
LOOP = HEADER + """
    g (int64 M, bool go, double[3] s0, double[3] w, double[3] x, double limit)
        => (double[3] s, double[N, 3] y) {
        s, y = Loop (M, go, s0) <body = step (int64 t, bool c_in, double[3] s_in)
                                        => (bool c_out, double[3] s_out, double[3] y_t) {
            m = Mul(s_in, w)
            tf = Cast <to = 11> (t)
            a = Add(m, tf)
            s_out = Sin(a)
            y_t = Mul(s_out, x)
            total = ReduceSum <keepdims = 0> (s_out)
            c_out = Less(total, limit)
        }>
    }
"""


@pytest.mark.parametrize("trips, go, limit",
                         [(4, True, 100.0), (1, True, 100.0), (9, True, 0.5), (0, True, 100.0),
                          (3, False, 100.0)])
def test_loop_gradients_through_states_scan_outputs_and_captured_weights(rng, trips, go, limit):
    values = {"M": np.array(trips), "go": np.array(go), "limit": np.array(limit),
              **_values(rng, s0=(3,), w=(3,), x=(3,))}
    for output in ("s", "y"):
        check_gradients(LOOP, values, ["s0", "w", "x"], output=output)


@pytest.mark.parametrize("opset", [13, 21])
def test_loop_gradients_at_other_opsets(rng, opset):
    model = LOOP.replace('"" : 17', f'"" : {opset}')
    values = {"M": np.array(3), "go": np.array(True), "limit": np.array(100.0),
              **_values(rng, s0=(3,), w=(3,), x=(3,))}
    check_gradients(model, values, ["s0", "w", "x"], output="y")


def test_a_loop_ended_by_its_condition_differentiates_the_iterations_that_ran(rng, run_model):
    values = {"M": np.array(50), "go": np.array(True), "limit": np.array(0.5),
              **_values(rng, s0=(3,), w=(3,), x=(3,))}
    model = onnx.parser.parse_model(LOOP)
    ran = run_model(model, values)["y"].shape[0]
    assert 1 < ran < 50
    check_gradients(model, values, ["s0", "w", "x"], output="y")


def test_loop_without_trip_count(rng):
    model = LOOP.replace("Loop (M, go, s0)", 'Loop ("", go, s0)')
    values = {"M": np.array(0), "go": np.array(True), "limit": np.array(0.5),
              **_values(rng, s0=(3,), w=(3,), x=(3,))}
    check_gradients(model, values, ["s0", "w", "x"], output="y")


def test_loop_without_states_gathers_rows_of_a_captured_weight(rng):
    """What torch exports for nn.EmbeddingBag: each iteration reads a bag of rows."""
    model = HEADER + """
        g (double[6, 3] E, int64[3, 2] bags) => (double[3, 3] y) {
            n = Constant <value = int64 {3}> ()
            go = Constant <value = bool {1}> ()
            y = Loop (n, go) <body = step (int64 t, bool c_in) => (bool c_out, double[3] y_t) {
                c_out = Identity(c_in)
                bag = Gather <axis = 0> (bags, t)
                rows = Gather <axis = 0> (E, bag)
                y_t = ReduceMean <axes = [0], keepdims = 0> (rows)
            }>
        }
    """
    values = {"E": rng.normal(size=(6, 3)), "bags": np.array([[0, 2], [2, 2], [5, 1]])}
    check_gradients(model, values, ["E"])
    none = model.replace("int64 {3}", "int64 {0}").replace("double[3, 3] y", "double[0, 3] y")
    grads = check_gradients(none, values, ["E"])
    np.testing.assert_array_equal(grads["E"], np.zeros((6, 3)))


def test_loop_with_an_integer_state_and_a_state_passed_through(rng):
    model = HEADER + """
        g (int64 M, double[3] s0, double[3] w0, int64 k0) => (double[3] s, double[3] w) {
            go = Constant <value = bool {1}> ()
            s, w, k = Loop (M, go, s0, w0, k0) <
                body = step (int64 t, bool c_in, double[3] s_in, double[3] w_in, int64 k_in)
                       => (bool c_out, double[3] s_out, double[3] w_in, int64 k_out) {
                    c_out = Identity(c_in)
                    two = Constant <value = int64 {2}> ()
                    k_out = Mul(k_in, two)
                    kf = Cast <to = 11> (k_out)
                    m = Mul(s_in, w_in)
                    d = Div(m, kf)
                    s_out = Sin(d)
                }>
        }
    """
    values = {"M": np.array(3), "k0": np.array(1), **_values(rng, s0=(3,), w0=(3,))}
    check_gradients(model, values, ["s0", "w0"], output="s")


def test_a_loop_that_grows_its_state_is_a_named_error():
    model = onnx.parser.parse_model(HEADER + """
        g (int64 M, double[1, 3] s0, double[3] w) => (double[N, 3] s) {
            go = Constant <value = bool {1}> ()
            s = Loop (M, go, s0) <body = step (int64 t, bool c_in, double[1, 3] s_in)
                                         => (bool c_out, double[2, 3] s_out) {
                c_out = Identity(c_in)
                m = Mul(s_in, w)
                s_out = Concat <axis = 0> (s_in, m)
            }>
        }
    """)
    with pytest.raises(UnsupportedModelError, match=r"changes the shape of its state 0"):
        lossgraph.gradient(model, weights=["w"], outputs=["s"])


def test_the_gradient_of_a_loop_is_the_same_bytes_every_time():
    model = onnx.parser.parse_model(LOOP)
    first, again = (lossgraph.gradient(model, weights=["s0", "w"], outputs=["s", "y"])
                    for _ in range(2))
    assert first.SerializeToString() == again.SerializeToString()


# --------------------------------------------------------------------------- torch
@pytest.mark.torch
@pytest.mark.parametrize("fuse", ["step", "epoch"])
def test_an_exported_embedding_bag_trains_like_torch_step_for_step(fuse):
    import torch

    from lossgraph.optim import SGD

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bag = torch.nn.EmbeddingBag(12, 4, mode="mean")
            self.head = torch.nn.Linear(4, 1)

        def forward(self, x):
            return self.head(torch.tanh(self.bag(x)))

    torch.manual_seed(0)
    net = Net()
    rng = np.random.default_rng(0)
    X = rng.integers(0, 12, size=(32, 3))
    y = rng.normal(size=(32, 1)).astype(np.float32)
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation warning
        torch.onnx.export(net, (torch.from_numpy(X[:2]),), buffer, dynamo=False,
                          opset_version=17, input_names=["x"], output_names=["y"],
                          dynamic_axes={"x": {0: "N"}, "y": {0: "N"}})
    model = onnx.load_from_string(buffer.getvalue())
    assert "Loop" in {n.op_type for n in model.graph.node}
    initial = net.bag.weight.detach().numpy().copy()
    trainer = lossgraph.Trainer(lossgraph.compile_program(model, optimizer=SGD(0.5),
                                                           fuse=fuse))
    assert_sgd_steps_like_torch(trainer, net, 0.5, X, y)
    trained = {t.name: onnx.numpy_helper.to_array(t)
               for t in trainer.to_inference_model().graph.initializer}
    table = net.bag.weight.detach().numpy()
    assert np.abs(table - initial).max() > 1e-3  # the embedding table moved ...
    np.testing.assert_allclose(trained["bag.weight"], table, rtol=1e-4, atol=1e-6)  # ... as torch's


# acc = 0; twice: acc = acc + x @ coef; y = acc + intercept. onnx's shape inference gives
# the Loop's output no shape: its rank comes from the carried value's (lossgraph.graphs).
LOOPED_LINEAR = """
    <ir_version: 8, opset_import: ["" : 18]>
    looped (float[N, 4] x) => (float[N, 1] y)
    <float[4, 1] coef = {0.1, -0.2, 0.3, 0.0}, float[1] intercept = {0.5}, int64 trips = {2},
     bool keep = {1}>
    {
        zero = Constant <value = float[1] {0}> ()
        first = Constant <value = int64[1] {0}> ()
        one = Constant <value = int64[1] {1}> ()
        x_shape = Shape(x)
        rows = Slice(x_shape, first, one)
        acc_shape = Concat <axis = 0> (rows, one)
        acc0 = Expand(zero, acc_shape)
        acc = Loop(trips, keep, acc0) <body = body (int64 i, bool c, float[N, 1] a)
                                                    => (bool c_out, float[N, 1] a_out) {
            c_out = Identity(c)
            p = MatMul(x, coef)
            a_out = Add(a, p)
        }>
        y = Add(acc, intercept)
    }
"""


@pytest.mark.parametrize("fuse", ["separate", "step", "epoch"])
def test_a_weight_read_in_a_loop_body_trains_as_the_unrolled_model(fuse):
    """The Loop's output rank is found from its carried value (onnx gives it none), so the
    model compiles, and training it equals training ``2 x @ coef + intercept``."""
    from support.linear import linear_data

    unrolled = onnx.parser.parse_model("""
        <ir_version: 8, opset_import: ["" : 18]>
        unrolled (float[N, 4] x) => (float[N, 1] y)
        <float[4, 1] coef = {0.1, -0.2, 0.3, 0.0}, float[1] intercept = {0.5}>
        {
            p = MatMul(x, coef)
            twice = Add(p, p)
            y = Add(twice, intercept)
        }""")
    X, y = linear_data(64, seed=1)
    weights = []
    for model in (onnx.parser.parse_model(LOOPED_LINEAR), unrolled):
        program = lossgraph.compile_program(model, weights=["coef", "intercept"], fuse=fuse,
                                            optimizer=lossgraph.optim.SGD(0.01))
        trainer = lossgraph.Trainer(program).fit(X, y, epochs=3, batch_size=16,
                                                 random_state=0, progress=False)
        weights.append(trainer.state)
    for name in ("coef", "intercept"):
        np.testing.assert_allclose(weights[0][name], weights[1][name], rtol=1e-5, atol=1e-6)
