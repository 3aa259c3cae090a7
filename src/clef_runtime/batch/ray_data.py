"""``clef batch --ray``: the grouped batches answered by a pool of `ClefBatchWorker` actors on Ray Data.

The driver hands Ray Data one block per batch (`ray.data.from_arrow`), so a batch formed around a state
stays whole; ``map_batches`` sends each block to an actor of the pool (``--replicas`` actors, each
reserving ``--ray-num-cpus`` CPUs and ``--ray-num-gpus`` GPUs, each holding one loaded `Clef`), and the
answered blocks stream back to the driver, which commits them (`clef_runtime.batch.output`). Ray Data
restarts an actor that dies and retries the batch it held; the driver drops a line it has already
committed, so a retried batch never writes a row twice.

Without an address a local Ray head is started on 127.0.0.1 and stopped at the end; with one (``auto``,
``ray://head:10001``, ``127.0.0.1:6379``) the job joins that cluster, whose nodes must all reach the
model (a Hugging Face id in each node's cache, or a path on shared storage) and OUTPUT's filesystem.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from clef_runtime.batch.worker import ClefBatchWorker

__all__ = ["RayPool", "ray_answers"]

logger = logging.getLogger("clef_runtime.batch")


@dataclass(frozen=True)
class RayPool:
    """Where and how wide the actor pool runs."""

    address: str | None
    """A Ray cluster to join; None starts a local head on 127.0.0.1."""
    replicas: int
    num_cpus: float
    num_gpus: float


def ray_answers(
    batches: Sequence[pa.Table], model: str, options: Mapping[str, Any], pool: RayPool
) -> Iterator[pa.Table]:
    """The answered batches (`clef_runtime.batch.rows.OUTPUT_SCHEMA` tables), in the order they finish.
    Starts or joins Ray first; stops what it started when the iteration ends or is abandoned."""
    from clef_runtime.scale.ray_start import start_ray

    started_here = "ray" not in sys.modules or not sys.modules["ray"].is_initialized()
    if started_here:
        start_ray(pool.address)  # sets Ray's variables before ray is imported
    import ray

    try:
        cluster_gpus = ray.cluster_resources().get("GPU", 0)
        if cluster_gpus and not pool.num_gpus:
            logger.warning(
                "the Ray cluster has %g GPUs but the workers use none: give --ray-num-gpus 1 (or --device "
                "cuda) to answer on them",
                cluster_gpus,
            )
        context = ray.data.DataContext.get_current()
        context.enable_progress_bars = False  # the command draws its own
        context.print_on_execution_start = False
        threads = max(1, int(pool.num_cpus)) if pool.num_cpus >= 1 else 1
        dataset = ray.data.from_arrow(list(batches)).map_batches(
            ClefBatchWorker,
            fn_constructor_kwargs={"model": model, "options": dict(options), "threads": threads},
            batch_size=None,  # a whole block: one grouped batch
            batch_format="pyarrow",
            compute=ray.data.ActorPoolStrategy(size=pool.replicas),
            num_cpus=pool.num_cpus,
            num_gpus=pool.num_gpus,
        )
        yield from dataset.iter_batches(batch_size=None, batch_format="pyarrow", prefetch_batches=0)
    finally:
        if started_here:
            ray.shutdown()
