"""01: train a scikit-learn model as ONNX.

A scikit-learn ``LinearRegression`` fitted on 4 rows is converted to ONNX by skl2onnx
(an ``ai.onnx.ml.LinearRegressor`` node). lossgraph compiles it into training graphs
(squared error, SGD) and trains it on all 2,000 rows; its predictions are checked against
a ``LinearRegression`` fitted by scikit-learn on the same rows.

Run: python docs/examples/01_train_sklearn_model.py
"""

from __future__ import annotations

import numpy as np
from skl2onnx import to_onnx
from sklearn.linear_model import LinearRegression

import lossgraph
from lossgraph.optim import SGD

rng = np.random.default_rng(0)
X = rng.normal(size=(2000, 5)).astype(np.float32)
y = (X @ np.array([1.5, -2.0, 0.5, 0.0, 3.0]) + 0.7 + 0.3 * rng.normal(size=2000))
y = y.astype(np.float32)

# A poor starting point: scikit-learn's fit on the first 4 rows, as ONNX.
start = LinearRegression().fit(X[:4], y[:4])
onx = to_onnx(start, X[:1], target_opset={"": 18, "ai.onnx.ml": 3})
print("inference model:", [node.op_type for node in onx.graph.node])

# compile: lower the ml op to standard ops, add the loss, derive gradients, add SGD.
program = lossgraph.compile_program(onx, loss="squared_error", optimizer=SGD(0.05))
print("trainable weights:", [w["name"] for w in program.manifest["weights"]])

trainer = lossgraph.Trainer(program)
trainer.fit(X, y, epochs=20, batch_size=100, random_state=0, progress=False)
print(f"train loss by epoch: {trainer.train_losses_[0]:.4f} -> {trainer.train_losses_[-1]:.4f}")

# SGD approaches the least-squares solution scikit-learn computes on all rows: the
# predictions agree to a tolerance (minibatch noise, float32), not to the bit.
reference = LinearRegression().fit(X, y).predict(X)
ours = trainer.predict(X).ravel()
gap = float(np.abs(ours - reference).max())
print(f"max |lossgraph - scikit-learn| prediction: {gap:.4f} (targets span {np.ptp(y):.1f})")
assert gap < 0.05, gap
print("OK: the ONNX model trained by lossgraph predicts like scikit-learn's own fit")
