"""``clef serve --ray``: many model replicas behind one endpoint, on Ray Serve.

Two deployments form one Ray Serve application:

- ``ClefIngress`` (one replica, no CPU reserved) runs the same FastAPI app as ``clef serve``: every route,
  auth, limits, metrics. Its engine is a `RequestPreparer` only (tokenizer and image preprocessing, no
  weights): it validates and encodes each request to find its state key, then the `ReplicaDispatcher`
  sends the request body to a model replica through a deployment handle, with the key as ``state_key``.
- ``ClefModel`` (``--replicas N``, or autoscaled between ``--min-replicas`` and ``--max-replicas`` on queue
  length) each own one engine: a `Clef` with its batcher and state cache. Their handle routes with
  `clef_runtime.scale.router.StateAffinityRouter`: the replica that owns the state key by consistent hashing
  gets the request, so a state computed once stays warm.

A request in flight on a replica that dies is retried once on another (decisions have no side effects);
Ray Serve replaces the replica. Without ``--ray-address`` a local Ray head is started on 127.0.0.1 and
everything it started is stopped on SIGTERM/SIGINT.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from clef_runtime.engine.scheduler import QueueFullError, SchedulerClosedError
from clef_runtime.server.runtime import DecisionEngine, Dispatcher, ServerRuntime
from clef_runtime.server.settings import ServerSettings

__all__ = ["ReplicaDispatcher", "app_builder", "build_application", "run_ray_serve"]

logger = logging.getLogger("clef_runtime.scale")

APP_NAME = "clef"
_STOP_TIMEOUT_S = 20


class IngressEngine:
    """What the ingress's server needs of an engine, without the weights: prepare requests (for their state
    keys and limits), describe the model; ``decide_encoded`` is never called (the dispatcher sends requests
    to the replicas)."""

    def __init__(self, settings: ServerSettings, handle: Any) -> None:
        from clef_runtime.engine.preparer import RequestPreparer
        from clef_runtime.model.resolve import resolve_model

        self.handle = handle
        # Waits until a replica is up (loaded and warmed): the ingress is ready only then.
        info: dict[str, Any] = handle.describe.remote().result()
        resolved = resolve_model(settings.model)
        self.preparer = RequestPreparer.from_checkpoint(resolved.path, settings.engine_options())
        self.name: str = info["name"]
        self.description: str = info["description"]
        self.release_date: str = info["release_date"]
        self.untrained: bool = info["untrained"]
        self.calibration_card: dict[str, Any] | None = info["calibration_card"]

    def prepare(self, request: Any, *, max_length: int | None = None) -> Any:
        """Validate and encode (the replica encodes again; this copy decides where the request goes)."""
        return self.preparer.prepare(request, max_length=max_length)

    def decide_encoded(self, items: Any) -> list[dict[str, Any]]:
        """Not used: requests go to the replicas through the dispatcher."""
        raise RuntimeError("the ingress has no model; requests are dispatched to replicas")

    def warmup(self, *, max_batch_tokens: int = 16384, max_batch_size: int = 32) -> None:
        """The replicas warm up themselves before they are ready."""

    def replica_status(self) -> dict[str, int]:
        """``{"up": running model replicas, "target": how many there should be}``, from Serve's controller."""
        from ray import serve

        deployment = serve.status().applications[APP_NAME].deployments["ClefModel"]
        states = {str(getattr(k, "value", k)): v for k, v in deployment.replica_states.items()}
        up = states.get("RUNNING", 0)
        target = getattr(deployment, "target_num_replicas", None) or sum(states.values())
        return {"up": int(up), "target": int(target)}

    def cache_stats(self) -> dict[str, int]:
        """The state cache of the replica the handle reaches (per-replica figures are in /metrics)."""
        stats: dict[str, Any] = self.handle.cache_stats.remote().result(timeout_s=5)
        return {key: value for key, value in stats.items() if isinstance(value, int) and key != "pid"}


class ReplicaDispatcher:
    """Sends each prepared request to a model replica (the handle's router picks it by state key) and
    retries once on another replica when the one it ran on died. At most ``max_queue`` requests in flight."""

    def __init__(self, handle: Any, settings: ServerSettings) -> None:
        self.handle = handle
        self.max_queue = settings.max_queue
        self._pool = ThreadPoolExecutor(
            max_workers=min(64, settings.max_queue), thread_name_prefix="clef-ray"
        )
        self._lock = threading.Lock()
        self._in_flight = 0
        self._closed = False

    def start(self) -> None:
        """Nothing to start: the replicas are already up."""

    def submit(self, payload: Any, tokens: int, *, background: bool = False) -> Future[dict[str, Any]]:
        """Queue one prepared request; returns the future of the replica's response. ``background``
        (batch-job lines) puts it in the replica batcher's low-priority lane."""
        with self._lock:
            if self._closed:
                raise SchedulerClosedError("the server is shutting down")
            if self._in_flight >= self.max_queue:
                raise QueueFullError(self._in_flight, 1.0)
            self._in_flight += 1
        future = self._pool.submit(self._call, payload, background)
        future.add_done_callback(lambda _: self._done())
        return future

    def _done(self) -> None:
        with self._lock:
            self._in_flight -= 1

    def _call(self, prepared: Any, background: bool) -> dict[str, Any]:
        from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

        # The prepared request itself travels (no second encoding on the replica); the router reads the key.
        key = prepared.state_key.hex()
        for attempt in (1, 2):
            try:
                response = self.handle.decide.remote(prepared, state_key=key, background=background)
                result: dict[str, Any] = response.result()
                return result
            except (ActorDiedError, ActorUnavailableError, RayActorError) as exc:
                if attempt == 2:
                    raise
                logger.warning("a replica died with a request in flight (%s); retrying on another", exc)
        raise AssertionError("unreachable")

    @property
    def queue_depth(self) -> int:
        """Requests sent to replicas and not answered yet."""
        with self._lock:
            return self._in_flight

    @property
    def running(self) -> int:
        """Same as queue_depth: the replicas' own batchers hold the waiting ones."""
        return self.queue_depth

    def wake(self) -> None:
        """No collection window here."""

    def close(self, *, drain: bool = True, timeout: float | None = None) -> None:
        """Stop accepting requests; with ``drain`` wait for those in flight."""
        with self._lock:
            self._closed = True
        self._pool.shutdown(wait=drain, cancel_futures=not drain)


def _load_on_a_passing_thread(settings: ServerSettings) -> Any:
    """Load and warm the engine on a thread that then exits (taking its CPU thread team with it)."""
    from clef_runtime.server.runtime import load_clef

    outcome: dict[str, Any] = {}

    def load() -> None:
        try:
            engine = load_clef(settings)
            engine.warmup(max_batch_tokens=settings.max_batch_tokens, max_batch_size=settings.max_batch_size)
            outcome["engine"] = engine
        except BaseException as exc:  # re-raised on the replica's thread below
            outcome["error"] = exc

    loader = threading.Thread(target=load, name="clef-replica-loader")
    loader.start()
    loader.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["engine"]


class ClefModel:
    """One model replica: a Clef engine with its own batcher and state cache."""

    def __init__(self, settings: ServerSettings, threads: int | None = None) -> None:
        from ray import serve

        from clef_runtime.engine.scheduler import DynamicBatcher
        from clef_runtime.model.kernels import configure_cpu_threads

        # The model runs on the batcher's thread, which starts its own CPU thread team; loading and warm-up
        # run on a thread that ends, so that no other live thread keeps a team (see model/kernels.py).
        configure_cpu_threads(threads, start_pool=False)
        self.settings = settings
        self.engine = _load_on_a_passing_thread(settings)
        self.batcher: DynamicBatcher[Any, dict[str, Any]] = DynamicBatcher(
            self.engine.decide_encoded,
            max_queue=settings.max_queue,
            max_batch_tokens=settings.max_batch_tokens,
            max_batch_size=settings.max_batch_size,
            window_s=settings.batch_window_ms / 1000.0,
            deterministic=settings.deterministic,
            background_batch_size=settings.jobs_batch_size,
            on_thread_start=self.engine.prepare_compute_thread,
        )
        self.batcher.start()
        self.replica_id = serve.get_replica_context().replica_id.unique_id

    def describe(self) -> dict[str, Any]:
        """The model's name and card."""
        engine = self.engine
        return {
            "name": engine.name,
            "description": engine.description,
            "release_date": engine.release_date,
            "untrained": bool(engine.untrained),
            "calibration_card": engine.calibration_card,
        }

    def cache_stats(self) -> dict[str, Any]:
        """This replica's state-cache counters, with its replica id and process id (``pid``)."""
        return {**self.engine.cache_stats(), "pid": os.getpid(), "replica": self.replica_id}

    async def decide(
        self, prepared: Any, state_key: str | None = None, background: bool = False
    ) -> dict[str, Any]:
        """Answer one prepared request (``state_key`` is read by the router only; ``background``: a
        batch-job line, run only when no interactive request waits). Returns the System One response with
        ``x_replica``."""
        future = self.batcher.submit(prepared, prepared.input_tokens, background=background)
        response = await asyncio.wrap_future(future)
        return {**response, "x_replica": self.replica_id}

    def __del__(self) -> None:
        batcher = getattr(self, "batcher", None)
        if batcher is not None:
            batcher.close(drain=False)


class ClefIngress:
    """The HTTP entry point: clef-runtime's FastAPI app (built on the replica), dispatching to the
    ClefModel replicas."""

    def __init__(self, model_handle: Any, settings: ServerSettings) -> None:
        self.model_handle = model_handle
        self.settings = settings

    def __serve_build_asgi_app__(self) -> Any:
        from clef_runtime.server.app import create_app

        handle = self.model_handle

        def engine_factory(settings: ServerSettings) -> DecisionEngine:
            return IngressEngine(settings, handle)  # type: ignore[return-value]

        def dispatcher_factory(engine: Any, settings: ServerSettings, runtime: ServerRuntime) -> Dispatcher:
            return ReplicaDispatcher(handle, settings)

        return create_app(self.settings, engine_factory=engine_factory, dispatcher_factory=dispatcher_factory)


def build_application(settings: ServerSettings) -> Any:
    """The Ray Serve application (ingress bound to the model deployment) for ``settings``."""
    from ray import serve
    from ray.serve.config import AutoscalingConfig, RequestRouterConfig

    from clef_runtime.scale.router import StateAffinityRouter

    model_options: dict[str, Any] = {
        "name": "ClefModel",
        "ray_actor_options": {"num_cpus": settings.ray_num_cpus, "num_gpus": settings.ray_num_gpus},
        "max_ongoing_requests": max(settings.max_batch_size * 2, 8),
        "health_check_period_s": 2,
    }
    if settings.ray_routing == "state-affinity":
        model_options["request_router_config"] = RequestRouterConfig(
            request_router_class=StateAffinityRouter,
            request_router_kwargs={"max_owner_queue": settings.ray_max_owner_queue},
        )
    if settings.min_replicas is not None or settings.max_replicas is not None:
        low = settings.min_replicas if settings.min_replicas is not None else 1
        high = settings.max_replicas if settings.max_replicas is not None else max(low, settings.replicas)
        model_options["autoscaling_config"] = AutoscalingConfig(
            min_replicas=low, max_replicas=high, target_ongoing_requests=settings.max_batch_size
        )
    else:
        model_options["num_replicas"] = settings.replicas
    threads = max(1, int(settings.ray_num_cpus)) if settings.ray_num_cpus >= 1 else 1
    model = serve.deployment(ClefModel).options(**model_options).bind(settings, threads)

    ingress = serve.deployment(serve.ingress()(ClefIngress)).options(
        name="ClefIngress", num_replicas=1, ray_actor_options={"num_cpus": 0}
    )
    return ingress.bind(model, settings)


def run_ray_serve(settings: ServerSettings) -> int:
    """Start (or join) Ray, deploy, serve until SIGTERM/SIGINT, then stop everything this process started.
    Returns the exit status."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray
    from ray import serve

    local = settings.ray_address is None
    init: dict[str, Any] = {"include_dashboard": False, "logging_level": logging.WARNING}
    if local:
        init.update(_node_ip_address="127.0.0.1", num_cpus=os.cpu_count() or 1)
    else:
        init["address"] = settings.ray_address
    ray.init(**init)
    stop = threading.Event()
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    for sig in previous:
        signal.signal(sig, lambda signum, frame: stop.set())
    try:
        serve.start(http_options={"host": settings.host, "port": settings.port})
        serve.run(build_application(settings), name=APP_NAME, route_prefix="/", blocking=False)
        logger.info("Ray Serve application %r on http://%s:%d", APP_NAME, settings.host, settings.port)
        stop.wait()
        logger.info("stopping")
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        _stop(local)
    logger.info("stopped")
    return 0


def _stop(local: bool) -> None:
    """Stop what this process started: the application (and, for a local head, Serve and every Ray process).
    Serve's own shutdown drains the replicas but can hang when a signal to the whole process group (Ctrl-C)
    already killed the raylet: it gets a bounded time, then Ray is shut down regardless."""
    import ray
    from ray import serve

    finished = threading.Event()

    def graceful() -> None:
        try:
            if local:
                serve.shutdown()
            else:
                serve.delete(APP_NAME)
        except Exception as exc:  # the cluster may already be half gone
            logger.warning("Ray Serve did not stop cleanly: %s", exc)
        finally:
            finished.set()

    threading.Thread(target=graceful, name="clef-ray-stop", daemon=True).start()
    if not finished.wait(_STOP_TIMEOUT_S):
        logger.warning("Ray Serve did not stop within %d s; stopping Ray", _STOP_TIMEOUT_S)
    ray.shutdown()


def app_builder(args: dict[str, Any]) -> Any:
    """The application for ``serve run`` / ``serve deploy`` config files
    (``import_path: clef_runtime.scale.ray_serve:app_builder``): ``args`` holds ``model`` and any server or
    engine option by its field name (``replicas``, ``ray_num_cpus``, ``cache_mb``, ...). Raises
    SettingsError for a bad value."""
    from clef_runtime.server.settings import server_settings

    values = dict(args)
    model = str(values.pop("model"))
    return build_application(server_settings(model, ray=True, **values))
