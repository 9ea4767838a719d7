"""Benchmarks of lossgraph, run from the repository root as modules:
``python -m benchmarks.training_speed``, ``python -m benchmarks.gradient_graphs``."""
