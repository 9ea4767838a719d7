"""Speed rewrites for onnxruntime, each a pass (:class:`~lossgraph.passes.contract.Pass`)
that keeps a graph's values and makes onnxruntime run it faster. Gradient rules and the
other passes emit plain mathematics; these passes choose the forms onnxruntime runs
best, each for a measured reason (onnxruntime 1.19 and 1.31, CPU):

- :class:`SumRowsByProduct` (``sum_rows``)::

      Reshape(ReduceSum(x, axes=(0..k-1), keepdims=0), t)
          ->  Reshape(ones[1, R] @ Reshape(x, [-1, C]), t)     C = prod(t) > 1
          ->  Reshape(ReduceSum(x), t)                          C = 1

  ``ones @ rows`` sums a batch of rows 10x faster than ``ReduceSum`` over axis 0 (10000
  x 50); one column is summed fastest whole (7 us against 36 us on 10,000 rows).
  ``compile`` applies it to every gradient: a bias gradient is that sum.

- :class:`WidenScalarConstants` (``widen_scalars``)::

      Op(x[N, 1], c[])  ->  Op(x[N, 1], c[1, 1])

  onnxruntime broadcasts a scalar against a tensor whose last dim is 1 element by
  element, 15-30x slower than against a constant of the tensor's rank. ``compile``
  applies it to every graph of a program.

- :class:`SpecializeBatch` (``specialize_batch``): the batch inputs get the fit's batch
  size, then :class:`FoldStaticShapes` and :class:`SplitRowProducts`. The Trainer runs
  a fit's full batches specialized to its batch size.

- :class:`FoldStaticShapes` (``fold_static_shapes``)::

      Shape(v), Size(v)  ->  Constant        Reshape(v, s)  ->  Identity(v)   (v of static shape s)

  takes the shape arithmetic out of every step (after it onnxruntime folds the rest);
  each kernel removed saves its fixed cost (about 0.7 us).

- :class:`SplitRowProducts` (``split_row_products``)::

      MatMul(row[1, n], m[n, k])  ->  ReduceSum(MatMul(row[p, 1, n/p], m[p, n/p, k]), axes=0)

  onnxruntime runs a one-row product on one thread, the ``p`` parts on all of them
  (12% faster linear-regression epochs at batch 1000 and 10000); ``p`` is
  :func:`row_product_parts` of ``n``.
"""

from .fold_static_shapes import FoldStaticShapes
from .specialize_batch import SpecializeBatch
from .split_row_products import SplitRowProducts, row_product_parts
from .sum_rows import SumRowsByProduct
from .widen_scalars import WidenScalarConstants

__all__ = ["FoldStaticShapes", "SpecializeBatch", "SplitRowProducts", "SumRowsByProduct",
           "WidenScalarConstants", "row_product_parts"]
