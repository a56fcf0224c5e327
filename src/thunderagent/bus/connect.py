"""nats-py connect options from the ``nats`` section of the config: TLS context and credentials.

Secrets are resolved here, at connect time, from the files and environment variables the config
names (never from the config file or the command line). Every failure is a :class:`ConfigError`
naming the field, raised before any connection is tried.
"""

from __future__ import annotations

import os
import ssl
from pathlib import Path
from typing import Any

from thunderagent.config import ConfigError, NatsAuthConfig, NatsConfig, NatsTlsConfig


def connect_options(cfg: NatsConfig) -> dict[str, Any]:
    """Keyword arguments for ``nats.connect`` besides the servers and callbacks."""
    opts: dict[str, Any] = {}
    if cfg.tls is not None or any(url.startswith("tls://") for url in cfg.servers):
        opts["tls"] = tls_context(cfg.tls or NatsTlsConfig())
        if cfg.tls is not None and cfg.tls.hostname is not None:
            opts["tls_hostname"] = cfg.tls.hostname
    if cfg.auth is not None:
        opts.update(auth_options(cfg.auth))
    return opts


def tls_context(tls: NatsTlsConfig) -> ssl.SSLContext:
    """A client context that verifies the server (against ``ca_file``, else the system's CAs)."""
    _readable(tls.ca_file, "nats.tls.ca_file")
    _readable(tls.cert_file, "nats.tls.cert_file")
    _readable(tls.key_file, "nats.tls.key_file")
    try:
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=tls.ca_file)
        if tls.cert_file is not None:
            ctx.load_cert_chain(tls.cert_file, tls.key_file)
    except ssl.SSLError as exc:
        raise ConfigError(f"nats.tls: cannot load the certificates: {exc}") from exc
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    return ctx


def auth_options(auth: NatsAuthConfig) -> dict[str, Any]:
    """nats-py's credential arguments for the one method the config gives (it validated that)."""
    if auth.user is not None or auth.user_env is not None:
        user = auth.user if auth.user is not None else _env(auth.user_env, "nats.auth.user_env")
        return {"user": user, "password": _secret(auth, "password")}
    if auth.token_file is not None or auth.token_env is not None:
        return {"token": _secret(auth, "token")}
    if auth.nkey_seed_file is not None or auth.nkey_seed_env is not None:
        _need_nkeys("nkey")
        if auth.nkey_seed_file is not None:
            _readable(auth.nkey_seed_file, "nats.auth.nkey_seed_file")
            return {"nkeys_seed": auth.nkey_seed_file}
        return {"nkeys_seed_str": _env(auth.nkey_seed_env, "nats.auth.nkey_seed_env")}
    assert auth.creds_file is not None, "NatsAuthConfig validated one method"
    _need_nkeys("creds")
    _readable(auth.creds_file, "nats.auth.creds_file")
    return {"user_credentials": auth.creds_file}


def _secret(auth: NatsAuthConfig, what: str) -> str:
    path = getattr(auth, f"{what}_file")
    if path is not None:
        field = f"nats.auth.{what}_file"
        _readable(path, field)
        value = Path(path).read_text().strip()
        if not value:
            raise ConfigError(f"{field}: {path} is empty")
        return value
    return _env(getattr(auth, f"{what}_env"), f"nats.auth.{what}_env")


def _env(name: str | None, field: str) -> str:
    assert name is not None
    value = os.environ.get(name, "").strip()
    if not value:
        raise ConfigError(f"{field}: environment variable {name} is not set (or empty)")
    return value


def _readable(path: str | None, field: str) -> None:
    if path is not None and not os.access(path, os.R_OK):
        raise ConfigError(f"{field}: cannot read {path}")


def _need_nkeys(method: str) -> None:
    try:
        import nkeys  # noqa: F401
    except ImportError as exc:
        raise ConfigError(f"nats.auth: {method} authentication needs the nkeys package "
                          "(pip install 'thunderagent[nats]')") from exc
