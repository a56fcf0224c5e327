"""vLLM's speech-to-text endpoints, relayed: ``POST /v1/audio/transcriptions`` and ``/v1/audio/translations``.

The client's ``multipart/form-data`` body (the audio ``file`` and the form's fields, as OpenAI's client sends them)
goes to a server that serves the request's ``model`` as it came, but for ``model``, which a vLLM / SGLang server's
worker sets to the server's own name (or the LoRA adapter's), as on the JSON paths. The answer comes back as the
server sent it: JSON (``response_format`` ``json`` / ``verbose_json``, the default), text (``text``, ``srt``,
``vtt``: ``text/plain``), or with ``stream`` true the server's event stream (OpenAI's chunks, relayed as they come).

What ThunderAgent reads of the form (python-multipart's parser, the offsets only: the audio is not copied):
``file`` (required), ``model`` (optional, as vLLM takes it), ``stream`` and ``response_format``; everything else is
the server's to check. A body that is not one well-formed form is a 400 naming ``file``.

Routing: a speech model's cache holds nothing a later request would find again (the audio's encoder output is
not prefix-cached across requests), so these requests are routed on load alone, as the pooling paths are
(``server_api.py``): they go through the holding queue, count in flight on their server, and a request a server did
not take is routed again. With API keys on they count against their tenant's request and in-flight limits; a
token limit charges no input (audio, not text ThunderAgent could count) and as completion only a streamed answer's
text chunks (a token each, as a relayed chat stream is counted; an unstreamed answer reports none).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from aiohttp import web

from thunderagent.execution.form_body import FormError, boundary_of, form_fields, text_field
from thunderagent.frontend.protocol import RequestError
from thunderagent.frontend.relay import RelayFrontend, Routed, relaying
from thunderagent.types import AUDIO_PATHS, Passthrough

#: pydantic's spellings of a form boolean (vLLM's server reads the form with them)
_TRUE = frozenset({"true", "1", "yes", "on", "t", "y"})
_FALSE = frozenset({"false", "0", "no", "off", "f", "n"})
#: response formats whose answer is text, not JSON
_TEXT_FORMATS = frozenset({"text", "srt", "vtt"})


def _flag(value: str | None, name: str) -> bool:
    if value is None:
        return False
    v = value.strip().lower()
    if v in _TRUE or v in _FALSE:
        return v in _TRUE
    raise RequestError(f"`{name}` must be a boolean (true or false), got {value[:40]!r}", param=name)


class AudioApi:
    """The paths of :data:`~thunderagent.types.AUDIO_PATHS` on a relaying fleet (``relay`` None: a fleet with no
    server to relay to, where each is a 404 that says so)."""

    def __init__(self, relay: RelayFrontend | None) -> None:
        self.relay = relay

    async def relayed(self, request: web.Request) -> web.StreamResponse:
        relay = relaying(self.relay, request)
        path = request.path
        content_type = request.headers.get("Content-Type", "")
        boundary = boundary_of(content_type)
        if boundary is None:
            raise RequestError(f"{path} takes a multipart/form-data body (the audio `file` and the form's fields), "
                               f"got {content_type[:80] or 'no Content-Type'!r}", param="file")
        body = await request.read()
        try:
            fields = form_fields(body, boundary)
            if not any(f.name == "file" and f.filename is not None for f in fields):
                raise RequestError("`file` (the audio, a file part of the form) is required", param="file")
            model = text_field(body, fields, "model")
            stream = _flag(text_field(body, fields, "stream"), "stream")
            answer_format = (text_field(body, fields, "response_format") or "json").strip()
        except FormError as exc:
            raise RequestError(str(exc), param="file") from None
        if model is not None and not model.strip():
            raise RequestError("`model` is empty", param="model")
        lora = relay.admit(model, lambda: None, path.lstrip("/"))  # (the fields are the server's to check)
        return await relay.dispatch(request, Routed(1, None, 0, False, None, None), [],
                                    Passthrough(path, body, stream), lora, "file", plain=0, content_type=content_type,
                                    answer_type="text/plain" if answer_format in _TEXT_FORMATS else "application/json")


def add_routes(route: Callable[[str, str, Any], None], api: AudioApi) -> None:
    """Each path of :data:`~thunderagent.types.AUDIO_PATHS`, a ``POST`` to :meth:`AudioApi.relayed`."""
    for path in AUDIO_PATHS:
        route("POST", path, api.relayed)
