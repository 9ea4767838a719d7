"""Gradient accumulation: several micro-batches, one update.

``SumGradients`` adds a micro-batch's gradient, scaled, to a running sum the graph
reads (each weight's, or the flat one of :class:`~lossgraph.passes.fuse.PackWeights`)::

    (..., <w>_grad_sum..., gradient_scale) -> (loss, <w>_grad_sum_new..., <buffer>_new...)
    <w>_grad_sum_new = <w>_grad_sum + gradient_scale * <w>_grad

and records the sums as the gradients, so that :class:`~lossgraph.passes.fuse.StepGraph`
after it updates the weights with the sum (the last micro-batch of a group). The scale of a
micro-batch is its share of the group's rows (its sample weights' sum over the group's), so
the sum is the gradient of the mean loss over every row of the group: one step at a batch
that large, to float rounding.

``GroupGradients`` makes of an accumulating model the gradient model of a whole group,
whose rows are ``k`` micro-batches end to end, ``k`` the length of ``micro_batch_scales``::

    (x[k*b, ...], y, w, micro_batch_scales[k], weights, buffers)
        -> (micro_batch_losses[k], <w>_grad_group, <buffer>_group_new)

a ``Scan`` over the micro-batches carrying the sum from zero (and the buffers, updated per
micro-batch as torch updates running statistics), the weights read from the enclosing graph.
:class:`~lossgraph.passes.fuse.StepGraph` then appends one update to it, and
:class:`~lossgraph.passes.fuse.EpochGraph` scans the groups of an epoch, one learning rate
and ``k`` scales per update.
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx
from onnx import helper

from ..builder import GraphBuilder
from ..graphs import opset_version
from ..names import NameAuthority
from ..signature import Signature
from .contract import Pass, PassResult
from .fuse import GRADIENT_MODEL, all_rows, scan_body

__all__ = ["SumGradients", "GroupGradients"]


def _start(model: onnx.ModelProto
           ) -> tuple[Signature, NameAuthority, dict[str, onnx.TypeProto], int]:
    """What both passes start from: the model's signature, its names, its inputs' types and
    the weights' element type."""
    signature = Signature.of(model)
    types = {v.name: v.type for v in model.graph.input}
    return (signature, NameAuthority.for_model(model), types,
            types[signature.weights[0]].tensor_type.elem_type)


@dataclass(frozen=True)
class SumGradients(Pass[Signature]):
    """Each gradient added, scaled, to a running sum the graph reads (module doc); reports
    and records the signature whose gradients are the new sums."""

    requires = (GRADIENT_MODEL,)

    def call(self, model: onnx.ModelProto) -> PassResult:
        signature, names, types, dtype = _start(model)
        graph = model.graph
        scale = names.fresh("gradient_scale")
        graph.input.append(helper.make_tensor_value_info(scale, dtype, []))
        b = GraphBuilder(names, opset_version(model) or 13, prefix="accumulate/")
        outputs = [next(o for o in graph.output if o.name == signature.loss)]
        for weight in signature.weights:
            total = names.fresh(f"{weight}_grad_sum")
            graph.input.append(helper.make_value_info(total, types[weight]))
            added = b.Mul(signature.gradients[weight], scale, hint=f"{weight}_grad_scaled")
            summed = b.Add(total, added, hint=f"{weight}_grad_sum_new")
            signature.gradient_sums[weight] = total
            signature.gradients[weight] = summed
            outputs.append(helper.make_value_info(summed, types[weight]))
        b.append_to(graph)
        computed = {o.name: o for o in graph.output}
        outputs += [computed[signature.new[buffer]] for buffer in signature.buffers]
        del graph.output[:]
        graph.output.extend(outputs)
        signature.gradient_scale = scale
        signature.record(model)
        return PassResult(model, signature)


@dataclass(frozen=True)
class GroupGradients(Pass[Signature]):
    """An accumulating model (:class:`SumGradients`) as the gradient model of a
    group of micro-batches, a Scan over them (module doc); reports and records its
    signature."""

    requires = (GRADIENT_MODEL,)

    def call(self, model: onnx.ModelProto) -> PassResult:
        micro, names, types, dtype = _start(model)
        graph = model.graph
        # the body: the accumulating graph, reading the weights from the group's graph
        body, mapping = scan_body(graph, names, "micro_batch", "micro_batch", micro.weights)
        body.name = "micro_batch"
        inputs = {v.name: v for v in body.input}
        outputs = {v.name: v for v in body.output}
        sums = [micro.gradient_sums[w] for w in micro.weights]
        carried = [*sums, *micro.buffers]
        scanned = [*micro.data, micro.gradient_scale]
        new_body_inputs = [inputs[mapping[n]] for n in (*carried, *scanned)]
        new_body_outputs = [outputs[mapping[micro.gradients[w]]] for w in micro.weights]
        new_body_outputs += [outputs[mapping[micro.new[b]]] for b in micro.buffers]
        new_body_outputs.append(outputs[mapping[micro.loss]])
        del body.input[:]
        body.input.extend(new_body_inputs)
        del body.output[:]
        body.output.extend(new_body_outputs)

        b = GraphBuilder(names, opset_version(model) or 13, prefix="group/")
        scales = names.fresh("micro_batch_scales")
        count = b.Shape(scales, hint="micro_batches")
        batch = b.Div(b.dims(micro.data[0], 0, 1), count, hint="micro_batch")
        batched = []
        for name in micro.data:
            rank = len(types[name].tensor_type.shape.dim)
            shape = [count, batch]
            if rank > 1:
                shape.append(b.Slice(b.Shape(name), b.ints([1]), b.ints([rank])))
            batched.append(b.Reshape(name, b.Concat(*shape, axis=0), hint=f"{name}_micro"))
        zero = helper.make_tensor("zero", dtype, [1], [0])
        starts = [b.ConstantOfShape(b.Shape(w), value=zero, hint=f"{w}_grad_zero")
                  for w in micro.weights]
        totals = [names.fresh(f"{w}_grad_group") for w in micro.weights]
        news = [names.fresh(f"{buffer}_group_new") for buffer in micro.buffers]
        losses = names.fresh("micro_batch_losses")
        b.op("Scan", *starts, *micro.buffers, *batched, scales,
             outputs=[*totals, *news, losses], body=body, num_scan_inputs=len(scanned))
        new_inputs = [all_rows(helper.make_value_info(n, types[n])) for n in micro.data]
        new_inputs.append(helper.make_tensor_value_info(scales, dtype, ["micro_batches"]))
        new_inputs += [helper.make_value_info(n, types[n]) for n in (*micro.weights,
                                                                      *micro.buffers)]
        new_outputs = [helper.make_tensor_value_info(losses, dtype, ["micro_batches"])]
        new_outputs += [helper.make_value_info(t, types[w]) for t, w in zip(totals,
                                                                             micro.weights)]
        new_outputs += [helper.make_value_info(n, types[buffer])
                        for n, buffer in zip(news, micro.buffers)]
        for field in ("node", "initializer", "value_info", "input", "output"):
            del getattr(graph, field)[:]
        graph.input.extend(new_inputs)
        graph.output.extend(new_outputs)
        b.append_to(graph)
        group = Signature(features=micro.features, label=micro.label,
                          sample_weight=micro.sample_weight, loss=losses,
                          weights=list(micro.weights), gradients=dict(zip(micro.weights, totals)),
                          new=dict(zip(micro.buffers, news)), unpacked=micro.unpacked,
                          shapes=micro.shapes, buffers=list(micro.buffers),
                          gradient_scale=scales)
        group.record(model)
        return PassResult(model, group)
