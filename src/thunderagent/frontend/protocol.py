"""OpenAI wire format: typed request structs (msgspec) and the error shape.

msgspec validates while it decodes, and its errors name the offending path (``$.max_tokens``),
which becomes the ``param`` of the OpenAI error. Unknown fields are ignored, as OpenAI clients send
extras (``user``, ``logprobs``...).
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from thunderagent.scheduler.programs import PROGRAM_ID

PositiveInt = Annotated[int, Meta(ge=1)]
Temperature = Annotated[float, Meta(ge=0.0, le=2.0)]
TopP = Annotated[float, Meta(gt=0.0, le=1.0)]
MAX_STOP = 4


class Message(msgspec.Struct):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, object]] | None = None


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class _Common(msgspec.Struct, kw_only=True):
    model: str
    max_tokens: PositiveInt | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    n: Literal[1] = 1
    seed: int | None = None
    # ThunderAgent extensions
    cache_salt: str | None = None
    lora_name: str | None = None
    priority: int = 0
    explain: bool = False  # return the routing decision in the body
    user: str | None = None  # OpenAI's end-user id: the route key with `routing.route_key: body:user`
    program_id: str | None = None  # the agent program (ThunderAgent paper's proxy field)
    extra_body: dict[str, object] | None = None  # clients that nest extensions here (program_id)


class ChatCompletionRequest(_Common, kw_only=True):
    messages: Annotated[list[Message], Meta(min_length=1)]
    max_completion_tokens: PositiveInt | None = None


class CompletionRequest(_Common, kw_only=True):
    # str, a token-id list, or a one-element list of str; checked in ``prompt_input``.
    prompt: str | list[int | str]
    echo: bool = False


class ReleaseRequest(msgspec.Struct):
    program_id: str


class RequestError(Exception):
    """Bad input from the client: becomes an OpenAI-shaped 4xx."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        status: int = 400,
        code: str | None = None,
        type_: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.code = code
        self.type = type_


_PATH = re.compile(r" - at `\$\.?([^`]*)`")
_MISSING = re.compile(r"missing required field `([^`]*)`")


def decode_request(body: bytes, kind: type[msgspec.Struct]) -> msgspec.Struct:
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        msg = str(exc)
        m = _PATH.search(msg)
        param = m.group(1) if m else None
        missing = _MISSING.search(msg)
        if missing:
            param = f"{param}.{missing.group(1)}" if param else missing.group(1)
        raise RequestError(msg, param=param or None) from exc
    except msgspec.DecodeError as exc:
        raise RequestError(f"request body is not valid JSON: {exc}") from exc


def stop_list(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if len(stops) > MAX_STOP:
        raise RequestError(f"at most {MAX_STOP} stop sequences are allowed", param="stop")
    if any(not s for s in stops):
        raise RequestError("stop sequences must be non-empty strings", param="stop")
    return stops


def message_text(msg: Message, index: int) -> str:
    """Content as text; OpenAI content parts of type "text" are concatenated."""
    if msg.content is None:
        return ""
    if isinstance(msg.content, str):
        return msg.content
    out = []
    for j, part in enumerate(msg.content):
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise RequestError(
                "only text content parts are supported", param=f"messages[{index}].content[{j}]"
            )
        out.append(part["text"])
    return "".join(out)


def error_body(err: RequestError) -> bytes:
    return msgspec.json.encode(
        {"error": {"message": err.message, "type": err.type, "param": err.param, "code": err.code}}
    )


def prompt_input(prompt: str | list[int | str]) -> str | list[int]:
    """The single prompt of a completion request: text, or token ids."""
    if isinstance(prompt, str):
        return prompt
    if not prompt:
        raise RequestError("prompt must not be empty", param="prompt")
    if all(isinstance(p, str) for p in prompt):
        if len(prompt) != 1:
            raise RequestError("only one prompt per request is supported", param="prompt")
        return str(prompt[0])
    if all(isinstance(p, int) and not isinstance(p, bool) and p >= 0 for p in prompt):
        return [int(p) for p in prompt]
    raise RequestError("prompt must be a string or a list of non-negative token ids", param="prompt")


def check_program_id(value: object) -> str:
    """A program id is 1-128 letters, digits or ``._:-`` (it appears in URLs and logs)."""
    if not isinstance(value, str) or not PROGRAM_ID.match(value):
        raise RequestError("program_id must be 1-128 letters, digits, '.', '_', ':' or '-'", param="program_id")
    return value
