"""The NATS bus under attack: a forged heartbeat must not end anyone's streams.

A raw nats-py client (no thunderagent code) plays the attacker. First on a permissive bus (no auth:
the frontend's protocol checks alone must hold), then with TLS and per-role users (the server's
permissions refuse the forgery before it reaches anyone)."""

from __future__ import annotations

import asyncio
import ssl
import time

import pytest

nats = pytest.importorskip("nats", reason="the NATS deployment needs the nats extra")

from nats_cluster import Cluster, free_port, wait_until  # noqa: E402  (tests/integration is on sys.path)
from support.nats_secure import secure_bus  # noqa: E402
from thunderagent.bus import wire  # noqa: E402
from thunderagent.bus.nats import BusError, NatsBus  # noqa: E402

pytestmark = [pytest.mark.nats, pytest.mark.integration]

MODEL = "thunderagent-sim"
WORKER = "x-thunderagent-worker"
PROMPT = "a forged heartbeat must not end this story " * 20


def forged_heartbeat(claimed_id: str, instance: str) -> bytes:
    info = wire.WireInfo(claimed_id, "both", "simulated", 64, 8192, 64, 8192)
    load = wire.WireLoad(0.0, 0, 0, 0, 0, 0, 0, 8192)
    return wire.encode(wire.Heartbeat(wire.WIRE_VERSION, instance, info, load, -1))


async def publish_raw(url: str, messages: list[tuple[str, bytes]], subscribe: tuple[str, ...] = (),
                      **connect: object) -> list[str]:
    """Publish (and subscribe) as a bare nats-py client; returns the errors the server sent back."""
    errors: list[str] = []

    async def on_error(exc: Exception) -> None:
        errors.append(str(exc))

    nc = await nats.connect(url, error_cb=on_error, allow_reconnect=False, connect_timeout=2, **connect)
    try:
        for subject in subscribe:
            await nc.subscribe(subject)
        for subject, data in messages:
            await nc.publish(subject, data)
        await nc.flush(timeout=2)
        await asyncio.sleep(0.3)  # a permission violation comes back asynchronously
    finally:
        await nc.close()
    return errors


def streamed_text(stream) -> tuple[str, str | None]:
    text, reason = "", None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].text or ""
            reason = chunk.choices[0].finish_reason or reason
    return text, reason


def test_forged_heartbeat_on_a_permissive_bus_ends_no_stream(tmp_path):
    c = Cluster(tmp_path, heartbeat_interval=0.2, misses=50)  # a 10 s lease: a restart is seen before it ends
    try:
        c.start_nats()
        c.start_worker("a", "--speedup", "0.05")  # streams last seconds
        c.start_frontend("f")
        wait_until(lambda: c.workers("f") == {"a"}, 30, "worker a")
        client = c.client("f")
        raw = client.completions.with_raw_response.create(model=MODEL, prompt=PROMPT, max_tokens=20, stream=True)
        assert raw.headers[WORKER] == "a"
        it = iter(raw.parse())
        first = next(it)
        assert first.choices[0].finish_reason is None
        # the attack: a "restarted" worker a (new instance), and a's subject carrying b's identity
        errors = asyncio.run(publish_raw(c.nats_url, [
            ("ta.worker.a.hello", forged_heartbeat("a", "forged0")),
            ("ta.worker.a.hb", forged_heartbeat("a", "forged1")),
            ("ta.worker.a.hb", forged_heartbeat("b", "forged2")),
        ]))
        assert errors == []  # a permissive bus lets it through: the frontend must ignore it
        text, reason = streamed_text(it)
        text = (first.choices[0].text or "") + text
        assert reason in ("length", "stop"), f"the forged heartbeat ended the stream: {reason}"
        assert c.workers("f") == {"a"}
        health = c.health("f")
        assert health["frontend"]["ignored_messages"].get("identity", 0) >= 1
        assert health["frontend"]["ignored_messages"].get("incarnation", 0) >= 2
        # the right tokens: the same prompt, unattacked, gives the same completion
        again = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20)
        assert again.choices[0].text == text

        # a prompt the bus cannot carry (over 1 MiB as a message) is a clear 400 at once, not a stall
        from openai import BadRequestError

        t0 = time.monotonic()
        with pytest.raises(BadRequestError, match="max_payload"):
            client.completions.create(model=MODEL, prompt="x" * 300_000, max_tokens=4)
        assert time.monotonic() - t0 < 3

        # a real restart still replaces the worker, well within the lease: the old process no longer
        # answers the frontend's ping, so nobody vouches for it
        c.kill("a")
        t0 = time.monotonic()
        c.start_worker("a", "--speedup", "0.05")
        old = health["frontend"]["instances"]["a"]
        wait_until(lambda: c.health("f")["frontend"]["instances"].get("a") not in (None, old),
                   8, "the restarted worker a to replace the old one")
        print(f"\nrestart recognised {time.monotonic() - t0:.2f}s after the kill")
        assert "worker a left: restarted" in (tmp_path / "f.log").read_text()
        assert client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20).choices[0].text == text
    finally:
        c.close()
        print(c.logs())


async def refusal(url: str, **connect: object) -> str:
    """Why a bare client cannot connect ("" if it can)."""
    errors: list[str] = []

    async def on_error(exc: Exception) -> None:
        errors.append(repr(exc))

    try:
        nc = await nats.connect(url, error_cb=on_error, allow_reconnect=False, connect_timeout=2, **connect)
    except Exception as exc:  # noqa: BLE001 - the reason is the result
        return " ".join([*errors, repr(exc)])
    await nc.close()
    return ""


def test_tls_and_per_role_users_refuse_strangers_and_forgeries(tmp_path):
    c = Cluster(tmp_path, heartbeat_interval=0.2, misses=10)
    try:
        sec, conf = secure_bus(tmp_path / "sec", free_port(), password_workers=["a"], nkey_workers=["b"])
        c.start_nats(conf, sec.port, sec.url)
        tls = ssl.create_default_context(cafile=str(sec.pki.ca))
        front = {"user": "frontend", "password": sec.passwords["frontend"]}

        # strangers: no credentials, wrong password, or a client that does not trust the CA
        assert "Authorization Violation" in asyncio.run(refusal(sec.url, tls=tls))
        assert "Authorization Violation" in asyncio.run(refusal(sec.url, tls=tls, user="frontend", password="guess"))
        assert "CERTIFICATE_VERIFY_FAILED" in asyncio.run(refusal(sec.url, **front))
        assert asyncio.run(refusal(sec.url, tls=tls, **front)) == ""
        t0 = time.monotonic()  # our own client fails at once, naming why (it does not retry for 10 s)
        with pytest.raises(BusError, match="refused"):
            asyncio.run(NatsBus(sec.url, "stranger", options={"tls": tls}).connect())
        assert time.monotonic() - t0 < 5

        # the deployment: secrets from the environment (password users) and a seed file (NKey user)
        nats_yaml = f"nats:\n  tls: {{ca_file: '{sec.pki.ca}'}}\n"
        by_env = c.write_config("env.yaml", nats_yaml + "  auth: {user_env: TA_NATS_USER, password_env: TA_NATS_PASSWORD}\n")
        by_seed = c.write_config("b.yaml", nats_yaml + f"  auth: {{nkey_seed_file: '{sec.nkeys['b']}'}}\n")
        c.start_worker("a", "--speedup", "0.05", config=by_env,
                       env={"TA_NATS_USER": "worker-a", "TA_NATS_PASSWORD": sec.passwords["worker-a"]})
        c.start_worker("b", "--speedup", "0.05", config=by_seed)
        c.start_frontend("f", config=by_env,
                         env={"TA_NATS_USER": "frontend", "TA_NATS_PASSWORD": sec.passwords["frontend"]})
        wait_until(lambda: c.workers("f") == {"a", "b"}, 30, "workers a and b over TLS with their own users")
        # the frontend's user may hear the frontends' beats (its own among them): it knows who acts for the planner
        wait_until(lambda: c.health("f")["frontend"]["planner_leadership"]["state"] == "alone", 10,
                   "the frontend to hear its own beat under its user's permissions")
        client = c.client("f")
        before = c.health("f")["frontend"]

        raw = client.completions.with_raw_response.create(model=MODEL, prompt=PROMPT, max_tokens=20, stream=True)
        victim = raw.headers[WORKER]
        attacker = ({"a", "b"} - {victim}).pop()
        as_attacker: dict[str, object] = ({"user": "worker-a", "password": sec.passwords["worker-a"]}
                                          if attacker == "a" else {"nkeys_seed": str(sec.nkeys["b"])})
        it = iter(raw.parse())
        first = next(it)
        assert first.choices[0].finish_reason is None

        # the attacker holds a worker's credentials: the server refuses everything under the victim's
        # name, and what it may say under its own name cannot claim the victim's identity
        errors = asyncio.run(publish_raw(sec.url, [
            (f"ta.worker.{victim}.hello", forged_heartbeat(victim, "forged")),
            (f"ta.reply.{victim}.{before['id']}.x", wire.encode(wire.TokenBatch(1, [], "forged"))),
            ("ta.discover", b""),
            (f"ta.worker.{attacker}.hb", forged_heartbeat(victim, "forged")),
        ], subscribe=(f"ta.rpc.{victim}.*",), tls=tls, **as_attacker))
        violations = [e.lower() for e in errors if "permissions violation" in e.lower()]
        assert len(violations) == len(errors) == 4, errors
        for refused in (f'publish to "ta.worker.{victim}.hello"', f'publish to "ta.reply.{victim}.',
                        'publish to "ta.discover"', f'subscription to "ta.rpc.{victim}.*"'):
            assert any(refused in e for e in violations), (refused, errors)

        text, reason = streamed_text(it)
        text = (first.choices[0].text or "") + text
        assert reason in ("length", "stop"), f"the stream ended with {reason}"
        after = c.health("f")["frontend"]
        assert after["instances"] == before["instances"] and c.workers("f") == {"a", "b"}
        assert after["ignored_messages"] == {"identity": 1}  # the only forgery the server let through
        # a full request through both workers, and the same completion as unattacked
        assert client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20).choices[0].text == text
        served = {client.completions.with_raw_response.create(model=MODEL, prompt=f"{i} {PROMPT}", max_tokens=4)
                  .headers[WORKER] for i in range(6)}
        assert served == {"a", "b"}

        # the request lease: a frontend killed mid-stream leaves no worker generating for nobody
        raw = client.completions.with_raw_response.create(model=MODEL, prompt="long " + PROMPT, max_tokens=500,
                                                          stream=True)
        busy = raw.headers[WORKER]
        assert next(iter(raw.parse())).choices[0].finish_reason is None
        c.kill("f")
        t_kill = time.monotonic()
        wait_until(lambda: "1 requests aborted" in (tmp_path / f"{busy}.log").read_text(), 6,
                   f"worker {busy} to abort the dead frontend's request")
        print(f"\nworker aborted the request {time.monotonic() - t_kill:.2f}s after its frontend died (lease 2 s)")
    finally:
        c.close()
        print(c.logs())
