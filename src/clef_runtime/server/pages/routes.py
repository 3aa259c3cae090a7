"""Pages for people: the playground (``GET /``), the saved classifiers (``GET /classifiers``: run one on a
state), the status page (``GET /status``, fed by ``GET /status.json``), and the API docs (``/docs``,
``/redoc``) with every asset served from here.

Our pages are plain HTML/CSS/JS files in ``server/pages/static`` (no build step). Swagger UI and ReDoc come
from the pinned ``fastapi-offline`` package, which ships their files. Every page carries a
Content-Security-Policy that only lets the browser talk to this server, so a page can make no request to
another host.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any, TypeVar

from fastapi import APIRouter, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse, Response

from clef_runtime.engine.contract import ReplicaStatus
from clef_runtime.server.engine_queries import EngineQueryError
from clef_runtime.server.errors import ApiError
from clef_runtime.server.feature import Feature
from clef_runtime.server.openapi import json_example
from clef_runtime.server.runtime import Engine, runtime_of
from clef_runtime.version import __version__

__all__ = ["FEATURE", "PAGES", "PAGE_CSP", "STATIC_FILES", "VENDOR_FILES", "OurPage", "docs_csp", "router"]

router = APIRouter()

T = TypeVar("T")

_STARTED = time.time()

PAGE_CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data: blob:; "
    "connect-src 'self'; font-src 'self'; object-src 'none'; base-uri 'none'; form-action 'self'; "
    "frame-ancestors 'none'"
)
"""The policy of our own pages: nothing inline, nothing from another host (data:/blob: images are the
playground's uploaded thumbnails)."""

_MEDIA_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
    ".png": "image/png",
}

STATIC_FILES = ("playground.js", "classifiers.js", "status.js", "common.js", "pages.css", "favicon.svg")
"""Our assets, served at ``/static/<name>``; one explicit route each keeps the metrics' route labels exact."""

VENDOR_FILES = {
    "swagger-ui-bundle.js": "swagger-ui-bundle.js",
    "swagger-ui.css": "swagger-ui.css",
    "redoc.standalone.js": "redoc.standalone.js",
}
"""``/static/vendor/<name>`` -> the file of that name in the ``fastapi_offline`` package."""

_VENDOR_PATCHES = {
    # ReDoc's side menu always shows Redocly's logo from their CDN; show our icon instead, so the page makes
    # no request to another host (ReDoc is MIT-licensed: changing it is allowed).
    "redoc.standalone.js": ((b"https://cdn.redoc.ly/redoc/logo-mini.svg", b"/static/favicon.svg"),),
}

_SECURITY_HEADERS = {"X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer"}


def _media_type(name: str) -> str:
    return next((t for ext, t in _MEDIA_TYPES.items() if name.endswith(ext)), "application/octet-stream")


@cache
def _our_file(name: str) -> bytes:
    return (resources.files("clef_runtime.server.pages") / "static" / name).read_bytes()


@cache
def _vendor_file(name: str) -> bytes:
    """The bytes of a Swagger UI / ReDoc file shipped by ``fastapi-offline``. Raises ApiError 404 naming
    the missing package when it is not installed (the rest of the server does not need it)."""
    try:
        data = (resources.files("fastapi_offline") / "static" / name).read_bytes()
    except (ModuleNotFoundError, FileNotFoundError):
        raise ApiError(
            404,
            "not_found",
            f"{name} is not available: install the 'fastapi-offline' package to serve the API docs",
        ) from None
    for old, new in _VENDOR_PATCHES.get(name, ()):
        data = data.replace(old, new)
    return data


def _page(body: bytes | str, media_type: str, csp: str = PAGE_CSP) -> Response:
    headers = {**_SECURITY_HEADERS, "Content-Security-Policy": csp, "Cache-Control": "no-cache"}
    return Response(body, media_type=media_type, headers=headers)


def _add_static_route(name: str, loader: Any, url: str) -> None:
    async def serve() -> Response:
        return _page(loader(name), _media_type(name))

    router.add_api_route(url, serve, methods=["GET"], include_in_schema=False, name=f"static:{url}")


for _name in STATIC_FILES:
    _add_static_route(_name, _our_file, f"/static/{_name}")
for _name, _file in VENDOR_FILES.items():
    _add_static_route(_file, _vendor_file, f"/static/vendor/{_name}")


_LINKS = {
    "/": "Playground",
    "/classifiers": "Saved classifiers",
    "/status": "Server status",
    "/docs": "API docs",
    "/redoc": "API reference",
    "/metrics": "Prometheus metrics",
}
"""Every page a page may link to, by path: the label is the same on every page."""


@dataclass(frozen=True)
class OurPage:
    """One of our HTML pages: its body (``static/<name>.html``, from the banner on) in the shell every page
    shares (head, icon, style, scripts, the top bar with its links)."""

    name: str
    title: str
    heading: str
    links: tuple[str, ...]

    def html(self) -> bytes:
        nav = "".join(f'    <a href="{path}">{_LINKS[path]}</a>\n' for path in self.links)
        shell = (
            '<!doctype html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
            '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
            f"<title>{self.title}</title>\n"
            '<link rel="icon" href="/static/favicon.svg" type="image/svg+xml">\n'
            '<link rel="stylesheet" href="/static/pages.css">\n'
            '<script src="/static/common.js" defer></script>\n'
            f'<script src="/static/{self.name}.js" defer></script>\n'
            "</head>\n<body>\n"
            f'<header class="top">\n  <h1>{self.heading}</h1>\n'
            f'  <nav aria-label="Pages">\n{nav}  </nav>\n</header>\n'
        )
        return shell.encode("utf-8") + _our_file(f"{self.name}.html")


PAGES = (
    OurPage(
        "playground", "Clef playground", "Clef playground", ("/classifiers", "/status", "/docs", "/redoc")
    ),
    OurPage("classifiers", "Saved classifiers", "Saved classifiers", ("/", "/status", "/docs")),
    OurPage("status", "Clef server status", "Server status", ("/", "/classifiers", "/docs", "/metrics")),
)


@cache
def _page_html(page: OurPage) -> bytes:
    return page.html()


@router.get("/", include_in_schema=False)
async def playground() -> Response:
    """The playground: build a System One request, decide, see every option's probability as a bar."""
    return _page(_page_html(PAGES[0]), _MEDIA_TYPES[".html"])


@router.get("/classifiers", include_in_schema=False)
async def classifiers_page() -> Response:
    """The caller's saved classifiers (``/v1/classifiers``): pick one, write a state, run it."""
    return _page(_page_html(PAGES[1]), _MEDIA_TYPES[".html"])


@router.get("/status", include_in_schema=False)
async def status_page() -> Response:
    """The status page (it polls ``/status.json``)."""
    return _page(_page_html(PAGES[2]), _MEDIA_TYPES[".html"])


_STATUS_EXAMPLE = {
    "model": "clef-flash",
    "state": "ready",
    "untrained": False,
    "device": "cuda:0",
    # What a bf16 GPU server reports: the weights held in the compute dtype, said as --dtype says it.
    "weights": "bf16",
    "compute_dtype": "bf16",
    "max_input_tokens": 16384,
    "queue_depth": 0,
    "requests": {"total": 120, "rejected": 5, "errors": 2, "window": 113, "p50_ms": 41.3, "p95_ms": 88.0},
    "state_cache": {"hits": 70, "misses": 48, "entries": 48, "bytes": 52428800, "hit_rate": 0.5932},
    "replicas": None,
    "fused_kernels": {
        "in_use": True,
        "device": "cuda:0",
        "reason": "in_use",
        "calls": {"fused": 96, "reference": 0},
        "conv": "fla",
    },
    "answers": [
        {"classifier": None, "answers": 310, "near_ties": 12, "mean_confidence": 0.8712},
        {"classifier": "refund-triage", "answers": 96, "near_ties": 2, "mean_confidence": 0.9034},
    ],
    "auth": True,
    "version": __version__,
    "uptime_s": 3600.0,
}


@router.get(
    "/status.json",
    summary="The status page's figures: model, device, queue, latency, state cache",
    description="What the status page (`/status`) shows: the model and where it runs, the queue, the number "
    "of decision requests since start with the p50 / p95 latency of the latest successful ones (arrival to "
    "answer, in ms), the state cache (`hit_rate` = hits / lookups), whether the fused CUDA kernels run, and "
    "per saved classifier the questions answered, near ties and mean confidence. No API key needed.",
    responses={200: json_example("The server's figures", _STATUS_EXAMPLE)},
)
async def status_json(request: Request) -> JSONResponse:
    """What the status page shows, as JSON; no API key needed (like ``/health`` and ``/metrics``).

    ``requests`` counts the decision requests (every POST route) since start; ``p50_ms`` / ``p95_ms`` are
    measured over the latest successful ones (``window`` of them). ``state_cache`` is the engine's cache
    counters plus ``hit_rate`` (hits / lookups, null before the first lookup), or null for an engine
    without a state cache. ``replicas`` is null for an engine in this process; with model replicas
    (``clef serve --ray``) it holds ``up`` and ``target`` and, for each running replica that has answered,
    its id, process id and state cache (``state_cache`` is then their sum). Either is also null when the
    cluster cannot tell within a few seconds (``/ready`` is then 503 and says why). ``fused_kernels`` says
    whether the fused CUDA kernels run, from the calls counted now, as ``/ready`` says it
    (`clef_runtime.server.answer_metrics.FusedKernels`). ``answers`` has, per saved classifier
    (``classifier`` null: requests made without one), the questions answered since start, the near ties
    among them and their mean confidence: the figures of ``/metrics``' ``clef_answers_total``,
    ``clef_near_ties_total`` and ``clef_answer_confidence``.
    """
    runtime = runtime_of(request)
    engine = runtime.engine
    stats: Mapping[str, int] | None = None
    replicas: ReplicaStatus | None = None
    if engine is not None:
        # A scale-out engine asks its replicas over the network: bounded in threads and time. Figures that
        # cannot be read show as unknown (null); /ready says what is wrong.
        with contextlib.suppress(EngineQueryError):
            stats, replicas = await runtime.engine_queries.ask(lambda: _engine_figures(engine))
    return JSONResponse(
        {
            "model": runtime.settings.model if engine is None else engine.name,
            "state": runtime.state,
            "untrained": None if engine is None else engine.card.model.untrained,
            "device": None if engine is None else engine.card.device,
            "weights": None if engine is None else engine.card.weight_mode,
            "compute_dtype": None if engine is None else engine.card.compute_dtype,
            "max_input_tokens": runtime.settings.input_token_limit if engine is not None else None,
            "queue_depth": runtime.queue_depth(),
            "requests": runtime.metrics.recent.summary(),
            "state_cache": _cache_figures(stats),
            "replicas": _replica_figures(replicas),
            "fused_kernels": runtime.metrics.decisions.fused_now().as_api(),
            "answers": runtime.metrics.decisions.summary(),
            "auth": runtime.keys.enabled,
            "version": __version__,
            "uptime_s": round(time.time() - _STARTED, 1),
        }
    )


def _engine_figures(engine: Engine) -> tuple[Mapping[str, int] | None, ReplicaStatus | None]:
    """The engine's cache counters and replicas, each None when it cannot be read (the other may still be:
    the replica count comes from Serve's controller, the counters from the replicas' answers)."""
    return _or_none(engine.cache_stats), _or_none(engine.replica_status)


def _or_none(read: Callable[[], T]) -> T | None:
    try:
        return read()
    except Exception:
        return None


def _cache_figures(stats: Mapping[str, int] | None) -> dict[str, Any] | None:
    if not stats:
        return None
    figures: dict[str, Any] = dict(stats)
    lookups = stats.get("hits", 0) + stats.get("misses", 0)
    figures["hit_rate"] = round(stats.get("hits", 0) / lookups, 4) if lookups else None
    return figures


def _replica_figures(replicas: ReplicaStatus | None) -> dict[str, Any] | None:
    if replicas is None:
        return None
    reports = [
        {"replica": report.replica, "pid": report.pid, "state_cache": _cache_figures(report.cache)}
        for report in replicas.reports
    ]
    return {"up": replicas.up, "target": replicas.target, "reports": reports}


# ------------------------------------------------------------------------------------------ API docs

_INLINE_SCRIPT = re.compile(r"<script>(.*?)</script>", re.DOTALL)


def docs_csp(html: str) -> str:
    """The policy for a Swagger UI / ReDoc page: scripts from this server plus the page's own inline
    bootstrap script, allowed by its hash; inline styles (both UIs set them at run time); workers from
    blob: (ReDoc's search); still nothing from another host."""
    sources = ["'self'"] + [
        "'sha256-" + base64.b64encode(hashlib.sha256(s.encode()).digest()).decode() + "'"
        for s in _INLINE_SCRIPT.findall(html)
    ]
    return (
        f"default-src 'self'; script-src {' '.join(sources)}; style-src 'self' 'unsafe-inline'; "
        "img-src 'self' data: blob:; connect-src 'self'; font-src 'self' data:; worker-src 'self' blob:; "
        "object-src 'none'; base-uri 'none'; frame-ancestors 'none'"
    )


def _docs_page(request: Request, build: Callable[..., HTMLResponse], title: str, **assets: Any) -> Response:
    """The page ``build`` (FastAPI's Swagger UI or ReDoc page) makes for this app's schema, with ``assets``
    (its script, style and icon URLs) served from here."""
    response = build(openapi_url=request.app.openapi_url, title=f"{request.app.title} - {title}", **assets)
    html = bytes(response.body).decode("utf-8")
    return _page(html, _MEDIA_TYPES[".html"], docs_csp(html))


_DOCS_PAGES: dict[str, tuple[Callable[..., HTMLResponse], str, dict[str, Any]]] = {
    # Swagger UI with its files served from here (it works without internet).
    "/docs": (
        get_swagger_ui_html,
        "API docs",
        {
            "swagger_js_url": "/static/vendor/swagger-ui-bundle.js",
            "swagger_css_url": "/static/vendor/swagger-ui.css",
            "swagger_favicon_url": "/static/favicon.svg",
            # validatorUrl: null, or Swagger UI asks validator.swagger.io to check the schema.
            "swagger_ui_parameters": {"validatorUrl": None, "tryItOutEnabled": True},
        },
    ),
    # ReDoc with its file served from here and no web fonts from elsewhere.
    "/redoc": (
        get_redoc_html,
        "API reference",
        {
            "redoc_js_url": "/static/vendor/redoc.standalone.js",
            "redoc_favicon_url": "/static/favicon.svg",
            "with_google_fonts": False,
        },
    ),
}
"""The API's pages that FastAPI builds (``build``, a title, their asset URLs), by path."""


def _add_docs_route(
    path: str, build: Callable[..., HTMLResponse], title: str, assets: dict[str, Any]
) -> None:
    async def serve(request: Request) -> Response:
        return _docs_page(request, build, title, **assets)

    router.add_api_route(path, serve, methods=["GET"], include_in_schema=False, name=f"docs:{path}")


for _path, (_build, _title, _assets) in _DOCS_PAGES.items():
    _add_docs_route(_path, _build, _title, _assets)


FEATURE = Feature("pages", router)
"""The playground, status and classifiers pages, their assets, and /docs and /redoc served offline."""
