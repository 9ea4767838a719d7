"""What importing costs. The command line answers ``--help``, argument and path errors
before it imports numpy, onnx, onnxruntime or torch; ``import lossgraph`` imports none of
them (each module imports alone all the same); and lossgraph imports onnxruntime without
the training build's Python package (which imports torch).

Each case runs in a fresh process and reads its ``sys.modules`` at the end (no timing here:
benchmarks/cli_speed.py times the same commands).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from support.environment import HAS_TRAINING, ROOT

import lossgraph

HEAVY = ("numpy", "onnx", "onnxruntime", "onnxruntime.training", "torch")

#: Runs ``lossgraph.cli.main(argv)``; prints its status, its stderr and the heavy modules.
COMMAND = """
import contextlib, io, json, sys
from lossgraph.cli import main
err = io.StringIO()
with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
    status = main(sys.argv[1:])
print(json.dumps({"status": status, "stderr": err.getvalue(),
                  "modules": [m for m in HEAVY if m in sys.modules]}))
""".replace("HEAVY", repr(HEAVY))

MODEL = """
    <ir_version: 8, opset_import: ["" : 18]>
    g (float[N, 3] x) => (float[N, 1] y)
    <float[3, 1] w = {1, 2, 3}, float[1] b = {0}>
    { h = MatMul(x, w)
      y = Add(h, b) }
"""


def run(code: str, *argv: str, cwd: Path, pycache: Path | None = None) -> dict:
    """Runs ``code`` with ``argv`` in a fresh interpreter in ``cwd``; its last line's JSON.
    With ``pycache``, bytecode is written there and read back (where the environment says
    not to write any, each child would compile every module it imports again)."""
    environment = {**os.environ, "PYTHONPATH": str(ROOT)}
    if pycache is not None:
        environment.pop("PYTHONDONTWRITEBYTECODE", None)
        environment["PYTHONPYCACHEPREFIX"] = str(pycache)
    result = subprocess.run([sys.executable, "-c", code, *argv], cwd=cwd, env=environment,
                            capture_output=True, text=True, check=True)
    return json.loads(result.stdout.splitlines()[-1])


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """A program folder ``prog``, a model ``m.onnx`` and data ``d.npz``; nothing ``missing``."""
    path = tmp_path_factory.mktemp("cli_imports")
    model = onnx.parser.parse_model(MODEL)
    onnx.save(model, path / "m.onnx")
    lossgraph.compile_program(model).save(path / "prog")
    X = np.random.default_rng(0).normal(size=(10, 3))
    np.savez(path / "d.npz", X=X, y=X @ [1.0, 2.0, 3.0])
    (path / "folder").mkdir()
    return path


QUICK = {
    "help": (["--help"], 0, ""),
    "a command's help": (["train", "--help"], 0, ""),
    "no -o": (["train", "--data", "missing.csv", "prog"], 2, "required: -o/--output"),
    "missing model": (["compile", "missing.onnx", "-o", "x"], 2, "No ONNX file at"),
    "model is a folder": (["lower-ml", "folder", "-o", "o.onnx"], 2, "is a folder"),
    "inspect a folder": (["inspect", "folder"], 2, "is a folder"),
    "missing data": (["train", "prog", "--data", "missing.csv", "-o", "o.onnx"], 2,
                     "There is no data file at 'missing.csv'"),
    "missing npz": (["train", "prog", "--data", "missing.npz", "-o", "o.onnx"], 2,
                    "There is no data file or folder"),
    "one npy file": (["train", "prog", "--data", "X.npy", "-o", "o.onnx"], 2, "one .npy array"),
    "missing program": (["train", "nope", "--data", "d.npz", "-o", "o.onnx"], 2,
                        "There is no lossgraph program folder at 'nope'"),
    "a model as the program": (["train", "m.onnx", "--data", "d.npz", "-o", "o.onnx"], 2,
                               "compile it first"),
    "a folder that is no program": (["train", "folder", "--data", "d.npz", "-o", "o.onnx"], 2,
                                    "holds no manifest.json"),
    "missing checkpoint": (["train", "--resume", "ckpt", "--data", "d.npz", "-o", "o.onnx"], 2,
                           "There is no lossgraph checkpoint folder"),
    "neither program nor checkpoint": (["train", "--data", "d.npz", "-o", "o.onnx"], 2,
                                       "Name the program folder"),
    "batch size zero": (["train", "prog", "--data", "d.npz", "--batch-size", "0", "-o",
                         "o.onnx"], 2, "batch_size=0 must be >= 1"),
    "export a missing folder": (["export", "nope", "-o", "o.onnx"], 2, "There is nothing at"),
    "output in a missing folder": (["lower-ml", "m.onnx", "-o", "no/o.onnx"], 2,
                                   "does not exist"),
    "epochs not a number": (["train", "prog", "--data", "d.npz", "--epochs", "ten", "-o",
                             "o.onnx"], 2, "invalid int value"),
}


@pytest.mark.parametrize(("argv", "status", "says"), QUICK.values(), ids=QUICK.keys())
def test_help_and_argument_and_path_errors_import_no_heavy_package(folder, argv, status, says):
    result = run(COMMAND, *argv, cwd=folder)
    assert result["status"] == status and says in result["stderr"], result
    assert result["modules"] == [], result


def test_a_fuse_mode_is_checked_against_the_registry_without_onnxruntime(folder):
    result = run(COMMAND, "compile", "missing.onnx", "-o", "p", "--fuse", "turbo", cwd=folder)
    assert result["status"] == 2 and "choose from 'separate', 'step', 'epoch'" in result["stderr"]
    assert not {"onnxruntime", "torch"} & set(result["modules"])  # the registry: numpy, onnx


def test_compile_help_lists_the_modes_of_the_registry(folder, capsys):
    from lossgraph.cli import main
    from lossgraph.modes import MODES

    assert main(["compile", "--help"]) == 0
    shown = " ".join(capsys.readouterr().out.split())
    for name, mode in MODES.items():
        assert f"{name}, {mode.summary}" in shown


def test_import_lossgraph_imports_no_heavy_package_and_every_name_still_loads(folder):
    code = ("import json, sys, lossgraph\n"
            "before = [m for m in HEAVY if m in sys.modules]\n"
            "names = [n for n in lossgraph.__all__ if getattr(lossgraph, n) is None]\n"
            "print(json.dumps({'before': before, 'missing': names,\n"
            "                  'passes': lossgraph.passes.__name__}))").replace("HEAVY",
                                                                            repr(HEAVY))
    result = run(code, cwd=folder)
    assert result == {"before": [], "missing": [], "passes": "lossgraph.passes"}


def test_training_imports_onnxruntime_without_torch(folder):
    result = run(COMMAND, "train", "prog", "--data", "d.npz", "-o", "o.onnx", cwd=folder)
    assert result["status"] == 0, result
    assert "onnxruntime" in result["modules"]
    assert "torch" not in result["modules"] and "onnxruntime.training" not in result["modules"]


@pytest.mark.slow  # imports torch, as onnxruntime.training does (2-4 s)
@pytest.mark.skipif(not HAS_TRAINING or importlib.util.find_spec("torch") is None,
                    reason="needs the training build and torch")
def test_onnxruntime_training_still_imports_after_lossgraph_imported_onnxruntime(folder):
    code = ("import json, sys\n"
            "from lossgraph.training_build import available, import_onnxruntime\n"
            "import_onnxruntime()\n"
            "before = 'torch' in sys.modules\n"
            "import onnxruntime.training\n"
            "from onnxruntime.training import artifacts\n"
            "print(json.dumps({'before': before, 'training': available(),\n"
            "                  'after': 'torch' in sys.modules}))")
    assert run(code, cwd=folder) == {"before": False, "training": True, "after": True}


#: Imports each module of lossgraph first in a fresh child (forked from a process that holds
#: numpy and onnx, not lossgraph); prints the modules that failed, with the error.
EVERY_MODULE = """
import importlib, json, os, sys, traceback
from pathlib import Path
import numpy, onnx
root = Path(sys.argv[1])
names = sorted(".".join(p.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
               for p in (root / "lossgraph").rglob("*.py"))
failed = {}
for name in names:
    if name in ("lossgraph.__main__", "lossgraph.torch", "lossgraph.ray"):
        continue  # runs the command line; needs torch; needs ray
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            importlib.import_module(name)
        except BaseException:
            os.write(write, traceback.format_exc().strip().splitlines()[-1].encode())
            os._exit(1)
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as stream:
        message = stream.read()
    if os.waitpid(pid, 0)[1]:
        failed[name] = message
print(json.dumps({"modules": len(names), "failed": failed}))
"""


@pytest.mark.slow  # 120 modules, each imported first in its own child: about 5 s of CPU
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_every_module_imports_first(tmp_path):
    """``import lossgraph`` loads nothing, so no import order hides a cycle between modules:
    each module must import when it is the first one of lossgraph a program imports. (A
    cycle fails only when the import enters it at one module, so no cheaper single import
    shows it; the children share compiled bytecode.)"""
    result = run(EVERY_MODULE, str(ROOT), cwd=tmp_path, pycache=tmp_path / "pycache")
    assert result["modules"] > 100 and result["failed"] == {}, result["failed"]
