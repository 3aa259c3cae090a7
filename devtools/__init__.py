"""What the tests, the benchmarks and the scripts share (developer tooling, not part of the installed
package), one module per job:

- `machine`: the machine record (CPU, ISA flags, threads, memory, torch build, GPU) with its GEMM limits;
- `gemm`: GEMM limits for fp32, bf16 and int8 on several shapes, best of >= 3;
- `timing`: repetitions with every sample kept, and their spread (median, min / max, quartiles);
- `models`: the benchmark models as named geometries, built once by the package's random-checkpoint builder;
- `flags`: ``clef`` flags and `EngineOptions` generated from the options tables;
- `harness`: starting and stopping ``clef serve`` (or a server around an in-process engine) and a client;
- `results`: the report's header (command line, machine record) and writing it;
- `requests`: generated request bodies and the drift between two sets of answers;
- `fake_engine`: an instant engine behind the real server (answers a pure function of the request);
- `browser`: Debian's chromium driven by Playwright, and a tiny-model server for it to visit.

Everything runs from the repository root (``python -m benchmarks.<script>``, ``python -m scripts.<script>``,
pytest), which puts the root on the path, and imports ``devtools.<module>``. The dependencies go one way:
tests, benchmarks and scripts import `devtools`; `devtools` imports none of them.
"""
