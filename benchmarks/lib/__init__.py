"""What every benchmark script shares, one module per job:

- `machine`: the machine record (CPU, ISA flags, threads, memory, torch build, GPU) with its GEMM limits;
- `gemm`: GEMM limits for fp32, bf16 and int8 on several shapes, best of >= 3;
- `timing`: repetitions with every sample kept, and their spread (median, min / max, quartiles);
- `models`: the benchmark models as named geometries, built once by the package's random-checkpoint builder;
- `flags`: ``clef`` flags and `EngineOptions` generated from the options tables;
- `harness`: starting and stopping ``clef serve`` (or a server around an in-process engine) and a client;
- `results`: the report's header (command line, machine record) and writing it;
- `requests`: generated request bodies and the drift between two sets of answers.

The scripts put the repository root on ``sys.path`` and import ``benchmarks.lib.<module>``; the tests import
the same modules (the repository root is on their path too).
"""
