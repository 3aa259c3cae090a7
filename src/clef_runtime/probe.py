"""``python -m clef_runtime.probe``: exit 0 when the clef server of this machine (or container) answers
``/ready`` with 200, else 1 with one line on stderr saying why. The container image's ``HEALTHCHECK`` and a
supervisor's readiness check.

It reads the server's own settings from the environment, so it probes what ``clef serve`` bound:
``CLEF_HOST`` (a wildcard address is probed on loopback), ``CLEF_PORT`` and ``CLEF_SSL_CERTFILE`` (then
HTTPS, without checking the certificate's name: the probe connects to itself and sends nothing secret).
Only the standard library: it runs every few seconds and must never import torch. Under ``--ssl-ca-certs``
(mutual TLS) it has no client certificate and reports the server unready: probe ``/ready`` from outside.
"""

from __future__ import annotations

import http.client
import os
import ssl
import sys
from collections.abc import Mapping

__all__ = ["main", "probe_target"]

_DEFAULT_PORT = 8094  # server.settings.DEFAULT_PORT, not imported: that module pulls the engine's options
_WILDCARDS = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1", "[::]": "::1"}


def probe_target(environ: Mapping[str, str]) -> tuple[str, int, bool]:
    """(host, port, tls) of the server the variables describe. Raises ValueError for a port that is not a
    number."""
    host = environ.get("CLEF_HOST", "127.0.0.1").strip()
    host = _WILDCARDS.get(host, host).strip("[]")
    raw_port = environ.get("CLEF_PORT", str(_DEFAULT_PORT)).strip()
    if not raw_port.isdigit():
        raise ValueError(f"CLEF_PORT={raw_port!r} is not a port number")
    return host, int(raw_port), bool(environ.get("CLEF_SSL_CERTFILE"))


def main(environ: Mapping[str, str] | None = None, timeout: float = 5.0) -> int:
    """Probe once; returns the exit status."""
    try:
        host, port, tls = probe_target(os.environ if environ is None else environ)
    except ValueError as exc:
        print(f"clef probe: {exc}", file=sys.stderr)
        return 1
    if tls:
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        connection: http.client.HTTPConnection = http.client.HTTPSConnection(
            host, port, timeout=timeout, context=context
        )
    else:
        connection = http.client.HTTPConnection(host, port, timeout=timeout)
    scheme = "https" if tls else "http"
    try:
        connection.request("GET", "/ready")
        status = connection.getresponse().status
    except (OSError, http.client.HTTPException) as exc:
        print(f"clef probe: {scheme}://{host}:{port}/ready: {exc}", file=sys.stderr)
        return 1
    finally:
        connection.close()
    if status != 200:
        print(f"clef probe: {scheme}://{host}:{port}/ready answered {status} (not ready)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
