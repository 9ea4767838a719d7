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
  size, then :class:`FoldStaticShapes`, :class:`TransposedProducts` and
  :class:`SplitRowProducts`. The Trainer runs a fit's full batches specialized to its
  batch size.

- :class:`FoldStaticShapes` (``fold_static_shapes``)::

      Shape(v), Size(v)  ->  Constant        Reshape(v, s)  ->  Identity(v)   (v of static shape s)

  takes the shape arithmetic out of every step (after it onnxruntime folds the rest);
  each kernel removed saves its fixed cost (about 0.7 us).

- :class:`SplitRowProducts` (``split_row_products``)::

      MatMul(row[1, n], m[n, k])  ->  ReduceSum(MatMul(row[p, 1, n/p], m[p, n/p, k]), axes=0)
      Gemm(a[n, k], b[n, m], transA=1)
                     ->  ReduceSum(MatMul(Transpose(a[q, n/q, k]), b[q, n/q, m]), axes=0)

  onnxruntime runs a one-row product on one thread, and a weight gradient ``a^T b`` over
  a long batch on few; the parts run on all of them (12% faster linear-regression epochs
  at batch 1000 and 10000, MLP epochs 0.86-0.88x the time at batch 10000); ``p`` is
  :func:`row_product_parts` of ``n``, ``q`` :func:`gradient_product_parts`.

- :class:`TransposedProducts` (``transposed_products``)::

      Transpose(Gemm(a, b, transA=i, transB=j))  ->  Gemm(b, a, transA=1-j, transB=1-i)

  the weight gradient of a layer that reads ``Transpose(W)`` (an unfolded export) as one
  product: onnxruntime fuses the ``Transpose`` into a node of its own, and its execution
  order then runs every such gradient after the whole backward (BERT-base's separate
  gradient session 1,220 -> 855 MiB, the same outputs bit for bit).

- :class:`UnfoldConvWeightGradients` (``unfold_conv_grads``)::

      Transpose(Conv(x^T, dy^T))  ->  sum_n unfold(x)[n] @ dy[n]^T      (kernels of <= 9 taps)

  a convolution's weight gradient as a batched product over the unfolded input (im2col by
  a grouped Conv of one-hot kernels), or as one ``Gemm`` over all rows where dy has few
  pixels (deep layers): onnxruntime runs the Conv as a GEMM as narrow as the kernel,
  1.5-4x slower for 3x3 and 1x1 kernels (slower unfolded for 5x5 and larger).
  ``compile`` applies it to every gradient.

- :class:`FoldBatchIntoProducts` (``fold_batch_products``)::

      ReduceSum(MatMul(a[L, S, D]^T, b[L, S, F]), axes=L)  ->  Gemm(a[-1, D], b[-1, F], transA=1)

  the weight gradient of a Linear layer on a sequence as one product over all rows: the
  batched products and their sum took a quarter of a transformer's step, 2x longer.
  ``compile`` applies it to every gradient.

- :class:`ConcatScatteredSlabs` (``concat_slabs``)::

      Sum(ScatterND(zeros[K, ...], [i], u_i) for i in 0..K-1)  ->  Concat(u_0, ..., u_K-1)

  the gradient of a tensor split by Gathers (attention's q, k, v): 6x faster.
  ``compile`` applies it to every gradient.
"""

from .concat_slabs import ConcatScatteredSlabs
from .fold_batch_products import FoldBatchIntoProducts
from .fold_static_shapes import FoldStaticShapes
from .specialize_batch import SpecializeBatch
from .split_row_products import SplitRowProducts, gradient_product_parts, row_product_parts
from .sum_rows import SumRowsByProduct
from .transposed_products import TransposedProducts
from .unfold_conv_grads import UnfoldConvWeightGradients
from .widen_scalars import WidenScalarConstants

__all__ = ["ConcatScatteredSlabs", "FoldBatchIntoProducts", "FoldStaticShapes",
           "SpecializeBatch", "SplitRowProducts", "SumRowsByProduct", "TransposedProducts",
           "UnfoldConvWeightGradients", "WidenScalarConstants", "gradient_product_parts",
           "row_product_parts"]
