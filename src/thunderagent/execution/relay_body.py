"""The body a vLLM / SGLang server receives for a relayed request (``relay``).

The client's JSON is kept as it came but for ThunderAgent's own fields, rewritten as the token path
(``engine_requests.request_body``) sends them, so both paths reach the server alike:

- ``model``: the server's own model name (its ``/v1/models``; the client named ThunderAgent's), or
  the LoRA adapter's (``lora_name``);
- ``cache_salt``: the effective salt (with API keys on, the tenant's salt folded in: a tenant never
  sets the salt the server keys its cache on), absent when there is none;
- ``priority``: vLLM's (our priority negated) only for a server with ``scheduling_policy: priority``;
- ``program_id``, ``explain``, ``lora_name`` and a ``program_id`` inside ``extra_body`` are dropped
  (the server has no use for them), as are the fleet-internal fields the frontend refuses anyway
  (KV-transfer parameters, the engine's request id).

An audio path's form (``form_body``) gets only its ``model`` field so; the rest is the server's as it came.
"""

from __future__ import annotations

from typing import Any

import msgspec

from thunderagent.execution.form_body import FormError, boundary_of, with_field
from thunderagent.types import EngineRequest

_doc = msgspec.json.Decoder(dict[str, Any])
_enc = msgspec.json.Encoder()
#: fleet-internal: a client must not steer where the engine pushes or pulls KV, nor its request ids (the
#: frontend refuses them: ``frontend/relay_fields.py``; dropped here too)
FLEET_FIELDS = frozenset({"kv_transfer_params", "ec_transfer_params", "request_id"})
_OURS = ("program_id", "explain", "lora_name", "cache_salt", "priority", *sorted(FLEET_FIELDS))


def engine_body(body: bytes, req: EngineRequest, model: str, *, send_priority: bool) -> bytes:
    doc = _doc.decode(body)
    for key in _OURS:
        doc.pop(key, None)
    doc["model"] = req.lora_name or model
    extra = doc.get("extra_body")
    if isinstance(extra, dict) and "program_id" in extra:
        extra = {k: v for k, v in extra.items() if k != "program_id"}
        if extra:
            doc["extra_body"] = extra
        else:
            del doc["extra_body"]
    if req.cache_salt:
        doc["cache_salt"] = req.cache_salt
    if send_priority and req.priority:  # 0 is vLLM's default too
        doc["priority"] = -req.priority
    return _enc.encode(doc)


def form_body(body: bytes, req: EngineRequest, model: str) -> bytes:
    """An audio request's multipart form with ``model`` the server's own name (or the LoRA adapter's); a form the
    frontend did not check (its content type lost) goes as it came, for the server to judge."""
    ctype = next((v for k, v in req.headers if k.lower() == "content-type"), None)
    boundary = boundary_of(ctype) if ctype is not None else None
    if boundary is None:
        return body
    try:
        return with_field(body, boundary, "model", req.lora_name or model)
    except FormError:
        return body
