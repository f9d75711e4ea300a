"""The harness's cases (``benchmarks.harness.case.CASES`` names them); each module defines ``CASE``."""
