"""What the command-line tests share: the model file they start from."""

from __future__ import annotations

import onnx
import pytest
from support.models import NET


@pytest.fixture
def model_file(tmp_path):
    """:data:`support.models.NET` saved as ``model.onnx`` in the test's folder."""
    path = tmp_path / "model.onnx"
    onnx.save(onnx.parser.parse_model(NET), path)
    return path
