"""Requests to one engine server (vLLM, SGLang) and the in-flight accounting of its worker's load.

A request is ``POST {url}/v1/completions`` with the prompt as *token ids* (tokenized by our frontend
with the model's tokenizer and chat template, so our block hashes describe exactly the tokens the
engine caches), streamed back (SSE) with the engine's text, token ids and, at the end,
``usage.prompt_tokens_details.cached_tokens`` (vLLM: only with ``--enable-prompt-tokens-details``).
Its outputs go to the request's :class:`~thunderagent.execution.handle.OutputQueue`.

Prefill/decode disaggregation (vLLM's NixlConnector, the protocol of vLLM's own disaggregation
proxy): a ``remote_decode`` request is sent as the *prefill* request (``stream: false``,
``max_tokens: 1``, ``kv_transfer_params`` asking for a remote decode); its JSON answer carries the
engine's ``kv_transfer_params`` (where the decode server pulls the KV from), returned on the finished
output as a :class:`~thunderagent.types.KvTransfer` with the object as JSON text. A ``kv_from``
request is the normal streamed request plus those ``kv_transfer_params`` unchanged; when they are
missing or not a JSON object it goes without them and the engine computes the prompt itself.

A request the engine did not take before any output (connection refused, 5xx) ends
``finish_reason="unavailable"``, which the fleet routes again to another worker; one the engine
rejected (4xx) or that failed after it started ends ``"error"``.

The in-flight totals count a request from the moment it is dispatched (the engine's own numbers are
up to one poll old); they are kept incrementally because the worker's load is read on every routing
decision.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterable, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import msgspec

from thunderagent.execution.engine_metrics import EngineFlavor
from thunderagent.execution.handle import OutputQueue
from thunderagent.execution.http_transport import HttpTransport, TransportConnectionError, TransportError
from thunderagent.types import EngineRequest, FinishReason, KvTransfer, TokenOutput

log = logging.getLogger(__name__)

_json = msgspec.json.Decoder()
#: finish reasons an engine may report that we pass on as they are (others count as "stop")
_REASONS = frozenset(r.value for r in FinishReason)
#: what a prefill request asks of vLLM: keep the prompt's KV for a decode server to pull (the
#: remote_* fields are the decode side's, unknown yet)
REMOTE_DECODE_PARAMS: dict[str, Any] = {
    "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None, "remote_block_ids": None,
    "remote_host": None, "remote_port": None,
}


@dataclass(slots=True, eq=False)
class Inflight:
    req: EngineRequest
    queue: OutputQueue
    expected_hit_tokens: int  # prompt tokens the engine holds per its events, at dispatch
    started: bool = False  # first output seen (prefill done)
    generated: int = 0
    task: asyncio.Task[None] | None = field(default=None, repr=False)


def request_body(req: EngineRequest, model: str, flavor: EngineFlavor, *,
                 send_priority: bool = False) -> dict[str, Any]:
    """The JSON body of ``POST /v1/completions`` for ``req``.

    ``send_priority`` (a vLLM server started with ``--scheduling-policy priority``): vLLM's ``priority``
    field, our priority negated, since vLLM serves *lower* values first and we serve higher ones
    first. Without it nothing is sent: vLLM refuses a non-zero priority under its default fcfs policy
    (HTTP 400 "Priority scheduling is not enabled")."""
    body: dict[str, Any] = {
        "model": req.lora_name or model,
        "prompt": req.prompt_tokens,
        "max_tokens": req.max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if flavor.return_token_ids:
        body["return_token_ids"] = True
    if req.ignore_eos:
        body["ignore_eos"] = True
    if req.cache_salt:
        body["cache_salt"] = req.cache_salt
    if send_priority and req.priority:  # 0 is vLLM's default too
        body["priority"] = -req.priority
    if req.sampling is not None:  # only what the client set: vLLM's defaults otherwise
        for key in ("temperature", "top_p", "seed"):
            value = getattr(req.sampling, key)
            if value is not None:
                body[key] = value
    if req.remote_decode:  # the prefill half: one token, one JSON answer carrying the transfer
        body["stream"] = False
        body["max_tokens"] = 1
        del body["stream_options"]
        body["kv_transfer_params"] = dict(REMOTE_DECODE_PARAMS)
    elif req.kv_from is not None:
        params = engine_params(req.kv_from)
        if params is not None:
            body["kv_transfer_params"] = params
    return body


def engine_params(t: KvTransfer) -> dict[str, Any] | None:
    """The engine's transfer object of ``t``, or None (logged) when it is missing or garbled: the
    decode request then goes without it, and the engine computes the prompt itself."""
    try:
        params = json.loads(t.engine_params) if t.engine_params is not None else None
    except ValueError:
        params = None
    if not isinstance(params, dict):
        log.warning("KV transfer from %s carries no usable kv_transfer_params (%.80r): prefilling locally",
                    t.source_worker, t.engine_params)
        return None
    return params


class RequestStreamer:
    """The requests in flight on one engine server.

    ``clock`` is the control plane's clock (queue liveness), ``loop_time`` the event loop's (output
    time stamps); ``served_model`` gives the model name to send, ``on_lost`` reports a server that
    refused a connection, ``on_change`` is called whenever the in-flight totals changed.
    """

    def __init__(
        self,
        worker_id: str,
        url: str,
        flavor: EngineFlavor,
        transport: HttpTransport,
        *,
        clock: Callable[[], float],
        loop_time: Callable[[], float],
        served_model: Callable[[], Awaitable[str]],
        on_lost: Callable[[str], None],
        on_change: Callable[[], None],
        send_priority: bool = False,
    ) -> None:
        self.worker_id = worker_id
        self.send_priority = send_priority  # see request_body
        self.url = url
        self.flavor = flavor
        self._transport = transport
        self._clock = clock
        self._loop_time = loop_time
        self._served_model = served_model
        self._on_lost = on_lost
        self._on_change = on_change
        self._reqs: dict[str, Inflight] = {}
        #: serves requests that carry the client's own body (``EngineRequest.passthrough``): the
        #: ``engine: openai`` worker sets it (``execution/openai_relay.py``); None: they are refused
        self.relay: Callable[[Inflight], Awaitable[None]] | None = None
        self.n_started = 0
        self.queued_tokens = 0  # prompt tokens of requests not started, less their expected hits
        self.decode_tokens = 0  # sequence lengths of started requests

    def __len__(self) -> int:
        return len(self._reqs)

    def queues(self) -> Iterator[OutputQueue]:
        return (r.queue for r in self._reqs.values())

    # -- dispatch and cancel -----------------------------------------------------------------
    def submit(self, req: EngineRequest, expected_hit_tokens: int) -> OutputQueue:
        q = OutputQueue(self._clock())
        r = Inflight(req, q, expected_hit_tokens)
        self._reqs[req.request_id] = r
        self.queued_tokens += len(req.prompt_tokens) - r.expected_hit_tokens
        r.task = asyncio.create_task(self._generate(r), name=f"req-{req.request_id}")
        self._on_change()
        return q

    def abort(self, request_id: str) -> None:
        r = self._drop(request_id)
        if r is not None and r.task is not None:
            r.task.cancel()  # closes the HTTP stream: the engine aborts the request

    async def abort_all(self) -> None:
        """End every request in flight with ``abort`` (the worker is stopping)."""
        pending = []
        for rid in list(self._reqs):
            r = self._drop(rid)
            assert r is not None
            if r.task is not None:
                r.task.cancel()
                pending.append(r.task)
            r.queue.put_output(self._final(r, [], None, FinishReason.ABORT, 0), self._clock())
        await asyncio.gather(*pending, return_exceptions=True)

    # -- in-flight accounting ----------------------------------------------------------------
    def _progress(self, r: Inflight, n_tokens: int) -> None:
        """``r`` produced ``n_tokens`` (its first output moves it from queued to decoding)."""
        if not r.started:
            r.started = True
            if self._reqs.get(r.req.request_id) is r:
                self.n_started += 1
                self.queued_tokens -= len(r.req.prompt_tokens) - r.expected_hit_tokens
                self.decode_tokens += len(r.req.prompt_tokens)
                self._on_change()
        r.generated += n_tokens
        if self._reqs.get(r.req.request_id) is r:
            self.decode_tokens += n_tokens

    def _drop(self, request_id: str) -> Inflight | None:
        r = self._reqs.pop(request_id, None)
        if r is not None:
            if r.started:
                self.n_started -= 1
                self.decode_tokens -= len(r.req.prompt_tokens) + r.generated
            else:
                self.queued_tokens -= len(r.req.prompt_tokens) - r.expected_hit_tokens
            self._on_change()
        return r

    # -- the HTTP exchange -------------------------------------------------------------------
    async def _generate(self, r: Inflight) -> None:
        req = r.req
        try:
            if req.passthrough is not None:
                if self.relay is None:  # a caller bug: only engine openai fleets relay
                    log.error("%s cannot relay request %s (engine %s)", self.worker_id, req.request_id,
                              self.flavor.name)
                    self._end(r, FinishReason.ERROR)
                else:
                    await self.relay(r)
                return
            model = await self._served_model()
            body = request_body(req, model, self.flavor, send_priority=self.send_priority)
            async with self._transport.stream_post(f"{self.url}/v1/completions", body, req.headers) as resp:
                if resp.status != 200:
                    detail = (await resp.text())[:300]
                    log.warning("%s refused request %s: HTTP %d %s", self.worker_id, req.request_id,
                                resp.status, detail)
                    self._end(r, FinishReason.UNAVAILABLE if resp.status >= 500 else FinishReason.ERROR)
                    return
                r.queue.accepted = True
                if req.remote_decode:
                    self._read_prefill(_json.decode(await resp.text()), r)
                else:
                    await self._read_stream(resp.lines(), r)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if not isinstance(exc, (TransportError, TimeoutError, msgspec.DecodeError)):
                # a bug of ours, not the server's: said loudly, and the request ends now (not at the stall bound)
                log.exception("%s: request %s failed", self.worker_id, req.request_id)
                self._end(r, FinishReason.ERROR)
                return
            if r.started:
                log.warning("%s: request %s broke off: %r", self.worker_id, req.request_id, exc)
                self._end(r, FinishReason.ERROR)
            else:
                if isinstance(exc, TransportConnectionError) and not isinstance(exc, TimeoutError):
                    # refused, reset, server gone
                    self._on_lost(f"request {req.request_id} failed: {exc!r}")
                else:
                    log.warning("%s: request %s failed: %r", self.worker_id, req.request_id, exc)
                self._end(r, FinishReason.UNAVAILABLE)
        finally:
            if self._reqs.get(req.request_id) is r:
                self._drop(req.request_id)

    async def _read_stream(self, lines: AsyncIterable[bytes], r: Inflight) -> None:
        clock = self._clock
        rid = r.req.request_id
        n_prompt = len(r.req.prompt_tokens)
        final: tuple[list[int], str, str] | None = None
        cached = 0
        reported: int | None = None  # usage.completion_tokens
        done = False
        async for line in lines:
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                done = True
                break
            chunk = _json.decode(data)
            if "error" in chunk:
                log.warning("%s: request %s failed in the engine: %s", self.worker_id, rid, chunk["error"])
                self._end(r, FinishReason.ERROR)
                return
            usage = chunk.get("usage")
            if usage:
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                reported = usage.get("completion_tokens")
            for choice in chunk.get("choices") or ():
                text = choice.get("text") or ""
                ids = choice.get("token_ids")
                if ids is None:  # engine without token ids in the stream: one token per chunk
                    ids = [-1] if text else []
                reason = choice.get("finish_reason")
                if reason is not None:
                    final = (ids, text, FinishReason(reason) if reason in _REASONS else FinishReason.STOP)
                elif ids or text:
                    self._progress(r, len(ids))
                    r.queue.put_output(TokenOutput(rid, ids, self._loop_time(), n_prompt, 0, text=text), clock())
                else:
                    # A chunk without text or ids (a detokenizer holding back an incomplete character,
                    # which a server without token ids in its stream may do for many tokens running)
                    # still proves the request is alive: the stall check must not depend on /metrics.
                    r.queue.touch(clock())
        if final is None and done and not r.started:
            # vLLM's stream of a request it aborted before its first token (a pause in abort mode, /abort_requests):
            # no choice at all (it skips an empty delta before setting the finish reason), then [DONE]. Aborted, not
            # refused: routed again, it would run after all, where its client or operator ended it.
            final = ([], "", FinishReason.ABORT)
        if final is None:
            log.warning("%s: stream of request %s ended without a finish reason", self.worker_id, rid)
            self._end(r, FinishReason.ERROR if r.started else FinishReason.UNAVAILABLE)
            return
        ids = final[0]
        if not self.flavor.return_token_ids and reported and reported > r.generated + len(ids):
            # one token per chunk with text undercounts: a detokenizer holds text back (vLLM sends "")
            ids = [*ids, *[-1] * (reported - r.generated - len(ids))]
        self._progress(r, len(ids))
        r.queue.put_output(self._final(r, ids, final[1], final[2], cached), clock())

    def _read_prefill(self, answer: Any, r: Inflight) -> None:
        """The JSON answer to a prefill (``remote_decode``) request: one finished output, with the
        :class:`KvTransfer` when the engine returned its ``kv_transfer_params`` (None otherwise: the
        decode side then prefills locally)."""
        if not isinstance(answer, dict) or "error" in answer or not answer.get("choices"):
            log.warning("%s: prefill %s failed in the engine: %.300r", self.worker_id, r.req.request_id, answer)
            self._end(r, FinishReason.ERROR)
            return
        choice = answer["choices"][0]
        ids = choice.get("token_ids") or []
        self._progress(r, len(ids))
        reason = choice.get("finish_reason")
        usage = answer.get("usage") or {}
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        out = self._final(r, ids, choice.get("text") or "",
                          FinishReason(reason) if reason in _REASONS else FinishReason.LENGTH, cached)
        params = answer.get("kv_transfer_params")
        if isinstance(params, dict):
            out.kv_transfer = KvTransfer(self.worker_id, len(r.req.prompt_tokens), tuple(r.req.block_hashes),
                                         json.dumps(params))
        else:
            log.warning("%s: prefill %s returned no kv_transfer_params (is the server started with a "
                        "kv_producer NixlConnector?)", self.worker_id, r.req.request_id)
        r.queue.put_output(out, self._clock())

    def _final(self, r: Inflight, ids: list[int], text: str | None, reason: FinishReason,
               cached: int) -> TokenOutput:
        return TokenOutput(r.req.request_id, ids, self._loop_time(), len(r.req.prompt_tokens), cached, True,
                           reason, text=text)

    def _end(self, r: Inflight, reason: FinishReason) -> None:
        r.queue.put_output(self._final(r, [], "", reason, 0), self._clock())
