"""One word per idea (docs/concepts.md), and the previous release's spellings still working
with a LossgraphDeprecationWarning (the suite turns that warning into an error elsewhere)."""

from __future__ import annotations

import argparse
import inspect
from pathlib import Path

import numpy as np
import onnx
import pytest
from support.environment import GOLDEN_MODELS

import lossgraph
import lossgraph.passes
import lossgraph.speed
import lossgraph.surgery
from lossgraph.cli import main
from lossgraph.cli.parser import build_parser
from lossgraph.errors import LossgraphDeprecationWarning, UnsupportedOptionError

GOLDEN = GOLDEN_MODELS


@pytest.fixture
def linear() -> onnx.ModelProto:
    return onnx.load(GOLDEN / "hand_linear.onnx")


def same_graphs(a: lossgraph.TrainingProgram, b: lossgraph.TrainingProgram) -> bool:
    return all(a.graphs[n].SerializeToString() == b.graphs[n].SerializeToString()
               for n in a.graphs) and a.graphs.keys() == b.graphs.keys()


def test_lossgraph_compile_is_compile_program_with_a_warning(linear):
    with pytest.warns(LossgraphDeprecationWarning, match="use lossgraph.compile_program"):
        old = lossgraph.compile
    assert old is lossgraph.compile_program


@pytest.mark.parametrize("old, new, value", [("trainable", "weights", ["W"]),
                                             ("gradient", "backend", "onnx")])
def test_old_compile_keywords_give_the_same_program_with_a_warning(linear, old, new, value):
    expected = lossgraph.compile_program(linear, **{new: value})
    with pytest.warns(LossgraphDeprecationWarning, match=f"{old}=.*use {new}="):
        program = lossgraph.compile_program(linear, **{old: value})
    assert same_graphs(program, expected)


def test_an_old_and_a_new_keyword_together_are_an_error(linear):
    with pytest.raises(UnsupportedOptionError, match="both trainable= and weights="):
        lossgraph.compile_program(linear, trainable=["W"], weights=["W"])


@pytest.mark.parametrize("old, new", [("wrt", "weights"), ("loss", "loss_name")])
def test_old_gradient_keywords_work_with_a_warning(linear, old, new):
    with_loss = lossgraph.add_loss_output(linear)
    value = ["W"] if new == "weights" else "loss"
    expected = lossgraph.gradient(with_loss, **{new: value})
    with pytest.warns(LossgraphDeprecationWarning, match=f"gradient\\({old}="):
        graph = lossgraph.gradient(with_loss, **{old: value})
    assert graph.SerializeToString() == expected.SerializeToString()


@pytest.mark.parametrize("old, new", [("log", "binary_log_loss"),
                                      ("cross_entropy", "multiclass_log_loss")])
def test_old_loss_names_build_the_same_loss_with_a_warning(old, new):
    columns = 1 if new == "binary_log_loss" else 3
    model = onnx.parser.parse_model(f"""
        <ir_version: 8, opset_import: ["" : 18]>
        g (float[N, {columns}] p) => (float[N, {columns}] q) {{ q = Identity(p) }}""")
    expected = lossgraph.add_loss_output(model, new)
    with pytest.warns(LossgraphDeprecationWarning, match=f"'{old}'.*'{new}'"):
        built = lossgraph.add_loss_output(model, old)
    assert built.SerializeToString() == expected.SerializeToString()


def test_score_name_is_the_reference_documents_spelling_and_stays(linear, recwarn):
    with_score_name = lossgraph.add_loss_output(linear, score_name="elastic", l1_weight=0.1,
                                                l2_weight=0.9)
    with_loss = lossgraph.add_loss_output(linear, loss="elastic", l1_weight=0.1, l2_weight=0.9)
    assert with_score_name.SerializeToString() == with_loss.SerializeToString()
    assert not [w for w in recwarn if issubclass(w.category, DeprecationWarning)]
    with pytest.raises(UnsupportedOptionError, match="pass one of them"):
        lossgraph.add_loss_output(linear, loss="huber", score_name="elastic")


def test_alphabetize_initializers_takes_weights(linear):
    renamed, mapping = lossgraph.alphabetize_initializers(linear, weights=["W", "B"])
    assert list(mapping) == ["W", "B"]
    with pytest.warns(LossgraphDeprecationWarning, match="names="):
        assert lossgraph.alphabetize_initializers(linear, names=["W", "B"])[1] == mapping


@pytest.mark.parametrize("command, old, new", [
    (["add-loss"], ["--score", "huber"], ["--loss", "huber"]),
    (["add-loss"], ["--weight", "w"], ["--weight-name", "w"]),
    (["add-loss"], ["--loss", "huber", "--option", "delta=2"],
     ["--loss", "huber", "--loss-option", "delta=2"]),
    (["gradient"], ["--wrt", "W"], ["--weights", "W"]),
    (["gradient"], ["--loss", "loss"], ["--loss-name", "loss"]),
])
def test_old_command_line_options_work_with_a_warning(tmp_path, linear, capsys, command, old,
                                                     new):
    source = tmp_path / "model.onnx"
    model = lossgraph.add_loss_output(linear) if command == ["gradient"] else linear
    onnx.save(model, source)
    outputs = []
    for options, name in ((new, "new.onnx"), (old, "old.onnx")):
        assert main([*command, str(source), "-o", str(tmp_path / name), *options]) == 0
        outputs.append((tmp_path / name).read_bytes())
    assert outputs[0] == outputs[1]
    renamed = next(o for o in old if o.startswith("--") and o not in new)
    replacement = next(o for o in new if o.startswith("--") and o not in old)
    err = capsys.readouterr().err
    assert f"warning: {renamed} is deprecated" in err and f"use {replacement}" in err


@pytest.mark.parametrize("old, new", [(["--trainable", "W"], ["--weights", "W"]),
                                      (["--gradient", "onnx"], ["--backend", "onnx"])])
def test_old_compile_options_give_the_same_program_with_a_warning(tmp_path, linear, capsys,
                                                                   old, new):
    source = tmp_path / "model.onnx"
    onnx.save(linear, source)
    programs = []
    for options, name in ((new, "new"), (old, "old")):
        assert main(["compile", str(source), "-o", str(tmp_path / name), *options]) == 0
        programs.append(lossgraph.TrainingProgram.load(tmp_path / name))
    assert same_graphs(*programs)
    assert f"warning: {old[0]} is deprecated" in capsys.readouterr().err


# Every option of the commands that mirror a Python function, and the parameter it feeds:
# one word per idea on both sides. None: an option of the command line alone.
FLAG_PARAMETERS = {
    "add-loss": (lossgraph.add_loss_output, {
        "--loss": "loss", "--loss-name": "loss_name", "--label-name": "label_name",
        "--weight-name": "weight_name", "--output-index": "output_index",
        "--reduction": "reduction", "--penalty": "penalty", "--loss-option": "options",
        "--output": None, "--force": None}),
    "gradient": (lossgraph.gradient, {
        "--weights": "weights", "--loss-name": "loss_name", "--outputs": "outputs",
        "--backend": "backend", "--output": None, "--force": None}),
    "compile": (lossgraph.compile_program, {
        "--weights": "weights", "--loss": "loss", "--loss-option": "loss_options",
        "--weight-name": "loss_options", "--class-weight-labels": "loss_options",
        "--penalty": "penalty", "--penalty-l1": "penalty",
        "--penalty-l2": "penalty", "--optimizer": "optimizer", "--learning-rate": "optimizer",
        "--momentum": "optimizer", "--schedule": "optimizer", "--warmup-steps": "optimizer",
        "--total-steps": "optimizer", "--schedule-option": "optimizer",
        # AdamW's and the penalty's (Penalty) exclude_from_weight_decay
        "--exclude-from-weight-decay": "optimizer", "--backend": "backend", "--fuse": "fuse",
        "--target": "target", "--fixed-batch": "fixed_batch", "--untie": "untie",
        "--accumulation-steps": "accumulation_steps", "--recompute": "recompute",
        "--recompute-budget": "recompute",
        "--max-grad-norm": "max_grad_norm", "--ema-decay": "ema_decay",
        "--lora": "adapters", "--lora-alpha": "adapters", "--lora-targets": "adapters",
        "--lora-pattern": "adapters", "--lora-dropout": "adapters", "--output": None,
        "--format": None}),
}


def command_flags(name: str) -> set[str]:
    """The documented (not deprecated) long options of a lossgraph command."""
    commands = next(a for a in build_parser()._actions
                    if isinstance(a, argparse._SubParsersAction))
    return {flag for action in commands.choices[name]._actions
            if action.help != argparse.SUPPRESS for flag in action.option_strings
            if flag.startswith("--") and flag != "--help"}


@pytest.mark.parametrize("command", sorted(FLAG_PARAMETERS))
def test_command_line_options_are_named_as_the_python_parameters(command):
    function, table = FLAG_PARAMETERS[command]
    assert command_flags(command) == set(table)
    parameters = set(inspect.signature(function).parameters)
    assert {p for p in table.values() if p} <= parameters
    for flag, parameter in table.items():  # where the option feeds one parameter, same word
        if parameter and list(table.values()).count(parameter) == 1 and parameter != "options":
            assert flag == "--" + parameter.replace("_", "-"), (flag, parameter)


def test_deprecated_modules_still_import_with_a_warning():
    with pytest.warns(LossgraphDeprecationWarning, match="lossgraph.speed"):
        from lossgraph.optimize import SpecializeBatch
    assert SpecializeBatch is lossgraph.speed.SpecializeBatch
    with pytest.warns(LossgraphDeprecationWarning, match="lossgraph.surgery.GradientHalves"):
        from lossgraph.separate import ForwardBackward
    assert ForwardBackward is lossgraph.surgery.GradientHalves


def test_deprecated_attributes_and_keywords_still_work_with_a_warning(linear):
    program = lossgraph.compile_program(linear, fuse="epoch")
    with pytest.warns(LossgraphDeprecationWarning, match="optimizer_states"):
        assert program.states == program.optimizer_states
    with pytest.warns(LossgraphDeprecationWarning, match="shuffle="):
        lossgraph.passes.EpochGraph(shuffled=False)
    with pytest.warns(LossgraphDeprecationWarning, match="loss=None"):
        built = lossgraph.add_loss_output(linear, loss=None)
    assert built.SerializeToString() == lossgraph.add_loss_output(linear).SerializeToString()
    trainer = lossgraph.Trainer(lossgraph.compile_program(linear))
    x = np.linspace(0, 1, 48, dtype=np.float32).reshape(8, 6)
    y = np.ones((8, 1), np.float32)
    trainer.fit(x, y, epochs=1, batch_size=4)
    with pytest.warns(LossgraphDeprecationWarning, match="evaluate"):
        assert trainer.score(x, y) == trainer.evaluate(x, y)


def test_import_lossgraph_exposes_a_curated_surface():
    """Every public attribute of ``lossgraph`` that is not a submodule is in __all__ (no
    leaked typing or helper names), every name of __all__ exists, and each pass a user
    runs alone is reachable as add_loss_output is."""
    import inspect

    public = {name for name in dir(lossgraph) if not name.startswith("_")
              and not inspect.ismodule(getattr(lossgraph, name))}
    assert public == set(lossgraph.__all__) - {"optim", "schedules", "__version__"}
    for helper in ("add_loss_output", "gradient", "lower_ml_ops", "alphabetize_initializers",
                   "stabilize_numerics", "strip_training", "straight_through_quantization"):
        assert getattr(lossgraph, helper) is getattr(lossgraph.passes, helper)


def test_every_error_and_warning_class_is_in_errors_all():
    import inspect

    from lossgraph import errors

    classes = {name for name, value in vars(errors).items()
               if inspect.isclass(value) and issubclass(value, BaseException)
               and value.__module__ == errors.__name__}
    assert classes <= set(errors.__all__)


def test_the_package_speaks_of_onnxcustom_by_name():
    package = Path(lossgraph.__file__).parent
    found = [f"{path.relative_to(package)}:{number}"
             for path in sorted(package.rglob("*.py"))
             for number, line in enumerate(path.read_text().splitlines(), 1)
             if "reference document" in line.lower()]
    assert found == []


def test_top_level_reexports():
    for name in ("LearningRateSGD", "LearningRateSGDNesterov", "SquareLearningLoss",
                 "ElasticLearningLoss", "ElasticLearningPenalty", "NoLearningPenalty"):
        assert getattr(lossgraph, name) is getattr(lossgraph.compat, name)
