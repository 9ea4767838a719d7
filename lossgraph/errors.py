"""lossgraph's exception hierarchy.

Every error a user can cause derives from :class:`LossgraphError`, and its message
names the tensor, node or option at fault, what would be valid, and how to fix it.
The concrete classes also derive from the matching built-in exception so that code
written against ``ValueError`` or ``TypeError`` keeps working.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class LossgraphError(Exception):
    """Base class of every error lossgraph raises on purpose."""


class InvalidModelError(LossgraphError, ValueError):
    """The model is not a valid ONNX model (it fails the ONNX checker or shape inference)."""


class ModelChangedError(InvalidModelError):
    """The model a program reads its initial state from changed after compile."""


class UnsupportedModelError(LossgraphError, ValueError):
    """The model is valid ONNX but uses something lossgraph cannot handle (yet)."""


class UnknownNameError(LossgraphError, ValueError):
    """A tensor, output or initializer name does not exist in the model."""


class UnsupportedOptionError(LossgraphError, ValueError):
    """An option has a value lossgraph does not accept."""


class DTypeMismatchError(LossgraphError, TypeError):
    """A tensor has an element type the operation cannot use."""


class ShapeMismatchError(LossgraphError, ValueError):
    """A tensor has a shape the operation cannot use."""


class NameCollisionError(LossgraphError, ValueError):
    """A name explicitly requested by the user is already taken in the model."""


class InternalError(LossgraphError, AssertionError):
    """lossgraph produced something invalid: a bug in lossgraph, please report it."""


def suggest(name: str, candidates: Iterable[str], what: str = "names") -> str:
    """Return ' Did you mean X? Valid <what>: a, b, c.' for an error message."""
    candidates = list(candidates)
    close = difflib.get_close_matches(name, candidates, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    shown = ", ".join(repr(c) for c in candidates[:20])
    more = f", ... ({len(candidates)} in all)" if len(candidates) > 20 else ""
    listing = f" Valid {what}: {shown}{more}." if candidates else f" The model has no {what}."
    return hint + listing


class MissingGradientError(LossgraphError, NotImplementedError):
    """An op on the path from a weight to the loss has no gradient rule."""


class RuntimeUnavailableError(LossgraphError, ImportError):
    """The requested runtime feature (e.g. the onnxruntime training build) is not installed."""


class ConvergenceError(LossgraphError, ArithmeticError, RuntimeError):
    """Training diverged: the loss became NaN or infinite. Also a ``RuntimeError``, the
    onnxcustom's base for it."""


class InvalidDataError(LossgraphError, ValueError):
    """Training or prediction data cannot be used (NaN, wrong type or shape, empty)."""


class InvalidProgramError(InvalidModelError):
    """A saved program or checkpoint folder (or an adapter file) is damaged, of another
    format, or not one at all."""


class AdapterMismatchError(LossgraphError, ValueError):
    """An adapter file does not fit the program it is loaded into: another base model, other
    targets, rank or alpha (lossgraph.export.adapters)."""


class UnsafeWriteError(LossgraphError, FileExistsError):
    """Writing would replace a file or folder that lossgraph did not create."""


class MissingFolderError(UnsafeWriteError, FileNotFoundError):
    """The folder to write into does not exist. A ``FileNotFoundError`` (what onnxcustom's
    ``save_onnx_graph`` raised), and the :class:`UnsafeWriteError` it was before."""


class NoGradientError(LossgraphError, ValueError):
    """A weight asked for reaches the loss only through non-differentiable values."""


class InvalidRuleError(LossgraphError, TypeError):
    """A gradient rule broke the rule contract (one gradient or ``None`` per input)."""


class LossgraphDeprecationWarning(DeprecationWarning):
    """A spelling that still works in this release and goes in the next (lossgraph.deprecation)."""


class LossgraphWarning(UserWarning):
    """Base class of every warning lossgraph gives (but deprecations)."""


class ConvergenceWarning(LossgraphWarning):
    """Training stopped before it converged (the iterations ran out)."""


class ValidationLossWarning(LossgraphWarning):
    """The validation loss is NaN or infinite: the model predicts values the loss cannot
    score on the validation data (training goes on; the value is recorded)."""


class StuckWeightWarning(LossgraphWarning):
    """A weight to train reaches the loss only through ops whose gradient is zero
    everywhere: training never changes it."""


class FixedBatchWarning(LossgraphWarning):
    """The model's batch is fixed (torch.onnx.export's default) and lossgraph cannot prove
    which of its constants hold it: the program trains in batches of exactly that size."""


class TiedWeightWarning(LossgraphWarning):
    """An initializer to train is read by several layers that look independent (an
    exporter merged initializers of equal values): it trains as one tied weight, unless
    ``untie`` gives each layer its own copy."""


class FoldedWeightWarning(LossgraphWarning):
    """A weight of the export is not a parameter of the module it came from (the exporter
    folded a BatchNorm into it, computed it from a parametrization, stored a tied tensor
    twice) or the export dropped one: training trains another model than the module."""


class EvaluationError(LossgraphError, RuntimeError):
    """Running a graph failed while training or predicting."""


class ProviderError(LossgraphError, ValueError, RuntimeError):
    """The requested device or execution provider cannot run the graphs. Also a
    ``RuntimeError``, onnxcustom's base for it."""


class NotFittedError(LossgraphError, AttributeError):
    """An estimator was asked for what only a fit gives (its trained state, a prediction)."""


__all__ = [
    "LossgraphError", "InvalidModelError", "ModelChangedError", "UnsupportedModelError",
    "UnknownNameError",
    "UnsupportedOptionError", "DTypeMismatchError", "ShapeMismatchError", "NameCollisionError",
    "InternalError", "MissingGradientError", "RuntimeUnavailableError", "ConvergenceError",
    "InvalidDataError", "InvalidProgramError", "AdapterMismatchError", "UnsafeWriteError",
    "MissingFolderError",
    "NoGradientError", "InvalidRuleError", "EvaluationError", "ProviderError", "NotFittedError",
    "LossgraphWarning", "LossgraphDeprecationWarning", "ConvergenceWarning",
    "ValidationLossWarning", "StuckWeightWarning", "TiedWeightWarning", "FixedBatchWarning",
    "FoldedWeightWarning",
    "suggest",
]
