"""Benchmarks and measurements of the Ulysses all-to-all, as cases of one harness (docs/benchmarks.md).

``python -m benchmarks.run CASE [flags]`` runs one case; ``benchmark_ulysses_a2a.py``, ``tune_ulysses_a2a.py``
and ``benchmark_dit_step.py`` are the entry points of the cases ``a2a``, ``tune`` and ``dit_step``;
``check_results.py`` judges a run's JSON against the targets. Importing this package imports nothing (no
torch, no fastvideo): the tree under test must be chosen before fastvideo is first imported
(``harness.tree``).
"""
