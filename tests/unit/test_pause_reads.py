"""The load poller's reading of vLLM's ``GET /is_paused`` (``execution/engine_poll.py``): the pause mark follows it
while the server is awake, a poll begun before a call through ThunderAgent is not applied, and a server that has no
such path of vLLM's (a 404, a page that is not JSON, an answer of another shape) is not asked again."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import aiohttp
import pytest
from yarl import URL

from support.callbacks import Recorder
from thunderagent.execution.engine_metrics import VLLM, EngineStats
from thunderagent.execution.engine_poll import EnginePoller


class _Answers:
    """``get_json`` answers ``answer`` (an exception is raised)."""

    def __init__(self, answer: Any) -> None:
        self.answer, self.asked = answer, 0

    async def get_json(self, url: str, timeout: float) -> Any:
        assert url == "http://x/is_paused"
        self.asked += 1
        if isinstance(self.answer, BaseException):
            raise self.answer
        return self.answer


def _poller(transport: _Answers) -> tuple[EnginePoller, list[bool]]:
    seen: list[bool] = []
    cb = replace(Recorder().callbacks(), on_paused=lambda wid, paused: seen.append(paused))
    p = EnginePoller("w", "http://x", 16, VLLM, transport, cb, interval=0.1, connect_timeout=1.0,  # type: ignore[arg-type]
                     load=lambda: None, on_restart=lambda: None, in_flight=list)  # type: ignore[arg-type,return-value]
    return p, seen


def _status(status: int) -> aiohttp.ClientResponseError:
    info = aiohttp.RequestInfo(URL("http://x/is_paused"), "GET", {}, URL("http://x/is_paused"))  # type: ignore[arg-type]
    return aiohttp.ClientResponseError(info, (), status=status)


async def test_the_mark_follows_is_paused_while_awake_and_not_from_a_stale_poll() -> None:
    t = _Answers({"is_paused": True})
    p, seen = _poller(t)
    p.pause_seen(await p._paused(1.0), 0)
    assert seen == [True]
    p.stats = EngineStats(asleep=True)  # asleep: vLLM says paused too; that is the sleep mark's
    p.pause_seen(await p._paused(1.0), 0)
    assert seen == [True]
    p.stats = EngineStats(asleep=False)
    p.marks_changed()  # a pause or resume through ThunderAgent was answered: a poll begun at epoch 0 is stale
    t.answer = {"is_paused": False}
    p.pause_seen(await p._paused(1.0), 0)
    assert seen == [True]
    p.pause_seen(await p._paused(1.0), 1)
    assert seen == [True, False] and p.reads_pause


@pytest.mark.parametrize("answer", [_status(404), _status(405), _status(200), ValueError("not JSON"),
                                    {"paused": True}, ["is_paused"]])
async def test_a_server_without_vllms_path_is_asked_once(answer: Any) -> None:
    t = _Answers(answer)
    p, seen = _poller(t)
    assert await p._paused(1.0) is None and not p.reads_pause and t.asked == 1 and seen == []
    p.on_stats(EngineStats(start_time=1.0))
    p.on_stats(EngineStats(start_time=2.0))  # restarted: the new process may serve it
    assert p.reads_pause


@pytest.mark.parametrize("answer", [_status(500), _status(503), aiohttp.ClientConnectionError("reset"),
                                    TimeoutError()])
async def test_a_failing_answer_is_asked_again(answer: Any) -> None:
    t = _Answers(answer)
    p, _ = _poller(t)
    assert await p._paused(1.0) is None and p.reads_pause
