"""Where a model file holds each initializer's bytes (lossgraph/graphs/spans.py), and a
model file read without them: its weights held once, from the file (issue 27)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import numpy_helper
from support.models import large_weights_model, saved, tower

from lossgraph.graphs import HeldWeights, is_held
from lossgraph.graphs.spans import OpenedFiles, initializer_spans, model_without_raw_data
from lossgraph.graphs.weights import with_weight_data
from lossgraph.models import as_model


def _saved(tmp_path, model, external: bool = False):
    return saved(model, tmp_path / "m.onnx", external)


@pytest.mark.parametrize("external", [False, True], ids=["in-the-file", "external-data"])
def test_spans_are_each_initializers_bytes(tmp_path, external):
    model = large_weights_model()
    path = _saved(tmp_path, model, external)
    spans = initializer_spans(path)
    assert set(spans) == {t.name for t in model.graph.initializer}
    with OpenedFiles() as files:
        for tensor in model.graph.initializer:
            assert files.read(spans[tensor.name]) == tensor.raw_data
    if external:  # the large one in the data file, the small ones in the model's
        assert spans["W"].path == (tmp_path / "m.data").resolve()
        assert spans["shape"].path == path


def test_a_model_without_its_raw_data_is_the_model_less_that_data(tmp_path):
    model = large_weights_model()
    serialized, spans = model_without_raw_data(_saved(tmp_path, model))
    light = onnx.load_model_from_string(serialized)
    assert len(serialized) < 4096 and set(spans) == {t.name for t in model.graph.initializer}
    for tensor in light.graph.initializer:
        assert not tensor.HasField("raw_data")
        with OpenedFiles() as files:
            tensor.raw_data = files.read(spans[tensor.name])
    assert light == model


@pytest.mark.parametrize("external", [False, True], ids=["in-the-file", "external-data"])
def test_a_model_file_read_holds_its_large_weights_once_from_the_file(tmp_path, external,
                                                                      monkeypatch):
    """The large float weight is held; the small one and the int64 shape keep their data
    in the tensor, as protobuf reads them; put back, the model is onnx.load's. The file
    is never read whole (its bytes, then protobuf's copy of them)."""
    import lossgraph.models

    monkeypatch.setattr(lossgraph.models, "_read", None)
    model = large_weights_model()
    held = HeldWeights()
    path = _saved(tmp_path, model, external)
    read = as_model(path, held)
    assert [is_held(t) for t in read.graph.initializer] == [True, False, False]
    assert len(held) == 1
    np.testing.assert_array_equal(held.array(0), numpy_helper.to_array(
        model.graph.initializer[0]))
    assert with_weight_data(read) == onnx.load(path)


def test_a_file_the_walk_cannot_read_gives_no_spans_and_is_read_whole(tmp_path):
    """A model whose bytes are not where the walk says (two ``graph`` fields, which
    protobuf merges) is read as protobuf reads it; a file that is no model has no spans."""
    model = tower()
    path = _saved(tmp_path, model)
    empty = onnx.GraphProto(name="empty").SerializeToString()
    path.write_bytes(path.read_bytes() + bytes([7 << 3 | 2, len(empty)]) + empty)
    assert initializer_spans(path) == {} and model_without_raw_data(path) is None
    expected = onnx.load(path)
    assert with_weight_data(as_model(path, HeldWeights(min_bytes=1))) == expected
    for content in (b"", b"\xff" * 8):
        (tmp_path / "other").write_bytes(content)
        assert initializer_spans(tmp_path / "other") == {}


def test_a_name_given_twice_has_no_span(tmp_path):
    model = large_weights_model()
    model.graph.initializer.append(model.graph.initializer[1])  # "S" twice
    spans = initializer_spans(_saved(tmp_path, model))
    assert "S" not in spans and "W" in spans
