"""Learning-rate schedules: each equals transformers' or torch's scheduler at every step,
is data in the optimizer's dict, and trains like torch with that scheduler in every fusion
mode and after a program is saved and loaded."""

from __future__ import annotations

import json

import numpy as np
import pytest
from support.linear import COEF, INTERCEPT, linear_data, linear_model

import lossgraph
from lossgraph.optim import SGD, Adam, AdamW, Momentum, optimizer_from_dict
from lossgraph.schedules import (
    Constant,
    Cosine,
    InverseSqrt,
    Linear,
    OneCycle,
    Polynomial,
    Schedule,
    StepDecay,
    schedule_from_dict,
)

STEPS = 24
PEAK = 0.1


def _transformers(name: str, *args, **kwargs):
    def make(optimizer):
        from transformers import optimization

        return getattr(optimization, name)(optimizer, *args, **kwargs)
    return make


def _torch(name: str, *args, **kwargs):
    def make(optimizer):
        import torch

        return getattr(torch.optim.lr_scheduler, name)(optimizer, *args, **kwargs)
    return make


#: each schedule and the reference scheduler it equals (built on an optimizer of rate PEAK)
REFERENCES = {
    "constant": (Constant(PEAK, warmup_steps=5),
                 _transformers("get_constant_schedule_with_warmup", 5)),
    "linear": (Linear(PEAK, 20, warmup_steps=5),
               _transformers("get_linear_schedule_with_warmup", 5, 20)),
    "linear-to-end": (Linear(PEAK, 20, warmup_steps=5, end=0.02),
                      _transformers("get_polynomial_decay_schedule_with_warmup", 5, 20,
                                    lr_end=0.02, power=1.0)),
    "cosine": (Cosine(PEAK, 20, warmup_steps=5),
               _transformers("get_cosine_schedule_with_warmup", 5, 20)),
    "cosine-to-end-two-waves": (Cosine(PEAK, 20, warmup_steps=3, end=0.01, cycles=2.0),
                                _transformers("get_cosine_with_min_lr_schedule_with_warmup", 3,
                                              20, num_cycles=2.0, min_lr=0.01)),
    "polynomial": (Polynomial(PEAK, 20, warmup_steps=5, power=2.0),
                   _transformers("get_polynomial_decay_schedule_with_warmup", 5, 20,
                                 power=2.0)),
    "inverse-sqrt": (InverseSqrt(PEAK, 5), _transformers("get_inverse_sqrt_schedule", 5)),
    "inverse-sqrt-no-warmup": (InverseSqrt(PEAK, 0),
                               _transformers("get_inverse_sqrt_schedule", 0)),
    "step-decay": (StepDecay(PEAK, 4, 0.5), _torch("StepLR", 4, 0.5)),
    "one-cycle": (OneCycle(PEAK, STEPS), _torch("OneCycleLR", PEAK, total_steps=STEPS,
                                                 anneal_strategy="cos")),
    "one-cycle-short-rise": (OneCycle(PEAK, STEPS, pct_start=0.1, div_factor=10,
                                      final_div_factor=100),
                             _torch("OneCycleLR", PEAK, total_steps=STEPS, pct_start=0.1,
                                    div_factor=10, final_div_factor=100,
                                    anneal_strategy="cos")),
}


def reference_rates(make, steps: int = STEPS) -> list[float]:
    """The rate of each of ``steps`` updates under a torch scheduler: what the optimizer
    holds at each ``optimizer.step()``, ``scheduler.step()`` after it (torch's order)."""
    import torch

    parameter = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([parameter], lr=PEAK)
    scheduler = make(optimizer)
    rates = []
    for _ in range(steps):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return rates


@pytest.mark.torch
@pytest.mark.parametrize("name", REFERENCES)
def test_each_schedule_equals_its_reference_at_every_step(name):
    pytest.importorskip("transformers")
    schedule, make = REFERENCES[name]
    ours = [schedule(t) for t in range(1, STEPS + 1)]  # update t: the reference's step t - 1
    np.testing.assert_allclose(ours, reference_rates(make), rtol=1e-12, atol=1e-15)


def test_the_first_update_of_a_warmup_runs_at_rate_zero_as_in_transformers():
    schedule = Linear(1.0, total_steps=10, warmup_steps=4)
    assert [schedule(t) for t in (1, 2, 5, 11, 12)] == [0.0, 0.25, 1.0, 0.0, 0.0]
    assert AdamW(schedule).schedules(1, 3).tolist() == [0.0, 0.25, 0.5]


@pytest.mark.parametrize("optimizer", [
    SGD(Cosine(0.1, 100, warmup_steps=10, end=1e-3)), Momentum(StepDecay(0.1, 10, 0.5)),
    Adam(OneCycle(0.01, 50)), AdamW(Polynomial(1e-3, 100, power=2.0), weight_decay=0.05),
    AdamW(InverseSqrt(1e-3, 10), exclude_from_weight_decay=["bias", "norm"])])
def test_a_schedule_is_data_in_the_optimizers_dict_and_comes_back(optimizer):
    described = json.loads(json.dumps(optimizer.to_dict()))
    assert described["learning_rate"]["type"] == type(optimizer.learning_rate).__name__
    again = optimizer_from_dict(described)
    assert again == optimizer and again.schedules(1, 30).tolist() == \
        optimizer.schedules(1, 30).tolist()


def test_every_schedule_comes_back_from_its_dict():
    for schedule, _ in REFERENCES.values():
        assert schedule_from_dict(schedule.to_dict()) == schedule
        assert isinstance(schedule, Schedule)


def test_a_number_is_still_a_constant_rate_in_the_same_dict_as_before():
    assert AdamW(0.01).to_dict() == {"type": "AdamW", "learning_rate": 0.01, "beta1": 0.9,
                                     "beta2": 0.999, "epsilon": 1e-08, "weight_decay": 0.01}


# -- training with a schedule equals torch with its scheduler ----------------------------------


def torch_linear_run(X, y, steps: int, batch: int, weight_decay: float):
    """The linear model trained in torch by AdamW with transformers' linear warmup: the loss
    of each step and the weights after each."""
    import torch
    from transformers import get_linear_schedule_with_warmup

    torch.manual_seed(0)
    net = torch.nn.Linear(4, 1).double()
    with torch.no_grad():
        net.weight.copy_(torch.tensor([COEF], dtype=torch.float64))
        net.bias.fill_(INTERCEPT)
    optimizer = torch.optim.AdamW(net.parameters(), lr=0.05, weight_decay=weight_decay)
    scheduler = get_linear_schedule_with_warmup(optimizer, 3, steps)
    losses, weights = [], []
    for step in range(steps):
        rows = slice(step * batch % len(X), step * batch % len(X) + batch)
        optimizer.zero_grad()
        loss = ((net(torch.from_numpy(X[rows]).double()) -
                 torch.from_numpy(y[rows]).double().reshape(-1, 1)) ** 2).mean()
        loss.backward()
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
        weights.append({"coef": net.weight.detach().numpy().T.copy(),
                        "intercept": net.bias.detach().numpy().copy()})
    return losses, weights


@pytest.mark.torch
@pytest.mark.parametrize("fuse", ["step", "epoch", "separate"])
def test_adamw_with_a_linear_warmup_trains_like_torch_step_for_step_and_after_load(
        fuse, tmp_path):
    pytest.importorskip("transformers")
    X, y = linear_data(32, seed=3)
    batch, epochs = 8, 3
    steps = epochs * len(X) // batch
    losses, weights = torch_linear_run(X, y, steps, batch, weight_decay=0.1)
    optimizer = AdamW(Linear(0.05, total_steps=steps, warmup_steps=3), weight_decay=0.1)
    program = lossgraph.compile_program(linear_model(), optimizer=optimizer, fuse=fuse)
    program.save(tmp_path / "program")
    for trained in (program, lossgraph.TrainingProgram.load(tmp_path / "program")):
        assert trained.optimizer == optimizer
        trainer = lossgraph.Trainer(trained)
        for epoch in range(epochs):  # epoch mode: the epoch graph runs 4 steps, 4 rates
            trainer.fit(X, y, epochs=1, batch_size=batch, shuffle=False, progress=False,
                        warm_start=epoch > 0)
            expected = np.mean(losses[epoch * 4:(epoch + 1) * 4])
            assert trainer.train_losses_[-1] == pytest.approx(expected, rel=1e-5)
            for name, value in weights[epoch * 4 + 3].items():
                np.testing.assert_allclose(trainer.state[name], value, rtol=1e-5, atol=1e-6,
                                           err_msg=f"{name} after epoch {epoch}")
    moved = np.abs(weights[-1]["coef"].ravel() - np.array(COEF)).max()
    assert moved > 0.05, "training hardly moved the weights"
