"""LoRA adapters with the rest of lossgraph: onnxruntime's on-device training artifacts
(onnxruntime's Module steps the adapters, the only trainable parameters, as the Trainer
does; test_lora.py checks what the files hold), checkpoints
(Trainer.save_checkpoint and the rotating checkpoints of fit keep and restore them) and the
Ray data-parallel trainer (equal to the single-process one)."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
from support.adapters import ALPHA, RANK, lora_program, query_data, query_model
from support.environment import local_ray_cluster

import lossgraph
from lossgraph.adapters import LoRA
from lossgraph.export import to_ort_artifacts
from lossgraph.optim import SGD, AdamW

ADAPTER_TENSORS = ["encoder.query.lora_A", "encoder.query.lora_B"]


@pytest.mark.training
@pytest.mark.torch
def test_onnxruntime_steps_the_adapters_to_lossgraphs_weights(tmp_path):
    from onnxruntime.training.api import CheckpointState, Module, Optimizer

    X, y = query_data()
    optimizer = SGD(0.05)
    paths = to_ort_artifacts(query_model(), tmp_path / "a", optimizer=optimizer,
                             adapters=LoRA(rank=RANK, alpha=ALPHA))
    state = CheckpointState.load_checkpoint(str(paths.checkpoint))
    module = Module(str(paths.training_model), state, str(paths.eval_model))
    runner = Optimizer(str(paths.optimizer_model), module)
    runner.set_learning_rate(optimizer.learning_rate)
    module.train()
    for start in range(0, len(X), 8):
        module(X[start:start + 8], y[start:start + 8])
        runner.step()
        module.lazy_reset_grad()
    trainer = lossgraph.Trainer(lora_program()).fit(X, y, epochs=1, batch_size=8,
                                                    shuffle=False, progress=False)
    for name in ADAPTER_TENSORS:
        np.testing.assert_allclose(state.parameters[name].data, trainer.state[name],
                                   rtol=1e-5, atol=1e-6, err_msg=name)
    assert not np.array_equal(trainer.state[ADAPTER_TENSORS[1]], 0)  # B trained


def test_checkpoints_keep_and_restore_the_adapters(tmp_path):
    X, y = query_data()
    trainer = lossgraph.Trainer(lora_program(optimizer=AdamW(0.05)))
    trainer.fit(X, y, epochs=2, batch_size=8, progress=False, checkpoint_dir=tmp_path / "run",
                keep_last=1, monitor="loss")
    restored = lossgraph.Trainer.load_checkpoint(lossgraph.latest_checkpoint(tmp_path / "run"))
    assert restored.program.adapters == trainer.program.adapters
    for name, value in trainer.state.items():  # the adapters and their moments
        np.testing.assert_array_equal(restored.state[name], value, err_msg=name)
    trainer.fit(X, y, epochs=1, batch_size=8, progress=False, warm_start=True)
    restored.fit(X, y, epochs=1, batch_size=8, progress=False, warm_start=True)
    for name in ADAPTER_TENSORS:
        np.testing.assert_array_equal(restored.state[name], trainer.state[name])
    merged = restored.to_inference_model(merge=True)
    assert [n.op_type for n in merged.graph.node] == ["Gemm"]


HAS_RAY = importlib.util.find_spec("ray") is not None \
    and importlib.util.find_spec("ray.train") is not None


@pytest.mark.slow
@pytest.mark.skipif(not HAS_RAY, reason="needs Ray (pip install 'lossgraph[ray]')")
@pytest.mark.filterwarnings("ignore::DeprecationWarning:ray.data.context")
def test_ray_trains_a_lora_program_as_the_single_process_trainer(tmp_path):
    from lossgraph.ray import RayTrainer

    X, y = query_data(40)
    program = lora_program("separate", optimizer=AdamW(0.05))
    with local_ray_cluster():
        result = RayTrainer(program, num_workers=2, resources_per_worker={"CPU": 0.5},
                            all_reduce="actor", storage_path=str(tmp_path), name="lora"
                            ).fit((X, y), epochs=2, batch_size=8, shuffle=False)
    single = lossgraph.Trainer(program).fit(X, y, epochs=2, batch_size=8, shuffle=False,
                                            progress=False)
    assert sorted(result.state) == sorted(single.state)
    for name, value in single.state.items():
        np.testing.assert_allclose(result.state[name], value, rtol=2e-5, atol=2e-6,
                                   err_msg=name)
