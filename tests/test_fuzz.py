"""A fuzzer behind the catalogue of bad inputs (docs/reference/errors.md).

The catalogue holds the bad inputs someone thought of; this file throws generated ones at
lossgraph's entry points (tests/support/fuzzing.py builds them):

- **models**: every golden model with one to three mutations (fields dropped, dims
  changed, dtypes swapped, nodes rewired, attributes corrupted, opsets changed,
  initializers truncated, op types swapped), compiled in each fuse mode, then trained,
  scored, predicted with and exported;
- **options**: values drawn for ``compile_program``'s and ``fit``'s options, data included;
- **storage**: program and checkpoint folders with one file truncated, flipped, replaced,
  extended, deleted, edited as JSON or (an ONNX file) mutated as a model, checksums kept,
  dropped or recomputed, loaded with ``TrainingProgram.load`` and
  ``Trainer.load_checkpoint``;
- **cli**: command lines of every command with drawn arguments, options and files.

The property: a lossgraph error (not an ``InternalError``, which says "a bug in
lossgraph"), or a correct result: a program that trains a step or two, runs its graphs in
onnxruntime, predicts and exports a valid model; a fit that returns finite losses and
weights; a damaged folder that loads only if it trains to the numbers of the intact one
(where its checksum was written again too, an edit: only if it trains cleanly);
a command that exits 0, or 2 with one line saying ``error:``, no traceback and nothing
written. Never a raw exception, a hang, or a native crash.

The default run draws a few examples per family, derandomized (the same examples on
every machine), in this process: a few seconds. ``pytest -m fuzz`` is the long run: each
family for ``LOSSGRAPH_FUZZ_SECONDS`` seconds (default 40) of random examples, each run
in a sandbox process (support.fuzzing's ``Sandbox``) so that a native crash or a hang of
onnxruntime is a reported failure, not the end of pytest; it prints how many examples ran
and their seeds (``LOSSGRAPH_FUZZ_SEED`` replays a run). With ``LOSSGRAPH_FUZZ_BATCHES=n``
it draws exactly ``n`` batches of 50 examples from the seed instead, the same examples on
every machine: CI runs a fixed replay, so that what fails there fails here too, and new
ground is broken by runs without a seed. It does not shrink a failing
example (each try of a crashing one would restart the sandbox): the failure prints the
example in words, a reproduction. What the fuzzer found is in the catalogue, each finding
a case of its own.
"""

from __future__ import annotations

import collections
import os
import random
import time
from typing import Any

import pytest

pytest.importorskip("onnxruntime")
hypothesis = pytest.importorskip("hypothesis")

from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from support.fuzzing import (  # noqa: E402
    FAMILIES,
    Example,
    Finding,
    Outcome,
    Sandbox,
    compile_and_train,
    golden_bytes,
    load_damaged,
    run_cli,
    run_example,
)

#: Examples per family in the default run (derandomized, a few seconds in all).
DEFAULT_EXAMPLES = {"models": 30, "options": 20, "storage": 4, "cli": 4}
#: Seconds per family in the long run (pytest -m fuzz).
LONG_SECONDS = float(os.environ.get("LOSSGRAPH_FUZZ_SECONDS", "40"))
#: Examples per hypothesis run in the long run: it runs batches, each with its own seed,
#: until the family's time is spent, each sized to the time left (at most BATCH).
BATCH = 50


class HypothesisChooser:
    """A mutation's choices drawn by hypothesis (which then shrinks a failing example)."""

    def __init__(self, data: Any) -> None:
        self.data = data

    def integer(self, lo: int, hi: int) -> int:
        return self.data.draw(st.integers(lo, hi))

    def choice(self, options: Any) -> Any:
        return self.data.draw(st.sampled_from(list(options)))


def fuzz(family: str, examples: int, sandbox: Sandbox | None = None,
         seed: int | None = None, outcomes: collections.Counter | None = None) -> None:
    """``examples`` examples of ``family`` through hypothesis: derandomized (``seed`` None)
    or from ``seed``; each run here (a failure is shrunk), or in ``sandbox`` (not shrunk).
    A failure is raised with the example in words."""
    tally = outcomes if outcomes is not None else collections.Counter()

    phases = [Phase.generate] if sandbox is not None else [Phase.generate, Phase.shrink]

    @settings(max_examples=examples, derandomize=seed is None, database=None, deadline=None,
              phases=phases, suppress_health_check=list(HealthCheck))
    @given(st.data())
    def check(data: Any) -> None:
        example: Example = FAMILIES[family](HypothesisChooser(data))
        hypothesis.note(example.words)
        tally[run_example(example, sandbox)] += 1

    if seed is not None:
        check = hypothesis.seed(seed)(check)
    check()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_fuzzed_calls_end_in_a_lossgraph_error_or_a_correct_result(family):
    fuzz(family, DEFAULT_EXAMPLES[family])


@pytest.mark.parametrize(("name", "fuse"), [("hand_linear", "separate"),
                                            ("skl_mlp_classifier", "epoch"),
                                            ("torch_cnn", "step")])
def test_the_properties_hold_for_intact_inputs(name, fuse):
    """What a fuzzed call is held to, met by intact models, folders and commands: the
    checks of a correct result pass, not only the refusals."""
    assert compile_and_train(name, golden_bytes(name), fuse) == "trained"
    untouched = {"file": 0, "op": "truncate", "at": 1.0, "checksums": "keep"}
    for kind in ("program", "checkpoint"):
        assert load_damaged(name, fuse, kind, untouched) == "loaded and trained alike"
    words = ["train", "@program", "--data", "@data.npz", "-o", "@out.onnx"]
    assert run_cli(name, words, b"", b"", untouched) == "exit 0"


@pytest.mark.fuzz
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_long_run_of_random_examples_in_a_sandbox(family, request, capsys):
    if "fuzz" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("the long fuzz run takes minutes: pytest -m fuzz")
    first = int(os.environ.get("LOSSGRAPH_FUZZ_SEED", random.randrange(1 << 30)))
    replay = int(os.environ.get("LOSSGRAPH_FUZZ_BATCHES", "0"))
    outcomes: collections.Counter = collections.Counter()
    sandbox = Sandbox(timeout=120)
    start = time.monotonic()
    batches, size = 0, BATCH if replay else 5  # a timed run's first batch measures
    try:
        while (batches < replay if replay
               else (left := LONG_SECONDS - (time.monotonic() - start)) > 0):
            began, done = time.monotonic(), sum(outcomes.values())
            fuzz(family, size, sandbox, seed=first + batches, outcomes=outcomes)
            batches += 1
            if not replay:
                each = (time.monotonic() - began) / max(1, sum(outcomes.values()) - done)
                size = max(1, min(BATCH, int((left - (time.monotonic() - began)) / each)))
    finally:
        sandbox.close()
        seconds = time.monotonic() - start
        common = ", ".join(f"{count} {outcome}" for outcome, count in outcomes.most_common(6))
        with capsys.disabled():
            print(f"\nfuzz {family}: {sum(outcomes.values())} examples in {seconds:.0f} s "
                  f"(LOSSGRAPH_FUZZ_SEED={first}, seeds {first}..{first + batches - 1}): "
                  f"{common}")


def test_a_crash_or_a_hang_in_the_sandbox_is_a_finding_and_the_next_call_works():
    sandbox, impatient = Sandbox(timeout=120), Sandbox(timeout=1)
    try:
        crashed = sandbox.call("_crash_for_test")
        assert crashed.kind == "crashed" and "signal" in crashed.detail
        assert sandbox.call("_echo_for_test", 3) == Outcome("ok", "3")
        assert impatient.call("_hang_for_test").kind == "hung"
        with pytest.raises(Finding, match="crashed"):
            run_example(Example("_crash_for_test", (), "a crash"), sandbox)
    finally:
        sandbox.close()
        impatient.close()

