"""lossgraph.compat's learning penalties (lossgraph/compat/learning_penalty.py): the elastic
penalty graph against numpy, no graph for no penalty, the aliases and the errors."""

from __future__ import annotations

import numpy as np
import pytest
from support.estimators import run_onnx

from lossgraph.compat import BaseLearningPenalty, ElasticLearningPenalty, NoLearningPenalty
from lossgraph.errors import UnsupportedOptionError


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_elastic_penalty_graph_matches_numpy(dtype):
    penalty = ElasticLearningPenalty(l1=0.1, l2=0.3)
    weights = {"coef": np.array([[-1.0], [0.5]], dtype), "intercept": np.array([2.0], dtype)}
    assert penalty.penalty(weights) == {"coef": {"l1": 0.1, "l2": 0.3},
                                        "intercept": {"l1": 0.1, "l2": 0.3}}
    value, coef_grad, intercept_grad = run_onnx(penalty.build_onnx_function(weights), weights)
    expected = sum(0.1 * np.abs(w).sum() + 0.3 * (w.astype(np.float64) ** 2).sum()
                   for w in weights.values())
    assert value == pytest.approx(expected, rel=1e-6)
    np.testing.assert_allclose(coef_grad, 0.1 * np.sign(weights["coef"]) + 0.6 * weights["coef"],
                               rtol=1e-6)
    np.testing.assert_allclose(intercept_grad, [0.1 + 1.2], rtol=1e-6)


def test_no_penalty_has_no_graph():
    assert NoLearningPenalty().penalty(["coef"]) == {}
    assert NoLearningPenalty().build_onnx_function({"coef": np.zeros(2, np.float32)}) is None


@pytest.mark.parametrize("alias,kind", [(None, NoLearningPenalty), ("", NoLearningPenalty),
                                        ("NoLearningPenalty", NoLearningPenalty),
                                        ("elastic", ElasticLearningPenalty),
                                        ("l1l2", ElasticLearningPenalty),
                                        ("ElasticLearningPenalty", ElasticLearningPenalty)])
def test_penalty_aliases(alias, kind):
    assert type(BaseLearningPenalty.select(alias)) is kind


def test_bad_penalty_names_and_options_raise():
    with pytest.raises(UnsupportedOptionError, match="Did you mean 'l1l2'"):
        BaseLearningPenalty.select("l1l3")
    with pytest.raises(UnsupportedOptionError):
        ElasticLearningPenalty(l1=-0.1)
