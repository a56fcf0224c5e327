"""The multi-process deployment over NATS, as an operator runs it: nats-server, 3 ``thunderagent
worker`` processes and 2 ``thunderagent frontend`` replicas, driven with the official OpenAI client.
A worker is killed and a frontend restarted in the middle."""

from __future__ import annotations

import signal
import time

import pytest

pytest.importorskip("nats", reason="the NATS deployment needs the nats extra")

from nats_cluster import Cluster, cluster, wait_until  # noqa: E402, F401  (on sys.path; cluster: a fixture)

pytestmark = [pytest.mark.nats, pytest.mark.integration]

MODEL = "thunderagent-sim"
WORKER = "x-thunderagent-worker"
# ~1,100 bytes: 17 full 64-token blocks with the byte tokenizer
TEXT = ("The router keeps a map of which worker holds which block of every prompt it has seen, "
        "and it sends each new request where the longest prefix already sits, unless that worker "
        "is drowning. ") * 6


def complete(client, prompt: str, max_tokens: int = 8):
    raw = client.completions.with_raw_response.create(model=MODEL, prompt=prompt, max_tokens=max_tokens)
    body = raw.parse()
    return raw.headers[WORKER], body


def test_two_frontends_three_workers_survive_a_killed_worker_and_a_restarted_frontend(cluster: Cluster):
    cluster.start_nats()
    workers = ["w0", "w1", "w2"]
    for w in workers:
        cluster.start_worker(w)
    cluster.start_frontend("fa")
    cluster.start_frontend("fb")
    for f in ("fa", "fb"):
        wait_until(lambda f=f: cluster.workers(f) == set(workers), 30, f"{f} to discover 3 workers")
    ca, cb = cluster.client("fa"), cluster.client("fb")

    # 1. traffic through both frontends; each conversation lands somewhere
    prompts = [f"Conversation {i}. " + TEXT for i in range(6)]
    home: dict[int, str] = {}
    for i, p in enumerate(prompts):
        home[i], body = complete(ca if i % 2 == 0 else cb, p)
        assert body.choices[0].finish_reason in ("length", "stop") and body.choices[0].text
    assert len(set(home.values())) >= 2, f"6 conversations on one worker: {home}"

    # 2. replicas share the index: the same blocks per worker on both, from the workers' events
    wait_until(lambda: cluster.indexed("fa") == cluster.indexed("fb") and sum(cluster.indexed("fa").values()) > 0,
               5, "both frontends to index the same blocks")

    # 3. the same prompt through the *other* frontend goes to the worker holding it, and hits its cache
    for i, p in enumerate(prompts):
        wid, body = complete(cb if i % 2 == 0 else ca, p)
        assert wid == home[i], f"conversation {i}: first on {home[i]}, repeated via the other frontend on {wid}"
        assert body.usage.prompt_tokens_details.cached_tokens >= 64 * 16
    # streaming through both
    for client in (ca, cb):
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": "stream please " + TEXT}], max_tokens=12, stream=True)
        assert raw.headers[WORKER] in workers
        chunks = list(raw.parse())
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert chunks[-1].choices[0].finish_reason in ("length", "stop")

    # 4. kill a worker that holds conversations: it leaves both fleets, requests keep succeeding
    victim = home[0]
    survivors = set(workers) - {victim}
    cluster.kill(victim)
    t_kill = time.monotonic()
    for i, p in enumerate(prompts):  # at once: some are routed to the dead worker and must be re-routed
        wid, body = complete(ca if i % 2 == 0 else cb, p)
        assert wid in survivors and body.choices[0].finish_reason in ("length", "stop")
        if home[i] == victim:
            home[i] = wid
    for f in ("fa", "fb"):
        wait_until(lambda f=f: cluster.workers(f) == survivors, 5, f"{f} to drop {victim}")
    left_s = time.monotonic() - t_kill
    assert victim not in cluster.indexed("fa") and victim not in cluster.indexed("fb")
    wait_until(lambda: cluster.indexed("fa") == cluster.indexed("fb"), 5, "indexes to agree after the kill")

    # 5. restart frontend B: it rebuilds its index from worker dumps before it serves
    expected = cluster.indexed("fa")
    cluster.kill("fb", signal.SIGTERM)
    t_spawn = time.monotonic()
    cluster.start_frontend("fb")
    health = wait_until(lambda: cluster.health("fb"), 30, "restarted fb to answer /health")
    up_s = time.monotonic() - t_spawn
    rebuild_s = health["frontend"]["index_rebuild_s"]
    assert rebuild_s <= 2.0, f"index rebuilt in {rebuild_s}s"
    got = {w["id"]: w["indexed_blocks"] for w in health["workers"]}
    assert got == expected, f"restarted frontend indexed {got}, the other frontend {expected}"

    # 6. a repeated prompt through the restarted frontend goes to the worker holding it
    cb = cluster.client("fb")
    for i, p in enumerate(prompts):
        wid, body = complete(cb, p)
        assert wid == home[i], f"conversation {i}: on {home[i]}, after the restart routed to {wid}"
        assert body.usage.prompt_tokens_details.cached_tokens >= 64 * 16
    print(f"\nworker left both fleets {left_s:.2f}s after SIGKILL; restarted frontend serving after {up_s:.2f}s "
          f"(process start included), index rebuilt in {rebuild_s:.3f}s")


def test_stopped_worker_drains_and_a_crashed_one_ends_its_streams(tmp_path):
    c = Cluster(tmp_path, heartbeat_interval=0.2, misses=10)  # 2 s lease: a bye is visibly faster
    try:
        c.start_nats()
        for w in ("a", "b"):
            c.start_worker(w, "--speedup", "0.05")  # 20x slower than real time: streams last seconds
        c.start_frontend("f")
        wait_until(lambda: c.workers("f") == {"a", "b"}, 30, "2 workers")
        client = c.client("f")

        # a clean stop (SIGTERM) mid-stream: the worker leaves routing at once, its stream completes
        raw = client.completions.with_raw_response.create(model=MODEL, prompt="a short story " + TEXT,
                                                          max_tokens=20, stream=True)
        stopped = raw.headers[WORKER]
        it = iter(raw.parse())
        assert next(it).choices[0].finish_reason is None
        t0 = time.monotonic()
        c.kill(stopped, signal.SIGTERM, wait=False)
        wait_until(lambda: c.workers("f") == {"a", "b"} - {stopped}, 1.5, "the stopped worker to leave")
        assert time.monotonic() - t0 < 1.5
        rest = list(it)
        assert rest[-1].choices[0].finish_reason in ("length", "stop")
        wait_until(lambda: c.exited(stopped), 10, "the stopped worker to exit after draining")

        # a crash mid-stream: the client gets a finish_reason within the lease, never a hang
        (survivor,) = c.workers("f")
        stream = client.completions.create(model=MODEL, prompt="tell me a long story " + TEXT, max_tokens=500,
                                           stream=True)
        it = iter(stream)
        assert next(it).choices[0].finish_reason is None
        c.kill(survivor)
        t_kill = time.monotonic()
        rest = list(it)
        waited = time.monotonic() - t_kill
        assert rest[-1].choices[0].finish_reason == "error"
        assert waited < 2.0 + 3.0, f"stream ended {waited:.1f}s after the worker died"

        # no worker left: a clear 503, not a hang
        from openai import APIStatusError

        wait_until(lambda: not c.workers("f"), 5, "the crashed worker to leave")
        with pytest.raises(APIStatusError) as err:
            client.completions.create(model=MODEL, prompt="anyone?", max_tokens=4)
        assert err.value.status_code == 503
    finally:
        c.close()
        print(c.logs())  # captured: pytest shows it only when the test failed


def test_a_program_released_through_any_frontend_is_released_on_every_frontend(cluster: Cluster):
    """Each frontend keeps its own program table: a release through one frontend reaches the copies
    the others hold (``ta.programs.release``), and is a 404 only when no frontend held the program."""
    import json
    import urllib.error
    import urllib.request

    cluster.start_nats()
    cluster.start_worker("w0")
    for f in ("fa", "fb"):
        cluster.start_frontend(f)
    for f in ("fa", "fb"):
        wait_until(lambda f=f: cluster.workers(f) == {"w0"}, 30, f"{f} to discover its worker")

    def step(f: str, program: str) -> None:
        cluster.client(f).completions.create(model=MODEL, prompt=f"{program} " + TEXT, max_tokens=2,
                                             extra_headers={"x-thunderagent-program-id": program})

    def programs(f: str) -> list[str]:
        with urllib.request.urlopen(f"http://127.0.0.1:{cluster.ports[f]}/v1/programs", timeout=5) as r:
            return sorted(p["id"] for p in json.loads(r.read())["data"])

    def release(f: str, program: str, paper_form: bool = False) -> int:
        url = f"http://127.0.0.1:{cluster.ports[f]}" + ("/programs/release" if paper_form
                                                         else f"/v1/programs/{program}/release")
        body = json.dumps({"program_id": program}).encode() if paper_form else b""
        req = urllib.request.Request(url, data=body, method="POST", headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=5) as r:
                assert json.loads(r.read())["released"] is True
                return r.status
        except urllib.error.HTTPError as e:
            return e.code

    step("fa", "both")
    step("fb", "both")  # no sticky balancing: a copy on each frontend
    step("fa", "only-a")
    assert (programs("fa"), programs("fb")) == (["both", "only-a"], ["both"])
    assert release("fb", "only-a") == 200  # fb never saw it: fa held it, and released it
    assert release("fa", "both", paper_form=True) == 200  # fa's copy, and fb's
    wait_until(lambda: programs("fa") == [] and programs("fb") == [], 5, "every copy released")
    assert release("fb", "never-seen") == 404 and release("fa", "both") == 404
    assert cluster.health("fb")["frontend"]["programs_released_for_peers"] == 1
    assert cluster.health("fa")["frontend"]["programs_released_for_peers"] == 1


def test_tenant_limits_hold_across_the_frontends(cluster: Cluster):
    """Each frontend reports its tenants' use on ``ta.tenants.usage`` and takes the others' reports:
    a tenant's burst spent through one frontend is spent on the other, a request in flight through
    one counts against ``max_in_flight`` on the other, and so does a program with a request in flight
    against ``max_programs``."""
    import json
    import urllib.error
    import urllib.request

    import openai

    keys = {"acme": "k-acme-0123456789abcdef", "initech": "k-initech-0123456789abc",
            "globex": "k-globex-0123456789abcd", "hooli": "k-hooli-0123456789abcde"}
    admin = "k-admin-0123456789abcdef"
    limits = "{acme: {requests_per_s: 0.02, burst: 2}, initech: {max_in_flight: 1}, hooli: {max_programs: 1}}"
    cfg = cluster.tmp / "tenants.yaml"
    # a slow engine (0.1x): a stream lasts seconds, whatever its natural length (16 tokens at least)
    cfg.write_text(cluster.config.read_text().replace(
        "control_plane: {", "control_plane: {api_keys: {" + ", ".join(f"{k}: {t}" for t, k in keys.items())
        + f"}}, admin_keys: [{admin}], tenant_limits: {limits}, ").replace("speedup: 10.0", "speedup: 0.1"))

    def health(f: str) -> dict:  # the detail needs the admin key
        req = urllib.request.Request(f"http://127.0.0.1:{cluster.ports[f]}/health",
                                     headers={"Authorization": "Bearer " + admin})
        try:
            with urllib.request.urlopen(req, timeout=5) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as err:  # 503 while no worker: still a summary
            return json.load(err)

    cluster.start_nats()
    cluster.start_worker("w0", config=cfg)
    for f in ("fa", "fb"):
        cluster.start_frontend(f, config=cfg)
    for f in ("fa", "fb"):
        wait_until(lambda f=f: {w["id"] for w in health(f).get("workers", [])} == {"w0"}, 30,
                   f"{f} to discover its worker")

    def client(f: str, tenant: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"http://127.0.0.1:{cluster.ports[f]}/v1", api_key=keys[tenant],
                             max_retries=0, timeout=30)

    def ask(f: str, tenant: str) -> None:
        client(f, tenant).completions.create(model=MODEL, prompt=TEXT, max_tokens=2)

    ask("fa", "acme")
    ask("fb", "acme")  # the burst of 2, one through each frontend
    time.sleep(0.5)  # a few reports
    for f in ("fa", "fb"):  # each frontend alone would still hold a token
        with pytest.raises(openai.RateLimitError) as exc:
            ask(f, "acme")
        assert exc.value.body["code"] == "rate_limit_exceeded"
    ask("fb", "globex")  # other tenants are not limited by acme's use

    stream = client("fa", "initech").completions.create(model=MODEL, prompt=TEXT, max_tokens=4000, stream=True)
    next(iter(stream))
    time.sleep(0.5)
    with pytest.raises(openai.RateLimitError) as exc:
        ask("fb", "initech")
    assert exc.value.body["code"] == "too_many_requests_in_flight"
    stream.close()

    def admitted() -> bool:
        try:
            ask("fb", "initech")
        except openai.RateLimitError:
            return False
        return True

    wait_until(admitted, 10, "the stream's end to reach the other frontend")

    # max_programs: a program with a request in flight through one frontend fills hooli's cap on the other
    program = client("fa", "hooli").completions.create(model=MODEL, prompt=TEXT, max_tokens=4000, stream=True,
                                                       extra_headers={"x-thunderagent-program-id": "p1"})
    next(iter(program))
    time.sleep(0.5)
    with pytest.raises(openai.RateLimitError) as exc:
        client("fb", "hooli").completions.create(model=MODEL, prompt=TEXT, max_tokens=2,
                                                 extra_headers={"x-thunderagent-program-id": "p2"})
    assert exc.value.body["code"] == "too_many_programs" and "1 at the other frontends" in exc.value.body["message"]
    program.close()

    def second_program() -> bool:
        try:
            client("fb", "hooli").completions.create(model=MODEL, prompt=TEXT, max_tokens=2,
                                                     extra_headers={"x-thunderagent-program-id": "p2"})
        except openai.RateLimitError:
            return False
        return True

    wait_until(second_program, 10, "p1's end to reach the other frontend")

    for f in ("fa", "fb"):
        got = health(f)["frontend"]["tenant_reports"]
        assert got["sent"] > 0 and got["taken"] > 0, (f, got)


def one_worker_two_frontends(cluster: Cluster, config) -> None:  # noqa: ANN001
    """nats-server, worker w0, then frontends fa and fb (fa the older), each having found w0."""
    cluster.start_nats()
    cluster.start_worker("w0", config=config)
    cluster.start_frontend("fa", config=config)
    wait_until(lambda: cluster.workers("fa") == {"w0"}, 30, "fa to discover its worker")
    cluster.start_frontend("fb", config=config)
    wait_until(lambda: cluster.workers("fb") == {"w0"}, 30, "fb to discover its worker")


_RECORD_PID = "import os, sys; open(sys.argv[1], 'a').write(f'{os.getppid()} {sys.argv[2]} {sys.argv[3]}\\n')"


def test_one_frontend_acts_for_the_planner_and_the_next_oldest_takes_over_when_it_dies(cluster: Cluster):
    """Both frontends run the planner on the fleet's traffic (each adds the other's counters); only the oldest
    runs the command (the other one records its step as not acted on). All traffic goes through the other
    one here: the oldest acts on what it hears of it. When the oldest is killed, the other acts one lease later."""
    import json
    import sys
    import urllib.request

    calls = cluster.tmp / "calls.txt"
    planner = {"enabled": True, "interval_s": 0.1, "window_s": 0.5, "cooldown_s": 0.5, "warm_requests": 1,
               "up_ttft_s": 0.0001, "down_ttft_s": 0.0, "command": [sys.executable, "-c", _RECORD_PID, str(calls)]}
    config = cluster.write_config("planner.yaml", f"planner: {json.dumps(planner)}\n")
    one_worker_two_frontends(cluster, config)

    def planner_view(f: str) -> dict:
        with urllib.request.urlopen(f"http://127.0.0.1:{cluster.ports[f]}/v1/planner", timeout=5) as r:
            return json.loads(r.read())

    def states() -> tuple[str, str]:
        return planner_view("fa")["leadership"]["state"], planner_view("fb")["leadership"]["state"]

    wait_until(lambda: states() == ("leader", "follower"), 15, "fa (the older) to lead, fb to follow")
    fa_id = planner_view("fa")["leadership"]["id"]
    assert planner_view("fb")["leadership"]["leader"] == fa_id
    assert (planner_view("fa")["acting"], planner_view("fb")["acting"]) == (True, False)

    def load(fronts: tuple[str, ...], until) -> None:  # noqa: ANN001
        end = time.monotonic() + 30
        i = 0
        while not until():
            assert time.monotonic() < end, "timed out"
            for f in fronts:
                complete(cluster.client(f), f"{i} {f} " + TEXT, max_tokens=2)
            i += 1

    def pids() -> list[int]:
        return [int(line.split()[0]) for line in calls.read_text().splitlines()] if calls.exists() else []

    def not_acted(f: str) -> list[dict]:
        return [a for a in planner_view(f)["actions"] if a["kind"] == "not_acted"]

    load(("fb",), lambda: len(pids()) >= 2 and not_acted("fb"))  # fa routes nothing, and acts on fb's traffic
    fb_id = planner_view("fb")["leadership"]["id"]
    assert cluster.health("fa")["frontend"]["planner_counters_from"] == [fb_id]
    assert set(pids()) == {cluster.procs["fa"].pid}, "only the leader runs the command"
    assert calls.read_text().splitlines()[0].split()[1:] == ["both", "+1"]
    assert not_acted("fb")[0]["leader"] == fa_id and not_acted("fb")[0]["delta"] == 1
    assert not_acted("fa") == []

    cluster.kill("fa")
    wait_until(lambda: planner_view("fb")["leadership"]["state"] == "alone", 10, "fb to find itself alone")
    load(("fb",), lambda: cluster.procs["fb"].pid in pids())
    assert set(pids()) == {cluster.procs["fa"].pid, cluster.procs["fb"].pid}


def test_one_frontend_plans_cache_migrations_copies_and_the_other_takes_over_when_it_dies(cluster: Cluster):
    """``routing.migration`` on two frontends: one migrator plans the copies (the older frontend; two would copy
    the same hot prefix twice), the other shows ``planning: false``; when the older one is killed the other plans
    one lease later; each hears the other's demand reports. The migrator's own decisions are tested elsewhere
    (``test_cache_migration_live.py``, ``tests/unit/test_migration_demand.py``)."""
    mig = "migration: {enabled: true, link: {enabled: true, sim_block_bytes: 4096}}"
    base = cluster.config.read_text()
    assert "routing: {seed: 7}" in base
    config = cluster.tmp / "migration.yaml"
    config.write_text(base.replace("routing: {seed: 7}", f"routing: {{seed: 7, {mig}}}"))
    one_worker_two_frontends(cluster, config)

    def planning() -> tuple[bool, bool]:
        return tuple(cluster.health(f)["cache_migration"]["planning"] for f in ("fa", "fb"))  # type: ignore[return-value]

    wait_until(lambda: planning() == (True, False), 15, "fa (the older) to plan the copies, fb to hold")
    ids = {f: cluster.health(f)["frontend"]["planner_leadership"]["id"] for f in ("fa", "fb")}
    # each reports its own demand every look (routing.migration.interval_s): fa plans on fb's requests too
    wait_until(lambda: cluster.health("fa")["cache_migration"]["demand_from"] == [ids["fb"]], 15,
               "fa to hear fb's demand reports")
    assert cluster.health("fb")["cache_migration"]["demand_from"] == [ids["fa"]]
    cluster.kill("fa")
    wait_until(lambda: cluster.health("fb")["cache_migration"]["planning"], 15, "fb to plan once fa is gone")


def test_a_sharded_index_splits_the_workers_and_routes_on_the_other_frontends_answers(cluster: Cluster):
    """``nats.index: sharded``: each worker's events are indexed by one frontend (rendezvous over the live
    frontends); a prompt sent first through one frontend and continued through the other goes back to the
    worker holding it, from the other frontend's answer; when one frontend dies, the survivor indexes all."""
    config = cluster.write_config("sharded.yaml", "nats: {index: sharded, lookup_timeout_s: 0.5}\n")
    cluster.start_nats()
    workers = {f"w{i}" for i in range(4)}
    for w in sorted(workers):
        cluster.start_worker(w, config=config)
    for f in ("fa", "fb"):
        cluster.start_frontend(f, config=config)
    for f in ("fa", "fb"):
        wait_until(lambda f=f: cluster.workers(f) == workers, 30, f"{f} to discover its workers")

    def index(f: str) -> dict:
        return cluster.health(f)["frontend"]["index"]

    def split() -> bool:
        a, b = index("fa"), index("fb")
        return len(a["frontends"]) == 2 and a["frontends"] == b["frontends"] and \
            set(a["owned"]) | set(b["owned"]) == workers and not set(a["owned"]) & set(b["owned"])

    wait_until(split, 15, "the two frontends to split the workers between them")
    # frontend ids are random: one of them may own all four; more workers until each owns some
    while not all(index(f)["owned"] for f in ("fa", "fb")):
        assert len(workers) < 16, "16 workers and one frontend owns them all: rendezvous hashing is broken"
        workers.add(f"w{len(workers)}")
        cluster.start_worker(f"w{len(workers) - 1}", config=config)
        wait_until(lambda: split() and cluster.workers("fa") == workers, 30, "the new worker to be split too")
    owned = {f: set(index(f)["owned"]) for f in ("fa", "fb")}

    remote = []  # conversations whose holder fb does not index: their next turn needs fa's answer
    for i in range(40):  # each conversation's first turn through fa, its second through fb
        first = f"conversation {i} " + TEXT
        w1, _ = complete(cluster.client("fa"), first, max_tokens=4)
        wait_until(lambda w1=w1: cluster.indexed("fa" if w1 in owned["fa"] else "fb")[w1] > 0, 10,
                   "the holder's owner to index its blocks")
        w2, body = complete(cluster.client("fb"), first + " and then some more words", max_tokens=4)
        assert w2 == w1, f"turn 2 went to {w2}, its history is on {w1}"
        if w1 in owned["fa"]:
            remote.append(w1)
        if len(remote) >= 3 and i >= 5:
            break
    assert len(remote) >= 3, "conversations did not land on workers fb does not own: the lookup path was not run"
    assert index("fb")["answered"] > 0 and index("fa")["answered_for_peers"] > 0
    assert index("fb")["late"] == 0
    import re
    import urllib.request

    def metric(f: str, name: str) -> float:
        with urllib.request.urlopen(f"http://127.0.0.1:{cluster.ports[f]}/metrics", timeout=5) as r:
            text = r.read().decode()
        m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
        assert m, f"{name} not exported by {f}"
        return float(m.group(1))

    assert metric("fb", 'thunderagent_index_lookups_total{outcome="answered"}') == index("fb")["answered"]
    assert metric("fa", "thunderagent_index_lookups_served_total") == index("fa")["answered_for_peers"]
    assert metric("fb", "thunderagent_index_owned_workers") == len(owned["fb"])

    cluster.kill("fa")
    wait_until(lambda: set(index("fb")["owned"]) == workers, 15, "fb to index every worker once fa is gone")
    held = remote[0]
    wait_until(lambda: cluster.indexed("fb")[held] > 0, 10, f"fb to dump {held}'s cache")


def test_a_stopped_frontend_lets_its_streams_finish(tmp_path):
    """SIGTERM to a `thunderagent frontend` (a rolling update): its listener closes and the streams it relays finish
    (control_plane.shutdown_timeout_s) before it exits."""
    c = Cluster(tmp_path, heartbeat_interval=0.2, misses=10)
    try:
        c.start_nats()
        c.start_worker("w0", "--speedup", "0.05")  # 20x slower than real time: the stream lasts seconds
        c.start_frontend("f")
        wait_until(lambda: c.workers("f") == {"w0"}, 30, "the worker")
        stream = c.client("f").completions.create(model=MODEL, prompt="a slow story " + TEXT, max_tokens=24,
                                                  stream=True)
        n, finish, stopped = 0, None, 0.0
        for chunk in stream:
            for choice in chunk.choices:
                n += bool(choice.text)
                finish = choice.finish_reason or finish
            if n and not stopped:
                c.kill("f", signal.SIGTERM, wait=False)
                stopped = time.monotonic()
        assert (n, finish) == (24, "length") and time.monotonic() - stopped > 0.5, c.logs()
        assert c.procs["f"].wait(30) == 0
    finally:
        c.close()
