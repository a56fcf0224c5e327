"""OpenAI wire format: typed request structs (msgspec) and the error shape.

msgspec validates while it decodes, and its errors name the offending path (``$.max_tokens``),
which becomes the ``param`` of the OpenAI error. Nothing is silently ignored: an unknown field is a
400 naming it, and an OpenAI field we do not implement (``logprobs``, ``tools``, penalties...) is
accepted only with the value that means "off" (``NEUTRAL``), else a 400 naming it. Numbers are
bounded to what the engines can carry (token ids are uint32, seeds int64).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from thunderagent.scheduler.programs import LIVE_STATES, PROGRAM_ID, ProgramState

INT32_MAX = 2**31 - 1
MaxTokens = Annotated[int, Meta(ge=1, le=INT32_MAX)]
Seed = Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)]
Priority = Annotated[int, Meta(ge=-INT32_MAX - 1, le=INT32_MAX)]
#: token ids are hashed and shipped as uint32
MAX_TOKEN_ID = 2**32 - 1
Temperature = Annotated[float, Meta(ge=0.0, le=2.0)]
TopP = Annotated[float, Meta(gt=0.0, le=1.0)]
MAX_STOP = 4


class Message(msgspec.Struct, forbid_unknown_fields=True):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None
    # OpenAI message fields accepted only empty (see NEUTRAL): clients echo assistant messages back
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    function_call: dict[str, Any] | None = None
    refusal: str | None = None


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool = False


class _Common(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str
    max_tokens: MaxTokens | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    n: Annotated[int, Meta(ge=1, le=128)] | None = 1  # only 1 is served here: see NEUTRAL
    seed: Seed | None = None
    # OpenAI fields not implemented: accepted only with their "off" value (NEUTRAL)
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # ThunderAgent extensions
    cache_salt: str | None = None
    lora_name: str | None = None
    priority: Priority = 0
    explain: bool = False  # return the routing decision in the body
    user: str | None = None  # OpenAI's end-user id: the route key with `routing.route_key: body:user`
    program_id: str | None = None  # the agent program (ThunderAgent paper's proxy field)
    extra_body: dict[str, Any] | None = None  # clients that nest extensions here (program_id)


class ChatCompletionRequest(_Common, kw_only=True):
    messages: Annotated[list[Message], Meta(min_length=1)]
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None  # has no effect without tools, which are refused
    response_format: dict[str, Any] | None = None


class CompletionRequest(_Common, kw_only=True):
    # str, a token-id list, or a one-element list of str; checked in ``prompt_input``.
    prompt: str | list[int | str]
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None


class ReleaseRequest(msgspec.Struct, forbid_unknown_fields=True):
    program_id: str


# OpenAI fields this server does not implement, with the values that ask for nothing (what OpenAI
# does when they are absent). Any other value would be silently ignored, so it is refused instead.
NEUTRAL: dict[str, tuple[object, ...]] = {
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "frequency_penalty": (None, 0.0),
    "presence_penalty": (None, 0.0),
    "logit_bias": (None, {}),
    "tools": (None, []),
    "tool_choice": (None, "none", "auto"),
    "response_format": (None, {"type": "text"}),
    "echo": (False,),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "n": (None, 1),
}
NEUTRAL_COMPLETION = {**NEUTRAL, "logprobs": (None,)}  # an int there: 0 still returns logprobs
NEUTRAL_MESSAGE: dict[str, tuple[object, ...]] = {
    "name": (None,), "tool_calls": (None, []), "tool_call_id": (None,), "function_call": (None,), "refusal": (None,),
}


#: the ``Server`` header of every answer: the product, no versions (aiohttp's default names Python's and
#: aiohttp's, a map of known holes for whoever scans the endpoint)
SERVER = "ThunderAgent"


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


class Unmodelled(RequestError):
    """A request that asks for something ThunderAgent does not model itself (an OpenAI field it does not
    implement, a field unknown to it, a content part other than text). A fleet of servers that take the
    client's body (``relay: unmodelled``) relays it to them unchanged; otherwise it is this 400."""


_PATH = re.compile(r" - at `\$\.?([^`]*)`")
_NAMED = re.compile(r"(?:missing required|unknown) field `([^`]*)`")


def decode_request(body: bytes, kind: type[msgspec.Struct]) -> msgspec.Struct:
    try:
        req = msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        msg = str(exc)
        m = _PATH.search(msg)
        param = m.group(1) if m else None
        named = _NAMED.search(msg)
        if named:
            param = f"{param}.{named.group(1)}" if param else named.group(1)
        if "unknown field" in msg:
            msg = f"unsupported field `{param}`: this server does not implement it; remove it from the request"
            raise Unmodelled(msg, param=param, code="unsupported_parameter") from exc
        raise RequestError(msg, param=param or None) from exc
    except msgspec.DecodeError as exc:
        raise RequestError(f"request body is not valid JSON: {exc}") from exc
    except RecursionError as exc:  # msgspec's own guard against stack exhaustion
        raise RequestError("request body is nested too deeply", code="nesting_too_deep") from exc
    _check_neutral(req, NEUTRAL_COMPLETION if isinstance(req, CompletionRequest) else NEUTRAL, "")
    for i, message in enumerate(getattr(req, "messages", ())):
        _check_neutral(message, NEUTRAL_MESSAGE, f"messages[{i}].")
    return req


def _is(value: object, allowed: object) -> bool:
    return value is allowed or (type(value) is type(allowed) and value == allowed)  # False is not 0


def _check_neutral(obj: msgspec.Struct, table: dict[str, tuple[object, ...]], prefix: str) -> None:
    for name, allowed in table.items():
        if name not in obj.__struct_fields__:
            continue
        value = getattr(obj, name)
        if not any(_is(value, a) for a in allowed):
            shown = " or ".join(msgspec.json.encode(a).decode() for a in allowed)
            raise Unmodelled(
                f"`{prefix}{name}` is not supported by this server: leave it out (or {shown})",
                param=prefix + name, code="unsupported_parameter",
            )


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
            raise Unmodelled(
                "only text content parts are supported", param=f"messages[{index}].content[{j}]",
                code="unsupported_content",
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
    if all(isinstance(p, int) and not isinstance(p, bool) and 0 <= p <= MAX_TOKEN_ID for p in prompt):
        return [int(p) for p in prompt]
    raise RequestError(f"prompt must be a string or a list of token ids in [0, {MAX_TOKEN_ID}] (non-negative "
                       "uint32)", param="prompt")


def check_program_id(value: object) -> str:
    """A program id is 1-128 letters, digits or ``._:-`` (it appears in URLs and logs)."""
    if not isinstance(value, str) or not PROGRAM_ID.fullmatch(value):
        raise RequestError("program_id must be 1-128 letters, digits, '.', '_', ':' or '-'", param="program_id")
    return value


#: ``GET /v1/programs``: programs listed when ``limit`` is not given, and the most one may ask for
PROGRAMS_LIMIT_DEFAULT, PROGRAMS_LIMIT_MAX = 1_000, 100_000


def program_filters(query: Mapping[str, str]) -> tuple[ProgramState | None, int]:
    """``GET /v1/programs``'s ``state`` and ``limit`` query parameters, checked."""
    state = query.get("state")
    found = None
    if state is not None:
        found = next((s for s in LIVE_STATES if s.value == state), None)
        if found is None:
            raise RequestError(f"state must be one of {', '.join(s.value for s in LIVE_STATES)}", param="state")
    raw = query.get("limit")
    if raw is None:
        return found, PROGRAMS_LIMIT_DEFAULT
    if not (raw.isascii() and raw.isdigit()) or not 1 <= int(raw) <= PROGRAMS_LIMIT_MAX:
        raise RequestError(f"limit must be an integer from 1 to {PROGRAMS_LIMIT_MAX}", param="limit")
    return found, int(raw)
