"""Training a lossgraph Trainer and a torch network side by side, step for step: the
check the torch-export tests share."""

from __future__ import annotations

import numpy as np

import lossgraph


def assert_sgd_steps_like_torch(trainer: lossgraph.Trainer, net, learning_rate: float,
                                X: np.ndarray, y: np.ndarray, steps: int = 4,
                                rows: int = 8) -> None:
    """``steps`` minibatch SGD steps of ``rows`` rows (mean squared error) with the trainer
    and with ``torch.optim.SGD`` on ``net``: after each, the trainer predicts what the net
    does on all of ``X`` (float32 rounding)."""
    import torch

    theirs = torch.optim.SGD(net.parameters(), lr=learning_rate)
    for step in range(steps):
        batch = slice(rows * step, rows * (step + 1))
        trainer.fit(X[batch], y[batch], epochs=1, batch_size=rows, shuffle=False,
                    progress=False, warm_start=step > 0)
        theirs.zero_grad()
        loss = ((net(torch.from_numpy(X[batch])) - torch.from_numpy(y[batch])) ** 2).mean()
        loss.backward()
        theirs.step()
        with torch.no_grad():
            expected = net(torch.from_numpy(X)).numpy()
        np.testing.assert_allclose(trainer.predict(X), expected, rtol=1e-4, atol=1e-5,
                                   err_msg=f"after step {step}")
