"""The benchmark harness: one command line, process setup, line-up and timing method, header, table, JSON
schema and ``#wrong`` column for every case (``benchmarks.harness.case``). Importing it imports no fastvideo.

Modules: ``main`` (the driver), ``case`` (the plug-in interface and the registry), ``cli`` (flags, geometries),
``process`` (ranks), ``lineup`` and ``timing`` (the method), ``stats`` (medians, spread, bandwidth),
``oracle`` (``#wrong``), ``header``, ``commit`` (the commit a tree's files are), ``report`` (table, JSON,
validation), ``progress``, ``revs`` (``--compare-revs``), ``tree`` (the tree under test), ``product`` (the one
place that reaches into fastvideo's internals).
"""
