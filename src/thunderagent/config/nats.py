"""The `nats:` section: servers, TLS and authentication for the NATS bus."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from thunderagent.config._base import _Strict


class NatsTlsConfig(_Strict):
    """TLS to the NATS servers (``tls://`` URLs turn it on with the system's CAs)."""

    ca_file: str | None = Field(None, description="PEM file of the CA that signed the servers' certificates")
    cert_file: str | None = Field(None, description="client certificate (PEM), when the server verifies clients")
    key_file: str | None = Field(None, description="private key of cert_file (PEM)")
    hostname: str | None = Field(None, description="name to verify in the server certificate (default: the URL's host)")

    @model_validator(mode="after")
    def _cert_and_key(self) -> NatsTlsConfig:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("cert_file and key_file go together: a client certificate needs its key")
        return self


class NatsAuthConfig(_Strict):
    """How this process proves who it is to NATS: exactly one of user + password, token, NKey seed or
    creds file. Secrets are read at connect time from a file or an environment variable, never from
    this file or the command line; each process (the frontends, every worker) can have its own."""

    user: str | None = Field(None, description="user name (with password_file or password_env)")
    user_env: str | None = Field(None, description="environment variable holding the user name")
    password_file: str | None = Field(None, description="file holding the password")
    password_env: str | None = Field(None, description="environment variable holding the password")
    token_file: str | None = Field(None, description="file holding the token")
    token_env: str | None = Field(None, description="environment variable holding the token")
    nkey_seed_file: str | None = Field(None, description="NKey user seed file (needs the nkeys package)")
    nkey_seed_env: str | None = Field(None, description="environment variable holding an NKey user seed")
    creds_file: str | None = Field(None, description="JWT credentials file (.creds; needs the nkeys package)")

    @model_validator(mode="after")
    def _one_method(self) -> NatsAuthConfig:
        for a, b in (("user", "user_env"), ("password_file", "password_env"), ("token_file", "token_env"),
                     ("nkey_seed_file", "nkey_seed_env")):
            if getattr(self, a) is not None and getattr(self, b) is not None:
                raise ValueError(f"give {a} or {b}, not both")
        user = self.user is not None or self.user_env is not None
        password = self.password_file is not None or self.password_env is not None
        if user != password:
            raise ValueError("user (or user_env) and password_file (or password_env) go together")
        methods = [name for name, on in (
            ("user/password", user),
            ("token", self.token_file is not None or self.token_env is not None),
            ("nkey", self.nkey_seed_file is not None or self.nkey_seed_env is not None),
            ("creds", self.creds_file is not None),
        ) if on]
        if len(methods) != 1:
            raise ValueError(f"give exactly one auth method (user/password, token, nkey or creds), got {methods or 'none'}")
        return self


class NatsConfig(_Strict):
    """The NATS bus of the multi-process deployment (``thunderagent frontend`` / ``worker``)."""

    servers: list[str] = Field(
        default_factory=lambda: ["nats://127.0.0.1:4222"],
        description="server URLs of one cluster (nats:// or tls://); the client fails over between them",
    )
    tls: NatsTlsConfig | None = Field(None, description="TLS settings; tls:// URLs need none with public CAs")
    auth: NatsAuthConfig | None = Field(None, description="credentials; none = an open server")
    index: Literal["replica", "sharded"] = Field(
        "replica", description="replica: every frontend indexes every worker's KV events; sharded: each indexes "
        "the workers it owns (rendezvous over the live frontends) and asks the others at each routing decision")
    lookup_timeout_s: float = Field(0.05, gt=0, le=5, description="sharded: how long a routing decision waits "
                                    "for the other frontends' answers (a late one counts as no match)")

    @model_validator(mode="after")
    def _lookup_needs_sharded(self) -> NatsConfig:
        if self.index != "sharded" and self.lookup_timeout_s != type(self).model_fields["lookup_timeout_s"].default:
            raise ValueError("lookup_timeout_s acts only with index: sharded; set it or remove lookup_timeout_s")
        return self

    @field_validator("servers")
    @classmethod
    def _urls(cls, v: list[str]) -> list[str]:
        if not v:
            raise ValueError("list at least one server URL")
        schemes = set()
        for url in v:
            scheme, sep, rest = url.partition("://")
            if not sep or scheme not in ("nats", "tls") or not rest:
                raise ValueError(f"{url!r} must be nats://HOST:PORT or tls://HOST:PORT")
            if "@" in rest:
                raise ValueError(f"{url!r} carries credentials: put them in nats.auth (read from a file or "
                                 "an environment variable), not in the URL")
            schemes.add(scheme)
        if len(schemes) > 1:
            raise ValueError("mix of nats:// and tls:// URLs: with TLS every server must use it (tls:// or nats.tls)")
        return v
