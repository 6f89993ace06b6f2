"""The benchmark harness of hf_diloco: one module per benchmark, run from the repository root.

    python -m benchmarks.comm --help

`benchmarks.common` holds what several benchmarks share (the command line a result records, worker processes, the
training run of `comm`, `quality` and `eager_estimate`); a benchmark module imports from it and from the public API
of hf_diloco, never from another benchmark's internals. Stored results are under `benchmarks/results/`;
benchmarks/README.md lists the modules and BENCHMARKS.md the command behind every stored file.
"""
