"""The files and commands the command-line tests share: a compiled program folder, data files
in every format, the initializers of a trained model, and ``lossgraph`` run in a shell."""

from __future__ import annotations

import importlib
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

from lossgraph.cli import main

from .models import NET


def program_folder(tmp_path) -> str:
    model = tmp_path / "net.onnx"
    onnx.save(onnx.parser.parse_model(NET), model)
    folder = tmp_path / "program"
    assert main(["compile", str(model), "-o", str(folder)]) == 0
    return str(folder)


def write_file(tmp_path, name: str, data: bytes) -> str:
    (tmp_path / name).write_bytes(data)
    return str(tmp_path / name)


def npz_data(tmp_path) -> str:
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "data.npz", X=rng.normal(size=(10, 3)).astype(np.float32),
             y=rng.normal(size=(10, 2)).astype(np.float32))
    return str(tmp_path / "data.npz")


def two_output_data(rows: int = 60) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1)
    X = rng.normal(size=(rows, 3)).astype(np.float32)
    y = np.stack([X @ [1.0, 2.0, -1.0], X @ [0.5, 0.0, 1.0]], axis=1).astype(np.float32)
    return X, y


def write_csv(path: Path, columns: dict[str, np.ndarray]) -> None:
    """Columns as a .csv file with a header row; float32 values survive the round trip."""
    table = np.stack([np.asarray(c, np.float64) for c in columns.values()], axis=1)
    np.savetxt(path, table, delimiter=",", header=",".join(columns), comments="", fmt="%.9g")


def initializers(path: Path) -> dict[str, np.ndarray]:
    return {t.name: onnx.numpy_helper.to_array(t) for t in onnx.load(path).graph.initializer}


def initializers_of(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    return {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}


def installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def shell(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """``lossgraph ARGS`` run in ``cwd``, as a user types it."""
    env = {k: v for k, v in os.environ.items() if k != "LOSSGRAPH_DEBUG"}
    return subprocess.run([sys.executable, "-m", "lossgraph", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def ok(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 0, result.stderr
    return result.stdout


def export_has(name: str) -> bool:
    """Whether lossgraph.export provides ``name`` in this checkout."""
    try:
        getattr(importlib.import_module("lossgraph.export"), name)
    except (ImportError, AttributeError):
        return False
    return True


needs_skl2onnx = pytest.mark.skipif(not (installed("skl2onnx") and installed("sklearn")),
                                    reason="needs scikit-learn and skl2onnx (pip install "
                                           "'lossgraph[dev]')")
