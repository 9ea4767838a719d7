"""Deployment: what lossgraph writes for the runtimes people deploy to.

- :func:`to_ort_artifacts` (:mod:`lossgraph.export.artifacts`): onnxruntime's on-device
  training artifacts (training, eval and optimizer models and a checkpoint), written
  without torch or the training build.
- :func:`to_inference_model`, :func:`save_inference_model`
  (:mod:`lossgraph.export.inference`): the inference model with trained weights and
  nothing of training left.
- :func:`export_adapters`, :func:`load_adapters` (:mod:`lossgraph.export.adapters`): a
  program's LoRA adapters alone, as safetensors (PEFT's names), ``.npz`` or onnxruntime's
  ``.onnx_adapter``, and back; :func:`with_adapter_inputs`: an inference model onnxruntime
  feeds an ``.onnx_adapter``'s tensors to.
"""

from __future__ import annotations

from ..lazy import lazy_names

#: Public name -> the module of this package that defines it.
_HOMES = {
    "to_ort_artifacts": ".artifacts",
    "read_ort_checkpoint": ".ort_checkpoint",
    "to_inference_model": ".inference",
    "save_inference_model": ".inference",
    "export_adapters": ".adapters",
    "load_adapters": ".adapters",
    "with_adapter_inputs": ".adapters",
}

__all__ = sorted(_HOMES)
__getattr__ = lazy_names(__name__, _HOMES)
