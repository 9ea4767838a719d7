"""dask_ml.wrappers.Incremental trains lossgraph.compat's estimators over a Dask array, one
block after the other through partial_fit (one sequential stream, not data-parallel): on a
local cluster of two worker processes it gives the weights of the same blocks fed to
partial_fit in this process. Skipped where dask-ml or distributed is not installed."""

from __future__ import annotations

import numpy as np
import pytest
from sklearn.base import clone
from support.estimators import (
    ESTIMATORS,
    FB,
    assert_states_close,
    classification,
    linear_onnx,
    small_linear,
)

from lossgraph.compat import LearningRateSGDNesterov
from lossgraph.errors import ShapeMismatchError

NEEDS = "needs dask-ml and distributed: pip install dask-ml 'dask[distributed]'"
dask = pytest.importorskip("dask", reason=NEEDS)
da = pytest.importorskip("dask.array", reason=NEEDS)
Incremental = pytest.importorskip("dask_ml.wrappers", reason=NEEDS).Incremental
distributed = pytest.importorskip("distributed", reason=NEEDS)

#: Uneven blocks of rows: 120 rows as 50, 40 and 30.
BLOCKS = (50, 40, 30)


@pytest.fixture(scope="module")
def client():
    """Two single-threaded worker processes: the estimator travels between processes as a
    pickle (its sessions made again there) and comes back to this one the same way."""
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                                  dashboard_address=None) as cluster, \
            distributed.Client(cluster) as running:
        yield running


def dask_arrays(X, y):
    return (da.from_array(X, chunks=(BLOCKS, X.shape[1:])), da.from_array(y, chunks=(BLOCKS,)))


def partial_fits(est, X, y, **kwargs):
    """``est`` (a clone) given the blocks of ``BLOCKS`` rows in order, in this process."""
    est = clone(est)
    for lo, hi in zip(np.cumsum((0, *BLOCKS[:-1])), np.cumsum(BLOCKS)):
        est.partial_fit(X[lo:hi], y[lo:hi], **kwargs)
    return est


@pytest.mark.parametrize("kind", sorted(ESTIMATORS))
def test_incremental_on_a_local_cluster_equals_partial_fit_in_one_process(kind, client):
    X, y, _ = small_linear()
    est = ESTIMATORS[kind](batch_size=16, random_state=0,
                           learning_rate=LearningRateSGDNesterov(eta0=0.02, power_t=0.5))
    incremental = Incremental(est, shuffle_blocks=False).fit(*dask_arrays(X, y))
    reference = partial_fits(est, X, y)
    assert not hasattr(est, "trained_coef_")  # Incremental trained a clone
    assert_states_close(incremental.estimator_.get_state(), reference.get_state(),
                        rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(incremental.train_losses_, reference.train_losses_, rtol=1e-6)
    assert len(reference.train_losses_) == len(BLOCKS)  # one epoch per block
    # after the fit: score on Dask arrays (gathered into memory), predict block by block
    Xd, yd = dask_arrays(X, y)
    assert incremental.score(Xd, yd) == pytest.approx(reference.score(X, y), rel=1e-6)
    predicted = Xd.map_blocks(incremental.estimator_.predict, chunks=(Xd.chunks[0], (1,)),
                              dtype=np.float32)
    np.testing.assert_allclose(predicted.compute(), reference.predict(X), rtol=1e-5,
                               atol=1e-6)


def test_incremental_passes_classes_to_each_block(client):
    X, y = classification(rows=120)
    est = FB(linear_onnx(np.full(10, 0.01), 0.0), learning_loss="log", batch_size=20,
             learning_rate=0.1, random_state=0)
    incremental = Incremental(est, shuffle_blocks=False).fit(*dask_arrays(X, y),
                                                             classes=[0, 1])
    assert_states_close(incremental.estimator_.get_state(),
                        partial_fits(est, X, y, classes=[0, 1]).get_state(), rtol=1e-6,
                        atol=1e-7)


def test_sample_weights_through_incremental_are_refused_by_row_count():
    """Incremental passes fit's keyword arguments unchanged to every block's partial_fit,
    so a whole-array sample_weight meets a block of fewer rows: a named error, not a
    silent broadcast (docs/out_of_core.md shows the loop that weighs blocks)."""
    X, y, _ = small_linear()
    with dask.config.set(scheduler="sync"), pytest.raises(ShapeMismatchError, match="rows"):
        Incremental(ESTIMATORS["forward_backward"](), shuffle_blocks=False).fit(
            *dask_arrays(X, y), sample_weight=np.ones(len(y), np.float32))
