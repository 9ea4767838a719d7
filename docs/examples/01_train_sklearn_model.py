"""01: train a scikit-learn model as ONNX.

A scikit-learn ``LinearRegression`` fitted on 4 rows is converted to ONNX by skl2onnx
(an ``ai.onnx.ml.LinearRegressor`` node). lossgraph compiles it into training graphs
(squared error, SGD) and trains it on 1,500 rows; its R2 on the 500 rows held out is
printed beside that of a ``LinearRegression`` fitted by scikit-learn on the same rows.

Run: python docs/examples/01_train_sklearn_model.py
"""

from __future__ import annotations

import numpy as np
from skl2onnx import to_onnx
from sklearn.linear_model import LinearRegression
from sklearn.metrics import r2_score
from sklearn.model_selection import train_test_split

import lossgraph
from lossgraph.optim import SGD

rng = np.random.default_rng(0)
X = rng.normal(size=(2000, 5)).astype(np.float32)
y = (X @ np.array([1.5, -2.0, 0.5, 0.0, 3.0]) + 0.7 + 0.3 * rng.normal(size=2000))
y = y.astype(np.float32)
X_train, X_test, y_train, y_test = train_test_split(X, y, test_size=500, random_state=0)

# A poor starting point: scikit-learn's fit on 4 rows, as ONNX.
start = LinearRegression().fit(X_train[:4], y_train[:4])
onx = to_onnx(start, X[:1], target_opset={"": 18, "ai.onnx.ml": 3})
print("inference model:", [node.op_type for node in onx.graph.node])

# compile: lower the ml op to standard ops, add the loss, derive gradients, add SGD.
program = lossgraph.compile_program(onx, loss="squared_error", optimizer=SGD(0.05))
print("trainable weights:", [w["name"] for w in program.manifest["weights"]])

trainer = lossgraph.Trainer(program)
trainer.fit(X_train, y_train, epochs=20, batch_size=100, random_state=0, progress=False)
print(f"train loss by epoch: {trainer.train_losses_[0]:.4f} -> {trainer.train_losses_[-1]:.4f}")

# SGD approaches the least-squares solution scikit-learn computes on the same rows: the
# held-out scores agree to a tolerance (minibatch noise, float32), not to the bit.
reference = LinearRegression().fit(X_train, y_train)
ours = r2_score(y_test, trainer.predict(X_test).ravel())
theirs = r2_score(y_test, reference.predict(X_test))
print(f"held-out R2: lossgraph {ours:.4f}, scikit-learn LinearRegression {theirs:.4f}")
assert abs(ours - theirs) < 0.001, (ours, theirs)
print("OK: the ONNX model trained by lossgraph predicts like scikit-learn's own fit")
