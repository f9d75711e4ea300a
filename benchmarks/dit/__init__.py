"""The DiT step benchmark: ``model`` (the model under test, replaceable), ``runner`` (the procedure, timed on the
harness), ``report`` (tables and plot), ``estimate`` (wall-time planning), ``case`` (the harness case
``dit_step``). Targets and verdicts are in ``benchmarks/check_results.py``, which reads the JSON."""
