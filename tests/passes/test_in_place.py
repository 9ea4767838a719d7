"""Training graphs that write the next state over the state they read (one buffer set):
the WriteInPlace rewrite, and the engine running it."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnxruntime.capi import _pybind_state as C
from support.models import embedding_bag, tower

from lossgraph import Trainer, compile_program
from lossgraph.errors import UnsupportedOptionError
from lossgraph.optim import SGD, AdamW, Momentum
from lossgraph.passes.in_place import WriteInPlace, in_place_problem
from lossgraph.program import TrainingProgram
from lossgraph.runtime.session import cpu_device, create_session, ortvalue
from lossgraph.speed.specialize_batch import SpecializeBatch

RATE = 0.1


def _data(rows: int = 12) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1)
    return (rng.normal(size=(rows, 3)).astype(np.float32),
            rng.normal(size=(rows, 1)).astype(np.float32))


def _trained(program: TrainingProgram, **options) -> Trainer:
    """Two epochs of 14 rows in batches of 4: three full batches (the graph specialized to
    them) and a last one of 2 rows (the general graph), each epoch."""
    X, y = _data(14)
    return Trainer(program, **options).fit(X, y, batch_size=4, epochs=2, shuffle=False,
                                           progress=False)


OPTIMIZERS = {"sgd": lambda: SGD(RATE), "momentum": lambda: Momentum(RATE, 0.9),
              "adamw": lambda: AdamW(0.01, weight_decay=0.1)}


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize("fuse", ["step", "separate"])
def test_one_buffer_set_trains_bit_for_bit_as_two(fuse, optimizer):
    program = compile_program(tower(), optimizer=OPTIMIZERS[optimizer](), fuse=fuse)
    in_place = _trained(program, in_place=True)
    apart = _trained(program, keep_previous_state=False, in_place=False)
    assert (in_place.engine.ring.sets, apart.engine.ring.sets) == (1, 2)
    assert in_place.engine.in_place and not apart.engine.in_place
    assert in_place.state.keys() == apart.state.keys()
    assert all(np.array_equal(in_place.state[n], apart.state[n]) for n in apart.state)
    assert in_place.history_ == apart.history_


@pytest.mark.parametrize("options", [{"max_grad_norm": 0.5, "ema_decay": 0.9},
                                     {"recompute": "auto"}])
def test_clipping_the_ema_and_recomputation_write_in_place_too(options):
    program = compile_program(tower(), optimizer=Momentum(RATE, 0.9), **options)
    in_place = _trained(program, in_place=True)
    apart = _trained(program, keep_previous_state=False, in_place=False)
    assert all(np.array_equal(in_place.state[n], apart.state[n]) for n in apart.state)


def test_running_statistics_are_written_in_place_in_a_step_graph():
    program = compile_program(tower(norm=True), optimizer=SGD(RATE))
    assert program.buffers
    in_place = _trained(program, in_place=True)
    apart = _trained(program, keep_previous_state=False, in_place=False)
    assert all(np.array_equal(in_place.state[n], apart.state[n]) for n in apart.state)
    with pytest.raises(UnsupportedOptionError, match="running statistics"):
        Trainer(compile_program(tower(norm=True), fuse="separate"), in_place=True)


def test_the_rewrite_orders_every_reader_of_a_weight_before_its_next_value():
    """The backward reads W2 and W3 after their gradients are known, with nothing ordering
    those products before the updates; rewritten, every reader is an ancestor of the node
    writing the next value, which reads the finite loss's flag."""
    program = compile_program(tower(), optimizer=SGD(RATE))
    graph, pairs = program.graphs["train_step"], program.state_updates("train_step")
    assert in_place_problem(graph, pairs) == (
        "node 'grad/Gemm_1' may read 'W2' after 'W2_new' is written")
    rewritten = WriteInPlace(pairs, program.io("train_step", "loss")[0])(graph).model
    assert in_place_problem(rewritten, pairs) is None
    writers = [n for n in rewritten.graph.node if set(n.output) & set(pairs.values())]
    assert [n.op_type for n in writers] == ["Where"] * 3


def _ids(rows: int, seed: int = 1, vocabulary: int = 8) -> tuple[np.ndarray, np.ndarray]:
    """``rows`` rows of 6 token ids drawn from the first ``vocabulary`` (so that ids repeat,
    within a row and across rows), and targets."""
    rng = np.random.default_rng(seed)
    return (rng.integers(0, vocabulary, size=(rows, 6)),
            rng.normal(size=(rows, 1)).astype(np.float32))


def _in_place_step(program: TrainingProgram, batch: int = 4) -> onnx.ModelProto:
    """The step graph as an in-place engine runs it at ``batch`` rows."""
    graph = SpecializeBatch(batch)(program.graphs["train_step"]).model
    return WriteInPlace(program.state_updates("train_step"),
                        program.io("train_step", "loss")[0])(graph).model


@pytest.mark.parametrize("vocabulary", [50, 4096])  # zeros folded / made at each run
@pytest.mark.parametrize("optimizer", ["sgd", "momentum"])
def test_an_embedding_table_is_written_row_by_row_bit_for_bit_as_two_sets(vocabulary,
                                                                           optimizer):
    """A table only Gather reads, under plain SGD: its batch's rows are stepped and scattered
    over it, no table-sized zeros, gradient or step made; the same weights and losses bit
    for bit as the dense step with two buffer sets, rows never gathered untouched. Any
    other optimizer reads the whole gradient: the dense step, guarded as any state."""
    program = compile_program(embedding_bag(vocabulary, width=64),
                              optimizer=OPTIMIZERS[optimizer]())
    X, y = _ids(14)
    fit = dict(batch_size=4, epochs=2, shuffle=False, progress=False)
    in_place = Trainer(program, in_place=True).fit(X, y, **fit)
    apart = Trainer(program, keep_previous_state=False, in_place=False).fit(X, y, **fit)
    assert in_place.engine.ring.sets == 1
    assert all(np.array_equal(in_place.state[n], apart.state[n]) for n in apart.state)
    assert in_place.history_ == apart.history_
    assert np.array_equal(in_place.state["table"][8:], program.state["table"][8:])
    assert not np.array_equal(in_place.state["table"][:8], program.state["table"][:8])
    step = _in_place_step(program)
    writer = next(n for n in step.graph.node if "table_new" in n.output)
    inferred = onnx.shape_inference.infer_shapes(step).graph.value_info
    table_sized = [v.name for v in inferred
                   if [d.dim_value for d in v.type.tensor_type.shape.dim] == [vocabulary, 64]]
    if optimizer == "sgd":
        assert writer.op_type == "ScatterND" and writer.input[0] == "table"
        assert table_sized == []
    else:
        assert writer.op_type == "Where" and table_sized


def test_an_embedding_step_whose_loss_is_not_finite_leaves_the_table_it_read():
    program = compile_program(embedding_bag(), optimizer=SGD(RATE))
    trainer = Trainer(program, in_place=True)
    before = trainer.state
    X, _ = _ids(4)
    batch = trainer.engine.prepare(X, np.full((4, 1), 3e38, np.float32))
    assert not np.isfinite(trainer.engine.step(batch, step=1, rate=RATE))
    assert all(np.array_equal(trainer.state[n], before[n]) for n in before)


@pytest.mark.parametrize("options", [{"penalty": {"table": 0.01}}, {"max_grad_norm": 0.5}])
def test_an_embedding_whose_gradient_is_read_elsewhere_keeps_the_dense_step(options):
    """A penalty adds to the table's gradient, a clipping norm reads it: the dense step."""
    program = compile_program(embedding_bag(), optimizer=SGD(RATE), **options)
    step = _in_place_step(program)
    assert next(n for n in step.graph.node if "table_new" in n.output).op_type == "Where"
    X, y = _ids(14)
    fit = dict(batch_size=4, epochs=1, shuffle=False, progress=False)
    in_place = Trainer(program, in_place=True).fit(X, y, **fit)
    apart = Trainer(program, keep_previous_state=False, in_place=False).fit(X, y, **fit)
    assert all(np.array_equal(in_place.state[n], apart.state[n]) for n in apart.state)


def _run_in_place(program: TrainingProgram, model: onnx.ModelProto, last: str
                  ) -> dict[str, np.ndarray]:
    """One run of the step graph ``model`` with its updates bound over the weights it reads,
    the node writing ``last`` moved to the end of the node list (onnxruntime then runs it
    before the products of the backward that other updates wait for)."""
    nodes = list(model.graph.node)
    nodes.append(nodes.pop(next(i for i, n in enumerate(nodes) if last in n.output)))
    moved = onnx.ModelProto()
    moved.CopyFrom(model)
    del moved.graph.node[:]
    moved.graph.node.extend(nodes)
    session = create_session(moved, None, None, "train_step")
    X, y = _data(8)
    state = {name: program.state[name].copy() for name in program.state}
    feeds = {**state, program.io("train_step", "learning_rate")[0]: np.array(RATE, np.float32),
             program.io("train_step", "step")[0]: np.array(1, np.int64),
             program.io("train_step", "feature")[0]: X, program.io("train_step", "label")[0]: y}
    binding, device = C.SessionIOBinding(session._sess), cpu_device()
    values = {name: ortvalue(array, device) for name, array in feeds.items()}
    for name, value in values.items():
        binding.bind_ortvalue_input(name, value)
    for name, written in program.state_updates("train_step").items():
        binding.bind_ortvalue_output(written, values[name])
    for output in moved.graph.output:
        if output.name not in program.state_updates("train_step").values():
            binding.bind_output(output.name, device)
    session._sess.run_with_iobinding(binding, C.RunOptions())
    return state


@pytest.mark.parametrize("last", ["W2_new", "W3_new"])
def test_without_the_rewrite_an_update_in_place_overwrites_a_weight_the_backward_reads(last):
    """The failure the rewrite prevents, shown: bound in place as it is, the graph gives
    wrong weights when onnxruntime runs an update early; rewritten, the right ones."""
    program = compile_program(tower(), optimizer=SGD(RATE))
    expected = _trained_once(program)
    graph = program.graphs["train_step"]
    wrong = _run_in_place(program, graph, last)
    assert not all(np.array_equal(wrong[w], expected[w]) for w in program.weights)
    rewritten = WriteInPlace(program.state_updates("train_step"),
                             program.io("train_step", "loss")[0])(graph).model
    right = _run_in_place(program, rewritten, last)
    assert all(np.array_equal(right[w], expected[w]) for w in program.weights)


def _trained_once(program: TrainingProgram) -> dict[str, np.ndarray]:
    """The state after one step of 8 rows, with two buffer sets."""
    X, y = _data(8)
    trainer = Trainer(program, keep_previous_state=False, in_place=False)
    trainer.fit(X, y, batch_size=8, epochs=1, shuffle=False, progress=False)
    return trainer.state


@pytest.mark.parametrize("fuse", ["step", "separate"])
def test_a_step_whose_loss_is_not_finite_leaves_the_state_it_read(fuse):
    program = compile_program(tower(), optimizer=SGD(RATE), fuse=fuse)
    trainer = Trainer(program, in_place=True)
    engine = trainer.engine
    before = trainer.state
    X, y = _data(4)
    batch = engine.prepare(X, np.full_like(y, 3e38))  # its square overflows float32
    loss = engine.step(batch, step=1, rate=RATE)
    assert not np.isfinite(loss)
    assert all(np.array_equal(trainer.state[n], before[n]) for n in before)


def test_a_large_state_is_written_in_place_by_default_where_the_mode_can(monkeypatch):
    from lossgraph.runtime import engine

    monkeypatch.setattr(engine, "KEEP_PREVIOUS_MAX_BYTES", 0)
    sets = {fuse: Trainer(compile_program(tower(), fuse=fuse)).engine.ring.sets
            for fuse in ("step", "separate", "epoch")}
    assert sets == {"step": 1, "separate": 1, "epoch": 1}
    assert Trainer(compile_program(tower(), accumulation_steps=2)).engine.ring.sets == 2
    monkeypatch.undo()
    assert Trainer(compile_program(tower())).engine.ring.sets == 3


@pytest.mark.parametrize("options, match", [
    ({"in_place": "yes"}, "in_place"),
    ({"in_place": True, "keep_previous_state": True}, "keep_previous_state=False"),
])
def test_contradictory_or_bad_options_are_refused(options, match):
    with pytest.raises(UnsupportedOptionError, match=match):
        Trainer(compile_program(tower()), **options)


@pytest.mark.parametrize("fuse", ["step", "epoch"])
def test_programs_whose_steps_cannot_write_in_place_say_why(fuse):
    with pytest.raises(UnsupportedOptionError, match="accumulate gradients"):
        Trainer(compile_program(tower(), fuse=fuse, accumulation_steps=2), in_place=True)


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_an_epoch_program_in_place_runs_its_epochs_as_steps_to_the_same_weights(optimizer):
    """A Scan cannot write in place, so in place an epoch program trains every batch with
    its step graph: bit for bit the updates its epoch graph makes, the state held once."""
    program = compile_program(tower(), optimizer=OPTIMIZERS[optimizer](), fuse="epoch")
    X, y = _data(14)
    fit = {"batch_size": 4, "epochs": 2, "random_state": 3, "progress": False}
    in_place = Trainer(program, in_place=True)
    epochs = Trainer(program, keep_previous_state=False)
    assert (in_place.engine.ring.sets, epochs.engine.ring.sets) == (1, 2)
    assert not in_place.engine.runs_epochs and epochs.engine.runs_epochs
    in_place.fit(X, y, **fit)
    epochs.fit(X, y, **fit)
    assert [s for s in in_place.engine.open_sessions if s[0] != "train_step"] == []
    assert any(s[0] == "train_epoch" for s in epochs.engine.open_sessions)
    assert in_place.history_ == epochs.history_
    assert all(np.array_equal(in_place.state[n], epochs.state[n]) for n in epochs.state)


@pytest.mark.parametrize("fuse", ["step", "separate"])
def test_lora_adapters_over_frozen_weights_write_in_place_too(fuse):
    from support.adapters import lora_program, query_data

    X, y = query_data()
    states = []
    for options in ({"in_place": True}, {"keep_previous_state": False, "in_place": False}):
        trainer = Trainer(lora_program(fuse, Momentum(0.05, 0.9)), **options)
        trainer.fit(X, y, batch_size=8, epochs=2, shuffle=False, progress=False)
        states.append(trainer.state)
    assert all(np.array_equal(states[0][n], states[1][n]) for n in states[1])


def test_a_checkpoint_resumes_in_place_as_without(tmp_path):
    """A fit stopped at a checkpoint and resumed by a trainer writing in place ends where
    one fit of two sets does."""
    from lossgraph import latest_checkpoint

    program = compile_program(tower(), optimizer=AdamW(0.01, weight_decay=0.1))
    X, y = _data()
    fit = {"batch_size": 4, "shuffle": False, "progress": False}
    whole = Trainer(program, keep_previous_state=False, in_place=False).fit(X, y, epochs=2,
                                                                             **fit)
    Trainer(program, in_place=True).fit(X, y, epochs=1, checkpoint_dir=tmp_path / "run",
                                        keep_best=False, **fit)
    resumed = Trainer.load_checkpoint(latest_checkpoint(tmp_path / "run"), in_place=True)
    assert resumed.engine.in_place and resumed.steps_ == 3
    resumed.fit(X, y, epochs=1, warm_start=True, **fit)
    assert all(np.array_equal(resumed.state[n], whole.state[n]) for n in whole.state)


def test_a_pickled_trainer_keeps_its_buffer_set_options():
    import pickle

    program = compile_program(tower())
    for options, sets in (({"in_place": True}, 1), ({"keep_previous_state": False,
                                                     "in_place": False}, 2), ({}, 3)):
        copy = pickle.loads(pickle.dumps(Trainer(program, **options)))
        assert copy.engine.ring.sets == sets
