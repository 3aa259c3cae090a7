"""``clef serve --ray``: many model replicas behind one endpoint, on Ray Serve.

Two deployments form one Ray Serve application:

- ``ClefIngress`` (one replica, no CPU reserved) runs the same FastAPI app as ``clef serve``: every route,
  auth, limits, metrics. Its engine is a `RequestPreparer` only (tokenizer and image preprocessing, no
  weights): it validates and encodes each request to find its state key, then the `ReplicaDispatcher`
  sends the request body to a model replica through a deployment handle, with the key as ``state_key``.
- ``ClefModel`` (``--replicas N``, or autoscaled between ``--min-replicas`` and ``--max-replicas`` on queue
  length) each own one engine: a `Clef` with its engine loop and state cache. Their handle routes with
  `clef_runtime.scale.router.StateAffinityRouter`: the replica that owns the state key by consistent hashing
  gets the request, so a state computed once stays warm.

A request in flight on a replica that dies is retried once on another (decisions have no side effects);
Ray Serve replaces the replica. Every answer carries its replica's report (process id, state-cache
counters), which the ingress keeps for ``/status.json`` and ``/metrics``. With tracing on, each request
carries its span's W3C trace context to the replica, which exports its own ``clef.replica`` span and the
engine's spans under it. Without ``--ray-address`` a local
Ray head is started on 127.0.0.1 and everything it started is stopped on SIGTERM/SIGINT.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from clef_runtime.engine.card import CardedEngine, EngineCard
from clef_runtime.engine.contract import ReplicaReport, ReplicaStatus
from clef_runtime.engine.decision import Decision
from clef_runtime.engine.head_records import HeadInfo, HeadRefusedError, check_pin
from clef_runtime.engine.loop import QueueFullError, QueueTimeoutError, SchedulerClosedError
from clef_runtime.engine.policy import DEFAULT_STEP_ROWS
from clef_runtime.jobs.runner import RetryLaterError
from clef_runtime.logs import configure_logging
from clef_runtime.protocol.systemone import SystemOneRequest
from clef_runtime.scale.ray_start import start_ray
from clef_runtime.scale.settings import RAY_OPTIONS, RaySettings, split_ray_values
from clef_runtime.server.errors import ApiError
from clef_runtime.server.runtime import Dispatcher, Engine, ServerRuntime
from clef_runtime.server.settings import ServerSettings
from clef_runtime.server.tracing import Tracing, record_replica, start_tracing, trace_context

__all__ = [
    "IngressEngine",
    "ReplicaAnswer",
    "ReplicaDescription",
    "ReplicaDispatcher",
    "ReplicaReports",
    "app_builder",
    "build_application",
    "run_ray_serve",
]

logger = logging.getLogger("clef_runtime.scale")

APP_NAME = "clef"
MODEL_DEPLOYMENT = "ClefModel"
_STOP_TIMEOUT_S = 20
_INGRESS_HEADROOM = 64
"""Requests beyond ``--max-queue`` the ingress takes in (probes, pages, bodies being read): the server's own
429 decides overload, instead of Ray Serve's proxy queueing requests in front of a busy ingress."""


@dataclass(frozen=True)
class ReplicaDescription:
    """What a model replica tells the ingress when it is up (`ClefModel.describe`): its engine's card, its
    heads and its first report. Pickled whole by Ray."""

    card: EngineCard
    heads: tuple[HeadInfo, ...]
    report: ReplicaReport


@dataclass(frozen=True)
class ReplicaAnswer:
    """What a model replica answers for one request (`ClefModel.decide`): its decision (naming the replica)
    or, when the request waited past ``--queue-timeout-ms``, the timeout's figures ``(waited_s, timeout_s,
    retry_after_s)``: plain values, the ingress raises the error itself, whatever Ray would make of a
    pickled exception. Either way with the replica's report. Pickled whole by Ray."""

    report: ReplicaReport
    decision: Decision | None = None
    timeout: tuple[float, float, float] | None = None

    def __post_init__(self) -> None:
        if (self.decision is None) == (self.timeout is None):
            raise ValueError("a replica answers either a decision or a queue timeout")

    def outcome(self) -> Decision:
        """The decision. Raises ``QueueTimeoutError`` for a request that waited past its queue timeout."""
        if self.timeout is not None:
            raise QueueTimeoutError(*self.timeout)
        assert self.decision is not None  # __post_init__: one of the two
        return self.decision


class ReplicaReports:
    """The latest report (process id, state-cache counters) of each model replica, from its answers.
    Thread-safe: the dispatcher's threads add, the server's info routes read."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._latest: dict[str, ReplicaReport] = {}

    def add(self, report: ReplicaReport) -> None:
        """Keep ``report`` (`ClefModel.report`) as its replica's latest."""
        with self._lock:
            self._latest[report.replica] = report

    def running(self, alive: set[str]) -> tuple[ReplicaReport, ...]:
        """The reports of the replicas in ``alive``, by replica id; the others' are forgotten (a replica
        that stopped takes its figures with it)."""
        with self._lock:
            for replica in set(self._latest) - alive:
                del self._latest[replica]
            return tuple(self._latest[replica] for replica in sorted(self._latest))


def _alive_model_replicas() -> set[str]:
    """The ids of the model replicas alive now, from Ray's named actors (Ray Serve names each replica's actor
    ``SERVE_REPLICA::<app>#<deployment>#<replica id>``)."""
    import ray

    prefix = f"SERVE_REPLICA::{APP_NAME}#{MODEL_DEPLOYMENT}#"
    names = (entry["name"] for entry in ray.util.list_named_actors(all_namespaces=True))
    return {name.removeprefix(prefix) for name in names if name.startswith(prefix)}


_FIXED_HEADS = (
    "with --ray the heads are fixed at startup, the same on every replica: restart with --head NAME=DIR to "
    "change them"
)


class IngressEngine(CardedEngine):
    """The engine contract (`clef_runtime.engine.contract.DecisionEngine`) of the ingress, without the
    weights: it prepares requests (for their state keys and limits) and describes the model and its
    replicas; it has no runner (the dispatcher sends requests to the replicas)."""

    def __init__(self, settings: ServerSettings, handle: Any, reports: ReplicaReports) -> None:
        from clef_runtime.engine.preparer import RequestPreparer
        from clef_runtime.model.resolve import resolve_model

        self.handle = handle
        self.reports = reports
        # Waits until a replica is up (loaded and warmed): the ingress is ready only then.
        description: ReplicaDescription = handle.describe.remote().result()
        resolved = resolve_model(settings.model)
        self.preparer = RequestPreparer.from_checkpoint(resolved.path, settings.engine_options())
        self.card = description.card
        """The replicas' card: the model they serve and how."""
        self.heads = description.heads
        reports.add(description.report)

    def prepare(self, request: Any, *, max_length: int | None = None) -> Any:
        """Validate and encode (the replica encodes again; this copy decides where the request goes); a
        request pinning a head's digest is checked against the replicas' heads."""
        return self.preparer.prepare(request, max_length=max_length, resolve_head=self._check_pin)

    def _check_pin(self, request: SystemOneRequest) -> None:
        check_pin(self.heads, request.model, request.x_head_digest)

    def head_infos(self) -> tuple[HeadInfo, ...]:
        """The replicas' heads (every replica loads the same ``--head`` options; they never change)."""
        return self.heads

    def load_head(self, name: str, path: str) -> HeadInfo:
        """Refused: the replicas' heads are fixed at startup (``--head``) so that every replica answers a
        name with the same weights."""
        raise HeadRefusedError("name", _FIXED_HEADS, conflict=True)

    def unload_head(self, name: str) -> HeadInfo:
        """Refused, as `load_head`."""
        raise HeadRefusedError("name", _FIXED_HEADS, conflict=True)

    def runner(self) -> Any:
        """Not used: requests go to the replicas through the dispatcher."""
        raise RuntimeError("the ingress has no model; requests are dispatched to replicas")

    def warmup(self, *, max_rows: int = DEFAULT_STEP_ROWS) -> None:
        """The replicas warm up themselves before they are ready."""

    def prepare_compute_thread(self) -> None:
        """Nothing to prepare: the ingress computes nothing."""

    def replica_status(self) -> ReplicaStatus:
        """Running and intended model replicas (from Serve's controller), with the latest report of each
        running replica that has answered. Blocks on the cluster: call it off the event loop."""
        from ray import serve

        deployment = serve.status().applications[APP_NAME].deployments[MODEL_DEPLOYMENT]
        states = {str(getattr(k, "value", k)): v for k, v in deployment.replica_states.items()}
        reports = self.reports.running(_alive_model_replicas())
        return ReplicaStatus(
            up=int(states.get("RUNNING", 0)), target=int(sum(states.values())), reports=reports
        )

    def cache_stats(self) -> dict[str, int]:
        """The running replicas' state-cache counters, summed (each replica's are in `replica_status`).
        Blocks on the cluster: call it off the event loop."""
        totals: Counter[str] = Counter()
        for report in self.reports.running(_alive_model_replicas()):
            totals.update(report.cache)
        return dict(totals)


class ReplicasUnavailableError(ApiError, RetryLaterError):
    """No replica could answer (two died): a 503 for an interactive request, a later try for a job line."""


class ReplicaDispatcher:
    """Sends each prepared request to a model replica (the handle's router picks it by state key) and
    retries once on another replica when the one it ran on died. At most ``max_queue`` requests in flight."""

    def __init__(self, handle: Any, settings: ServerSettings, reports: ReplicaReports) -> None:
        self.handle = handle
        self.reports = reports
        self.max_queue = settings.max_queue
        self._pool = ThreadPoolExecutor(
            max_workers=min(64, settings.max_queue), thread_name_prefix="clef-ray"
        )
        self._lock = threading.Lock()
        self._in_flight = 0
        self._closed = False

    def start(self) -> None:
        """Nothing to start: the replicas are already up."""

    def submit(
        self, payload: Any, tokens: int, *, background: bool = False, waited_s: float = 0.0
    ) -> Future[Decision]:
        """Queue one prepared request; returns the future of the replica's decision. ``background``
        (batch-job lines) puts it in the replica engine's background lane; ``waited_s`` (and the wait for a
        dispatch thread here) counts against the replica's queue timeout."""
        with self._lock:
            if self._closed:
                raise SchedulerClosedError("the server is shutting down")
            if self._in_flight >= self.max_queue:
                raise QueueFullError(self._in_flight, 1.0)
            self._in_flight += 1
        # Read here, on the request's task: the dispatch thread does not see the request's trace.
        context = trace_context()
        future = self._pool.submit(self._call, payload, background, time.monotonic() - waited_s, context)
        future.add_done_callback(lambda _: self._done())
        return future

    def _done(self) -> None:
        with self._lock:
            self._in_flight -= 1

    def _call(
        self, prepared: Any, background: bool, arrived: float, context: dict[str, str] | None
    ) -> Decision:
        from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

        # The prepared request itself travels (no second encoding on the replica); the router reads the key.
        key = prepared.state_key.hex()
        for attempt in (1, 2):
            try:
                waited = time.monotonic() - arrived
                response = self.handle.decide.remote(
                    prepared, state_key=key, background=background, waited_s=waited, trace_context=context
                )
                answer: ReplicaAnswer = response.result()
                self.reports.add(answer.report)
                return answer.outcome()
            except (ActorDiedError, ActorUnavailableError, RayActorError) as exc:
                if attempt == 1:
                    logger.warning("a replica died with a request in flight (%s); retrying on another", exc)
                    continue
                logger.warning("the retry's replica died too (%s); answering 503", exc)
        raise ReplicasUnavailableError(
            503,
            "not_ready",
            "no model replica could answer (two died); retry shortly",
            headers={"Retry-After": "5"},
        )

    @property
    def queue_depth(self) -> int:
        """Requests sent to replicas and not answered yet."""
        with self._lock:
            return self._in_flight

    @property
    def running(self) -> int:
        """Same as queue_depth: the replicas' own engine loops hold the waiting ones."""
        return self.queue_depth

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
            engine.warmup(max_rows=settings.max_batch_size)
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
    """One model replica: a Clef engine with its own engine loop and state cache, and its own tracer when
    the settings (or the replica's ``OTEL_EXPORTER_OTLP_*`` variables) turn tracing on."""

    tracing: Tracing | None = None

    def __init__(self, settings: ServerSettings, threads: int | None = None) -> None:
        from ray import serve

        from clef_runtime.engine.loop import EngineLoop
        from clef_runtime.heap_trim import HeapTrimmer
        from clef_runtime.model.kernels import configure_cpu_threads
        from clef_runtime.server.runtime import step_settings

        # The model runs on the engine loop's thread, which starts its own CPU thread team; loading and
        # warm-up run on a thread that ends, so that no other live thread keeps a team (see model/kernels.py).
        configure_logging(settings.log_level)
        configure_cpu_threads(threads, start_pool=False)
        self.settings = settings
        self.engine = _load_on_a_passing_thread(settings)
        self.loop = EngineLoop(
            self.engine.runner(),
            step_settings(self.engine, settings),
            max_queue=settings.max_queue,
            queue_timeout_s=settings.queue_timeout_s,
            on_step=HeapTrimmer().after_step,
            on_thread_start=self.engine.prepare_compute_thread,
        )
        self.loop.start()
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        # One provider per replica process: its spans carry moments of this process's clock.
        self.tracing = start_tracing(settings.otlp_traces_endpoint, settings.otlp_traces_protocol)

    def describe(self) -> ReplicaDescription:
        """What the ingress's engine needs to describe the model (`IngressEngine`), and this replica's
        report."""
        return ReplicaDescription(self.engine.card, self.engine.head_infos(), self.report())

    def report(self) -> ReplicaReport:
        """This replica's id, process id and state-cache counters (for `ReplicaReports`)."""
        return ReplicaReport(self.replica_id, os.getpid(), self.engine.cache_stats())

    async def decide(
        self,
        prepared: Any,
        state_key: str | None = None,
        background: bool = False,
        waited_s: float = 0.0,
        trace_context: dict[str, str] | None = None,
    ) -> ReplicaAnswer:
        """Answer one prepared request (``state_key`` is read by the router only; ``background``: a
        batch-job line, run only when no interactive request waits; ``waited_s``: its wait before it came
        here, counted against the queue timeout; ``trace_context``: the W3C context of the ingress's request
        span, None when it is not traced): its decision, naming this replica, or its queue timeout, with this
        replica's report."""
        arrived_ns = time.time_ns()
        future = self.loop.submit(
            prepared, prepared.record.input_tokens, background=background, waited_s=waited_s
        )
        try:
            decision = await asyncio.wrap_future(future)
        except QueueTimeoutError as exc:
            return ReplicaAnswer(self.report(), timeout=(exc.waited_s, exc.timeout_s, exc.retry_after_s))
        if self.tracing is not None and trace_context:
            record_replica(
                self.tracing, trace_context, self.replica_id, arrived_ns, time.time_ns(), decision.timings
            )
        return ReplicaAnswer(self.report(), decision=dataclasses.replace(decision, replica=self.replica_id))

    def __del__(self) -> None:
        loop = getattr(self, "loop", None)
        if loop is not None:
            loop.close(drain=False)
        # Ray Serve calls this on a graceful stop (and Python again when the object goes): export what is
        # buffered, once.
        tracing, self.tracing = self.tracing, None
        if tracing is not None:
            tracing.shutdown()


class ClefIngress:
    """The HTTP entry point: clef-runtime's FastAPI app (built on the replica), dispatching to the
    ClefModel replicas."""

    def __init__(self, model_handle: Any, settings: ServerSettings) -> None:
        # The app's request lines (with the real path and request id) replace Serve's access log.
        configure_logging(settings.log_level)
        self.model_handle = model_handle
        self.settings = settings

    def __serve_build_asgi_app__(self) -> Any:
        from clef_runtime.server.app import create_app

        handle = self.model_handle
        reports = ReplicaReports()

        def engine_factory(settings: ServerSettings) -> Engine:
            return IngressEngine(settings, handle, reports)

        def dispatcher_factory(
            engine: Engine, settings: ServerSettings, runtime: ServerRuntime
        ) -> Dispatcher:
            return ReplicaDispatcher(handle, settings, reports)

        # Serve's proxy puts the request id on every response itself (the same id: it hands it to the app).
        return create_app(
            self.settings,
            engine_factory=engine_factory,
            dispatcher_factory=dispatcher_factory,
            send_request_id=False,
        )


def _serve_logging(settings: ServerSettings) -> Any:
    """Ray Serve's logging for its controller, proxy and replicas: plain text at the server's level, without
    Serve's access log (it names every path ``/``, the ingress's route; the app logs each request itself)."""
    from ray.serve.schema import LoggingConfig

    return LoggingConfig(encoding="TEXT", log_level=settings.log_level.upper(), enable_access_log=False)


def _actor_options(environ: Mapping[str, str], **resources: float) -> dict[str, Any]:
    """A deployment's ``ray_actor_options``: ``resources``, and the ``OTEL_*`` variables of ``environ`` in
    its actors' environment (a Ray worker does not inherit the variables of the process that deployed it:
    on a cluster it runs elsewhere), so that the standard variables configure every replica's tracing."""
    options: dict[str, Any] = dict(resources)
    otel = {name: value for name, value in environ.items() if name.startswith("OTEL_")}
    if otel:
        options["runtime_env"] = {"env_vars": otel}
    return options


def build_application(
    settings: ServerSettings, ray: RaySettings, environ: Mapping[str, str] | None = None
) -> Any:
    """The Ray Serve application (ingress bound to the model deployment) for ``settings``; the ``OTEL_*``
    variables of ``environ`` (default ``os.environ``) go to its replicas."""
    from ray import serve
    from ray.serve.config import AutoscalingConfig, RequestRouterConfig

    from clef_runtime.scale.router import StateAffinityRouter

    environ = os.environ if environ is None else environ
    logging_config = _serve_logging(settings)
    model_options: dict[str, Any] = {
        "name": MODEL_DEPLOYMENT,
        "ray_actor_options": _actor_options(environ, num_cpus=ray.ray_num_cpus, num_gpus=ray.ray_num_gpus),
        "max_ongoing_requests": max(settings.max_batch_size * 2, 8),
        "health_check_period_s": 2,
        "logging_config": logging_config,
    }
    if ray.ray_routing == "state-affinity":
        # ray annotates RequestRouterConfig(**kwargs: dict[str, Any]); its field takes a class or a path.
        model_options["request_router_config"] = RequestRouterConfig(
            request_router_class=StateAffinityRouter,  # type: ignore[arg-type]
            request_router_kwargs={"max_owner_queue": ray.ray_max_owner_queue},
        )
    if ray.autoscaling:
        low = ray.min_replicas if ray.min_replicas is not None else 1
        high = ray.max_replicas if ray.max_replicas is not None else max(low, ray.replicas)
        model_options["autoscaling_config"] = AutoscalingConfig(
            min_replicas=low, max_replicas=high, target_ongoing_requests=settings.max_batch_size
        )
    else:
        model_options["num_replicas"] = ray.replicas
    threads = max(1, int(ray.ray_num_cpus)) if ray.ray_num_cpus >= 1 else 1
    # ray types serve.deployment as the decorator factory only; given a class it returns the Deployment.
    model = serve.deployment(ClefModel).options(**model_options).bind(settings, threads)  # type: ignore[attr-defined]

    ingress = serve.deployment(serve.ingress()(ClefIngress)).options(  # type: ignore[attr-defined]
        name="ClefIngress",
        num_replicas=1,
        ray_actor_options=_actor_options(environ, num_cpus=0),
        max_ongoing_requests=settings.max_queue + _INGRESS_HEADROOM,
        logging_config=logging_config,
    )
    return ingress.bind(model, settings)


def run_ray_serve(settings: ServerSettings, ray_settings: RaySettings) -> int:
    """Start (or join) Ray, deploy, serve until SIGTERM/SIGINT, then stop everything this process started.
    Returns the exit status."""
    start_ray(ray_settings.ray_address)  # sets Ray's variables before ray is imported
    from ray import serve

    logger.info("settings: %s; ray: %s", settings.redacted(), dataclasses.asdict(ray_settings))
    stop = threading.Event()
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    for sig in previous:
        signal.signal(sig, lambda signum, frame: stop.set())
    try:
        serve.start(
            http_options={"host": settings.host, "port": settings.port},
            logging_config=_serve_logging(settings),
        )
        serve.run(build_application(settings, ray_settings), name=APP_NAME, route_prefix="/", blocking=False)
        logger.info("Ray Serve application %r on http://%s:%d", APP_NAME, settings.host, settings.port)
        stop.wait()
        logger.info("stopping")
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        _stop()
    logger.info("stopped")
    return 0


def _stop() -> None:
    """Stop what this process started: the application (its replicas drain first), then this process's Ray
    (for a local head: every Ray process, Serve's controller and proxy with them). Not ``serve.shutdown()``:
    its controller kills itself inside the call that asked it to stop, and Ray logs that call as failed
    ("graceful_shutdown failed ... will be retried"). Deleting the application can hang when a signal to the
    whole process group (Ctrl-C) already killed the raylet: it gets a bounded time, then Ray stops
    regardless."""
    import ray
    from ray import serve

    finished = threading.Event()

    def graceful() -> None:
        try:
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
    """The application for ``serve run`` / ``serve deploy`` config files and KubeRay's ``serveConfigV2``
    (``import_path: clef_runtime.scale.ray_serve:app_builder``; see ``deploy/ray-serve.yaml``): ``args``
    holds ``model`` and any server, engine or scale-out option by its field name (``replicas``,
    ``ray_num_cpus``, ``cache_mb``, ...). An option not in ``args`` is read from its ``CLEF_*`` variable
    where the builder runs, as ``clef serve`` reads it (so a secret such as ``CLEF_API_KEY`` can come from a
    pod's environment instead of the config's text); an arg beats its variable. Raises SettingsError for a
    bad value or a missing model (naming the variable of a bad variable), TypeError for an unknown name."""
    from clef_runtime.options import ENGINE_OPTIONS, MODEL_OPTION, read_option_values
    from clef_runtime.server.settings import OPTIONS, SettingsError, server_settings

    # --ray and --ray-address are how `clef serve` gets onto Ray; a config file is on Ray already.
    scale_options = [option for option in RAY_OPTIONS if option.field not in ("ray", "ray_address")]
    options = (MODEL_OPTION, *OPTIONS, *ENGINE_OPTIONS, *scale_options)
    values = {**read_option_values(None, os.environ, options), **args}
    if "model" not in values:
        raise SettingsError("args.model is required (or set CLEF_MODEL): 'tiny', a directory or a repo id")
    model = str(values.pop("model"))
    ray_values, server_values = split_ray_values(values)
    return build_application(
        server_settings(model, **server_values), RaySettings(**{"ray": True, **ray_values})
    )
