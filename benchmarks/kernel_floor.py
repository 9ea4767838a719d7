"""The floor of a training step: its heavy kernels alone, on each runtime.

- :func:`heavy_kernel_floor`: a compiled step graph (ONNX) cut down to its heavy nodes
  (:data:`HEAVY_OPS`: the convolutions and products, in the forms lossgraph's passes
  chose: the unfolding grouped ``Conv`` and the batched ``MatMul`` of
  :mod:`lossgraph.speed.unfold_conv_grads` included) in the main graph, each fed the
  values it reads in a real step of that graph. Any graph onnxruntime runs for that step
  in those forms runs at least these kernels, so no such graph trains faster.
- :func:`torch_heavy_kernels`: the same kernels in torch, called directly on tensors of
  the step's shapes: ``F.conv2d`` and ``aten.convolution_backward`` (input and weight
  gradients) per ``Conv2d``; ``F.linear`` and the two gradient ``mm``\\ s per ``Linear``;
  attention's projections and its six batched products per ``MultiheadAttention``.

Both leave out what is not a product or a convolution (activations, pooling,
normalization, bias sums, the update): they bound a step from below, they do not train.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from lossgraph.errors import UnsupportedModelError
from lossgraph.graphs import subgraphs, tensor_array
from lossgraph.program import TrainingProgram
from lossgraph.runtime.session import create_session
from lossgraph.speed import SpecializeBatch

__all__ = ["HEAVY_OPS", "KernelFloor", "TorchKernels", "heavy_kernel_floor", "step_graph",
           "torch_heavy_kernels"]

#: The heavy ops: convolutions, products, and the recurrent layers (one node holds a
#: whole recurrence: its products and gates).
HEAVY_OPS = frozenset({"Conv", "ConvTranspose", "MatMul", "Gemm", "Einsum",
                       "LSTM", "GRU", "RNN"})

#: Ops whose outputs are not fixed by constant inputs (onnxruntime folds no others).
_RANDOM_OPS = frozenset({"RandomNormal", "RandomUniform", "RandomNormalLike",
                         "RandomUniformLike", "Multinomial", "Bernoulli", "Dropout"})


@dataclass(frozen=True)
class KernelFloor:
    """A step graph's heavy nodes as a graph of their own (``model``), with the values
    they read in the step as its inputs (``feeds``); the values that are constant in the
    step stay initializers, as onnxruntime sees them there."""

    model: onnx.ModelProto
    feeds: dict[str, np.ndarray]
    #: heavy nodes inside Scan/Loop/If bodies, which the floor leaves out
    left_out: int

    @property
    def kernels(self) -> dict[str, int]:
        """How many nodes of each op type the floor runs."""
        return dict(Counter(node.op_type for node in self.model.graph.node))

    def describe(self) -> str:
        """``4 Conv, 3 MatMul, ...`` and what was left out."""
        text = ", ".join(f"{count} {op}" for op, count in sorted(self.kernels.items()))
        if self.left_out:
            text += f"; not the {self.left_out} in Scan/Loop/If bodies"
        return text


def _is_heavy(node: onnx.NodeProto, op_types: frozenset[str]) -> bool:
    return node.op_type in op_types and node.domain in ("", "ai.onnx")


def _constants(graph: onnx.GraphProto) -> set[str]:
    """The main graph's values fixed before any input arrives: initializers that are not
    inputs, and the outputs of deterministic nodes without subgraphs that read only those
    (what onnxruntime's constant folding computes once)."""
    inputs = {value.name for value in graph.input}
    constant = {tensor.name for tensor in graph.initializer if tensor.name not in inputs}
    for node in graph.node:
        if (node.op_type not in _RANDOM_OPS and next(subgraphs(node), None) is None
                and all(not name or name in constant for name in node.input)):
            constant.update(name for name in node.output if name)
    return constant


def heavy_kernel_floor(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray],
                       op_types: frozenset[str] = HEAVY_OPS) -> KernelFloor:
    """The heavy nodes of ``model``'s main graph alone, fed what they read when
    onnxruntime runs ``model`` on ``feeds`` once (module doc).

    Each heavy node keeps its inputs' names: one produced by another heavy node stays that
    node's output, one constant in ``model`` stays an initializer (holding its value), any
    other becomes a graph input; every heavy output is a graph output. A heavy node that
    reads only constants is left out (onnxruntime folds it).
    """
    graph = model.graph
    constant = _constants(graph)
    heavy = [node for node in graph.node if _is_heavy(node, op_types)
             and not all(not name or name in constant for name in node.input)]
    if not heavy:
        raise UnsupportedModelError(
            f"Graph {graph.name!r} has no {', '.join(sorted(op_types))} node outside "
            "subgraphs reading a non-constant value: there is no heavy-kernel floor to take.")
    produced = {name for node in heavy for name in node.output if name}
    read = list(dict.fromkeys(name for node in heavy for name in node.input
                              if name and name not in produced))
    outputs = list(dict.fromkeys(name for node in heavy for name in node.output if name))
    values = _values(model, feeds, [*read, *outputs])
    floor_graph = helper.make_graph(
        [_copy(node) for node in heavy], f"{graph.name}_heavy_kernels",
        [_declared(name, values[name]) for name in read if name not in constant],
        [_declared(name, values[name]) for name in outputs],
        [numpy_helper.from_array(values[name], name) for name in read if name in constant])
    floor = helper.make_model(floor_graph, ir_version=model.ir_version,
                              opset_imports=list(model.opset_import))
    onnx.checker.check_model(floor)
    left_out = sum(_is_heavy(inner, op_types) for node in graph.node
                   for body in subgraphs(node) for inner in _all_nodes(body))
    return KernelFloor(floor, {name: values[name] for name in read if name not in constant},
                       left_out)


def _values(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray],
            names: list[str]) -> dict[str, np.ndarray]:
    """The values ``names`` take when onnxruntime runs ``model`` on ``feeds``: graph
    inputs from ``feeds``, initializers as stored (a light model's frozen weights read from
    their store), the rest computed (made outputs)."""
    values = {name: np.asarray(feeds[name]) for name in names if name in feeds}
    stored = {tensor.name: tensor for tensor in model.graph.initializer}
    values.update({name: tensor_array(stored[name]) for name in names
                   if name not in values and name in stored})
    computed = [name for name in names if name not in values]
    if computed:
        probe = onnx.ModelProto()
        probe.CopyFrom(model)
        del probe.graph.output[:]
        probe.graph.output.extend(onnx.ValueInfoProto(name=name) for name in computed)
        session = create_session(probe)
        inputs = {value.name for value in model.graph.input}
        run = session.run(computed, {k: v for k, v in feeds.items() if k in inputs})
        values.update(zip(computed, run))
    return values


def _declared(name: str, value: np.ndarray) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(value.dtype),
                                         value.shape)


def _copy(node: onnx.NodeProto) -> onnx.NodeProto:
    copied = onnx.NodeProto()
    copied.CopyFrom(node)
    return copied


def _all_nodes(graph: onnx.GraphProto) -> list[onnx.NodeProto]:
    """Every node of ``graph`` and of the bodies nested in it."""
    return [inner for node in graph.node
            for inner in (node, *(n for body in subgraphs(node) for n in _all_nodes(body)))]


def step_graph(program: TrainingProgram, data: Mapping[str, np.ndarray],
               learning_rate: float) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """``program``'s ``train_step`` as the Trainer runs it for a batch of ``data``'s rows
    (:class:`~lossgraph.speed.SpecializeBatch`), and feeds for one step: ``data`` by
    role (``feature``, ``label``, ...), the program's initial state, ``learning_rate``
    and step 0."""
    entry = program.manifest["graphs"]["train_step"]
    feeds = {}
    for value in entry["inputs"]:
        name, role, dtype = value["name"], value["role"], np.dtype(value["dtype"])
        if role in data:
            feeds[name] = np.ascontiguousarray(data[role], dtype)
        elif name in program.state:
            feeds[name] = program.state[name]
        elif role == "learning_rate":
            feeds[name] = np.array(learning_rate, dtype)
        elif role == "step":
            feeds[name] = np.array(0, dtype)
        else:
            raise UnsupportedModelError(
                f"train_step's input {name!r} plays the role {role!r}: pass its value in data.")
    batch = len(next(iter(data.values())))
    # the light graph (its frozen weights in the program's store: the graph reads them
    # while the program lives), as the Trainer specializes it
    return SpecializeBatch(batch)(program.light_graphs["train_step"]).model, feeds


# -- torch ------------------------------------------------------------------------------


@dataclass(frozen=True)
class TorchKernels:
    """One step's heavy kernels in torch: ``calls`` (each one op, run in order by
    :meth:`step`, under ``torch.no_grad``) and how many of each op."""

    calls: tuple[Callable[[], Any], ...]
    kernels: dict[str, int]

    def step(self) -> None:
        for call in self.calls:
            call()

    def describe(self) -> str:
        return ", ".join(f"{count} {op}" for op, count in sorted(self.kernels.items()))


Kernel = tuple[str, Callable[[], Any]]


def torch_heavy_kernels(net: Any, example: np.ndarray) -> TorchKernels:
    """The heavy kernels of a training step of ``net`` on the batch ``example`` (module
    doc), each on tensors of the shapes it has in that step: the layers' inputs as the
    forward gives them, random upstream gradients. ``net``'s state is left as it was.

    Covered: ``Conv2d`` (zero padding), ``Linear`` and self-attention
    ``MultiheadAttention``; any other module with weights of its own but a normalization
    is an :class:`~lossgraph.errors.UnsupportedModelError` naming it.
    """
    import torch
    from torch import nn

    covered = (nn.Conv2d, nn.Linear, nn.MultiheadAttention)
    not_heavy = (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm)
    inside_attention = {id(part) for module in net.modules()
                        if isinstance(module, nn.MultiheadAttention)
                        for part in module.modules() if part is not module}
    seen: list[tuple[Any, tuple, dict, Any]] = []
    hooks, uncovered = [], set()
    for module in net.modules():
        if id(module) in inside_attention:
            continue
        if isinstance(module, covered):
            hooks.append(module.register_forward_hook(
                lambda *call: seen.append(call), with_kwargs=True))
        elif next(module.parameters(recurse=False), None) is not None and not isinstance(
                module, not_heavy):
            uncovered.add(type(module).__name__)
    if uncovered:
        for hook in hooks:
            hook.remove()
        raise UnsupportedModelError(
            f"torch_heavy_kernels has no kernels written for {', '.join(sorted(uncovered))}.")
    saved = {name: value.clone() for name, value in net.state_dict().items()}
    try:  # with gradients on: an input's requires_grad says whether its gradient is due
        net(torch.from_numpy(example))
    finally:
        for hook in hooks:
            hook.remove()
        net.load_state_dict(saved)  # BatchNorm's running statistics, as they were
    generator = torch.Generator().manual_seed(0)

    def random(*shape: int) -> Any:
        return torch.randn(*shape, generator=generator)

    kernels: list[Kernel] = []
    for module, args, kwargs, output in seen:
        if isinstance(module, nn.Conv2d):
            kernels += _conv2d(torch, module, args[0], random(*output.shape))
        elif isinstance(module, nn.Linear):
            kernels += _linear(torch, module.weight, module.bias, args[0].detach(),
                               args[0].requires_grad, random)
        else:
            kernels += _self_attention(torch, module, args, kwargs, random)

    def no_grad(call: Callable[[], Any]) -> Callable[[], Any]:
        def run() -> Any:
            with torch.no_grad():
                return call()
        return run

    return TorchKernels(tuple(no_grad(call) for _, call in kernels),
                        dict(Counter(name for name, _ in kernels)))


def _conv2d(torch: Any, module: Any, x: Any, upstream: Any) -> list[Kernel]:
    """The forward ``conv2d`` and one ``convolution_backward`` of ``upstream`` giving the
    weight gradient, and the input's when it needs one (not the bias sum)."""
    if module.padding_mode != "zeros" or isinstance(module.padding, str):
        raise UnsupportedModelError(
            f"torch_heavy_kernels: Conv2d with padding {module.padding!r} "
            f"({module.padding_mode}); only explicit zero padding is covered.")
    weight, bias = module.weight.detach(), _detached(module.bias)
    needs_input_grad, x = x.requires_grad, x.detach()
    settings = (list(module.stride), list(module.padding), list(module.dilation))

    def forward() -> Any:
        return torch.nn.functional.conv2d(x, weight, bias, module.stride, module.padding,
                                          module.dilation, module.groups)

    def backward() -> Any:
        return torch.ops.aten.convolution_backward(
            upstream, x, weight, None, *settings, False, [0, 0], module.groups,
            [needs_input_grad, True, False])

    return [("conv2d", forward), ("convolution_backward", backward)]


def _linear(torch: Any, weight: Any, bias: Any, x: Any, needs_input_grad: bool,
            random: Callable[..., Any]) -> list[Kernel]:
    """``F.linear`` forward, the weight gradient ``x^T @ dy`` and, when the input needs
    it, ``dy @ W``: the two ``mm``\\ s of linear's backward (rows folded as torch folds
    them)."""
    weight, bias = weight.detach(), _detached(bias)
    rows = x.reshape(-1, x.shape[-1])
    upstream = random(rows.shape[0], weight.shape[0])
    kernels: list[Kernel] = [("linear", lambda: torch.nn.functional.linear(x, weight, bias)),
                             ("mm", lambda: rows.t() @ upstream)]
    if needs_input_grad:
        kernels.append(("mm", lambda: upstream @ weight))
    return kernels


def _self_attention(torch: Any, module: Any, args: tuple, kwargs: dict,
                    random: Callable[..., Any]) -> list[Kernel]:
    """Self-attention: the packed q, k, v projection, ``q k^T`` and ``p v`` forward,
    ``p^T do``, ``do v^T``, ``ds k`` and ``ds^T q`` backward (batched over batch x heads),
    the output projection; each projection a :func:`_linear`."""
    names = ("query", "key", "value")
    query, key, value = (args[i] if i < len(args) else kwargs[n] for i, n in enumerate(names))
    if not (query is key is value and module._qkv_same_embed_dim):
        raise UnsupportedModelError("torch_heavy_kernels covers self-attention only "
                                    "(query, key and value one tensor).")
    batch, length = query.shape[:2] if module.batch_first else query.shape[1::-1]
    heads, width = module.num_heads, module.head_dim
    q, k, v, do = (random(batch * heads, length, width) for _ in range(4))
    p, ds = (random(batch * heads, length, length) for _ in range(2))
    attended = random(batch * length, module.embed_dim)
    return [*_linear(torch, module.in_proj_weight, module.in_proj_bias, query.detach(),
                     query.requires_grad, random),
            ("bmm", lambda: torch.bmm(q, k.transpose(1, 2))),
            ("bmm", lambda: torch.bmm(p, v)),
            ("bmm", lambda: torch.bmm(p.transpose(1, 2), do)),
            ("bmm", lambda: torch.bmm(do, v.transpose(1, 2))),
            ("bmm", lambda: torch.bmm(ds, k)),
            ("bmm", lambda: torch.bmm(ds.transpose(1, 2), q)),
            *_linear(torch, module.out_proj.weight, module.out_proj.bias, attended, True,
                     random)]


def _detached(tensor: Any) -> Any:
    return None if tensor is None else tensor.detach()
