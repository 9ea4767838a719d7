"""lossgraph inspect (lossgraph/cli/inspection.py): what a model holds, what of it can be
trained, the ops without a gradient rule and where they are, a loss the model carries."""

from __future__ import annotations

import json
import warnings

import numpy as np
import onnx
from support.cli import needs_skl2onnx

from lossgraph.cli import main


def test_inspect_of_a_model_with_its_loss_looks_towards_the_loss(model_file, tmp_path, capsys):
    with_loss = tmp_path / "loss.onnx"
    assert main(["add-loss", str(model_file), "-o", str(with_loss)]) == 0
    assert main(["inspect", str(with_loss)]) == 0
    out = capsys.readouterr().out
    assert "the model carries its loss 'loss' (compile it with --loss none)" in out
    assert "  label  float  [N, 2]" in out


@needs_skl2onnx
def test_inspect_shows_inputs_initializers_trainable_candidates_and_op_counts(tmp_path, capsys):
    from skl2onnx import to_onnx
    from sklearn.neural_network import MLPRegressor

    X = np.random.default_rng(0).normal(size=(40, 3)).astype(np.float32)
    with warnings.catch_warnings():  # scikit-learn's ConvergenceWarning: 5 iterations
        warnings.simplefilter("ignore")
        mlp = MLPRegressor(hidden_layer_sizes=(5,), max_iter=5, random_state=0).fit(X, X[:, 0])
    (tmp_path / "mlp.onnx").write_bytes(to_onnx(mlp, X[:1], target_opset=18)
                                        .SerializeToString())
    assert main(["inspect", str(tmp_path / "mlp.onnx"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ir_version"] >= 7 and report["opsets"]["ai.onnx"] == 18
    assert report["inputs"] == [{"name": "X", "dtype": "float", "shape": [None, 3]}]
    assert report["outputs"][0]["shape"] == [None, 1]
    assert report["trainable"] == ["coefficient", "intercepts", "coefficient1", "intercepts1"]
    shapes = {t["name"]: (t["shape"], t["trainable"]) for t in report["initializers"]}
    assert shapes["coefficient"] == ([3, 5], True) and shapes["shape_tensor"] == ([2], False)
    counts = {op["op_type"]: (op["count"], op["gradient_rule"]) for op in report["ops"]}
    assert counts["MatMul"] == (2, "yes") and counts["Relu"] == (1, "yes")
    assert report["missing_gradient_rules"] == []

    assert main(["inspect", str(tmp_path / "mlp.onnx")]) == 0
    table = capsys.readouterr().out
    assert "  X     float  [?, 3]" in table
    assert "  coefficient   float  [3, 5]  15      yes" in table
    assert "  shape_tensor  int64  [2]     2       -" in table
    assert "ops (7 nodes)" in table and "  MatMul   2      yes" in table
    assert "every op between the trainable weights and the outputs has a gradient rule" in table


# an op of the user's own domain (no gradient rule, ever) between w and y
NO_RULE_MODEL = """
    <ir_version: 8, opset_import: ["" : 18, "my.ops" : 1]>
    net (float[N, 3] x) => (float[N, 2] y, int64[N] best)
    <float[3, 2] w = {1, 2, 3, 4, 5, 6}, float[2] b = {0.5, -0.5}, float[N, 2] m>
    { h = MatMul(x, w)
      m = my.ops.Mystery(h)
      y = Add(m, b)
      best = ArgMax <axis = 1, keepdims = 0> (y) }
"""


def test_inspect_names_the_ops_without_a_gradient_rule_with_their_path(tmp_path, capsys):
    model = tmp_path / "norule.onnx"
    onnx.save(onnx.parser.parse_model(NO_RULE_MODEL), model)
    assert main(["inspect", str(model), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["missing_gradient_rules"] == [{
        "op_type": "Mystery", "domain": "my.ops", "node": "", "opset": 1,
        "path": ["w", "MatMul", "h", "my.ops::Mystery", "m", "Add", "y"], "at": 3}]
    rules = {op["op_type"]: op["gradient_rule"] for op in report["ops"]}
    assert rules == {"MatMul": "yes", "Mystery": "missing", "Add": "yes",
                     "ArgMax": "no"}  # ArgMax has no rule, and needs none: no gradient passes

    assert main(["inspect", str(model)]) == 0
    table = capsys.readouterr().out
    assert "my.ops::Mystery  1      MISSING (see below)" in table
    assert "ArgMax           1      no (no gradient needs to pass it)" in table
    assert "  my.ops::Mystery  -     w -> MatMul -> h -> my.ops::Mystery -> m -> Add -> y" in table

    # and compile fails on that op, as inspect said (b alone trains)
    assert main(["compile", str(model), "-o", str(tmp_path / "p")]) == 2
    assert "No gradient rule for op 'Mystery'" in capsys.readouterr().err
    assert main(["compile", str(model), "-o", str(tmp_path / "p"), "--weights", "b",
                 "--loss-option", "output_index=y"]) == 0
