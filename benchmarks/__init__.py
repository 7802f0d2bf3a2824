"""nvdd benchmarks: the shared harness (``harness``), named suites (``suite``),
the page renderer (``render``) and the benchmark scripts (``bench_*.py``)."""
