"""lossgraph compile (lossgraph/cli/build.py): every form of its flags builds what the Python
API builds; --format ort-artifacts writes onnxruntime's training artifacts."""

from __future__ import annotations

import onnx
import pytest
from support.cli import export_has

from lossgraph import compile_program
from lossgraph.adapters import LoRA
from lossgraph.cli import main
from lossgraph.optim import SGD, Adam, AdamW, Momentum
from lossgraph.schedules import Linear, StepDecay

PENALTY_BOTH = {"l1": 0.01, "l2": 0.1}


FLAG_FORMS = {
    "sgd": (["--optimizer", "sgd", "--learning-rate", "0.1"], {"optimizer": SGD(0.1)}),
    "momentum": (["--optimizer", "momentum", "--learning-rate", "0.05"],
                 {"optimizer": Momentum(0.05, momentum=0.9)}),
    "nesterov": (["--optimizer", "Nesterov", "--momentum", "0.5"],
                 {"optimizer": Momentum(momentum=0.5, nesterov=True)}),
    "adam": (["--optimizer", "adam", "--learning-rate", "0.01"], {"optimizer": Adam(0.01)}),
    "adamw": (["--optimizer", "adamw"], {"optimizer": AdamW()}),
    "JSON with --learning-rate": (["--optimizer", '{"type": "AdamW", "weight_decay": 0.1}',
                                   "--learning-rate", "0.5"],
                                  {"optimizer": AdamW(0.5, weight_decay=0.1)}),
    "penalties on every weight": (["--penalty-l1", "0.01", "--penalty-l2", "0.1"],
                                  {"penalty": {"z_weight": PENALTY_BOTH,
                                               "a_bias": PENALTY_BOTH}}),
    "penalty on the trained weight": (["--weights", "z_weight", "--penalty-l2", "0.1"],
                                      {"weights": ["z_weight"],
                                       "penalty": {"z_weight": {"l1": 0.0, "l2": 0.1}}}),
    "schedule with a warmup": (["--optimizer", "adamw", "--learning-rate", "0.01", "--schedule",
                                "linear", "--warmup-steps", "2", "--total-steps", "10"],
                               {"optimizer": AdamW(Linear(0.01, 10, warmup_steps=2))}),
    "schedule options": (["--schedule", "step_decay", "--schedule-option", "step_size=3",
                          "--schedule-option", "gamma=0.5"],
                         {"optimizer": SGD(StepDecay(0.01, step_size=3, gamma=0.5))}),
    "decay groups found from the graph": (["--optimizer", "adamw",
                                           "--exclude-from-weight-decay"],
                                          {"optimizer": AdamW(exclude_from_weight_decay="auto")}),
    "penalty on every weight but one": (["--penalty-l2", "0.1", "--exclude-from-weight-decay",
                                         "bias"],
                                        {"penalty": {"z_weight": {"l1": 0.0, "l2": 0.1}}}),
    "sample weight": (["--weight-name", "w", "--loss", "huber", "--loss-option", "delta=0.5"],
                      {"loss": "huber", "loss_options": {"weight_name": "w", "delta": 0.5}}),
    "fuse, backend, target": (["--fuse", "epoch", "--backend", "onnx", "--target",
                               "onnxruntime"],
                              {"fuse": "epoch", "backend": "onnx", "target": "onnxruntime"}),
    "LoRA adapters": (["--lora", "2", "--lora-alpha", "8", "--lora-targets", "z_weight",
                       "--lora-dropout", "0.1"],
                      {"adapters": LoRA(rank=2, alpha=8.0, targets=["z_weight"], dropout=0.1)}),
    "LoRA adapters by default": (["--lora", "1"], {"adapters": LoRA(rank=1)}),
}


@pytest.mark.parametrize(("flags", "options"), FLAG_FORMS.values(), ids=FLAG_FORMS.keys())
def test_compile_flag_forms_build_what_the_python_api_builds(model_file, tmp_path, flags,
                                                             options):
    assert main(["compile", str(model_file), "-o", str(tmp_path / "p"), *flags]) == 0
    compile_program(onnx.load(model_file), **options).save(tmp_path / "expected")
    files = sorted(p.name for p in (tmp_path / "expected").iterdir())
    assert sorted(p.name for p in (tmp_path / "p").iterdir()) == files
    for name in files:  # the same program, byte for byte
        assert (tmp_path / "p" / name).read_bytes() == (tmp_path / "expected" / name).read_bytes()


@pytest.mark.skipif(not export_has("to_ort_artifacts"),
                    reason="lossgraph.export.to_ort_artifacts is not in this checkout yet")
def test_compile_writes_onnxruntime_training_artifacts(model_file, tmp_path):
    from lossgraph.export import to_ort_artifacts

    assert main(["compile", str(model_file), "-o", str(tmp_path / "artifacts"), "--format",
                 "ort-artifacts", "--optimizer", "adamw", "--learning-rate", "0.01",
                 "--penalty-l2", "0.001"]) == 0
    expected = to_ort_artifacts(model_file, tmp_path / "expected", optimizer=AdamW(0.01),
                                penalty={"z_weight": {"l1": 0.0, "l2": 0.001},
                                         "a_bias": {"l1": 0.0, "l2": 0.001}})
    for path in expected:
        assert (tmp_path / "artifacts" / path.name).read_bytes() == path.read_bytes()
