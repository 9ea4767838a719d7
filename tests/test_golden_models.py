"""The golden models are valid, match their recipes, and regenerate reproducibly: byte for
byte, apart from the weights a third-party library fits (to a tolerance)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
import recipes
from support.environment import GOLDEN_MODELS

GOLDEN_DIR = GOLDEN_MODELS

NAMES = list(recipes.RECIPES)
# The torch model's comparison needs torch: conftest skips ``torch``-marked items.
NAMES_MARKED = [
    pytest.param(name, marks=pytest.mark.torch) if recipes.RECIPES[name].kind == "torch" else name
    for name in NAMES
]
MAX_AI_ONNX_OPSET = 21


def _load(name: str) -> onnx.ModelProto:
    return onnx.load(str(GOLDEN_DIR / recipes.RECIPES[name].file))


def _dims(value_info: onnx.ValueInfoProto) -> tuple[str | int, ...]:
    return tuple(
        d.dim_param or (d.dim_value if d.HasField("dim_value") else "?")
        for d in value_info.type.tensor_type.shape.dim
    )


def _session(model: onnx.ModelProto) -> Any:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(
        model.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )


def test_every_onnx_file_has_a_recipe_and_every_recipe_a_file() -> None:
    on_disk = sorted(p.stem for p in GOLDEN_DIR.glob("*.onnx"))
    assert on_disk == sorted(NAMES)


def test_readme_has_a_row_for_every_golden_file() -> None:
    readme = (GOLDEN_DIR / "README.md").read_text()
    for r in recipes.RECIPES.values():
        assert f"| `{r.file}` |" in readme


def test_golden_directory_stays_under_one_megabyte() -> None:
    total = sum(p.stat().st_size for p in GOLDEN_DIR.iterdir() if p.is_file())
    assert total < 1_000_000


@pytest.mark.parametrize("name", NAMES)
def test_golden_model_passes_full_checker_with_ir10_and_one_opset_per_domain(name: str) -> None:
    model = _load(name)
    onnx.checker.check_model(model, full_check=True)
    assert model.ir_version == 10
    domains = [entry.domain for entry in model.opset_import]
    assert len(domains) == len(set(domains)), f"duplicate opset_import domains {domains}"
    versions = {entry.domain: entry.version for entry in model.opset_import}
    assert versions[""] == recipes.RECIPES[name].opset
    assert versions[""] <= MAX_AI_ONNX_OPSET
    assert not model.functions


@pytest.mark.parametrize("name", NAMES)
def test_golden_model_structure_matches_its_recipe(name: str) -> None:
    r = recipes.RECIPES[name]
    model = _load(name)
    assert tuple(sorted({n.op_type for n in model.graph.node})) == r.ops
    [graph_input] = [i for i in model.graph.input]
    assert graph_input.name == r.input_name
    assert _dims(graph_input) == r.input_shape
    elem_type = graph_input.type.tensor_type.elem_type
    assert onnx.helper.tensor_dtype_to_np_dtype(elem_type) == np.dtype(r.dtype)
    assert tuple(o.name for o in model.graph.output) == r.outputs
    initializers = {t.name: t for t in model.graph.initializer}
    for weight in r.trainable:
        assert weight in initializers, f"trainable {weight!r} is not an initializer"
        assert initializers[weight].data_type == elem_type


@pytest.mark.parametrize("name", NAMES_MARKED)
def test_golden_model_predicts_like_its_recipe_estimator(name: str) -> None:
    r = recipes.RECIPES[name]
    if r.kind == "torch":
        pytest.importorskip("torch")
    elif r.kind in ("regressor", "classifier"):
        pytest.importorskip("sklearn")
    X_test = recipes.dataset(name)[2]
    assert X_test.dtype == np.dtype(r.dtype)
    got = _session(_load(name)).run(list(r.outputs), {r.input_name: X_test})
    expected = recipes.expected_outputs(name, X_test)
    assert sorted(expected) == sorted(r.outputs)
    if r.dtype == "float32":
        tolerance = {"rtol": 1e-4, "atol": 1e-5}
    else:
        tolerance = {"rtol": 1e-9, "atol": 1e-12}
    for output, value in zip(r.outputs, got, strict=True):
        want = expected[output]
        assert value.shape == want.shape, output
        if want.dtype.kind in "iu":
            np.testing.assert_array_equal(value, want, err_msg=output)
        else:
            assert value.dtype == np.dtype(r.dtype), output
            np.testing.assert_allclose(value, want, err_msg=output, **tolerance)


def test_recipes_are_deterministic() -> None:
    first = recipes.dataset("skl_mlp_regressor")
    second = recipes.dataset("skl_mlp_regressor")
    for a, b in zip(first, second, strict=True):
        np.testing.assert_array_equal(a, b)
    hand_a = recipes.hand_model("hand_broadcast_reuse").parameters
    hand_b = recipes.hand_model("hand_broadcast_reuse").parameters
    for key in hand_a:
        np.testing.assert_array_equal(hand_a[key], hand_b[key])


def _skeleton_and_values(model: onnx.ModelProto) -> tuple[bytes, dict[str, np.ndarray]]:
    """The model's deterministic bytes with every stored float removed, and those floats.

    Weights live in initializers, or in float attributes (``ai.onnx.ml`` models'
    ``coefficients``, a Constant's ``value``); each is set aside under its name.
    """
    skeleton = onnx.ModelProto()
    skeleton.CopyFrom(model)
    values: dict[str, np.ndarray] = {}

    def take(tensor: onnx.TensorProto, key: str) -> None:
        values[key] = onnx.numpy_helper.to_array(tensor)
        for field in ("raw_data", "float_data", "double_data", "int32_data", "int64_data"):
            tensor.ClearField(field)

    for tensor in skeleton.graph.initializer:
        take(tensor, tensor.name)
    for node in skeleton.graph.node:
        for attribute in node.attribute:
            key = f"{node.name}.{attribute.name}"
            if attribute.HasField("t"):
                take(attribute.t, key)
            elif attribute.floats:
                values[key] = np.array(attribute.floats, np.float32)
                attribute.ClearField("floats")
            elif attribute.type == onnx.AttributeProto.FLOAT:
                values[key] = np.array(attribute.f, np.float32)
                attribute.ClearField("f")
    return skeleton.SerializeToString(deterministic=True), values


#: How far a refitted weight may move from the committed one, relative to the tensor's
#: largest magnitude: scikit-learn's fits run on the machine's BLAS, whose summation
#: order differs between CPUs and builds (measured: 4e-7 for float32 MLPs, 7e-16 for
#: float64 models between two x86-64 machines).
REFIT_TOLERANCE = {"float32": 1e-3, "float64": 1e-8}


@pytest.mark.parametrize("name", NAMES_MARKED)
def test_regenerating_a_golden_model_gives_the_committed_one(name: str, tmp_path: Path) -> None:
    """Hand-written models regenerate byte for byte. Models a third-party library fitted
    regenerate with the same bytes apart from their weights, which match to a tolerance."""
    committed = recipes.RECIPES[name].path.read_bytes()
    kind = recipes.RECIPES[name].kind
    if kind in ("regressor", "classifier"):
        skl2onnx = pytest.importorskip("skl2onnx")
        producer = onnx.load_from_string(committed).producer_version
        if skl2onnx.__version__ != producer:
            pytest.skip(f"file made by skl2onnx {producer}, this is {skl2onnx.__version__}")
    import generate

    assert generate.main(["--output-dir", str(tmp_path), "--no-verify", name]) == 0
    regenerated = (tmp_path / recipes.RECIPES[name].file).read_bytes()
    assert generate.serialize(generate.build(name)) == regenerated  # deterministic run to run
    if kind == "hand":
        assert regenerated == committed
        return
    skeleton, values = _skeleton_and_values(onnx.load_from_string(regenerated))
    committed_skeleton, committed_values = _skeleton_and_values(onnx.load_from_string(committed))
    assert skeleton == committed_skeleton
    for weight, expected in committed_values.items():
        got = values[weight]
        assert got.dtype == expected.dtype and got.shape == expected.shape, weight
        if expected.dtype.kind != "f" or kind == "torch":  # torch's export is not refitted
            np.testing.assert_array_equal(got, expected, err_msg=weight)
        else:
            scale = float(np.max(np.abs(expected), initial=0.0)) or 1.0
            np.testing.assert_allclose(got, expected, rtol=0,
                                       atol=REFIT_TOLERANCE[expected.dtype.name] * scale,
                                       err_msg=weight)


SKELETONS = """
import hashlib, json, sys, warnings
sys.path[:0] = [{golden!r}, {tests!r}]
warnings.simplefilter("ignore")
import generate
from test_golden_models import _skeleton_and_values
print(json.dumps({{name: hashlib.sha256(_skeleton_and_values(generate.build(name))[0]).hexdigest()
                   for name in {names!r}}}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("hash_seed", ["0", "1"])
def test_regeneration_does_not_depend_on_the_hash_seed(hash_seed: str) -> None:
    """skl2onnx lists opset imports in an order that varies with the hash seed (seeds 0
    and 1 reorder skl_logistic_binary's); generate.normalize sorts them."""
    pytest.importorskip("skl2onnx")
    import hashlib
    import json
    import os
    import subprocess

    names = [n for n in NAMES if recipes.RECIPES[n].kind in ("regressor", "classifier")]
    script = SKELETONS.format(golden=str(GOLDEN_DIR), tests=str(Path(__file__).parent),
                              names=names)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            env={**os.environ, "PYTHONHASHSEED": hash_seed}, check=True)
    built = json.loads(result.stdout.strip().splitlines()[-1])
    for name in names:
        committed = _skeleton_and_values(_load(name))[0]
        assert built[name] == hashlib.sha256(committed).hexdigest(), name
