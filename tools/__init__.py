"""Developer tools: the benchmarks (``python -m tools.bench``), the mutation check, the
executor size count, the GPU check, and the asynchronous CPU device the tests and benchmarks
share (``tools.emulation``). Not part of the installed package."""
