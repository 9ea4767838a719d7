"""Training data files for lossgraph train: .npz, .npy folders, .csv, .parquet."""

from __future__ import annotations

import argparse
import csv
import sys
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..data import converted, declared
from ..errors import (
    InvalidDataError,
    RuntimeUnavailableError,
    UnsupportedOptionError,
    suggest,
)
from ..paths import data_source
from ..program import TrainingProgram
from ..storage import read_arrays
from .parser import TABLE_SUFFIXES, _one_line

EXIT_OK = 0

# -- training data ---------------------------------------------------------------------------


def _input_specs(program: TrainingProgram) -> dict[str, list[dict[str, Any]]]:
    """The evaluate graph's data inputs by role: feature, label, sample_weight."""
    specs: dict[str, list[dict[str, Any]]] = {"feature": [], "label": [], "sample_weight": []}
    for value in program.manifest["graphs"]["evaluate"]["inputs"]:
        if value["role"] in specs:
            specs[value["role"]].append(value)
    return specs


def _default_label(available: Sequence[str], path: str, what: str) -> list[str]:
    for name in ("y", "label"):
        if name in available:
            return [name]
    raise InvalidDataError(
        f"{path!r} has no {what} named y or label: name the label with --label ({what}s: "
        f"{', '.join(available)}).")


def _selection(args: argparse.Namespace, available: Sequence[str], path: str, what: str,
               weighted: bool, default_features: Callable[[list[str]], list[str]]
               ) -> tuple[list[str], list[str], str | None]:
    """The features, label and sample weight to read (column or array names), checked:
    each exists and is read once. The sample weight defaults to ``sample_weight`` when the
    program takes one."""
    label = args.label or _default_label(available, path, what)
    weight = args.sample_weight
    if weight is not None and not weighted:
        raise UnsupportedOptionError(
            f"--sample-weight {weight}: the program has no sample-weight input; compile it "
            "with --weight-name NAME to train with sample weights.")
    if weight is None and "sample_weight" in available and "sample_weight" not in label:
        if weighted:
            weight = "sample_weight"
        elif not args.features:
            print(f"lossgraph train: warning: {path!r} holds sample weights ('sample_weight'), "
                  "but the program has no sample-weight input (compile --weight-name): they "
                  "are not used.", file=sys.stderr)
    taken = [*label, *([weight] if weight else [])]
    unused = ["sample_weight"] if weight is None and "sample_weight" in available else []
    features = args.features or default_features([*taken, *unused])
    _known([*features, *taken], available, path, what)
    for option, names in (("--features", features), ("--label", label)):
        repeated = next((n for i, n in enumerate(names) if n in names[:i]), None)
        if repeated is not None:
            raise InvalidDataError(f"{option} names the {what} {repeated!r} twice.")
    both = next((n for n in features if n in taken), None)
    if both is not None:
        role = "the sample weight" if both == weight else "the label"
        raise InvalidDataError(f"The {what} {both!r} cannot be both a feature and {role}.")
    return features, label, weight


def _known(names: Sequence[str], available: Sequence[str], path: str, what: str) -> None:
    for name in names:
        if name not in available:
            raise InvalidDataError(f"{path!r} has no {what} {name!r}."
                                   + suggest(name, available, f"{what}s"))


def _array_data(path: str, args: argparse.Namespace,
                specs: Mapping[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """``X``, ``y`` (and ``sample_weight``) from an .npz file or a folder of .npy files."""
    arrays = read_arrays(path)
    names = sorted(arrays)
    needs = (f"{path!r} holds {names}; it needs arrays named X and y (and optionally "
             "sample_weight), or --features and --label naming others.")
    by_input = [f["name"] for f in specs["feature"]]

    def default_features(taken: list[str]) -> list[str]:
        if "X" in arrays:
            return ["X"]
        if len(by_input) > 1 and all(n in arrays for n in by_input):
            return by_input  # one array per feature input, named after it
        raise InvalidDataError(needs)

    if not args.label and "y" not in arrays and "label" not in arrays:
        raise InvalidDataError(needs)
    features, label, weight = _selection(args, names, path, "array",
                                         bool(specs["sample_weight"]), default_features)
    if len(label) > 1:
        raise InvalidDataError(f"--label names {len(label)} arrays; in .npz and .npy data the "
                               "label is one array (of shape (N, k) for k outputs).")
    data = {"X": arrays[features[0]] if len(features) == 1 else
            {name: arrays[name] for name in features}, "y": arrays[label[0]]}
    if weight:
        data["sample_weight"] = arrays[weight]
    return data


def _csv_columns(path: Path) -> list[str]:
    try:
        with open(path, newline="", encoding="utf-8-sig") as stream:
            header = next(csv.reader(stream), None)
    except UnicodeDecodeError:
        raise InvalidDataError(f"{str(path)!r} is not a text file (UTF-8): a .csv file holds a "
                               "header row, then rows of numbers.") from None
    except csv.Error as exc:
        raise InvalidDataError(f"{str(path)!r} cannot be read as CSV ({exc}).") from None
    if not header or not any(name.strip() for name in header):
        raise InvalidDataError(f"{str(path)!r} is empty: a .csv file starts with a header row "
                               "naming its columns.")
    return [name.strip() for name in header]


def _read_csv(path: Path, names: Sequence[str], wanted: Sequence[str]) -> dict[str, np.ndarray]:
    columns = [names.index(name) for name in wanted]
    try:
        with warnings.catch_warnings():  # no rows: said below, as an error
            warnings.filterwarnings("ignore", "loadtxt: input contained no data")
            table = np.loadtxt(path, delimiter=",", skiprows=1, usecols=columns, ndmin=2,
                               dtype=np.float64, encoding="utf-8-sig", quotechar='"')
    except ValueError as exc:
        raise InvalidDataError(f"{str(path)!r} cannot be read as numbers: "
                               f"{_csv_problem(path, names, wanted) or _one_line(str(exc))} "
                               "(choose the columns with --features, --label, --sample-weight)."
                               ) from None
    return {name: table[:, k] for k, name in enumerate(wanted)}


def _csv_problem(path: Path, names: Sequence[str], wanted: Sequence[str]) -> str | None:
    """Where a .csv file numpy could not read goes wrong: the first bad line and cell."""
    columns = [names.index(name) for name in wanted]
    line = 1
    try:
        with open(path, newline="", encoding="utf-8-sig") as stream:
            reader = csv.reader(stream)
            next(reader, None)
            for row in reader:
                line = reader.line_num
                if not row:
                    continue
                if len(row) != len(names):
                    return f"line {line} has {len(row)} fields, the header {len(names)}"
                for index in columns:
                    try:
                        float(row[index])
                    except ValueError:
                        return (f"line {line}, column {names[index]!r}: {row[index]!r} is not "
                                "a number")
    except UnicodeDecodeError:
        return f"after line {line} it is not UTF-8 text"
    except csv.Error as exc:
        return f"line {line + 1}: {exc}"
    return None


def _parquet_module() -> Any:
    try:
        import pyarrow.parquet as parquet
    except ImportError:
        raise RuntimeUnavailableError(
            "Reading .parquet files needs pyarrow: pip install pyarrow (or pip install "
            "'lossgraph[parquet]').") from None
    return parquet


def _parquet_columns(path: Path) -> list[str]:
    parquet = _parquet_module()
    try:
        return list(parquet.read_schema(path).names)
    except (OSError, ValueError) as exc:
        raise InvalidDataError(f"{str(path)!r} is not a readable Parquet file ({exc}).") from None


def _read_parquet(path: Path, wanted: Sequence[str]) -> dict[str, np.ndarray]:
    table = _parquet_module().read_table(path, columns=list(wanted))
    return {name: np.asarray(table.column(name).to_numpy()) for name in wanted}


def _as_input(values: np.ndarray, spec: Mapping[str, Any], what: str) -> np.ndarray:
    """A column (or columns) of a table as the dtype input ``spec`` declares, converted as
    the Trainer converts arrays (:func:`lossgraph.data.converted`); a text table has no
    dtype of its own, so whole numbers are taken for an integer input."""
    return converted(values, np.dtype(spec["dtype"]), what,
                     declared(spec["name"], spec["dtype"], spec["shape"]), whole=True)


def _table_data(path: str, args: argparse.Namespace,
                specs: Mapping[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """``X``, ``y`` (and ``sample_weight``) from the columns of a .csv or .parquet file,
    converted to the dtypes of the program's inputs."""
    source = data_source(path, table=True)
    parquet = source.suffix.lower() != ".csv"
    names = _parquet_columns(source) if parquet else _csv_columns(source)
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise InvalidDataError(f"{path!r} names the column {duplicates[0]!r} twice.")
    features, label, weight = _selection(
        args, names, path, "column", bool(specs["sample_weight"]),
        lambda taken: [n for n in names if n not in taken])
    if not features:
        raise InvalidDataError(f"{path!r} has no feature column besides {', '.join(label)}.")
    if len(specs["feature"]) != 1:
        inputs = ", ".join(f["name"] for f in specs["feature"])
        raise InvalidDataError(
            f"The program has {len(specs['feature'])} feature inputs ({inputs}); a .csv or "
            ".parquet file feeds one. Save one array per input in an .npz file instead, named "
            "after the inputs.")
    wanted = [*features, *label, *([weight] if weight else [])]
    columns = _read_parquet(source, wanted) if parquet else _read_csv(source, names, wanted)
    rows = len(next(iter(columns.values())))
    if rows == 0:
        raise InvalidDataError(f"{path!r} has no rows of data.")

    for name, values in columns.items():
        if values.dtype.kind not in "biuf":
            raise InvalidDataError(f"The column {name!r} of {path!r} holds {values.dtype} values "
                                   "(text?), not numbers: leave it out of --features.")

    def stacked(chosen: Sequence[str]) -> np.ndarray:
        return np.stack([columns[name] for name in chosen], axis=1)

    feature_spec = specs["feature"][0]
    width = feature_spec["shape"][-1] if len(feature_spec["shape"]) == 2 else None
    if isinstance(width, int) and width != len(features):
        raise InvalidDataError(
            f"{path!r} gives {len(features)} feature column{'s' * (len(features) != 1)} "
            f"({', '.join(features)}), but the model's input {feature_spec['name']!r} takes "
            f"{width}: choose them with --features (and the label with --label).")
    label_spec = specs["label"][0] if specs["label"] else {"name": "label", "dtype": "float32",
                                                           "shape": []}
    outputs = label_spec["shape"][-1] if len(label_spec["shape"]) == 2 else 1
    if isinstance(outputs, int) and outputs != len(label):
        raise InvalidDataError(
            f"{path!r} gives {len(label)} label column{'s' * (len(label) != 1)} "
            f"({', '.join(label)}), but the model's label {label_spec['name']!r} takes "
            f"{outputs}: name them with --label.")
    data: dict[str, Any] = {
        "X": _as_input(stacked(features), feature_spec,
                       f"{path!r} (columns {', '.join(features)})"),
        "y": _as_input(columns[label[0]] if len(label) == 1 else stacked(label), label_spec,
                       f"{path!r} (column{'s' * (len(label) > 1)} {', '.join(label)})")}
    if weight:
        data["sample_weight"] = _as_input(columns[weight], specs["sample_weight"][0],
                                          f"{path!r} (column {weight})")
    return data


def class_labels(path: str, name: str | None) -> np.ndarray:
    """The class labels of a data file (.npz, a folder of .npy files, .csv, .parquet): the
    column or array ``name`` (default: y, else label), as int64."""
    suffix = Path(path).suffix.lower()
    if suffix in TABLE_SUFFIXES:
        source, what = data_source(path, table=True), "column"
        parquet = suffix != ".csv"
        available = _parquet_columns(source) if parquet else _csv_columns(source)
        chosen = name or _default_label(available, path, what)[0]
        _known([chosen], available, path, what)
        read = (_read_parquet(source, [chosen]) if parquet else
                _read_csv(source, available, [chosen]))
        values = read[chosen]
    else:
        arrays, what = read_arrays(path), "array"
        chosen = name or _default_label(sorted(arrays), path, what)[0]
        _known([chosen], sorted(arrays), path, what)
        values = arrays[chosen]
    if values.dtype.kind not in "iuf" or (values.dtype.kind == "f" and not (
            np.isfinite(values).all() and (values == np.round(values)).all())):
        raise InvalidDataError(
            f"The {what} {chosen!r} of {path!r} holds {values.dtype} values that are not all "
            "whole numbers: class labels are class indices 0, 1, ... (name the label with "
            "--class-weight-labels DATA NAME).")
    return values.astype(np.int64)


def _training_data(path: str, args: argparse.Namespace,
                   program: TrainingProgram) -> dict[str, Any]:
    """The data of ``--data``, by the names ``Trainer.fit`` takes them."""
    specs = _input_specs(program)
    if Path(path).suffix.lower() in TABLE_SUFFIXES:
        return _table_data(path, args, specs)
    return _array_data(path, args, specs)  # (one .npy file was refused by check_inputs)


def _rows(value: Any) -> int:
    return len(next(iter(value.values()))) if isinstance(value, Mapping) else len(value)


def _split(data: Mapping[str, Any], fraction: float) -> tuple[dict[str, Any], tuple]:
    """The rows but the last ``fraction``, and those held out as validation data."""
    rows = _rows(data["y"])
    held = int(round(rows * fraction))
    if not 0 < held < rows:
        raise InvalidDataError(
            f"--validation-split {fraction:g} of {rows} rows holds out {held}: choose a split "
            "that keeps at least one row on each side.")
    cut = rows - held

    def part(value: Any, rows_: slice) -> Any:
        return ({k: v[rows_] for k, v in value.items()} if isinstance(value, Mapping)
                else value[rows_])

    train = {name: part(value, slice(None, cut)) for name, value in data.items()}
    validation = tuple(part(data[name], slice(cut, None))
                       for name in ("X", "y", "sample_weight") if name in data)
    return train, validation


