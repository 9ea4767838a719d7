"""The previous release's name of :mod:`lossgraph.speed` (the speed rewrites), kept for one
release: each name still works, with a
:class:`~lossgraph.errors.LossgraphDeprecationWarning`. ``lossgraph.optim`` holds the
optimizers; ``optimize`` was one letter from it."""

from __future__ import annotations

from ..deprecation import moved_names

__getattr__ = moved_names("lossgraph.optimize", {name: "lossgraph.speed" for name in (
    "ConcatScatteredSlabs", "FoldBatchIntoProducts", "FoldStaticShapes", "SpecializeBatch",
    "SplitRowProducts", "SumRowsByProduct", "UnfoldConvWeightGradients",
    "WidenScalarConstants", "gradient_product_parts", "row_product_parts")})
