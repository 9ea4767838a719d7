"""Regenerate the golden ONNX models from their recipes, deterministically.

Run from the repository root with the training environment (it needs
scikit-learn, skl2onnx, torch, onnx and onnxruntime)::

    python golden_models/generate.py                 # rewrite every model here
    python golden_models/generate.py --check         # compare with the files here
    python golden_models/generate.py -o /tmp/g skl_mlp_regressor

Each model is built by ``build(name)``, normalized (IR version 10, one
opset_import entry per domain, ai.onnx opset <= 21), checked with
``onnx.checker.check_model(full_check=True)``, run in onnxruntime against the
recipe's estimator, and written with deterministic serialization, so a rerun
gives byte-identical files.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import recipes  # noqa: E402

IR_VERSION = 10  # onnxruntime-training 1.19 rejects IR > 10
MAX_AI_ONNX_OPSET = 21
PRODUCER = "lossgraph golden_models/generate.py"

# Hand-written graphs: structure in ONNX text syntax; the weights come from
# recipes.hand_model(name) and are attached as initializers after parsing.
HAND_TEXT: dict[str, str] = {
    "hand_linear": """
        <ir_version: 10, opset_import: ["" : 13]>
        hand_linear (float[N, 6] X) => (float[N, 1] Y)
        {
            XW = MatMul(X, W)
            Y = Add(XW, B)
        }
    """,
    "hand_mlp_tanh_double": """
        <ir_version: 10, opset_import: ["" : 17]>
        hand_mlp_tanh_double (double[N, 5] X) => (double[N, 1] Y)
        {
            H = Gemm(X, W1, B1)
            A = Tanh(H)
            AW = MatMul(A, W2)
            Y = Add(AW, B2)
        }
    """,
    # X, z1 and scale each feed two nodes; (N,5)*(5), (N,5)+(1,5) and (N,1)*()
    # broadcast; ReduceSum takes its axes as an input from opset 13 on.
    "hand_broadcast_reuse": """
        <ir_version: 10, opset_import: ["" : 18]>
        hand_broadcast_reuse (float[N, 5] X) => (float[N, 1] Y)
        {
            z = Mul(X, scale)
            z1 = Add(z, shift)
            s = Sigmoid(z1)
            silu = Mul(z1, s)
            gated = Mul(silu, X)
            res = Add(gated, scale)
            axes = Constant<value = int64[1] {1}>()
            r = ReduceSum<keepdims = 1>(res, axes)
            Y = Mul(r, gain)
        }
    """,
}


def normalize(model: onnx.ModelProto) -> onnx.ModelProto:
    """Set IR 10, dedupe and sort opset_import, check the ai.onnx opset and the full checker."""
    versions: dict[str, int] = {}
    for entry in model.opset_import:
        seen = versions.setdefault(entry.domain, entry.version)
        if seen != entry.version:
            raise ValueError(
                f"opset_import lists domain {entry.domain!r} twice with versions "
                f"{seen} and {entry.version}"
            )
    if versions.get("", 0) > MAX_AI_ONNX_OPSET:
        raise ValueError(f"ai.onnx opset {versions['']} > {MAX_AI_ONNX_OPSET}")
    out = onnx.ModelProto()
    out.CopyFrom(model)
    del out.opset_import[:]
    # Sorted by domain: skl2onnx lists them in an order that varies with the hash seed.
    out.opset_import.extend(onnx.helper.make_opsetid(d, v) for d, v in sorted(versions.items()))
    out.ir_version = IR_VERSION
    onnx.checker.check_model(out, full_check=True)
    return out


def _build_sklearn(name: str) -> onnx.ModelProto:
    from skl2onnx import to_onnx

    r = recipes.recipe(name)
    est = recipes.fit_estimator(name)
    X_train = recipes.dataset(name)[0]
    options = {id(est): {"zipmap": False}} if r.kind == "classifier" else None
    return to_onnx(est, X_train[:1], options=options, target_opset={"": 18, "ai.onnx.ml": 3})


def _build_torch(name: str) -> onnx.ModelProto:
    import torch

    r = recipes.recipe(name)
    net = recipes.make_cnn()
    example = torch.from_numpy(recipes.dataset(name)[0][:2])
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the legacy exporter's DeprecationWarning
        torch.onnx.export(
            net,
            (example,),
            buffer,
            dynamo=False,  # the TorchScript exporter keeps BatchNormalization and initializers
            opset_version=r.opset,
            do_constant_folding=False,  # keep BatchNormalization, do not fold it into Conv
            training=torch.onnx.TrainingMode.EVAL,
            input_names=[r.input_name],
            output_names=list(r.outputs),
            dynamic_axes={r.input_name: {0: "N"}, r.outputs[0]: {0: "N"}},
        )
    model = onnx.load_from_string(buffer.getvalue())
    names = sorted(t.name for t in model.graph.initializer)
    expected = sorted([*r.trainable, "bn.running_mean", "bn.running_var"])
    if names != expected:
        raise RuntimeError(f"torch export gave initializers {names}, expected {expected}")
    return model


def _build_hand(name: str) -> onnx.ModelProto:
    model = onnx.parser.parse_model(HAND_TEXT[name])
    params = recipes.hand_model(name).parameters
    model.graph.initializer.extend(numpy_helper.from_array(v, k) for k, v in params.items())
    model.producer_name = PRODUCER
    return model


def build(name: str) -> onnx.ModelProto:
    """Build the golden model ``name`` from its recipe, normalized and checked."""
    kind = recipes.recipe(name).kind
    if kind in ("regressor", "classifier"):
        model = _build_sklearn(name)
    elif kind == "torch":
        model = _build_torch(name)
    else:
        model = _build_hand(name)
    return normalize(model)


def serialize(model: onnx.ModelProto) -> bytes:
    """Deterministic bytes of a model."""
    return model.SerializeToString(deterministic=True)


def verify(name: str, model: onnx.ModelProto) -> None:
    """Check the model's structure against its recipe and its outputs in onnxruntime."""
    import onnxruntime as ort

    r = recipes.recipe(name)
    ops = tuple(sorted({n.op_type for n in model.graph.node}))
    if ops != r.ops:
        raise AssertionError(f"{name}: ops {ops} != recipe ops {r.ops}")
    inits = {t.name for t in model.graph.initializer}
    if missing := set(r.trainable) - inits:
        raise AssertionError(f"{name}: trainable {sorted(missing)} not among initializers")
    if [o.name for o in model.graph.output] != list(r.outputs):
        raise AssertionError(f"{name}: outputs {[o.name for o in model.graph.output]}")
    X_test = recipes.dataset(name)[2]
    options = ort.SessionOptions()
    options.log_severity_level = 3
    sess = ort.InferenceSession(serialize(model), options, providers=["CPUExecutionProvider"])
    got = dict(zip(r.outputs, sess.run(list(r.outputs), {r.input_name: X_test}), strict=True))
    for key, want in recipes.expected_outputs(name, X_test).items():
        if want.dtype.kind in "iu":
            np.testing.assert_array_equal(got[key], want, err_msg=f"{name}:{key}")
        else:
            np.testing.assert_allclose(
                got[key], want, rtol=1e-4, atol=1e-5, err_msg=f"{name}:{key}"
            )


def _describe(name: str, data: bytes) -> str:
    model = onnx.load_from_string(data)
    ops = sorted({n.op_type for n in model.graph.node})
    digest = hashlib.sha256(data).hexdigest()[:12]
    return f"{name + '.onnx':34s} {len(data):7d} B  sha256:{digest}  {' '.join(ops)}"


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: write (or ``--check``) the golden models."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="models to build (default: all)")
    parser.add_argument("-o", "--output-dir", type=Path, default=HERE)
    parser.add_argument(
        "--check", action="store_true", help="compare with the files, write nothing"
    )
    parser.add_argument("--no-verify", action="store_true", help="skip the onnxruntime comparison")
    args = parser.parse_args(argv)
    names = args.names or list(recipes.RECIPES)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    failures = 0
    for name in names:
        model = build(name)
        if not args.no_verify:
            verify(name, model)
        data = serialize(model)
        path = args.output_dir / f"{name}.onnx"
        if args.check:
            same = path.exists() and path.read_bytes() == data
            failures += not same
            print(("same     " if same else "DIFFERS  ") + _describe(name, data))
        else:
            path.write_bytes(data)
            print(_describe(name, data))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
