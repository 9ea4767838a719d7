"""The supported-models catalogue (tests/support/supported_models.py) and its page,
docs/supported_models.md.

The whole catalogue (every model x way to export x fusion mode) takes many minutes of CPU,
so it runs as a script, ``python tests/support/supported_models.py``, which records every
outcome in tests/support/supported_models.json and writes the page from the record. Here:

- the page is the record's rendering, and the record covers exactly the catalogue's cases,
  every defect in it a known one (cheap: nothing is trained);
- a representative part of the catalogue (:data:`REPRESENTATIVE`: each source, each way to
  export, each fusion mode, each status, on the smallest models that show them) runs again
  and comes to its recorded outcome.
"""

from __future__ import annotations

import functools

import pytest
from support import supported_models as suite
from support.environment import MODEL_LIBRARIES, model_library

#: The cases CI runs again, by (source, name, exporter, fuse): each source, each way to
#: export, each fusion mode, and each status the record holds but "export fails" (T5's
#: dynamo export fails in torch), on the cheapest models that show them.
REPRESENTATIVE = (
    ("torchvision", "densenet", "legacy", "epoch"),  # training-mode BatchNorm
    ("torchvision", "densenet", "dynamo", "separate"),
    ("torchvision", "densenet", "dynamo-optimized", "step"),  # BatchNorm folded into Conv
    ("timm", "deit_tiny_patch16_224", "legacy", "step"),
    ("transformers", "bert", "legacy", "separate"),
    ("transformers", "bert", "dynamo", "step"),
    ("transformers", "bert-fresh", "legacy", "step"),  # equal initializers merged, warned
    ("transformers", "bert-fresh-untied", "legacy", "step"),  # untie="auto"
    ("transformers", "gpt2", "legacy-folded", "step"),  # the tied embedding stored twice
)


def _exporter(name: str) -> suite.Exporter:
    return next(e for e in suite.EXPORTERS if e.name == name)


def _architecture(source: str, name: str) -> suite.Architecture:
    found = [a for a in suite.catalogue() if (a.source, a.name) == (source, name)]
    assert len(found) == 1, f"no architecture {source}/{name} in the catalogue"
    return found[0]


@functools.cache
def _case(source: str, name: str) -> suite.Case:
    """One Case an architecture: its exports and torch references made once for its
    parametrized tests."""
    return suite.Case(_architecture(source, name))


def test_page_is_generated_from_the_record():
    assert suite.PAGE.read_text() == suite.render(suite.load_record()), (
        "docs/supported_models.md is stale: run python tests/support/supported_models.py "
        "--render (or without --render to run the catalogue again)")


def test_record_covers_the_catalogue_and_names_every_defect():
    record = suite.load_record()["cases"]
    keys = [suite.case_key(*c) for c in suite.cases()]
    assert sorted(record) == sorted(keys), (
        "tests/support/supported_models.json is not the catalogue's: run python "
        "tests/support/supported_models.py")
    assert all(outcome["status"] in suite.STATUSES for outcome in record.values())
    unknown, unequal = [], set()
    for architecture, exporter, fuse in suite.cases():
        key = suite.case_key(architecture, exporter, fuse)
        status = record[key]["status"]
        if suite.is_defect(status) and not suite.known(architecture, exporter):
            unknown.append(key)
        if status != suite.EQUAL:
            unequal |= {(name, exporter.name)
                        for name in ("*", f"{architecture.source}/{architecture.name}")}
    assert unknown == [], "defects with no KNOWN entry"
    assert sorted(set(suite.KNOWN) - unequal) == [], "KNOWN entries of cases all equal"


def test_representative_cases_are_in_the_catalogue():
    sources = {source for source, *_ in REPRESENTATIVE}
    assert sources == set(MODEL_LIBRARIES)
    assert {e for *_, e, _ in REPRESENTATIVE} == {e.name for e in suite.EXPORTERS}
    assert {f for *_, f in REPRESENTATIVE} == set(suite.FUSE_MODES)
    for source, name, exporter, fuse in REPRESENTATIVE:
        _architecture(source, name)
        assert fuse in _exporter(exporter).fuse_modes
    record = suite.load_record()["cases"]
    shown = {record[suite.case_key(_architecture(source, name), _exporter(exporter), fuse)]
             ["status"] for source, name, exporter, fuse in REPRESENTATIVE}
    held = {outcome["status"] for outcome in record.values()} - {suite.EXPORT_FAILS}
    assert sorted(held - shown) == [], "statuses no representative case shows"


def _same(outcome: suite.Outcome, recorded: dict[str, str]) -> bool:
    """Whether ``outcome`` is the recorded one: the status, and for an error its class (the
    message may quote numbers of this machine)."""
    if outcome.status != recorded["status"]:
        return False
    if outcome.status in (suite.NAMED_ERROR, suite.EXPORT_FAILS, suite.RAW_EXCEPTION):
        return outcome.reason.split(":")[0] == recorded["reason"].split(":")[0]
    return outcome.status != suite.EQUAL or outcome.reason == recorded["reason"]


@pytest.mark.torch
@pytest.mark.slow
@pytest.mark.parametrize(("source", "name", "exporter", "fuse"), REPRESENTATIVE,
                         ids=["-".join(c) for c in REPRESENTATIVE])
def test_case_comes_to_its_recorded_outcome(source, name, exporter, fuse):
    if model_library(source) is None:
        pytest.skip(f"needs {source} (CI's training environment installs it: "
                    ".ci/setup-env --torch)")
    architecture, exporter = _architecture(source, name), _exporter(exporter)
    recorded = suite.load_record()["cases"][suite.case_key(architecture, exporter, fuse)]
    outcome = _case(source, name).run(exporter, fuse)
    assert _same(outcome, recorded), (
        f"{source}/{name} {exporter.name} {fuse}: {outcome.status}: {outcome.reason}; recorded "
        f"{recorded['status']}: {recorded['reason']}")
