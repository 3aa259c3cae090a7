"""The server's engine side: background loading, encoding off the event loop, the engine loop, and waiting
for an answer while watching the client.

Nothing here builds HTTP responses; failures are raised as :class:`ApiError` or protocol errors and the
error handlers turn them into bodies.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeVar

from starlette.requests import Request

from clef_runtime.engine.contract import DecisionEngine, IndependentRequest, PreparedItem, submit_parts
from clef_runtime.engine.decision import Decision
from clef_runtime.engine.loop import (
    EngineLoop,
    QueueFullError,
    QueueTimeoutError,
    SchedulerClosedError,
    StepStats,
)
from clef_runtime.engine.policy import StepSettings, build_step_settings
from clef_runtime.heap_trim import HeapTrimmer
from clef_runtime.model.load_errors import is_out_of_memory
from clef_runtime.protocol.errors import ClefError, InputTooLongError, RequestValidationError
from clef_runtime.server.answer_metrics import fused_kernels_of
from clef_runtime.server.auth import KeyChecker
from clef_runtime.server.context import context_of
from clef_runtime.server.engine_queries import EngineQueries, EngineQueryError
from clef_runtime.server.errors import ApiError, ClientGone
from clef_runtime.server.limits import RateLimiter
from clef_runtime.server.metrics import CacheSeries, ServerMetrics
from clef_runtime.server.settings import ServerSettings

if TYPE_CHECKING:
    from clef_runtime.engine.preflight import EngineFiles

__all__ = [
    "Engine",
    "EngineFactory",
    "ServerRuntime",
    "load_clef",
    "question_types",
    "runtime_of",
]

logger = logging.getLogger("clef_runtime.server")

RuntimeState = Literal["loading", "ready", "failed", "stopping"]
T = TypeVar("T")


Engine = DecisionEngine[PreparedItem]
"""An engine as the server holds it (see `clef_runtime.engine.contract`)."""

EngineFactory = Callable[[ServerSettings], Engine]


class Dispatcher(Protocol):
    """Where prepared requests go: the local `EngineLoop` (one engine in this process), or a scale-out
    dispatcher that sends each request to a model replica (`clef_runtime.scale`)."""

    max_queue: int

    def start(self) -> None: ...

    def submit(
        self, payload: Any, tokens: int, *, background: bool = False, waited_s: float = 0.0
    ) -> Future[Decision]: ...

    @property
    def queue_depth(self) -> int: ...

    @property
    def running(self) -> int: ...

    def close(self, *, drain: bool = True, timeout: float | None = None) -> None: ...


#: Builds the dispatcher once the engine is loaded.
DispatcherFactory = Callable[[Engine, ServerSettings, "ServerRuntime"], Dispatcher]


def load_clef(settings: ServerSettings, checked_files: EngineFiles | None = None) -> Engine:
    """Load the model named by ``settings.model`` with the settings' engine options (the default factory);
    ``checked_files``: their calibration and head files, already read (see `Clef.load`).

    Returns the loaded ``Clef``. Raises whatever ``Clef.load`` raises (missing files, bad revision, ...).
    """
    from clef_runtime.engine.clef import Clef

    return Clef.load(settings.model, settings.engine_options(), checked_files=checked_files)


def _expected_load_error(exc: BaseException) -> bool:
    """Whether ``exc`` is a failure ``Clef.load`` reports with a complete message (a missing or damaged
    checkpoint, a failed download, not enough memory, a bad option) rather than a bug."""
    from clef_runtime.model.load_errors import classify_load_error

    return classify_load_error(exc) is not None


def step_settings(engine: Engine, settings: ServerSettings) -> StepSettings:
    """The engine loop's policy settings: the engine's step budget, the server's row and lane limits."""
    return build_step_settings(
        engine.step_tokens,
        max_rows=settings.max_batch_size,
        background_rows=settings.jobs_batch_size,
        deterministic=settings.deterministic,
    )


def local_engine_loop(engine: Engine, settings: ServerSettings, runtime: ServerRuntime) -> Dispatcher:
    """The default dispatcher: an `EngineLoop` over the engine in this process, on its own thread, its steps
    observed by the metrics and followed by a heap trim every few seconds (`HeapTrimmer`)."""
    trimmer = HeapTrimmer()

    def after_step(stats: StepStats) -> None:
        runtime.metrics.observe_step(stats)
        trimmer.after_step()

    return EngineLoop(
        engine.runner(),
        step_settings(engine, settings),
        max_queue=settings.max_queue,
        queue_timeout_s=settings.queue_timeout_s,
        on_step=after_step,
        on_thread_start=engine.prepare_compute_thread,
    )


def question_types(item: PreparedItem) -> list[str]:
    """The type of every question of a prepared request, in order."""
    return [question.type for question in item.request.questions.values()]


def _submit(
    dispatcher: Dispatcher, prepared: PreparedItem, *, background: bool = False, waited_s: float = 0.0
) -> Future[Decision]:
    """Queue a prepared request; an independent one (``x_independent``) as its parts, one per question."""

    def submit(item: PreparedItem) -> Future[Decision]:
        return dispatcher.submit(item, item.record.input_tokens, background=background, waited_s=waited_s)

    if isinstance(prepared, IndependentRequest):
        return submit_parts(prepared, submit)
    return submit(prepared)


class ServerRuntime:
    """Owns the engine and its dispatcher for one server process."""

    def __init__(
        self,
        settings: ServerSettings,
        engine_factory: EngineFactory,
        metrics: ServerMetrics,
        *,
        on_fatal: Callable[[BaseException], None] | None = None,
        dispatcher_factory: DispatcherFactory | None = None,
    ) -> None:
        self.settings = settings
        self.metrics = metrics
        self._dispatcher_factory = dispatcher_factory or local_engine_loop
        self.replica_id = f"{socket.gethostname()}:{settings.port}"
        """This process's replica id (``X-Clef-Replica``): stable for the server's address."""
        self.keys = KeyChecker(settings.accepted_api_keys)
        self.admin_keys = KeyChecker(settings.admin_keys)
        """The keys of the admin routes (``/v1/heads`` changes); none configured: those routes are 404."""
        rate = settings.rate_limit
        self.limiter = RateLimiter(rate, settings.rate_burst_size) if rate is not None else None
        """Per-caller rate limits on the decision routes (None: off)."""
        self._factory = engine_factory
        self._on_fatal = on_fatal
        self._lock = threading.Lock()
        self._state: RuntimeState = "loading"
        self._engine: Engine | None = None
        self._dispatcher: Dispatcher | None = None
        self._failure: str | None = None
        self._load_started = time.monotonic()
        self._loader: threading.Thread | None = None
        # One encode thread: fast tokenizers are not safe to share across threads ("Already borrowed"),
        # and encoding costs milliseconds next to the model's seconds.
        self._encoder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="clef-encode")
        self.engine_queries = EngineQueries()
        """Where the info routes ask the engine's figures that may block on a cluster."""
        # The engine's cache series as last fetched for /metrics (the collector must not block on a cluster).
        self._cache_series: CacheSeries = []
        metrics.bind_queue(self._queue_depth, self._running)
        metrics.bind_engine_cache(lambda: self._cache_series)

    # ------------------------------------------------------------------------------------ lifecycle

    @property
    def state(self) -> RuntimeState:
        """``loading``, ``ready``, ``failed`` or ``stopping``."""
        return self._state

    @property
    def engine(self) -> Engine | None:
        """The loaded engine, or None before it is ready."""
        return self._engine

    @property
    def failure(self) -> str | None:
        """Why loading failed, if it did."""
        return self._failure

    def start_loading(self) -> None:
        """Load and warm the engine on a background thread (the server answers /health meanwhile)."""
        with self._lock:
            if self._loader is not None:
                return
            self._load_started = time.monotonic()
            # Daemon: a SIGTERM during a long download must not wait for it. Published only once started:
            # another thread's wait_until_loaded may join it at any moment.
            loader = threading.Thread(target=self._load, name="clef-loader", daemon=True)
            loader.start()
            self._loader = loader

    def wait_until_loaded(self, timeout: float | None = None) -> bool:
        """Block until loading has finished (ready or failed). Returns True when ready."""
        if self._loader is not None:
            self._loader.join(timeout)
        return self._state == "ready"

    def _load(self) -> None:
        settings = self.settings
        logger.info("loading model %r", settings.model)
        try:
            engine = self._factory(settings)
            logger.info("warming up %r", engine.name)
            engine.warmup(max_rows=settings.max_batch_size)
        except BaseException as exc:
            self._failure = f"{type(exc).__name__}: {exc}"
            with self._lock:
                if self._state == "loading":
                    self._state = "failed"
            if _expected_load_error(exc):
                # The message says what failed and what to do; a traceback would only bury it.
                logger.error("loading model %r failed: %s", settings.model, exc)
            else:
                logger.exception("loading model %r failed", settings.model)
            if self._on_fatal is not None:
                self._on_fatal(exc)
            return
        dispatcher = self._dispatcher_factory(engine, settings, self)
        dispatcher.start()
        seconds = time.monotonic() - self._load_started
        with self._lock:
            if self._state != "loading":  # stopped while loading
                dispatcher.close(drain=False)
                return
            self._engine = engine
            self._dispatcher = dispatcher
            self._state = "ready"
        self.metrics.ready.set(1)
        self.metrics.load_seconds.set(seconds)
        # Read on every request from the calls counted so far (warm-up made the first), never frozen here.
        in_process = self._dispatcher_factory is local_engine_loop
        card = engine.card
        self.metrics.decisions.model_loaded(
            engine.name, lambda: fused_kernels_of(card, in_process=in_process)
        )
        logger.info("model %r ready in %.1f s", engine.name, seconds)

    def stop(self, timeout: float | None = None) -> None:
        """Stop accepting work, finish what was accepted, release the threads."""
        with self._lock:
            self._state = "stopping"
            dispatcher = self._dispatcher
        self.metrics.ready.set(0)
        if dispatcher is not None:
            dispatcher.close(drain=True, timeout=timeout)
        self._encoder.shutdown(wait=True)

    # --------------------------------------------------------------------------------------- helpers

    def _queue_depth(self) -> float:
        return float(self._dispatcher.queue_depth) if self._dispatcher is not None else 0.0

    def _running(self) -> float:
        return float(self._dispatcher.running) if self._dispatcher is not None else 0.0

    async def render_metrics(self) -> bytes:
        """The Prometheus exposition, with the engine's state-cache series fetched just before (none when
        the engine is not loaded or does not answer in time: the other metrics still come)."""
        engine = self._engine
        series: CacheSeries = []
        if engine is not None:
            try:
                series = await self.engine_queries.ask(lambda: _engine_cache_series(engine))
            except EngineQueryError as exc:
                logger.debug("/metrics without the engine's cache figures: %s", exc)
        # No await between storing and rendering: this exposition shows these figures.
        self._cache_series = series
        self.metrics.decisions.fused_now()  # the gauge as the calls counted say now
        return self.metrics.render()

    def queue_depth(self) -> int:
        """Requests waiting for the engine."""
        return int(self._queue_depth())

    def require_ready(self) -> Engine:
        """The engine, or :class:`ApiError` 503 ``not_ready`` (with Retry-After) when it is not loaded."""
        engine = self._engine
        if self._state == "ready" and engine is not None:
            return engine
        if self._state == "failed":
            raise ApiError(503, "not_ready", f"the model failed to load: {self._failure}")
        if self._state == "stopping":
            raise ApiError(503, "not_ready", "the server is shutting down", headers={"Retry-After": "5"})
        waited = time.monotonic() - self._load_started
        raise ApiError(
            503,
            "not_ready",
            f"the model {self.settings.model!r} is loading ({waited:.0f} s so far); retry shortly",
            headers={"Retry-After": "2"},
        )

    # --------------------------------------------------------------------------------------- pipeline

    async def run_encoder(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the encode thread and return its result (exceptions propagate)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._encoder, fn)

    def prepare_sync(self, engine: Engine, data: Any) -> PreparedItem:
        """Validate and encode a System One body, enforcing the token limit.

        Returns the engine's prepared request. Raises :class:`RequestValidationError` (422) or
        :class:`InputTooLongError` (413) before any model work.
        """
        prepared = engine.prepare(data)
        if self.settings.strict_model_names:
            self._check_model_name(engine, prepared.request.model)
        rows = prepared.parts if isinstance(prepared, IndependentRequest) else (prepared,)
        for row in rows:
            self._check_limit(row.record)
        return prepared

    @staticmethod
    def _check_model_name(engine: Engine, model: str | None) -> None:
        """``--strict-model-names``: a request naming no served head is refused instead of answered by the
        default head."""
        names = [info.name for info in engine.head_infos()]
        if model is not None and model not in names:
            raise ApiError(
                404,
                "model_not_found",
                f"model {model!r} is not served (--strict-model-names); the names served are "
                f"{', '.join(repr(name) for name in names)} (GET /v1/models)",
                extra={"served": names},
            )

    def _check_limit(self, record: Any) -> None:
        """Raises `InputTooLongError` for a row over the token limit (or truncated under reject)."""
        limit = self.settings.input_token_limit
        full = record.input_tokens + record.truncated_state_tokens
        if self.settings.on_overflow == "reject" and record.truncated_state_tokens > 0:
            raise InputTooLongError(
                ("state",),
                f"the input is {full} tokens, over the limit of {limit} (--max-input-tokens); the server "
                "rejects instead of truncating (--on-overflow reject)",
                input_tokens=full,
                limit=limit,
            )
        if record.input_tokens > limit:  # only if the engine did not honour max_length itself
            raise InputTooLongError(
                (),
                f"the input is {record.input_tokens} tokens, over the limit of {limit}",
                input_tokens=record.input_tokens,
                limit=limit,
            )

    async def prepare(self, data: Any) -> PreparedItem:
        """:meth:`prepare_sync` on the encode thread."""
        engine = self.require_ready()
        return await self.run_encoder(lambda: self.prepare_sync(engine, data))

    def submit_background(self, prepared: PreparedItem) -> Future[Decision]:
        """Queue a prepared request in the engine's background lane (batch-job lines: they run only when no
        interactive request waits or runs). Returns the future of its decision. Raises
        :class:`SchedulerClosedError` when the server is not ready or is shutting down, QueueFullError when
        the background lane is full."""
        dispatcher = self._dispatcher
        if self._state != "ready" or dispatcher is None:
            raise SchedulerClosedError("the engine is not ready")
        future = _submit(dispatcher, prepared, background=True)
        truncated = prepared.record.truncated_state_tokens
        future.add_done_callback(lambda done: self._observe_background(done, truncated))
        return future

    def _observe_background(self, done: Future[Decision], truncated_state_tokens: int) -> None:
        """Count a batch-job line's answers as a decision route's are counted (`flow.finish`)."""
        if not done.cancelled() and done.exception() is None:
            self.metrics.observe_answers(done.result(), truncated_state_tokens)

    def _refusal(self, status: int, error_type: str, why: str, estimate_s: float) -> ApiError:
        """A request refused for want of capacity (counted by ``error_type``), with ``Retry-After``: the
        loop's estimate of when the queued work is done, in whole seconds, 1 to 60."""
        self.metrics.rejected.labels(error_type).inc()
        retry_after = max(1, min(60, math.ceil(estimate_s)))
        return ApiError(
            status,
            error_type,
            f"{why}; retry in about {retry_after} s",
            headers={"Retry-After": str(retry_after)},
        )

    async def decide(self, prepared: PreparedItem, request: Request | None) -> Decision:
        """Queue a prepared request and wait for its decision, dropping it (waiting or running) if the client
        goes away.

        Returns the engine's `Decision`. Raises :class:`ApiError` 429 (queue full, with Retry-After) or 503
        (waited past the queue timeout, with Retry-After; shutting down), :class:`ClientGone`, protocol
        errors raised by the engine, or the engine's own exception (an internal error).
        """
        self.require_ready()
        dispatcher = self._dispatcher
        assert dispatcher is not None
        try:
            # The queue timeout counts from the request's arrival: reading, validating and encoding it were
            # waiting too, and under overload the encode thread has a queue of its own.
            arrived = context_of(request).started_at if request is not None else None
            waited = time.perf_counter() - arrived if arrived is not None else 0.0
            future = _submit(dispatcher, prepared, waited_s=waited)
        except QueueFullError as exc:
            busy = f"the server is busy ({exc.queued} requests waiting, --max-queue {dispatcher.max_queue})"
            raise self._refusal(429, "queue_full", busy, exc.retry_after_s) from None
        except SchedulerClosedError:
            raise ApiError(503, "not_ready", "the server is shutting down") from None
        answer = asyncio.wrap_future(future)
        watcher = asyncio.ensure_future(_wait_for_disconnect(request)) if request is not None else None
        try:
            waiting: set[asyncio.Future[Any]] = {answer} if watcher is None else {answer, watcher}
            done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            if answer not in done:
                # Cancel the engine's future itself, now: answer.cancel() alone would only schedule that on
                # the event loop. The loop drops the request, waiting or between two chunks.
                future.cancel()
                answer.cancel()
                self.metrics.disconnected.inc()
                raise ClientGone()
        except asyncio.CancelledError:
            future.cancel()
            answer.cancel()
            raise
        finally:
            if watcher is not None:
                watcher.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await watcher
        try:
            decision = answer.result()
        except SchedulerClosedError:
            raise ApiError(503, "not_ready", "the server shut down before answering") from None
        except QueueTimeoutError as exc:
            overloaded = f"{exc} (--queue-timeout-ms); the server is overloaded"
            raise self._refusal(503, "queue_timeout", overloaded, exc.retry_after_s) from None
        except (RequestValidationError, ApiError):
            raise
        except ClefError as exc:
            raise ApiError(400, exc.error_type, exc.message) from None
        except Exception as exc:
            # Out of memory is capacity, not a bad request: 503 so clients back off and retry.
            if is_out_of_memory(exc):
                self.metrics.rejected.labels("out_of_memory").inc()
                raise ApiError(
                    503,
                    "overloaded",
                    "the engine ran out of memory on this request; retry later or send a shorter input",
                    headers={"Retry-After": "5"},
                ) from None
            raise
        self.metrics.observe_decision(decision.timings)
        return decision


def _engine_cache_series(engine: Engine) -> CacheSeries:
    """The engine's state-cache counters as metric series. Blocks on the cluster of a scale-out engine."""
    replicas = engine.replica_status()
    if replicas is not None:
        # One series per replica: a replica that stops takes its series with it, and no summed counter goes
        # backwards.
        return [({"replica": report.replica}, report.cache) for report in replicas.reports]
    return [({}, engine.cache_stats())]


async def _wait_for_disconnect(request: Request) -> None:
    """Return when the client disconnects. Only call after the body was read: the next ASGI message is
    then either the disconnect or nothing until the response is sent."""
    while True:
        message = await request.receive()
        if message.get("type") == "http.disconnect":
            return


def runtime_of(request: Request) -> ServerRuntime:
    """The app's :class:`ServerRuntime`."""
    runtime: ServerRuntime = request.app.state.runtime
    return runtime
