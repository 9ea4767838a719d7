"""What this environment can run, and where the repository's files are.

The suite runs in two environments (docs/installation.md): the onnxruntime training
build runs everything; plain current onnxruntime runs everything that does not need the
training build. Markers (tests/conftest.py) skip what a test needs and the environment
lacks; for other optional packages use the flags ``HAS_ONNXRUNTIME``, ``HAS_TRAINING``,
``HAS_TORCH`` and ``HAS_SKL2ONNX`` (probed on first use), e.g.
``from support.environment import HAS_SKL2ONNX`` and
``@pytest.mark.skipif(not HAS_SKL2ONNX, reason="needs skl2onnx")``, or ``has("torch")``.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from lossgraph import training_build
from lossgraph.target import use_target

#: The repository's root folder, and its golden models.
ROOT = Path(__file__).resolve().parents[2]
GOLDEN_MODELS = ROOT / "golden_models"


def _import_or_none(module: str) -> Any | None:
    """The module if it is installed and imports cleanly, else None.

    Checking the spec first keeps absent packages cheap; catching every exception
    (not only ImportError) turns a broken binary install into "missing" rather
    than a collection error in every test module.
    """
    try:
        if importlib.util.find_spec(module) is None:
            return None
        return importlib.import_module(module)
    except Exception:
        return None


# Probed on first use, not at import: torch and skl2onnx take seconds to import,
# and a run of tests that need neither should not pay for them. Read them as
# ``from support.environment import HAS_TORCH`` (module __getattr__, PEP 562) or
# ``has("torch")``.
_PROBES: dict[str, Callable[[], bool]] = {
    "onnxruntime": lambda: _import_or_none("onnxruntime") is not None,
    "training": training_build.available,
    "torch": lambda: _import_or_none("torch") is not None,
    "skl2onnx": lambda: _import_or_none("skl2onnx") is not None,
}


@functools.cache
def has(capability: str) -> bool:
    """Whether this environment has ``capability`` (a key of ``_PROBES``), importable."""
    return _PROBES[capability]()


def __getattr__(name: str) -> bool:
    """``HAS_ONNXRUNTIME``, ``HAS_TRAINING``, ``HAS_TORCH``, ``HAS_SKL2ONNX``."""
    capability = name.removeprefix("HAS_").lower()
    if name.startswith("HAS_") and capability in _PROBES:
        return has(capability)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


#: The libraries the supported-models suite builds its models from.
MODEL_LIBRARIES = ("torchvision", "timm", "transformers")


@functools.cache
def model_library(name: str) -> Any | None:
    """torchvision, timm or transformers (:data:`MODEL_LIBRARIES`), or None where it or
    torch is not installed (the suite's cases of it skip). CI's PyPI torchvision imports
    beside the CPU torch through .ci/torchvision_cpu.py's start-up hook."""
    if name not in MODEL_LIBRARIES:
        raise KeyError(f"no model library {name!r}: one of {MODEL_LIBRARIES}")
    return _import_or_none(name) if has("torch") else None


def newer_runtime() -> contextlib.AbstractContextManager:
    """The onnxruntime target (the opsets of onnxruntime 1.20 and later), or a skip where
    the runtime is the training build, which loads opsets up to 21 only."""
    import onnxruntime

    if tuple(int(p) for p in onnxruntime.__version__.split(".")[:2]) < (1, 20):
        pytest.skip("onnxruntime-training 1.19 loads opsets up to 21; this op is opset 22+")
    return use_target("onnxruntime")


#: Ray's settings for a local test cluster: no token authentication, and Ray Train's
#: controller polling its workers every 0.2 s instead of 2 s (shorter runs).
RAY_ENVIRONMENT = {"RAY_AUTH_MODE": "disabled", "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.2"}


@contextlib.contextmanager
def local_ray_cluster(cpus: int = 2) -> Iterator[None]:
    """A local Ray cluster of ``cpus`` CPUs under :data:`RAY_ENVIRONMENT`, stopped (and the
    environment variables restored) on leaving."""
    import ray

    saved = {name: os.environ.get(name) for name in RAY_ENVIRONMENT}
    os.environ.update(RAY_ENVIRONMENT)
    ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
