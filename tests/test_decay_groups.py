"""Weight-decay groups: ``AdamW(exclude_from_weight_decay=...)`` and ``Penalty(...,
exclude_from_weight_decay=...)`` equal torch with two parameter groups (decay, no decay), in
every fusion mode and after a program is saved and loaded; ``"auto"`` excludes what Hugging
Face's Trainer excludes (every bias, every LayerNorm weight)."""

from __future__ import annotations

import numpy as np
import pytest
from support.linear import linear_model
from support.torch_steps import assert_steps_like_torch, legacy_export, make_distinct, torch_mse

import lossgraph
from lossgraph.errors import UnknownNameError, UnsupportedOptionError
from lossgraph.optim import SGD, Adam, AdamW, update_graph
from lossgraph.penalties import Penalty
from lossgraph.schedules import Linear


@pytest.fixture(scope="module")
def exported():
    """A Linear, LayerNorm, ReLU, Linear network, its legacy export, and the names of its
    parameters Hugging Face's Trainer leaves out of weight decay."""
    import torch

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.LayerNorm(6), torch.nn.ReLU(),
                              torch.nn.Linear(6, 1))
    make_distinct(net)
    norms = {f"{name}.{p}" for name, module in net.named_modules()
             if isinstance(module, torch.nn.LayerNorm) for p, _ in module.named_parameters()}
    excluded = [n for n, _ in net.named_parameters() if "bias" in n or n in norms]
    return net, legacy_export(net, np.zeros((2, 4), np.float32)), excluded


def grouped(net, excluded: list[str], optimizer, **options):
    """torch's ``optimizer`` on ``net`` with two parameter groups: decay, and no decay."""
    named = dict(net.named_parameters())
    return optimizer([{"params": [p for n, p in named.items() if n not in excluded]},
                      {"params": [named[n] for n in excluded], "weight_decay": 0.0}], **options)


@pytest.mark.torch
@pytest.mark.parametrize("fuse", ["step", "epoch", "separate"])
def test_adamw_excluding_auto_equals_torch_adamw_with_two_groups(exported, fuse, tmp_path):
    import copy

    import torch

    net, model, excluded = exported
    net = copy.deepcopy(net)
    optimizer = AdamW(0.05, weight_decay=0.5, exclude_from_weight_decay="auto")
    program = lossgraph.compile_program(model, optimizer=optimizer, fuse=fuse)
    assert list(program.optimizer.exclude_from_weight_decay) == excluded  # resolved, recorded
    program.save(tmp_path / "program")
    loaded = lossgraph.TrainingProgram.load(tmp_path / "program")
    assert loaded.optimizer == program.optimizer
    theirs = grouped(net, excluded, torch.optim.AdamW, lr=0.05, weight_decay=0.5)
    X = np.random.default_rng(0).normal(size=(32, 4)).astype(np.float32)
    assert_steps_like_torch(lossgraph.Trainer(loaded), net, theirs, X, X[:, :1] * 2 - 1,
                            steps=4)


@pytest.mark.torch
def test_the_epoch_graph_updates_decay_groups_weight_by_weight_as_the_steps_do(exported):
    _, model, _ = exported
    optimizer = AdamW(Linear(0.05, total_steps=8, warmup_steps=2), weight_decay=0.5,
                      exclude_from_weight_decay="auto")
    assert "PackWeights" not in lossgraph.describe_plan(model, optimizer=optimizer, fuse="epoch")
    X = np.random.default_rng(3).normal(size=(16, 4)).astype(np.float32)
    states = [lossgraph.Trainer(lossgraph.compile_program(model, optimizer=optimizer, fuse=fuse))
              .fit(X, X[:, :1], epochs=2, batch_size=4, random_state=0, progress=False).state
              for fuse in ("step", "epoch")]
    for name, value in states[0].items():
        np.testing.assert_allclose(states[1][name], value, rtol=1e-5, atol=1e-7, err_msg=name)


@pytest.mark.torch
def test_an_excluded_weight_takes_adams_step_and_the_others_adamws(exported):
    net, model, excluded = exported
    X = np.random.default_rng(1).normal(size=(8, 4)).astype(np.float32)

    def one_step(optimizer) -> dict[str, np.ndarray]:
        trainer = lossgraph.Trainer(lossgraph.compile_program(model, optimizer=optimizer))
        return trainer.fit(X, X[:, :1], batch_size=8, progress=False).state

    adamw, adam = one_step(AdamW(0.05, weight_decay=0.5)), one_step(Adam(0.05))
    grouped_ = one_step(AdamW(0.05, weight_decay=0.5, exclude_from_weight_decay="auto"))
    every = one_step(AdamW(0.05, weight_decay=0.5, exclude_from_weight_decay=".*"))
    for name in lossgraph.compile_program(model).weights:  # the states follow the gradients
        assert not np.allclose(adamw[name], adam[name]), name  # the decay shows in one step
        np.testing.assert_allclose(every[name], adam[name], rtol=1e-6, err_msg=name)
        like = adam if name in excluded else adamw
        np.testing.assert_allclose(grouped_[name], like[name], rtol=1e-6, err_msg=name)


@pytest.mark.torch
def test_a_penalty_excluding_auto_equals_torch_with_the_penalty_on_the_decay_group(exported):
    import copy

    import torch

    net, model, excluded = exported
    net = copy.deepcopy(net)
    program = lossgraph.compile_program(
        model, optimizer=SGD(0.05), penalty=Penalty(l1=0.01, l2=0.05,
                                                    exclude_from_weight_decay="auto"))
    decayed = [p for n, p in net.named_parameters() if n not in excluded]

    def penalized(prediction, target):
        return torch_mse(prediction, target) + sum(
            0.01 * p.abs().sum() + 0.05 * (p ** 2).sum() for p in decayed)

    X = np.random.default_rng(2).normal(size=(24, 4)).astype(np.float32)
    assert_steps_like_torch(lossgraph.Trainer(program), net,
                            torch.optim.SGD(net.parameters(), lr=0.05), X, X[:, 1:2],
                            loss=penalized)


@pytest.mark.parametrize("exclude, expected", [
    ("auto", ["intercept"]), (["intercept"], ["intercept"]), ("inter", ["intercept"]),
    (["^c", "t$"], ["coef", "intercept"])])
def test_names_and_regular_expressions_select_the_excluded_weights(exclude, expected):
    program = lossgraph.compile_program(linear_model(),
                                        optimizer=AdamW(exclude_from_weight_decay=exclude))
    assert program.optimizer.exclude_from_weight_decay == tuple(expected)
    assert program.manifest["optimizer"]["exclude_from_weight_decay"] == expected


def test_a_pattern_that_selects_no_weight_is_an_error_listing_the_weights():
    with pytest.raises(UnknownNameError, match="'bias', which names no trained weight.*"
                                               "'coef', 'intercept'"):
        lossgraph.compile_program(linear_model(),
                                  optimizer=AdamW(exclude_from_weight_decay=["bias"]))
    with pytest.raises(UnsupportedOptionError, match="needs the model's graph|from the model"):
        update_graph(AdamW(exclude_from_weight_decay="auto"), {"w": np.ones(2, np.float32)})
