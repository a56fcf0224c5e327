"""API keys of the HTTP frontend: where they come from and how their text is parsed.

The config holds only *where* keys are (a file, an environment variable) or, for tests and
development, inline keys; the secrets themselves are read when the app is built
(:func:`load_key_sources`), so ``check-config`` never prints a key read from a file or the
environment. Every failure is a :class:`ConfigError` naming the field.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path

import yaml

from thunderagent.config._base import ConfigError

#: tenant names enter the cache salt as ``tenant:<name>[:<client salt>]``: no ``:`` in a name keeps
#: that unambiguous, and the bound keeps a NATS request message within its fixed overhead.
TENANT_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
#: shorter keys are guessable; ``secrets.token_urlsafe(24)`` gives 32 characters
MIN_KEY_CHARS = 16
_KEY = re.compile(r"^[\x21-\x7e]+$")  # printable ASCII without spaces: what fits an Authorization header


def check_key(key: object) -> str:
    """A key as given; ValueError (never showing the key) when it is not acceptable."""
    if not isinstance(key, str) or not _KEY.fullmatch(key):
        raise ValueError("a key must be printable ASCII without spaces")
    if len(key) < MIN_KEY_CHARS:
        raise ValueError(f"a key must have at least {MIN_KEY_CHARS} characters "
                         "(generate one with `python -c 'import secrets; print(secrets.token_urlsafe(24))'`)")
    return key


def check_tenant(tenant: object) -> str:
    if not isinstance(tenant, str) or not TENANT_NAME.fullmatch(tenant):
        raise ValueError(f"tenant {str(tenant)[:70]!r} must be 1-64 characters of letters, digits, '_', '.' or '-'")
    return tenant


def _checked(field: str, check: Callable[[object], str], value: object) -> str:
    try:
        return check(value)
    except ValueError as exc:
        raise ConfigError(f"field '{field}': {exc}") from None


def parse_tenant_keys(text: str, field: str) -> dict[str, str]:
    """``key -> tenant`` from a YAML mapping (``KEY: TENANT``) or lines of ``KEY TENANT`` (``#`` comments)."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError:
        data = None
    if isinstance(data, Mapping):
        pairs = [(k, v) for k, v in data.items()]
    else:
        pairs = []
        for n, line in enumerate(text.splitlines(), 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            parts = line.split()
            if len(parts) != 2:
                raise ConfigError(f"field '{field}': line {n} must be `KEY TENANT` (or the whole text a YAML "
                                  "mapping KEY: TENANT)")
            pairs.append((parts[0], parts[1]))
    out: dict[str, str] = {}
    for key, tenant in pairs:
        add_tenant_key(out, _checked(field, check_key, key), _checked(field, check_tenant, tenant), field)
    return out


def add_tenant_key(keys: dict[str, str], key: str, tenant: str, field: str) -> None:
    if keys.get(key, tenant) != tenant:
        raise ConfigError(f"field '{field}': one key is given to two tenants ({keys[key]!r} and {tenant!r})")
    keys[key] = tenant


def parse_admin_keys(text: str, field: str) -> set[str]:
    """Admin keys: one per line (``#`` comments), or a YAML list."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError:
        data = None
    items = data if isinstance(data, list) else [line.split("#", 1)[0].strip() for line in text.splitlines()]
    return {_checked(field, check_key, k) for k in items if k != ""}


def read_secret(path: str | None, env: str | None, field: str) -> list[tuple[str, str]]:
    """The texts of a ``*_file`` and a ``*_env`` source, each with the field it came from."""
    texts = []
    if path is not None:
        try:
            texts.append((Path(path).read_text(encoding="utf-8"), f"{field}_file"))
        except OSError as exc:
            raise ConfigError(f"field '{field}_file': cannot read {path}: {exc.strerror}") from exc
    if env is not None:
        value = os.environ.get(env)
        if value is None:
            raise ConfigError(f"field '{field}_env': environment variable {env} is not set")
        texts.append((value, f"{field}_env"))
    return texts


def load_key_sources(
    inline: Mapping[str, str], inline_admin: list[str], files: Mapping[str, str | None],
) -> tuple[dict[str, str], set[str]]:
    """All tenant keys (``key -> tenant``) and admin keys, from the inline fields, files and env vars.
    ``files`` maps ``api_keys_file``/``api_keys_env``/``admin_keys_file``/``admin_keys_env`` to their values."""
    tenants: dict[str, str] = {}
    for key, tenant in inline.items():
        add_tenant_key(tenants, key, tenant, "control_plane.api_keys")
    for text, field in read_secret(files["api_keys_file"], files["api_keys_env"], "control_plane.api_keys"):
        for key, tenant in parse_tenant_keys(text, field).items():
            add_tenant_key(tenants, key, tenant, field)
    admins = set(inline_admin)
    for text, field in read_secret(files["admin_keys_file"], files["admin_keys_env"], "control_plane.admin_keys"):
        admins |= parse_admin_keys(text, field)
    sources = [f for f in ("api_keys_file", "api_keys_env") if files[f] is not None]
    if sources and not tenants:
        raise ConfigError(f"field 'control_plane.{sources[0]}': holds no key (every request would get 401)")
    return tenants, admins


def server_api_key(env: str | None, path: str | None, url: str) -> str | None:
    """The API key an engine server at ``url`` demands, read now from its endpoint's ``api_key_env`` or
    ``api_key_file`` (None: neither set). A ConfigError names the field and the server, never the key."""
    texts = read_secret(path, env, "api_key")
    if not texts:
        return None
    text, field = texts[0]
    lines = text.strip().splitlines()
    key = lines[0].strip() if lines else ""
    if not _KEY.fullmatch(key):  # (an empty or multi-word key, or one a header cannot carry)
        raise ConfigError(f"field '{field}' of the endpoint {url}: holds no key (printable ASCII, no spaces)")
    return key
