"""``control_plane.request_timeout_s``: a request not finished within it is aborted on its worker and answered 504
(a stream already begun ends with an error), never routed again nor migrated; requests within it are untouched.

Real sockets on 127.0.0.1: ThunderAgent's HTTP server in front of simulated workers (the token path) and of
scriptable OpenAI-compatible servers (``support.openai_backend``: the relay), the official ``openai`` client."""

from __future__ import annotations

import time

import aiohttp
import openai
import pytest

from integration.conftest import test_config as make_config
from support.openai_backend import MODEL, OpenAIBackend
from support.server import running_server
from support.waiting import wait_until
from thunderagent.config import parse_config

pytestmark = pytest.mark.integration


def _timeouts(srv) -> float:  # type: ignore[no-untyped-def]
    return next(s.value for m in srv.fleet.metrics.registry.collect() if m.name == "thunderagent_request_timeouts"
                for s in m.samples if s.name.endswith("_total"))


async def test_a_slow_simulated_request_is_cut_at_its_deadline() -> None:
    # speedup 0.5: a decode pass takes tens of ms, so 400 tokens run for seconds; 4 tokens do not
    cfg = make_config(simulation={"speedup": 0.5}, control_plane={"request_timeout_s": 0.6})
    async with running_server(cfg) as srv:
        c, model = srv.client, srv.fleet.model_name
        ok = await c.completions.create(model=model, prompt="quick", max_tokens=4)
        assert ok.choices[0].finish_reason == "length"
        t0 = time.monotonic()
        with pytest.raises(openai.APIStatusError) as cut:
            await c.completions.create(model=model, prompt="a long one", max_tokens=400)
        assert cut.value.status_code == 504 and cut.value.body["code"] == "request_timeout"
        assert "request_timeout_s (0.6 s)" in cut.value.body["message"]
        assert time.monotonic() - t0 < 3.0  # cut at the deadline, not when it would have ended
        # (the simulated text is drawn from the prompt: this one's runs past the deadline, as above)
        stream = await c.completions.create(model=model, prompt="a long one", max_tokens=400, stream=True)
        chunks = [ch async for ch in stream]
        assert chunks[-1].choices[0].finish_reason == "error" and 0 < len(chunks) < 400
        assert _timeouts(srv) == 2
        # aborted on the worker: nothing keeps running there
        await wait_until(lambda: all(w.load.running == 0 for w in srv.fleet.routable()), 5, "the engines idle")


async def test_a_relayed_request_is_cut_and_not_sent_elsewhere() -> None:
    # non-streamed answers come after 3 s, streamed tokens every 0.2 s: both past the 0.5 s deadline
    hung, spare = OpenAIBackend("hung", delay_s=3.0, step_s=0.2), OpenAIBackend("spare", delay_s=3.0, step_s=0.2)
    for b in (hung, spare):
        await b.start()
    try:
        cfg = parse_config({
            "model_name": MODEL, "control_plane": {"heartbeat_interval": 0.1, "heartbeat_misses": 5,
                                                   "request_timeout_s": 0.5},
            "execution_group": {"nodes": [{"engine": "openai", "block_size": 16,
                                           "endpoints": [{"url": b.url} for b in (hung, spare)]}]}}, "test")
        async with running_server(cfg) as srv:
            await wait_until(lambda: len(srv.fleet.routable()) == 2, 10, "servers heartbeat")
            async with aiohttp.ClientSession() as s:
                t0 = time.monotonic()
                async with s.post(srv.base_url + "/v1/completions",
                                  json={"model": MODEL, "prompt": "x", "max_tokens": 3}) as r:
                    body = await r.json()
                assert r.status == 504 and body["error"]["code"] == "request_timeout", body
                assert time.monotonic() - t0 < 3.0
                async with s.post(srv.base_url + "/v1/completions",
                                  json={"model": MODEL, "prompt": "y", "max_tokens": 8, "stream": True}) as r:
                    text = (await r.read()).decode()
                # tokens came, then the deadline: the stream ends with an error event, then [DONE]
                assert r.status == 200 and text.count('"text": "x"') >= 1, text
                assert "request_timeout_s (0.5 s)" in text and text.endswith("data: [DONE]\n\n")
            assert len(hung.bodies) + len(spare.bodies) == 2  # each went to one server only: never routed again
            # aborted: nothing of theirs counts in flight any more
            await wait_until(lambda: all(w.load.running == 0 for w in srv.fleet.routable()), 5, "nothing in flight")
            assert _timeouts(srv) == 2
    finally:
        for b in (hung, spare):
            await b.stop()


def test_the_timeout_must_be_positive() -> None:
    from thunderagent.config import ConfigError

    with pytest.raises(ConfigError, match="request_timeout_s"):
        make_config(control_plane={"request_timeout_s": 0})


async def test_a_request_still_held_at_its_deadline_leaves_the_queue() -> None:
    """One sequence slot: A runs, B (low priority) and then C (high) wait in the holding queue. A is cut at its
    deadline and the freed slot goes to C; B is still held at its own deadline: it leaves the queue with a 504."""
    import asyncio

    cfg = make_config(simulation={"speedup": 0.5}, control_plane={"request_timeout_s": 1.0},
                      execution_group={"nodes": [{"count": 1, "max_batch_size": 1}]})
    async with running_server(cfg) as srv:
        c, model = srv.client, srv.fleet.model_name

        async def ask(delay: float, priority: int) -> int:
            await asyncio.sleep(delay)
            try:
                await c.completions.create(model=model, prompt="a long one", max_tokens=400,
                                           extra_body={"priority": priority})
            except openai.APIStatusError as exc:
                return exc.status_code
            return 200

        t0 = time.monotonic()
        a, b, cc = await asyncio.gather(ask(0.0, 0), ask(0.2, 0), ask(0.4, 5))
        assert (a, b, cc) == (504, 504, 504)
        assert time.monotonic() - t0 < 3.0
        cancelled = srv.fleet.metrics.scheduler_cancelled._value.get()
        assert cancelled == 1  # B left the queue at its deadline (A and C were cut running)
        assert _timeouts(srv) == 3 and len(srv.fleet.dispatcher.queue or ()) == 0
