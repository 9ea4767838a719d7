"""What compile adds around the optimizer's update: gradient clipping before it, an
exponential moving average (EMA) of the weights after it.

For the gradients ``g_1 ... g_n`` the optimizer receives (the loss's plus the penalty's)
and a weight ``w`` whose update gives ``w'``::

    clipping (max_grad_norm=c)   norm = sqrt(sum_i sum(g_i^2))                (a graph output)
                                 g_i <- g_i min(1, c / (norm + 1e-6))     before the update
    averaging (ema_decay=d)      e' = e + (1 - d)(w' - e)                     after the update
                                 e' = w' at update 1

Clipping is ``torch.nn.utils.clip_grad_norm_(params, c)`` after ``loss.backward()``; the
average is ``torch.optim.swa_utils.AveragedModel(model,
multi_avg_fn=get_ema_multi_avg_fn(d))`` updated after every step: its first update
copies the weights, the next ones are ``torch.lerp(e, w', 1 - d)`` (the form written
above, ``1 - d`` rounded once from float64, as torch passes it). The EMA is one more
state per weight (``<weight>_ema``, after the optimizer's states), carried, saved,
checkpointed and reset like them; its value before the first update is the weight's.
The graphs read the update number ``t`` (1-based) to know the first update, and output
the norm where they clip (role ``grad_norm``; an epoch graph stacks one per update,
``grad_norms``). Both are emitted where the update is
(:class:`~lossgraph.passes.fuse.StepGraph`, :func:`~lossgraph.optim.build_update`); on
packed weights the norm is one reduction over the flat gradient.
"""

from __future__ import annotations

import math
import numbers
import reprlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from onnx import helper

from .builder import GraphBuilder
from .errors import UnsupportedOptionError

if TYPE_CHECKING:  # the optimizers' update graph builds on these options
    from .optim import Optimizer

__all__ = ["UpdateOptions", "EMA_SUFFIX", "CLIP_EPSILON"]

#: The EMA state of weight ``w`` is named ``w_ema`` (or a free name after it).
EMA_SUFFIX = "ema"
#: What the norm is shifted by before dividing, as torch's ``clip_grad_norm_``.
CLIP_EPSILON = 1e-6


@dataclass(frozen=True)
class UpdateOptions:
    """Gradient clipping by global norm and an EMA of the weights (module docstring);
    None: not done."""

    max_grad_norm: float | None = None
    ema_decay: float | None = None

    def __post_init__(self) -> None:
        if self.max_grad_norm is not None:
            object.__setattr__(self, "max_grad_norm", _positive("max_grad_norm",
                                                                self.max_grad_norm))
        if self.ema_decay is not None:
            decay = _real("ema_decay", self.ema_decay)
            if not 0 <= decay < 1:
                raise UnsupportedOptionError(
                    f"ema_decay={self.ema_decay!r} must lie in [0, 1): the average keeps "
                    "d of itself and takes 1 - d of the new weights each update (e.g. 0.999; "
                    "1 would never move).")
            object.__setattr__(self, "ema_decay", decay)

    @property
    def clips(self) -> bool:
        return self.max_grad_norm is not None

    @property
    def averages(self) -> bool:
        return self.ema_decay is not None

    def __bool__(self) -> bool:
        return self.clips or self.averages

    # -- state ---------------------------------------------------------------------------
    def state_names(self, optimizer: Optimizer, weight: str) -> list[str]:
        """The states of ``weight``: the optimizer's, then its EMA (where averaged)."""
        return [*optimizer.state_names(weight),
                *([f"{weight}_{EMA_SUFFIX}"] if self.averages else [])]

    def initial_state(self, optimizer: Optimizer, weight: np.ndarray) -> list[np.ndarray]:
        """The states before the first update: the optimizer's, then the weight itself."""
        return [*optimizer.initial_state(weight), *([weight.copy()] if self.averages else [])]

    def to_dict(self) -> dict[str, float]:
        """The options set, for the manifest (``{}`` when none is)."""
        return {k: v for k, v in (("max_grad_norm", self.max_grad_norm),
                                  ("ema_decay", self.ema_decay)) if v is not None}

    @classmethod
    def from_dict(cls, record: Mapping[str, Any] | None) -> UpdateOptions:
        """The options :meth:`to_dict` wrote (None: none)."""
        record = dict(record or {})
        unknown = sorted(set(record) - {"max_grad_norm", "ema_decay"})
        if unknown:
            raise UnsupportedOptionError(f"Unknown update option {unknown[0]!r} (known: "
                                         "max_grad_norm, ema_decay).")
        return cls(**record)

    # -- the update as ONNX ------------------------------------------------------------------
    def emit_update(self, b: GraphBuilder, optimizer: Optimizer, gradients: Mapping[str, str],
                    states: Mapping[str, Sequence[str]], learning_rate: str, step: str,
                    dtype: Any) -> tuple[dict[str, list[str]], str | None]:
        """Emit every weight's update into ``b``: ``({weight: [new weight, new states...]},
        the gradients' norm or None)``. ``gradients`` maps each weight to its gradient,
        ``states`` to its states in :meth:`state_names` order."""
        norm = None
        if self.clips:
            gradients, norm = self._clip(b, gradients, dtype)
        new = {}
        for weight, grad in gradients.items():
            own = list(states[weight])
            average = own.pop() if self.averages else None  # the last state (state_names)
            new_weight, new_states = optimizer.emit_update(
                b, weight, grad, own, learning_rate, step, dtype)
            if average is not None:
                new_states = [*new_states, self._average(b, average, new_weight, step, weight,
                                                         dtype)]
            new[weight] = [new_weight, *new_states]
        return new, norm

    def _clip(self, b: GraphBuilder, gradients: Mapping[str, str], dtype: Any
              ) -> tuple[dict[str, str], str]:
        squares = [b.reduce("ReduceSumSquare", g, keepdims=0, hint=f"{w}_grad_square_sum")
                   for w, g in gradients.items()]
        total = squares[0] if len(squares) == 1 else b.Sum(*squares, hint="grad_square_sum")
        norm = b.Sqrt(total, hint="grad_norm")
        shifted = b.Add(norm, b.const(CLIP_EPSILON, dtype, "clip_epsilon"))
        ratio = b.Div(b.const(self.max_grad_norm, dtype, "max_grad_norm"), shifted)
        scale = b.Min(ratio, b.const(1.0, dtype, "one"), hint="clip_scale")
        return {w: b.Mul(g, scale, hint=f"{w}_grad_clipped") for w, g in gradients.items()}, norm

    def _average(self, b: GraphBuilder, ema: str, new_weight: str, step: str, weight: str,
                 dtype: Any) -> str:
        def scalars() -> tuple[str, str]:
            # (0, 1) at the first update, (1, 1 - d) after it; 1 - d folded in float64, as
            # torch passes it to lerp (1 - float32(d) is off by up to 1e-5 of it at 0.999)
            elem_type = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
            one = b.const(1, np.int64, "one_step")
            later = b.Min(b.Sub(step, one), one)
            after_first = b.Cast(later, to=elem_type, hint="after_first_update")
            at_first = b.Cast(b.Sub(one, later), to=elem_type, hint="at_first_update")
            take = b.Max(at_first, b.const(1.0 - self.ema_decay, dtype, "one_minus_ema_decay"),
                         hint="ema_take")
            return after_first, take

        after_first, take = b.memo(("ema", self.ema_decay, step), scalars)
        # torch's lerp, e + (1 - d)(w' - e), from e = 0 at the first update: exactly w' then
        kept = b.Mul(ema, after_first, hint=f"{weight}_ema_kept")
        return b.Add(kept, b.Mul(b.Sub(new_weight, kept), take), hint=f"{weight}_ema_new")


def _real(what: str, value: Any) -> float:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real) \
            or not math.isfinite(value):
        raise UnsupportedOptionError(
            f"{what}={reprlib.repr(value)} must be a finite real number (or None: off).")
    return float(value)


def _positive(what: str, value: Any) -> float:
    number = _real(what, value)
    if number <= 0:
        raise UnsupportedOptionError(
            f"{what}={value!r} must be > 0: the gradients are scaled so that their global "
            "norm is at most it (e.g. 1.0); pass None to leave them unclipped.")
    return number
