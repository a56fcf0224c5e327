"""The OpenAPI 3.1 document of our HTTP API, served at ``GET /openapi.json``.

Request bodies are generated from the msgspec structs that decode them (``frontend/protocol.py``),
narrowed to what is really accepted: the served model, the OpenAI fields we do not implement to their
neutral values, program ids to their pattern. A test compares the document's paths with the app's
routes, and the fuzz test (schemathesis) checks the responses against it.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec
from aiohttp import web

from thunderagent.config import Config
from thunderagent.config.auth import TENANT_NAME
from thunderagent.execution.server_admin import SERVER_CALLS, ServerPath
from thunderagent.frontend.admin_api import (
    LOAD_ADAPTER_PATH,
    MAX_DRAIN_S,
    PAUSE_PATH,
    RESUME_PATH,
    RESET_PATH,
    UNLOAD_ADAPTER_PATH,
    VLLM_RESET_PATH,
    WORKER_ID_PATTERN,
    WORKERS_PATH,
    AddWorker,
    LoadAdapter,
    RemoveWorker,
    ResetCaches,
    UnloadAdapter,
)
from thunderagent.frontend.anthropic import COUNT_TOKENS_PATH, MESSAGES_PATH
from thunderagent.frontend.protocol import (
    MAX_STOP,
    NEUTRAL,
    NEUTRAL_COMPLETION,
    NEUTRAL_MESSAGE,
    PROGRAMS_LIMIT_DEFAULT,
    PROGRAMS_LIMIT_MAX,
    ChatCompletionRequest,
    CompletionRequest,
    ReleaseRequest,
)
from thunderagent.frontend.relay_fields import MESSAGE_KEYS, RelayFields, fleet_relay
from thunderagent.scheduler.programs import LIVE_STATES, PROGRAM_ID
from thunderagent.types import AUDIO_PATHS, RESPONSE_ID, RESPONSES_PATH, SERVER_PATHS, TOKENIZER_INFO_PATH

PATH = "/openapi.json"
PROGRAM_ID_SCHEMA = {"type": "string", "pattern": PROGRAM_ID.pattern}
_ERROR = {
    "type": "object", "required": ["error"],
    "properties": {"error": {
        "type": "object", "required": ["message", "type", "param", "code"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}},
    }},
}
_USAGE = {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"]}
_CHOICE_COMMON = {"index": {"type": "integer"}, "finish_reason": {"type": ["string", "null"]}}
_CHAT = {"type": "object", "required": ["id", "object", "created", "model", "choices", "usage"], "properties": {
    "id": {"type": "string"}, "object": {"const": "chat.completion"}, "created": {"type": "integer"},
    "model": {"type": "string"}, "usage": _USAGE, "choices": {"type": "array", "items": {
        "type": "object", "required": ["index", "message", "finish_reason"],
        "properties": {**_CHOICE_COMMON, "message": {"type": "object", "required": ["role", "content"]}},
    }},
}}
_COMPLETION = {"type": "object", "required": ["id", "object", "created", "model", "choices", "usage"], "properties": {
    "id": {"type": "string"}, "object": {"const": "text_completion"}, "created": {"type": "integer"},
    "model": {"type": "string"}, "usage": _USAGE, "choices": {"type": "array", "items": {
        "type": "object", "required": ["index", "text", "finish_reason"],
        "properties": {**_CHOICE_COMMON, "text": {"type": "string"}},
    }},
}}
#: one server-sent event: `data:` is a chunk as JSON, or `[DONE]`
_SSE_EVENT = {"type": "object", "required": ["data"], "properties": {"data": {"type": "string"}}}
_LIST = {"type": "object", "required": ["object", "data"], "properties": {
    "object": {"const": "list"}, "data": {"type": "array", "items": {"type": "object"}}}}
_TENANT = {"type": ["string", "null"], "description": "whose program it is (API keys on; null with keys off)"}
_PROGRAM = {"type": "object", "required": ["id", "tenant", "state", "steps", "in_flight"], "properties": {
    "id": {"type": "string"}, "tenant": _TENANT,
    "state": {"enum": [s.value for s in LIVE_STATES]}, "steps": {"type": "integer"},
    "in_flight": {"type": "integer"}}}
_PROGRAMS = {"type": "object", "required": ["object", "data", "total", "truncated", "by_state"], "properties": {
    "object": {"const": "list"}, "data": {"type": "array", "items": _PROGRAM}, "total": {"type": "integer"},
    "truncated": {"type": "boolean"}, "by_state": {"type": "object"}}}
_PROGRAM_PARAM = {"name": "program_id", "in": "path", "required": True, "schema": PROGRAM_ID_SCHEMA}
#: with API keys on, a tenant key reaches its own programs; an admin key names the tenant (400 with keys off)
_TENANT_PARAM = {"name": "tenant", "in": "query", "required": False,
                 "description": "the programs' tenant (admin key; a tenant key may name only its own)",
                 "schema": {"type": "string", "pattern": TENANT_NAME.pattern}}
_RELEASED = {"type": "object", "required": ["id", "tenant", "released"],
             "properties": {"id": {"type": "string"}, "tenant": _TENANT, "released": {"const": True}}}


#: Anthropic's Messages API (relayed to the servers: frontend/messages_api.py); its errors in Anthropic's shape
_ANTHROPIC_ERROR = {"type": "object", "required": ["type", "error"], "properties": {
    "type": {"const": "error"}, "error": {"type": "object", "required": ["type", "message"], "properties": {
        "type": {"type": "string"}, "message": {"type": "string"}}}}}
_BLOCKS = {"type": "array", "items": {"type": "object", "required": ["type"],
                                     "properties": {"type": {"type": "string"}}}}
_MESSAGES_REQUEST = {"type": "object", "required": ["model", "max_tokens", "messages"], "properties": {
    "model": {"type": "string", "minLength": 1}, "max_tokens": {"type": "integer", "minimum": 1},
    "messages": {"type": "array", "minItems": 1, "items": {"type": "object", "required": ["role", "content"],
                 "properties": {"role": {"enum": ["user", "assistant", "system"]},
                                "content": {"anyOf": [{"type": "string"}, _BLOCKS]}}}},
    "system": {"anyOf": [{"type": "string"}, _BLOCKS]}, "stream": {"type": "boolean"},
    "program_id": {"anyOf": [PROGRAM_ID_SCHEMA, {"type": "null"}]},
    "priority": {"type": "integer", "description": "the holding queue's tier (not sent to the server)"}},
    "description": "Anthropic's Messages API (its other fields and vLLM's extensions are relayed to the servers)"}
_MESSAGE = {"type": "object", "required": ["type", "role", "content"], "properties": {
    "type": {"const": "message"}, "role": {"const": "assistant"}, "content": _BLOCKS}}
_COUNT = {"type": "object", "required": ["input_tokens"], "properties": {"input_tokens": {"type": "integer"}}}
#: OpenAI's Responses API (relayed: frontend/responses_api.py)
_RESPONSES_REQUEST = {"type": "object", "required": ["input"], "properties": {
    "model": {"type": "string", "minLength": 1}, "input": {"anyOf": [{"type": "string"}, _BLOCKS]},
    "instructions": {"type": "string"}, "stream": {"type": "boolean"},
    "max_output_tokens": {"type": "integer", "minimum": 1}, "previous_response_id": {"type": "string"},
    "program_id": {"anyOf": [PROGRAM_ID_SCHEMA, {"type": "null"}]}},
    "description": "OpenAI's Responses API (its other fields and vLLM's extensions are relayed to the servers)"}
_RESPONSE = {"type": "object", "required": ["id", "object", "output"], "properties": {
    "id": {"type": "string"}, "object": {"const": "response"}, "output": {"type": "array"}}}
_RESPONSE_ID_PARAM = {"name": "response_id", "in": "path", "required": True,
                      "schema": {"type": "string", "pattern": f"^{RESPONSE_ID.pattern}$"}}
#: vLLM's paths that generate nothing, relayed (frontend/server_api.py)
_SERVER_REQUEST = {"type": "object", "properties": {
    "model": {"type": "string", "minLength": 1}, "priority": {"type": "integer"}},
    "description": "vLLM's request of this path (its fields are the server's to check)"}


#: vLLM's speech-to-text form (frontend/audio_api.py): what ThunderAgent reads of it
_AUDIO_REQUEST = {"type": "object", "required": ["file"], "properties": {
    "file": {"type": "string", "format": "binary"}, "model": {"type": "string", "minLength": 1},
    "stream": {"type": "boolean"}, "response_format": {"type": "string"}},
    "description": "vLLM's transcription / translation form (its other fields are the server's to check)"}


def _server_paths() -> dict[str, Any]:
    relayed = (400, 401, 404, 408, 413, 415, 429, 502, 503)
    paths: dict[str, Any] = {path: {"post": {
        "summary": f"vLLM's {path}, relayed to a server of the model (no KV routing: on load)",
        "requestBody": {"required": True, "content": {"application/json": {"schema": _SERVER_REQUEST}}},
        "responses": {"200": _json({"type": "object"}, "the server's answer"), **_errors(*relayed)}}}
        for path in SERVER_PATHS}
    paths[TOKENIZER_INFO_PATH] = {"get": {
        "summary": "vLLM's tokenizer configuration, from a server of the model (servers started with "
                   "--enable-tokenizer-info-endpoint)",
        "parameters": [{"name": "model", "in": "query", "required": False, "schema": {"type": "string",
                                                                                      "minLength": 1},
                        "description": "a server of this model (ThunderAgent's parameter, not sent on)"}],
        "responses": {"200": _json({"type": "object"}, "the server's answer"), **_errors(*relayed)}}}
    for path in AUDIO_PATHS:
        paths[path] = {"post": {
            "summary": f"vLLM's {path} (speech to text), the form relayed to a server of the model (on load)",
            "requestBody": {"required": True, "content": {"multipart/form-data": {"schema": _AUDIO_REQUEST}}},
            "responses": {"200": {"description": "the server's answer: JSON, text (response_format text, srt, "
                                                 "vtt) or, with stream, its events", "content": {
                "application/json": {"schema": {"type": "object"}}, "text/plain": {"schema": {"type": "string"}},
                "text/event-stream": {"schema": _SSE_EVENT}}}, **_errors(*relayed)}}}
    replay = [{"name": "stream", "in": "query", "required": False, "schema": {"type": "boolean", "default": False},
               "description": "replay a background response's events (server-sent events)"},
              {"name": "starting_after", "in": "query", "required": False, "schema": {
                  "type": "integer", "minimum": 0, "maximum": 9_999_999_999},
               "description": "with stream=true: the events after this sequence number"}]
    paths[f"{RESPONSES_PATH}/{{response_id}}"] = {"get": {
        "summary": "A stored response, read on the server storing it", "parameters": [_RESPONSE_ID_PARAM, *replay],
        "responses": {"200": {"description": "the stored response; stream=true: its events", "content": {
            "application/json": {"schema": _RESPONSE}, "text/event-stream": {"schema": _SSE_EVENT}}},
            **_errors(*relayed)}}}
    paths[f"{RESPONSES_PATH}/{{response_id}}/cancel"] = {"post": {
        "summary": "Cancel a stored (background) response, on the server storing it", "parameters": [
            _RESPONSE_ID_PARAM], "responses": {"200": _json(_RESPONSE, "the cancelled response"), **_errors(*relayed)}}}
    return paths


def _anthropic(summary: str, ok: dict[str, Any], statuses: tuple[int, ...]) -> dict[str, Any]:
    errors = {str(s): _json(_ANTHROPIC_ERROR, "error (Anthropic's shape)") for s in statuses}
    errors["default"] = _json({"anyOf": [_ANTHROPIC_ERROR, _ERROR]}, "error (a malformed HTTP request: OpenAI's shape)")
    return {"post": {"summary": summary, "requestBody": {"required": True, "content": {"application/json": {
        "schema": _MESSAGES_REQUEST}}}, "responses": {"200": ok, **errors}}}


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _errors(*statuses: int) -> dict[str, Any]:
    """Error responses (OpenAI's shape); ``default`` covers the ones every endpoint can give (415, 431...)."""
    out = {str(s): _json(_ERROR, "error") for s in statuses}
    out["default"] = _json(_ERROR, "error (malformed request, unsupported media type, oversized header...)")
    return out


def _generate(summary: str, body: str, result: dict[str, Any]) -> dict[str, Any]:
    ok = {"description": "the completion; `stream: true` gives server-sent events",
          "content": {"application/json": {"schema": result}, "text/event-stream": {"schema": _SSE_EVENT}}}
    return {"post": {
        "summary": summary,
        "requestBody": {"required": True, "content": {"application/json": {
            "schema": {"$ref": f"#/components/schemas/{body}"}}}},
        "responses": {"200": ok, **_errors(400, 404, 408, 413, 415, 429, 502, 503)},
    }}


def _narrow(components: dict[str, Any], model_name: str, relay: RelayFields | None) -> None:
    """Say in the schema what the server checks after decoding (``relay``: the fields a vLLM / SGLang fleet
    relays to its servers instead of refusing them)."""
    for name, table in (("ChatCompletionRequest", NEUTRAL), ("CompletionRequest", NEUTRAL_COMPLETION),
                        ("Message", NEUTRAL_MESSAGE)):
        props = components[name]["properties"]
        for field, allowed in table.items():
            if field in props:
                props[field] = {"description": "relayed to the servers: ThunderAgent does not model it"} if relay \
                    else {"enum": list(allowed), "description": "not implemented: only the neutral value"}
        if relay is not None:
            extra = MESSAGE_KEYS if name == "Message" else relay.chat if name == "ChatCompletionRequest" \
                else relay.completion
            for field in sorted(extra - set(props)):
                props[field] = {"description": f"engine {'/'.join(relay.engines)}'s own field: relayed to the servers"}
        if "model" in props:
            props["model"] = {"enum": [model_name], "description": "the served model (GET /v1/models); others: 404"}
        if "program_id" in props:
            props["program_id"] = {"anyOf": [PROGRAM_ID_SCHEMA, {"type": "null"}], "default": None}
        if "stop" in props:
            stops = {"type": "array", "items": {"type": "string", "minLength": 1}, "maxItems": MAX_STOP}
            props["stop"] = {"anyOf": [{"type": "string", "minLength": 1}, stops, {"type": "null"}], "default": None}
    components["ReleaseRequest"]["properties"]["program_id"] = PROGRAM_ID_SCHEMA
    components["AddWorker"]["properties"]["id"] = {"anyOf": [{"type": "string", "pattern": WORKER_ID_PATTERN},
                                                             {"type": "null"}], "default": None}
    components["RemoveWorker"]["properties"]["timeout_s"] = {"type": "number", "minimum": 0, "maximum": MAX_DRAIN_S,
                                                             "default": 30.0}


_WORKER_PARAM = {"name": "worker_id", "in": "path", "required": True, "schema": {"type": "string"}}
_WORKER = {"type": "object", "required": ["id", "health", "cordoned", "in_flight"]}


def _admin_paths() -> dict[str, Any]:
    """``/v1/admin/workers*``, the prefix-cache resets (``control_plane.admin_api``; 403 while it is off)."""
    ref = {"$ref": "#/components/schemas/RemoveWorker"}
    reset = {"$ref": "#/components/schemas/ResetCaches"}
    resets = {"type": "object", "required": ["success", "workers"], "properties": {"success": {"type": "boolean"},
              "workers": {"type": "array", "items": {"type": "object", "required": ["id", "success"]}}}}
    cordon = {"type": "object", "required": ["id", "cordoned", "in_flight"]}
    return {
        WORKERS_PATH: {
            "get": {"summary": "The fleet's workers: health, load, cordon mark, server, requests in flight here",
                    "responses": {"200": _json({"type": "object", "required": ["object", "data"], "properties": {
                        "data": {"type": "array", "items": _WORKER}}}, "workers"), **_errors(403)}},
            "post": {"summary": "Add a worker (thunderagent serve): a server of a real engine group, or a simulated "
                     "engine", "requestBody": {"required": True, "content": {"application/json": {
                         "schema": {"$ref": "#/components/schemas/AddWorker"}}}},
                     "responses": {"201": _json({"type": "object", "required": ["id", "added"]}, "added"),
                                   **_errors(400, 403, 409, 413, 415, 500)}}},
        **{f"{WORKERS_PATH}/{{worker_id}}/{verb}": {"post": {
            "summary": summary, "parameters": [_WORKER_PARAM],
            "responses": {"200": _json(cordon, "done"), **_errors(403, 404, 500, 504)}}}
           for verb, summary in (("cordon", "Take a worker out of routing; its requests in flight finish"),
                                 ("uncordon", "Put a cordoned worker back in routing"))},
        f"{WORKERS_PATH}/{{worker_id}}/remove": {"post": {
            "summary": "Cordon a worker, wait for its requests here to finish (or move them: force), then remove it",
            "parameters": [_WORKER_PARAM], "requestBody": {"required": False, "content": {"application/json": {
                "schema": ref}}},
            "responses": {"200": _json({"type": "object", "required": ["id", "removed", "requests_moved",
                                                                       "prefixes_handed_off"]},
                                       "removed"), **_errors(400, 403, 404, 409, 413, 415, 500, 504)}}},
        f"{WORKERS_PATH}/{{worker_id}}/reset_prefix_cache": {"post": {
            "summary": "Empty a worker's prefix cache (its server's), the index following",
            "parameters": [_WORKER_PARAM], "requestBody": {"required": False, "content": {"application/json": {
                "schema": reset}}},
            "responses": {"200": _json(resets, "each worker's answer"), **_errors(400, 403, 404, 413, 415)}}},
        RESET_PATH: {"post": {
            "summary": "Empty the prefix caches of the fleet's workers (all, or those named), the index following",
            "requestBody": {"required": False, "content": {"application/json": {"schema": reset}}},
            "responses": {"200": _json(resets, "each worker's answer"), **_errors(400, 403, 404, 413, 415)}}},
        VLLM_RESET_PATH: {"post": {
            "summary": "vLLM's prefix cache reset, for every worker of the fleet",
            "parameters": [{"name": name, "in": "query", "required": False, "schema": {"type": "boolean"}}
                           for name in ("reset_running_requests", "reset_external")],
            "responses": {"200": _json(resets, "each worker's answer"), **_errors(400, 403)}}},
        **{path: {"post": {
            "summary": summary, "requestBody": {"required": True, "content": {"application/json": {
                "schema": {"$ref": f"#/components/schemas/{schema}"}}}},
            "responses": {"200": _json(resets, "every server did it: each worker's answer"),
                          **_errors(400, 403, 404, 413, 415, 502)}}}
           for path, schema, summary in (
               (LOAD_ADAPTER_PATH, "LoadAdapter", "vLLM's LoRA adapter load, on every server of the fleet (or those "
                                                  "named)"),
               (UNLOAD_ADAPTER_PATH, "UnloadAdapter", "vLLM's LoRA adapter unload, on every server of the fleet (or "
                                                      "those named)"))},
        PAUSE_PATH: {"post": {
            "summary": "vLLM's generation pause, on every server of the fleet or those named (a paused server is "
                       "routed to only while no other can take a request)",
            "parameters": [{"name": "mode", "in": "query", "required": False,
                            "schema": {"enum": ["abort", "wait", "keep"], "default": "abort"}},
                           {"name": "clear_cache", "in": "query", "required": False,
                            "schema": {"type": "boolean", "default": True}}, _WORKERS_QUERY],
            "responses": {"200": _json(resets, "every server paused: each worker's answer"),
                          **_errors(400, 403, 404, 502)}}},
        **{path: {call.method.lower(): _server_call(path, call, resets)} for path, call in SERVER_CALLS.items()},
        RESUME_PATH: {"post": {
            "summary": "vLLM's generation resume, on every server of the fleet (or those named)",
            "parameters": [_WORKERS_QUERY],
            "responses": {"200": _json(resets, "every server resumed: each worker's answer"),
                          **_errors(400, 403, 404, 502)}}},
    }


#: what the query parameters of vLLM's operator paths take (``frontend/admin_api.server_query`` checks them)
_SERVER_QUERY: dict[str, dict[str, Any]] = {
    "level": {"type": "integer", "minimum": 0, "maximum": 2, "default": 1},
    "mode": {"enum": ["abort", "wait", "keep"], "default": "abort"},
    "tags": {"enum": ["weights", "kv_cache", "scheduling"]},
    "include_dp": {"type": "boolean", "default": True},
    "config_format": {"enum": ["text", "json"], "default": "text"},
}


_WORKERS_QUERY = {"name": "workers", "in": "query", "required": False, "description": "the workers to ask "
                  "(comma-separated or repeated); all of them when left out",
                  "schema": {"type": "string", "pattern": r"^[A-Za-z0-9._,-]+$"}}


def _server_call(path: str, call: ServerPath, answers: dict[str, Any]) -> dict[str, Any]:
    """One of vLLM's operator paths, on every server of the fleet (or those ``workers`` names)."""
    params = [{"name": name, "in": "query", "required": False, "schema": _SERVER_QUERY[name]} for name in call.query]
    params.append(_WORKERS_QUERY)
    state = path.lstrip("/") if path in ("/is_paused", "/is_sleeping") else None
    op: dict[str, Any] = {
        "summary": f"vLLM's {path}, on every server of the fleet" + (f" ({state}: all of them)" if state else ""),
        "parameters": params,
        "responses": {"200": _json({"type": "object", "required": [state, "workers"]} if state else answers,
                                   "every server did it: each worker's answer"),
                      **_errors(400, 403, 404, *((413, 415) if call.body else ()), 502, 503)}}
    if call.body:
        op["requestBody"] = {"required": False, "content": {"application/json": {"schema": {"type": "object"}}}}
    return op


def get(summary: str, responses: dict[str, Any]) -> dict[str, Any]:
    return {"get": {"summary": summary, "responses": responses}}


def openapi_document(cfg: Config) -> dict[str, Any]:
    _, components = msgspec.json.schema_components(
        [ChatCompletionRequest, CompletionRequest, ReleaseRequest, AddWorker, RemoveWorker, ResetCaches, LoadAdapter,
         UnloadAdapter],
        ref_template="#/components/schemas/{name}")
    _narrow(components, cfg.model_name, fleet_relay(cfg.execution_group.nodes))
    paths: dict[str, Any] = {
        "/v1/chat/completions": _generate("Chat completion (OpenAI)", "ChatCompletionRequest", _CHAT),
        "/v1/completions": _generate("Text completion (OpenAI)", "CompletionRequest", _COMPLETION),
        MESSAGES_PATH: _anthropic("Messages (Anthropic), relayed to a vLLM / SGLang / OpenAI-compatible server", {
            "description": "the server's message; `stream: true` gives its server-sent events", "content": {
                "application/json": {"schema": _MESSAGE}, "text/event-stream": {"schema": _SSE_EVENT}}},
            (400, 401, 404, 408, 413, 415, 429, 502, 503)),
        COUNT_TOKENS_PATH: _anthropic("Prompt tokens of a Messages request, as the servers render it",
                                      _json(_COUNT, "the count"), (400, 401, 404, 408, 413, 415, 429)),
        RESPONSES_PATH: {"post": {
            "summary": "Responses (OpenAI), relayed to a vLLM / SGLang / OpenAI-compatible server",
            "requestBody": {"required": True, "content": {"application/json": {"schema": _RESPONSES_REQUEST}}},
            "responses": {"200": {"description": "the server's response; `stream: true` gives its server-sent events",
                                  "content": {"application/json": {"schema": _RESPONSE},
                                              "text/event-stream": {"schema": _SSE_EVENT}}},
                          **_errors(400, 401, 404, 408, 413, 415, 429, 502, 503)}}},
        **_server_paths(),
        "/v1/models": get("The served model", {"200": _json(_LIST, "models"), **_errors()}),
        "/v1/programs": {"get": {
            "summary": "Agent programs known to the scheduler, oldest first", "parameters": [
                {"name": "state", "in": "query", "required": False,
                 "schema": {"enum": [s.value for s in LIVE_STATES]}},
                {"name": "limit", "in": "query", "required": False, "schema": {
                    "type": "integer", "minimum": 1, "maximum": PROGRAMS_LIMIT_MAX, "default": PROGRAMS_LIMIT_DEFAULT}},
                _TENANT_PARAM],
            "responses": {"200": _json(_PROGRAMS, "programs"), **_errors(400, 403)},
        }},
        "/v1/programs/{program_id}": {"get": {
            "summary": "One agent program", "parameters": [_PROGRAM_PARAM, _TENANT_PARAM],
            "responses": {"200": _json(_PROGRAM, "the program"), **_errors(400, 403, 404)},
        }},
        "/v1/programs/{program_id}/release": {"post": {
            "summary": "Release an agent program", "parameters": [_PROGRAM_PARAM, _TENANT_PARAM],
            "responses": {"200": _json(_RELEASED, "released"), **_errors(400, 403, 404)},
        }},
        "/programs/release": {"post": {
            "summary": "Release an agent program (the ThunderAgent paper proxy's form)", "parameters": [_TENANT_PARAM],
            "requestBody": {"required": True, "content": {"application/json": {
                "schema": {"$ref": "#/components/schemas/ReleaseRequest"}}}},
            "responses": {"200": _json(_RELEASED, "released"), **_errors(400, 403, 404, 408, 413, 415)},
        }},
        "/v1/planner": get("The scaling planner's recommendation per worker role, with its reasons", {
            "200": _json({"type": "object", "required": ["enabled", "acting", "leadership", "recommendations",
                                                         "actions"], "properties": {
                "enabled": {"type": "boolean"}, "acting": {"type": "boolean"},
                "leadership": {"type": ["object", "null"]}, "recommendations": {"type": "array"},
                "actions": {"type": "array"}}}, "recommendations"), **_errors()}),
        **_admin_paths(),
        "/health": get("Fleet health", {"200": _json({"type": "object"}, "healthy"),
                                         "503": _json({"type": "object"}, "no healthy worker"), **_errors()}),
        PATH: get("This document", {"200": _json({"type": "object"}, "OpenAPI 3.1"), **_errors()}),
    }
    if cfg.metrics.enabled:
        paths[cfg.metrics.path] = get("Prometheus metrics", {
            "200": {"description": "metrics", "content": {"text/plain": {"schema": {"type": "string"}}}},
            **_errors()})
    return {
        "openapi": "3.1.0",
        "info": {"title": "ThunderAgent", "version": "0.1.0",
                 "description": "OpenAI-compatible, KV-cache-aware router for LLM inference fleets"},
        "paths": paths,
        "components": {"schemas": components},
    }


def add_openapi_route(app: web.Application, cfg: Config) -> None:
    body = json.dumps(openapi_document(cfg)).encode()

    async def serve(request: web.Request) -> web.Response:
        return web.Response(body=body, content_type="application/json")

    app.router.add_get(PATH, serve)
