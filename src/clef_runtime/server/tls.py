"""HTTPS for ``clef serve`` (``--ssl-certfile``, ``--ssl-keyfile``, ``--ssl-ca-certs``).

The files are read once before the port is bound (`check_tls_files`), so a wrong path, a key that does not
belong to its certificate or an encrypted key is a usage error naming the flag (exit 2), not a traceback
from uvicorn after the model began to load. uvicorn then builds its own context from the same files
(`uvicorn_tls_arguments`): Python's server defaults, TLS 1.2 or later.
"""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import Any

from clef_runtime.options import OptionsError
from clef_runtime.server.settings import ServerSettings

__all__ = ["check_tls_files", "uvicorn_tls_arguments"]


def _no_password() -> bytes:
    # Without a callback OpenSSL would prompt on the terminal for an encrypted key: refuse it instead.
    return b""


def check_tls_files(settings: ServerSettings) -> None:
    """Load the settings' certificate, key and client CAs as the server will. Raises `OptionsError` naming
    the flag and the file when one cannot be used; does nothing without ``--ssl-certfile``."""
    if not settings.ssl_certfile:
        return
    files = (
        ("--ssl-certfile", settings.ssl_certfile),
        ("--ssl-keyfile", settings.ssl_keyfile),
        ("--ssl-ca-certs", settings.ssl_ca_certs),
    )
    for flag, path in files:
        # OpenSSL's errors do not say which file is missing.
        if path and not Path(path).is_file():
            raise OptionsError(f"{flag} {path}: no such file")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(settings.ssl_certfile, settings.ssl_keyfile, password=_no_password)
    except (ssl.SSLError, OSError) as exc:
        key = f"--ssl-keyfile {settings.ssl_keyfile}" if settings.ssl_keyfile else "a key inside it"
        raise OptionsError(
            f"--ssl-certfile {settings.ssl_certfile} with {key}: not a PEM certificate chain and its "
            f"unencrypted private key ({exc.strerror or exc})"
        ) from None
    if settings.ssl_ca_certs:
        try:
            context.load_verify_locations(settings.ssl_ca_certs)
        except (ssl.SSLError, OSError) as exc:
            raise OptionsError(
                f"--ssl-ca-certs {settings.ssl_ca_certs}: not PEM CA certificates ({exc.strerror or exc})"
            ) from None


def uvicorn_tls_arguments(settings: ServerSettings) -> dict[str, Any]:
    """The ``uvicorn.Config`` arguments that make it serve the settings' TLS (none without a certificate):
    with ``--ssl-ca-certs`` every client must present a certificate those CAs issued."""
    if not settings.ssl_certfile:
        return {}
    return {
        "ssl_certfile": settings.ssl_certfile,
        "ssl_keyfile": settings.ssl_keyfile,
        "ssl_ca_certs": settings.ssl_ca_certs,
        "ssl_cert_reqs": ssl.CERT_REQUIRED if settings.ssl_ca_certs else ssl.CERT_NONE,
    }
