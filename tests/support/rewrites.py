"""What the tests of the speed rewrites (tests/speed) share: a graph's op types, an epoch
graph's Scan body, and a rewrite checked against the plain form it replaces."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np
import onnx

import lossgraph
from lossgraph.runtime.session import create_session


def ops(graph: onnx.GraphProto) -> list[str]:
    return [node.op_type for node in graph.node]


def scan_body(graph: onnx.ModelProto) -> onnx.GraphProto:
    return next(n for n in graph.graph.node if n.op_type == "Scan").attribute[0].g


def plain_and_rewritten(text: str, weights: Sequence[str], rewrite: Callable) -> tuple:
    """The gradient of the one-graph model ``text`` (loss output ``loss``) and that
    gradient after ``rewrite``."""
    plain = lossgraph.gradient(onnx.parser.parse_model(text), weights=list(weights),
                               loss_name="loss")
    return plain, rewrite(plain)


def same_outputs(plain: onnx.ModelProto, rewritten: onnx.ModelProto,
                 feeds: Mapping[str, np.ndarray]) -> None:
    """The rewritten model computes the plain one's outputs (to float32 rounding)."""
    names = [o.name for o in plain.graph.output]
    for name, ours, theirs in zip(names, create_session(rewritten).run(names, feeds),
                                  create_session(plain).run(names, feeds)):
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6, err_msg=name)


def specialized_step(program, batch: int, data: Mapping[str, np.ndarray], run_model,
                     rtol: float = 0.0, atol: float = 0.0) -> onnx.ModelProto:
    """``program``'s ``train_step`` specialized to ``batch`` rows (``SpecializeBatch``),
    once checked to compute the general graph's outputs from ``data`` (its data inputs),
    the program's state, a learning rate of 0.05 and step 1: bit for bit, or to ``rtol``
    and ``atol``."""
    from lossgraph.speed import SpecializeBatch

    general = program.graphs["train_step"]
    specialized = SpecializeBatch(batch)(general).model
    feeds = {**data, **program.state,
             program.io("train_step", "learning_rate")[0]: np.array(0.05, np.float32),
             program.io("train_step", "step")[0]: np.array(1, np.int64)}
    expected = run_model(general, feeds)
    for name, value in run_model(specialized, feeds).items():
        np.testing.assert_allclose(value, expected[name], rtol=rtol, atol=atol, err_msg=name)
    return specialized
