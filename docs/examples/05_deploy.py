"""05: deploy the trained model with plain onnxruntime.

After training, ``Trainer.to_inference_model()`` returns the original inference model with
the trained weights written back as initializers: no loss, no gradients, no optimizer,
the same inputs and outputs as before. Saved to a file, it runs in any onnxruntime
``InferenceSession``, with no lossgraph on the serving side.

Run: python docs/examples/05_deploy.py
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import onnx
import onnxruntime

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
    prediction = served.run(["y"], {"x": X})[0]

assert inputs == ["x"] and outputs == ["y"]  # the inference model's own: nothing of training
np.testing.assert_allclose(prediction, trainer.predict(X), rtol=1e-5, atol=1e-6)
error = float(np.mean((prediction - y) ** 2))
print(f"served model's mean squared error: {error:.4f}")
print("OK: the exported model serves the trained weights in plain onnxruntime")
