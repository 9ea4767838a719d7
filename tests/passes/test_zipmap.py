"""ZipMapToTensor (lossgraph/passes/zipmap.py): a ZipMap output (skl2onnx's classifiers by
default) becomes the tensor it zips, which compile trains and predicts; the exported model
keeps the ZipMap."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

import lossgraph
from lossgraph.errors import UnsupportedModelError
from lossgraph.passes import ZipMapToTensor

ZIPMAP = """
    <ir_version: 8, opset_import: ["" : 18, "ai.onnx.ml" : 3]>
    clf (float[N, 4] x) => (int64[N] label, seq(map(int64, float)) output_probability)
    <float[4, 3] w = {0.1, 0, 0, 0, 0.1, 0, 0, 0, 0.1, 0.1, 0.1, 0.1}>
    { z = MatMul(x, w)
      p = Softmax <axis = 1> (z)
      label = ArgMax <axis = 1, keepdims = 0> (p)
      output_probability = ai.onnx.ml.ZipMap <classlabels_int64s = [0, 1, 2]> (p) }
"""


def test_a_zipmap_output_becomes_the_tensor_it_zips():
    result = ZipMapToTensor()(onnx.parser.parse_model(ZIPMAP))
    assert result.report == {"output_probability": "p"}
    assert [o.name for o in result.model.graph.output] == ["label", "p"]
    assert "ZipMap" not in [n.op_type for n in result.model.graph.node]
    dims = result.model.graph.output[1].type.tensor_type.shape.dim
    assert dims[1].dim_value == 3
    unchanged = ZipMapToTensor()(result.model)
    assert not unchanged.changed and unchanged.report == {}


def test_a_zipmap_classifier_trains_predicts_its_tensor_and_exports_its_zipmap():
    program = lossgraph.compile_program(onnx.parser.parse_model(ZIPMAP),
                                        optimizer=lossgraph.optim.SGD(0.5))
    assert program.notes.zipmaps == {"output_probability": "p"}
    assert program.notes.loss.output == "p" and program.notes.loss.loss == "multiclass_log_loss"
    assert program.manifest["roles"]["prediction"] == "p"
    assert "ZipMapToTensor -> WeightsToInputs" in lossgraph.describe_plan(
        onnx.parser.parse_model(ZIPMAP))
    rng = np.random.default_rng(0)
    X = rng.normal(size=(60, 4)).astype(np.float32)
    y = (X[:, 0] > 0).astype(np.int64) + (X[:, 1] > 0)
    trainer = lossgraph.Trainer(program).fit(X, y, epochs=20, batch_size=10, progress=False)
    assert trainer.train_losses_[-1] < trainer.train_losses_[0]
    predicted = trainer.predict(X)
    assert predicted.shape == (60, 3)
    np.testing.assert_allclose(predicted.sum(axis=1), 1, rtol=1e-5)
    exported = trainer.to_inference_model()
    assert [o.name for o in exported.graph.output] == ["label", "output_probability"]
    import onnxruntime

    session = onnxruntime.InferenceSession(exported.SerializeToString(),
                                           providers=["CPUExecutionProvider"])
    label, maps = session.run(None, {"x": X})
    np.testing.assert_allclose([[row[c] for c in range(3)] for row in maps], predicted,
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(label, predicted.argmax(axis=1))


def test_add_loss_output_on_a_zipmap_names_the_fixes_which_work():
    zipped = onnx.parser.parse_model(ZIPMAP)
    with pytest.raises(UnsupportedModelError) as caught:
        lossgraph.add_loss_output(zipped, "multiclass_log_loss")
    message = str(caught.value)
    assert "compile_program trains on the tensor it zips by itself" in message
    assert "lossgraph.passes.ZipMapToTensor()" in message
    lossgraph.compile_program(zipped)
    lossgraph.add_loss_output(ZipMapToTensor()(zipped).model, "multiclass_log_loss")


def test_a_zipped_tensor_of_a_type_shape_inference_cannot_tell_is_what_zipmap_takes():
    """onnx's specification: ZipMap reads a float tensor, one column per class label."""
    custom = onnx.parser.parse_model("""
        <ir_version: 8, opset_import: ["" : 18, "ai.onnx.ml" : 3, "com.example" : 1]>
        clf (float[N, 4] x) => (seq(map(int64, float)) output_probability)
        { p = com.example.Probabilities(x)
          output_probability = ai.onnx.ml.ZipMap <classlabels_int64s = [0, 1, 2]> (p) }""")
    tensor = ZipMapToTensor()(custom).model.graph.output[0]
    assert tensor.name == "p" and tensor.type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    assert [d.dim_value for d in tensor.type.tensor_type.shape.dim] == [0, 3]
