"""Let PyPI's torchvision import beside the CPU build of torch (test environments only).

PyPI's torchvision wheel is built against the CUDA build of torch; beside the CPU build
(``torch==2.13.0`` from this machine's disk) its C++ ops do not load, and ``import
torchvision`` fails registering their fake kernels ("operator torchvision::nms does not
exist"). transformers and timm import torchvision whenever it is installed, so they fail
too. The classification models lossgraph's tests build need none of those ops.

.ci/setup-env copies this module into the venv's site-packages with a ``.pth`` line that
imports it at start-up. It imports nothing heavy: it adds an import hook that, only while
torchvision's own modules execute, makes ``torch.library.register_fake`` skip an op that
does not exist. Nothing of lossgraph depends on it; a matched torchvision needs none.
"""

import importlib.machinery
import sys


class _TolerantLoader:
    """torchvision's loader, its modules executed with the lenient register_fake."""

    def __init__(self, loader) -> None:  # noqa: ANN001
        self.loader = loader

    def create_module(self, spec):  # noqa: ANN001
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:  # noqa: ANN001
        import torch.library

        real = torch.library.register_fake

        def lenient(op, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003
            inner = real(op, *args, **kwargs)
            if not callable(inner):
                return inner

            def register(fn):  # noqa: ANN001
                try:
                    return inner(fn)
                except RuntimeError:  # the C++ op is absent beside the CPU torch
                    return fn

            return register

        torch.library.register_fake = lenient
        try:
            self.loader.exec_module(module)
        finally:
            torch.library.register_fake = real


class _Finder:
    """Hands torchvision's spec the tolerant loader; every other import is untouched."""

    def find_spec(self, name, path, target=None):  # noqa: ANN001
        if name != "torchvision":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _TolerantLoader(spec.loader)
        return spec


if not any(isinstance(f, _Finder) for f in sys.meta_path):
    sys.meta_path.insert(0, _Finder())
