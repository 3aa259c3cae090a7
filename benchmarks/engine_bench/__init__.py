"""The engine measured side by side with the reference way, in one run, on one model.

Run: ``python -m benchmarks.engine_bench --model tiny|medium-1024|medium|DIR|REPO [--quick|--full]
[--json OUT] [--markdown OUT]`` (``python -m benchmarks.suite`` runs it on tiny and medium-1024).
Developer tooling: not part of the installed package (``clef bench`` there is a quick throughput check of
a loaded model).

Every figure is measured in the same process and run, interleaved with a **baseline implemented here**: the
reference way of running Clef (the author's code as described in docs/model.md): one request at a
time, the prompt encoded piece by piece with the Hugging Face tokenizer and no cache, one full forward of
transformers' stock Qwen3.5 text model (our CPU kernels, when the engine installed them, are taken out for
the baseline's calls), and a plain head forward that loops over questions and options and runs torch's own
``nn.TransformerDecoderLayer`` / ``nn.MultiheadAttention`` modules on the same weights. No state cache.

Sections (``--sections``; all by default):

- ``gemm``: the machine's GEMM limits (fp32, bf16, int8) over the model's own Linear shapes at each latency
  length T (best of the plan's repetitions per shape; `devtools.gemm`), the yardstick for the
  backbone's FLOP/s fraction at that T (int8 layers, ``--weights int8``, against the int8 limit); without it
  the machine record measures small shapes only and no fraction is reported;
- ``latency``: one request at a time at T = 256, 512, 1k, 4k (16k with ``--full``) tokens, 2 questions:
  p50/p95 latency, tokens/s, time split (encode / backbone / head / answer), backbone FLOP/s as a fraction
  of the GEMM rate, peak RSS;
- ``questions``: cost vs 1 / 8 / 64 questions on a 256-token state;
- ``state_cache``: a 2,000-token state asked again with a new 2-question schema (~150 tokens), cold vs
  warm (needs the engine's state cache: ``Clef.load(..., cache_mb=...)``; reported as not available
  without it);
- ``concurrency``: 16 requests at once (100- and 1,000-token states, one question: Clef's prompt scaffolding
  and one question alone take ~125 tokens): one batched ``decide_encoded`` vs 16 sequential baseline calls;
- ``padding``: the fraction of padded tokens when the scheduler batches a mixed-length workload, with and
  without its length grouping (no model involved).

``--model`` takes a benchmark model name (``medium-1024``: the release geometry scaled down to hidden 1,024
and 8 layers with the real head dims; ``medium``: hidden 512; see `devtools.models`), built once into
the cache, or anything ``Clef.load`` accepts. Engine options are the ``clef`` flags (``--cache-mb``,
``--weights``, ...), generated from the options table; ``CLEF_*`` variables are not read, so the command
line recorded in the report is the whole configuration.
"""

from __future__ import annotations

from benchmarks.engine_bench.baseline import ReferenceBaseline
from benchmarks.engine_bench.cli import add_bench_arguments, main, run_bench, run_suite
from benchmarks.engine_bench.markdown import render_markdown
from benchmarks.engine_bench.measure import backbone_flops, int8_flops, linear_weights
from benchmarks.engine_bench.plans import DEFAULT_CACHE_MB, MODES, SECTIONS, BenchPlan
from benchmarks.engine_bench.sections import padding_waste
from benchmarks.engine_bench.stats import GemmLimits

__all__ = [
    "DEFAULT_CACHE_MB",
    "MODES",
    "SECTIONS",
    "BenchPlan",
    "GemmLimits",
    "ReferenceBaseline",
    "add_bench_arguments",
    "backbone_flops",
    "int8_flops",
    "linear_weights",
    "main",
    "padding_waste",
    "render_markdown",
    "run_bench",
    "run_suite",
]
