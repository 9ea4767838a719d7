"""Shared test set-up: markers that skip what this environment cannot run, and small fixtures.

The suite runs in two environments (docs/installation.md): the onnxruntime
training build runs everything; plain current onnxruntime runs everything that
does not need the training build. Tests say what they need with markers:

    @pytest.mark.training   needs onnxruntime-training-cpu 1.19.2 ("ort" backend,
                            GradientGraphBuilder, com.microsoft ops)
    @pytest.mark.torch      needs torch
    @pytest.mark.slow       takes more than a few seconds

A test whose requirement is missing is skipped with a reason that says what to
install; nothing else is skipped. For other optional packages use the flags of
``support.environment`` (``from support.environment import HAS_SKL2ONNX``).

The layout (tests/README.md): the folders mirror the package (``tests/passes/test_loss.py``
tests ``lossgraph/passes/loss.py``), the tests of no single module sit here at the top,
and the helpers they share are the ``support`` package. pytest imports test files with
``--import-mode=importlib`` (pyproject.toml), so two folders may hold files of one name;
``tests/``, ``golden_models/`` and ``docs/examples/`` are on ``sys.path`` (pyproject's
pytest ``pythonpath``) so tests can ``import support.gradcheck`` or ``import recipes``.
A test file never imports another test file: what two share goes into ``support``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from importlib import metadata
from typing import Any

import numpy as np
import onnx
import pytest
from support.environment import has

from lossgraph.runtime.session import create_session, quiet_session_options

# Markers that skip a test when this environment lacks what it needs.
SKIP_REASONS: dict[str, str] = {
    "training": "needs onnxruntime-training-cpu 1.19.2 (pip install 'lossgraph[training]')",
    "torch": "needs torch (pip install torch==2.13.0)",
}


def _installed(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def pytest_report_header(config: pytest.Config) -> str:
    """One line saying what this run can exercise, from metadata (no slow imports)."""
    runtimes = [
        f"{dist} {version}"
        for dist in ("onnxruntime-training-cpu", "onnxruntime")
        if (version := _installed(dist))
    ]
    if not runtimes:
        runtimes = ["no onnxruntime"]
    elif len(runtimes) > 1:
        runtimes.append("CLASH: both installed, see docs/installation.md")
    return (
        f"lossgraph capabilities: {', '.join(runtimes)}, onnx {onnx.__version__}, "
        f"torch {_installed('torch') or 'missing'}, skl2onnx {_installed('skl2onnx') or 'missing'}"
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip the items whose marked requirement this environment lacks, and no others."""
    for item in items:
        for name, reason in SKIP_REASONS.items():
            if item.get_closest_marker(name) is not None and not has(name):
                item.add_marker(pytest.mark.skip(reason=reason))
                break


# ------------------------------------------------------------- hypothesis
try:
    from hypothesis import HealthCheck, settings
except ImportError:  # hypothesis is a dev dependency; conftest must not need it
    pass
else:
    # Building and running onnxruntime sessions is slow and uneven: no per-example
    # deadline. On CI, derandomized so a run is reproducible.
    settings.register_profile(
        "lossgraph", deadline=None, suppress_health_check=[HealthCheck.too_slow]
    )
    settings.register_profile(
        "lossgraph-ci",
        parent=settings.get_profile("lossgraph"),
        derandomize=True,
        database=None,
        print_blob=True,
    )
    if "HYPOTHESIS_PROFILE" not in os.environ:
        settings.load_profile("lossgraph-ci" if os.environ.get("CI") else "lossgraph")
    else:
        settings.load_profile(os.environ["HYPOTHESIS_PROFILE"])


# ----------------------------------------------------------------- fixtures
@pytest.fixture
def rng() -> np.random.Generator:
    """A seeded generator: every test draws the same numbers on every run."""
    return np.random.default_rng(0)


SessionFactory = Callable[..., Any]


# The two factories below hold no state, so they are session-scoped: that also lets
# hypothesis tests (@given) use them, which it refuses for function-scoped fixtures.
@pytest.fixture(scope="session")
def ort_session() -> SessionFactory:
    """Factory: ``ort_session(model, **options)`` -> ``onnxruntime.InferenceSession``.

    ``model`` is a ``ModelProto``, serialized bytes or a path. The session runs on
    the CPU provider with warnings silenced (``log_severity_level=3``); keyword
    arguments set further ``SessionOptions`` attributes, e.g.
    ``intra_op_num_threads=1``.
    """
    if not has("onnxruntime"):
        pytest.skip("needs onnxruntime (pip install 'lossgraph[runtime]')")

    def make(model: onnx.ModelProto | bytes | str | os.PathLike, **options: Any) -> Any:
        if isinstance(model, bytes):
            model = onnx.load_model_from_string(model)
        elif not isinstance(model, onnx.ModelProto):
            model = onnx.load(os.fspath(model))
        return create_session(model, session_options=quiet_session_options(**options))

    return make


@pytest.fixture(scope="session")
def run_model(ort_session: SessionFactory) -> Callable[..., dict[str, np.ndarray]]:
    """``run_model(model, feeds, **options)`` -> ``{output name: array}`` for all outputs."""

    def run(
        model: onnx.ModelProto | bytes | str | os.PathLike,
        feeds: Mapping[str, Any],
        **options: Any,
    ) -> dict[str, np.ndarray]:
        session = ort_session(model, **options)
        names = [o.name for o in session.get_outputs()]
        return dict(zip(names, session.run(names, dict(feeds))))

    return run
