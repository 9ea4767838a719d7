"""Running training programs in onnxruntime: sessions, the state ring, the engine and
the Trainer built on it.

- :class:`~lossgraph.runtime.engine.Engine`: a program's graphs over one live state
  (sessions, buffers, the rate and step scalars; prepare, step, apply, evaluate);
- :class:`~lossgraph.runtime.trainer.Trainer`: the training loop, scikit-learn style;
- :class:`~lossgraph.runtime.callbacks.Callback` and the loggers (``CSVLogger``,
  ``TensorBoard``) it calls; :func:`~lossgraph.runtime.checkpoints.latest_checkpoint` of
  the checkpoints it rotates;
- :mod:`~lossgraph.runtime.metrics` (scores computed by a graph over the predictions) and
  :class:`~lossgraph.runtime.early_stopping.EarlyStopping`, which the Trainer's fit takes.

The names are loaded on first use: the fusion modes (:mod:`lossgraph.modes`), which the
engine runs, build on this package's lower modules (the ring, sessions, the separate step).
"""

from __future__ import annotations

from ..lazy import lazy_names

#: Public name -> the module of this package that defines it.
_HOMES = {
    "CSVLogger": ".callbacks",
    "Callback": ".callbacks",
    "EarlyStopping": ".early_stopping",
    "Engine": ".engine",
    "Metrics": ".metrics",
    "TensorBoard": ".callbacks",
    "Trainer": ".trainer",
    "create_session": ".session",
    "latest_checkpoint": "..paths",
    "training_build_available": ".session",
}

__all__ = sorted(_HOMES)
__getattr__ = lazy_names(__name__, _HOMES)
