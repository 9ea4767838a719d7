"""lossgraph, the subject: one implementation per fuse mode, driven as a user drives it.

    program = lossgraph.compile_program(model, loss="squared_error",
                                optimizer=Momentum(0.01, momentum=0.9, nesterov=True), fuse=mode)
    Trainer(program).fit(X, y, epochs=1, batch_size=batch, shuffle=False, warm_start=...)
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

import lossgraph
from benchmarks.problems import (
    LEARNING_RATE,
    MOMENTUM,
    Implementation,
    Problem,
    Unavailable,
    Weights,
)
from lossgraph.optim import Momentum

FUSE_MODES = ("separate", "step", "epoch")


@dataclass
class Compiled:
    """One lossgraph fuse mode of one model: its program (or why it has none) and setup costs."""

    mode: str
    program: lossgraph.TrainingProgram | None = None
    error: str | None = None
    compile_s: float = 0.0
    trainer_s: list[float] = field(default_factory=list)


def compile_modes(problem: Problem) -> list[Compiled]:
    """The problem's model compiled once per fuse mode; a mode that fails keeps its error."""
    results = []
    for mode in FUSE_MODES:
        start = time.perf_counter()
        try:
            program = lossgraph.compile_program(problem.onnx_model, loss="squared_error",
                                        optimizer=Momentum(LEARNING_RATE, momentum=MOMENTUM,
                                                           nesterov=True),
                                        fuse=mode)
        except Exception as error:  # reported in the mode's row, the run goes on
            results.append(Compiled(mode, error=f"{type(error).__name__}: {error!s:.200}"))
            continue
        results.append(Compiled(mode, program, compile_s=time.perf_counter() - start))
    return results


def lossgraph_trainer(compiled: Compiled, problem: Problem, batch: int) -> Implementation:
    """A Trainer of the compiled program, one ``fit`` of one epoch per call."""
    if compiled.error:
        raise Unavailable(compiled.error)
    start = time.perf_counter()
    trainer = lossgraph.Trainer(compiled.program)
    compiled.trainer_s.append(time.perf_counter() - start)
    X, y = problem.X, problem.y

    def epoch() -> None:  # the first call (the warm-up) starts from the program's state
        trainer.fit(X, y, epochs=1, batch_size=batch, shuffle=False, progress=False,
                    warm_start=trainer.steps_ > 0)

    def weights() -> Weights:
        state = trainer.state
        return [np.asarray(state[n], np.float32).reshape(w.shape)
                for n, w in zip(problem.weight_names, problem.weights)]

    return epoch, weights
