"""A nats-server with TLS and per-role users, all made at test time: a self-signed CA and a server
certificate for 127.0.0.1 (``openssl`` CLI), random passwords, an NKey user, and the server config
with the permission layout the README documents. Nothing here is stored in the repository."""

from __future__ import annotations

import secrets
import subprocess
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Pki:
    ca: Path
    cert: Path
    key: Path


def make_pki(d: Path) -> Pki:
    """A CA and a server certificate it signs, valid for 127.0.0.1 and localhost for one day."""
    d.mkdir(parents=True, exist_ok=True)

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=d)

    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes")
    openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "1", "-subj", "/CN=ta test ca")
    openssl("req", *ec, "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=127.0.0.1")
    (d / "ext.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n")
    openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", "server.pem", "-days", "1", "-extfile", "ext.cnf")
    return Pki(d / "ca.pem", d / "server.pem", d / "server.key")


def make_nkey_user(d: Path, name: str) -> tuple[str, Path]:
    """A fresh NKey user: its public key (for the server) and its seed file (for the client)."""
    import nkeys

    seed = nkeys.encode_seed(secrets.token_bytes(32), nkeys.PREFIX_BYTE_USER)
    path = d / f"{name}.nk"
    path.write_bytes(seed + b"\n")
    path.chmod(0o600)
    return nkeys.from_seed(seed).public_key.decode(), path


def frontend_permissions(prefix: str = "ta") -> str:
    """A frontend sends RPCs, discovers and beats; it hears every worker and the replies to it, and
    tells the other frontends (and hears from them) which programs their clients released and what
    their tenants used; it hears the other frontends' beats and planner counters (the scaling planner)."""
    return (f'{{publish: {{allow: ["{prefix}.rpc.>", "{prefix}.discover", "{prefix}.frontend.>", '
            f'"{prefix}.programs.>", "{prefix}.tenants.>"]}}, '
            f'subscribe: {{allow: ["{prefix}.worker.>", "{prefix}.reply.>", "{prefix}.programs.>", '
            f'"{prefix}.tenants.>", "{prefix}.frontend.>"]}}}}')


def worker_permissions(wid: str, prefix: str = "ta") -> str:
    """A worker publishes only under its own name and hears only its own RPCs (and discovery)."""
    return (f'{{publish: {{allow: ["{prefix}.worker.{wid}.>", "{prefix}.reply.{wid}.>"]}}, '
            f'subscribe: {{allow: ["{prefix}.rpc.{wid}.*", "{prefix}.discover", "{prefix}.frontend.*.hb"]}}}}')


@dataclass
class SecureBus:
    """Server config (with its port) and every role's credentials."""

    pki: Pki
    port: int
    passwords: dict[str, str] = field(default_factory=dict)  # user -> password
    nkeys: dict[str, Path] = field(default_factory=dict)  # worker id -> seed file

    @property
    def url(self) -> str:
        return f"tls://127.0.0.1:{self.port}"

    def server_conf(self, nkey_publics: dict[str, str]) -> str:
        users = [f'{{user: "frontend", password: "{self.passwords["frontend"]}", '
                 f"permissions: {frontend_permissions()}}}"]
        users += [f'{{user: "{user}", password: "{pw}", permissions: {worker_permissions(user.removeprefix("worker-"))}}}'
                  for user, pw in self.passwords.items() if user.startswith("worker-")]
        users += [f'{{nkey: "{pub}", permissions: {worker_permissions(wid)}}}' for wid, pub in nkey_publics.items()]
        return (f"listen: 127.0.0.1:{self.port}\n"
                f'tls {{ cert_file: "{self.pki.cert}", key_file: "{self.pki.key}", timeout: 2 }}\n'
                "authorization { users: [\n  " + "\n  ".join(users) + "\n] }\n")


def secure_bus(d: Path, port: int, password_workers: list[str], nkey_workers: list[str]) -> tuple[SecureBus, Path]:
    """Credentials for a frontend user and the given workers; returns them and the server config file."""
    bus = SecureBus(make_pki(d / "pki"), port)
    bus.passwords["frontend"] = secrets.token_urlsafe(18)
    for wid in password_workers:
        bus.passwords[f"worker-{wid}"] = secrets.token_urlsafe(18)
    publics = {}
    for wid in nkey_workers:
        publics[wid], bus.nkeys[wid] = make_nkey_user(d, wid)
    conf = d / "nats-server.conf"
    conf.write_text(bus.server_conf(publics))
    conf.chmod(0o600)
    return bus, conf
