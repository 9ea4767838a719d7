"""The golden models are valid, match their recipes, and regenerate byte for byte."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest

GOLDEN_DIR = Path(__file__).parents[1] / "golden_models"
if str(GOLDEN_DIR) not in sys.path:
    sys.path.insert(0, str(GOLDEN_DIR))

import recipes  # noqa: E402

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


@pytest.mark.parametrize("name", ["skl_mlp_regressor", "hand_broadcast_reuse"])
def test_regenerating_a_golden_model_is_byte_identical(name: str, tmp_path: Path) -> None:
    committed = recipes.RECIPES[name].path.read_bytes()
    if recipes.RECIPES[name].kind != "hand":
        skl2onnx = pytest.importorskip("skl2onnx")
        producer = onnx.load_from_string(committed).producer_version
        if skl2onnx.__version__ != producer:
            pytest.skip(f"file made by skl2onnx {producer}, this is {skl2onnx.__version__}")
    import generate

    assert generate.main(["--output-dir", str(tmp_path), "--no-verify", name]) == 0
    assert (tmp_path / recipes.RECIPES[name].file).read_bytes() == committed
    assert generate.serialize(generate.build(name)) == committed
