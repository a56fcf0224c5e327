"""vLLM's speech-to-text paths (``/v1/audio/transcriptions``, ``/translations``) and ``GET /tokenizer_info`` in front
of a fleet of servers: the client's form reaches a server of the model byte for byte but for ``model`` (the
server's own name on a vLLM fleet, the client's on an ``engine: openai`` one), the answer comes back as the server
sent it (JSON, text, an event stream), and a bad form is a 400 that names the field (``frontend/audio_api.py``,
``execution/form_body.py``).

Real sockets on 127.0.0.1: two fake vLLM servers (``support.fake_engine``, which read the form with aiohttp's own
multipart parser), ThunderAgent's real HTTP server, the official ``openai`` client and aiohttp."""

from __future__ import annotations

import json
from pathlib import Path

import aiohttp
import openai
import pytest

from support.fake_engine import FakeEngine, fake_vllm_config
from support.server import relayed_counts, running_server
from support.waiting import wait_until
from thunderagent.config import parse_config

BS = 16
KEY = "sk-tenant-a-0123456789abcdef"
#: audio-like bytes with what a naive form reader would trip on: CRLFs, dashes, a fake boundary, NULs
AUDIO = b"RIFF\x00\x01--\r\n--boundary\r\n\r\nContent-Disposition: x\r\n\xff\xfe" * 700


async def _engines(n: int = 2) -> list[FakeEngine]:
    engines = [FakeEngine(block_size=BS) for _ in range(n)]
    for e in engines:
        await e.start()
    return engines


def _form(fields: dict[str, str], audio: bytes | None = AUDIO) -> aiohttp.FormData:
    form = aiohttp.FormData(default_to_multipart=True)
    if audio is not None:
        form.add_field("file", audio, filename="speech.wav", content_type="audio/wav")
    for k, v in fields.items():
        form.add_field(k, v)
    return form


async def _send(base: str, path: str, data: object, key: str | None = None) -> tuple[int, str, bytes]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with aiohttp.ClientSession() as s, s.post(base + path, data=data, headers=headers) as resp:
        return resp.status, resp.content_type, await resp.read()


@pytest.mark.filterwarnings("ignore:deprecated:DeprecationWarning")  # (the client's translations call)
async def test_transcriptions_and_translations_reach_a_server_of_the_model(tiny_model_dir: Path) -> None:
    engines = await _engines()
    try:
        async with running_server(fake_vllm_config(engines, tiny_model_dir, BS)) as srv:
            await wait_until(lambda: len(srv.fleet.routable()) == 2, 10, "both servers routable")
            model = srv.fleet.model_name
            urls = {e.url for e in engines}
            # the official client: a transcription and a translation, JSON answers
            t = await srv.client.audio.transcriptions.create(model=model, file=("speech.wav", AUDIO), language="en")
            assert t.text.startswith(f"heard {len(AUDIO)} bytes on ") and t.text.endswith(" as fake-model")
            assert t.text.split(" on ")[1].split(" as ")[0] in urls
            tr = await srv.client.audio.translations.create(model=model, file=("speech.wav", AUDIO))
            assert tr.text.startswith(f"heard {len(AUDIO)} bytes")
            sent = [f for e in engines for _, f in e.audio]
            assert len(sent) == 2 and all(f["file"] == AUDIO for f in sent)  # the audio, byte for byte
            first = next(f for e in engines for p, f in e.audio if p == "/v1/audio/transcriptions")
            assert first["model"] == "fake-model" and first["language"] == "en"  # the server's name, the rest as sent
            # text formats come back as text
            status, ctype, body = await _send(srv.base_url, "/v1/audio/transcriptions",
                                              _form({"model": model, "response_format": "srt"}))
            assert status == 200 and ctype == "text/plain" and body.startswith(b"heard ")
            # a stream: the server's events relayed as they come, [DONE] last
            status, ctype, body = await _send(srv.base_url, "/v1/audio/transcriptions",
                                              _form({"model": model, "stream": "true"}))
            assert status == 200 and ctype == "text/event-stream"
            events = [line[6:] for line in body.decode().split("\n") if line.startswith("data: ")]
            assert events[-1] == "[DONE]"
            text = "".join(json.loads(e)["choices"][0]["delta"]["content"] for e in events[:-1])
            assert text.startswith(f"heard {len(AUDIO)} bytes on ") and text.endswith(" as fake-model")
            # no model named: the fleet's; the form's other fields untouched
            status, _, body = await _send(srv.base_url, "/v1/audio/translations", _form({"temperature": "0.2"}))
            assert status == 200 and json.loads(body)["text"].endswith(" as fake-model")
            last = [f for e in engines for p, f in e.audio if f.get("temperature") == "0.2"]
            assert len(last) == 1 and last[0]["model"] == "fake-model" and last[0]["file"] == AUDIO
            counts = relayed_counts(srv.fleet)
            assert counts["v1/audio/transcriptions"] == 3 and counts["v1/audio/translations"] == 2
            # the server's refusal passes as it is, with its status
            status, _, body = await _send(srv.base_url, "/v1/audio/transcriptions", _form({"fail": "1"}))
            assert status == 400 and json.loads(body)["error"]["message"] == "bad audio"
            n = sum(len(e.audio) for e in engines)
            # ours: not a form, a form without a file, a bad flag, an unknown or empty model, a broken form, a query
            async with aiohttp.ClientSession() as s, s.post(srv.base_url + "/v1/audio/transcriptions",
                                                            json={"model": model}) as resp:  # JSON, not a form
                assert resp.status == 415 and (await resp.json())["error"]["code"] == "unsupported_media_type"
            refused = [
                (_form({"model": model}, audio=None), "file"),
                (_form({"stream": "maybe"}), "stream"),
                (_form({"model": " "}), "model"),
            ]
            for data, param in refused:
                async with aiohttp.ClientSession() as s:
                    async with s.post(srv.base_url + "/v1/audio/transcriptions", data=data) as resp:
                        got = await resp.json()
                        assert resp.status == 400 and got["error"]["param"] == param, (param, got)
            status, _, body = await _send(srv.base_url, "/v1/audio/transcriptions", _form({"model": "other"}))
            assert status == 404 and json.loads(body)["error"]["code"] == "model_not_found"
            async with aiohttp.ClientSession() as s:
                broken = b"--xyz\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a\"\r\n\r\nabc"
                async with s.post(srv.base_url + "/v1/audio/transcriptions", data=broken,
                                  headers={"Content-Type": "multipart/form-data; boundary=xyz"}) as resp:
                    got = await resp.json()
                    assert resp.status == 400 and got["error"]["param"] == "file" and "form" in got["error"]["message"]
                async with s.post(srv.base_url + "/v1/audio/transcriptions?language=en",
                                  data=_form({"model": model})) as resp:
                    assert resp.status == 400 and (await resp.json())["error"]["param"] == "language"
            assert sum(len(e.audio) for e in engines) == n  # the refused ones never left
    finally:
        for e in engines:
            await e.stop()


async def test_tokenizer_info_comes_from_a_server(tiny_model_dir: Path) -> None:
    engines = await _engines()
    try:
        async with running_server(fake_vllm_config(engines, tiny_model_dir, BS)) as srv:
            await wait_until(lambda: len(srv.fleet.routable()) == 2, 10, "both servers routable")
            async with aiohttp.ClientSession() as s:
                async with s.get(srv.base_url + "/tokenizer_info") as resp:
                    body = await resp.json()
                    assert resp.status == 200 and body["tokenizer_class"] == "FakeTokenizer"
                    assert body["served_by"] in {e.url for e in engines}
                async with s.get(srv.base_url + f"/tokenizer_info?model={srv.fleet.model_name}") as resp:
                    assert resp.status == 200
                    # ?model is ours: the server is asked without a query
                    assert [q for e in engines for p, q in e.pooled if p == "/tokenizer_info"] == [{}, {}]
                async with s.get(srv.base_url + "/tokenizer_info?model=other") as resp:
                    assert resp.status == 404 and (await resp.json())["error"]["code"] == "model_not_found"
                async with s.get(srv.base_url + "/tokenizer_info?x=1") as resp:
                    assert resp.status == 400 and (await resp.json())["error"]["param"] == "x"
            assert relayed_counts(srv.fleet)["tokenizer_info"] == 2  # (the unknown model was refused before)
    finally:
        for e in engines:
            await e.stop()


@pytest.mark.filterwarnings("ignore:deprecated:DeprecationWarning")
async def test_an_openai_fleet_sends_the_clients_model_and_tenants_are_counted() -> None:
    """``engine: openai``: the form goes byte for byte (the servers check the model); with API keys on, a tenant's
    in-flight and request limits count the audio paths."""
    engines = await _engines(1)
    try:
        cfg = parse_config({
            "model_name": "fake-model",
            "control_plane": {"heartbeat_interval": 0.1, "heartbeat_misses": 5, "api_keys": {KEY: "acme"},
                              "tenant_limits": {"acme": {"requests_per_s": 0.1, "burst": 2}}},
            "execution_group": {"nodes": [{"engine": "openai", "block_size": 16,
                                           "endpoints": [{"url": engines[0].url}]}]},
        }, "test")
        async with running_server(cfg) as srv:
            await wait_until(lambda: len(srv.fleet.routable()) == 1, 10, "the server routable")
            client = openai.AsyncOpenAI(base_url=f"{srv.base_url}/v1", api_key=KEY, max_retries=0)
            try:
                t = await client.audio.transcriptions.create(model="fake-model", file=("a.wav", AUDIO))
                assert t.text.endswith(" as fake-model")
                assert engines[0].audio[-1][1]["model"] == "fake-model"
                # no key: 401; the tenant's burst of 2 spent by the next: a 429
                status, _, _ = await _send(srv.base_url, "/v1/audio/transcriptions", _form({}))
                assert status == 401
                status, _, _ = await _send(srv.base_url, "/v1/audio/transcriptions", _form({}), KEY)
                with pytest.raises(openai.RateLimitError):
                    await client.audio.translations.create(model="fake-model", file=("a.wav", AUDIO))
                assert status == 200 and len(engines[0].audio) == 2
            finally:
                await client.close()
    finally:
        await engines[0].stop()
