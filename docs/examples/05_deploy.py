"""05: deploy the trained model with plain onnxruntime.

After training, ``Trainer.to_inference_model()`` returns the original inference model with
the trained weights written back as initializers: no loss, no gradients, no optimizer,
the same inputs and outputs as before. Saved to a file, it runs in any onnxruntime
``InferenceSession``, with no lossgraph on the serving side. The served model's R2 on rows
held out is printed beside that of scikit-learn's ``MLPRegressor`` of the same shape
trained the same way (tanh, Adam, same epochs and batches; its own initial weights).

Run: python docs/examples/05_deploy.py
"""

from __future__ import annotations

import tempfile
import warnings
from pathlib import Path

import numpy as np
import onnx
import onnxruntime
from sklearn.metrics import r2_score
from sklearn.neural_network import MLPRegressor

import lossgraph
from lossgraph.optim import Adam

# A one-hidden-layer MLP written in ONNX text syntax, its weights as initializers.
model = onnx.parser.parse_model("""
    <ir_version: 8, opset_import: ["" : 18]>
    mlp (float[N, 2] x) => (float[N, 1] y)
    <float[2, 8] W1 = {0.06, -0.07, 0.32, 0.05, -0.27, 0.18, 0.65, 0.47,
                       -0.35, -0.63, -0.31, 0.02, -1.16, -0.11, -0.62, -0.37},
     float[8] b1 = {0, 0, 0, 0, 0, 0, 0, 0},
     float[8, 1] W2 = {-0.27, -0.16, 0.21, 0.52, -0.06, 0.68, -0.33, 0.18},
     float[1] b2 = {0}>
    {
        a = MatMul(x, W1)
        z = Add(a, b1)
        h = Tanh(z)
        p = MatMul(h, W2)
        y = Add(p, b2)
    }
""")
rng = np.random.default_rng(0)
X = rng.uniform(-2, 2, size=(1000, 2)).astype(np.float32)
y = (np.sin(X[:, :1]) * np.cos(X[:, 1:])).astype(np.float32)
X, y, X_test, y_test = X[:800], y[:800], X[800:], y[800:]

trainer = lossgraph.Trainer(lossgraph.compile_program(model, optimizer=Adam(0.01)))
trainer.fit(X, y, epochs=30, batch_size=50, random_state=0, progress=False)
print(f"train loss by epoch: {trainer.train_losses_[0]:.4f} -> {trainer.train_losses_[-1]:.4f}")
assert trainer.train_losses_[-1] < trainer.train_losses_[0] / 2

trained = trainer.to_inference_model()
with tempfile.TemporaryDirectory() as folder:
    path = Path(folder) / "mlp_trained.onnx"
    onnx.save(trained, path)
    # Serving: a plain InferenceSession on the file; lossgraph is not involved.
    served = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    inputs = [i.name for i in served.get_inputs()]
    outputs = [o.name for o in served.get_outputs()]
    print(f"{path.name}: {path.stat().st_size} bytes, inputs {inputs}, outputs {outputs}")
    prediction = served.run(["y"], {"x": X_test})[0]

assert inputs == ["x"] and outputs == ["y"]  # the inference model's own: nothing of training
np.testing.assert_allclose(prediction, trainer.predict(X_test), rtol=1e-5, atol=1e-6)
with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # scikit-learn's ConvergenceWarning: 30 epochs on purpose
    reference = MLPRegressor(hidden_layer_sizes=(8,), activation="tanh", solver="adam",
                             learning_rate_init=0.01, batch_size=50, max_iter=30, alpha=0,
                             random_state=0).fit(X, y.ravel())
ours, theirs = r2_score(y_test, prediction), r2_score(y_test, reference.predict(X_test))
print(f"held-out R2: served model {ours:.4f}, scikit-learn MLPRegressor {theirs:.4f}")
assert abs(ours - theirs) < 0.02, (ours, theirs)  # different initial weights: near, not equal
print("OK: the exported model serves the trained weights in plain onnxruntime")
