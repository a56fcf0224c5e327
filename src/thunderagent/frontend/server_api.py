"""vLLM's endpoints that generate nothing, relayed: pooling, scoring and the server's own tokenizer.

``POST /v1/embeddings``, ``/v2/embed``, ``/pooling``, ``/classify`` (pooling models), ``/score``,
``/v1/score``, ``/rerank``, ``/v1/rerank``, ``/v2/rerank`` (scoring models) and ``/tokenize``,
``/detokenize``, ``GET /tokenizer_info`` (any model: the server's tokenizer and chat template, exactly what it
would run; the last only from servers started with ``--enable-tokenizer-info-endpoint``) go to a
server that serves the request's ``model`` (or the LoRA adapter it names) with the client's body; the
server's JSON answer, or its error, comes back as it came. Fleets that relay serve them (``engine: openai``,
and vLLM / SGLang with ``relay`` not ``off``); elsewhere they are a 404 that says why.

What ThunderAgent reads: a JSON object, ``model`` (optional, as vLLM takes it: a fleet of one model's servers
serves it anyway; on a vLLM / SGLang fleet a name must be the fleet's or an adapter's, and the worker sends the
server's own) and ``priority`` (the holding queue's tier, passed on as vLLM's priority where the token path
would pass it). Everything else is the server's to check.

Routing: an embedding, pooling or classification request (``/v1/embeddings``, ``/pooling``, ``/classify``) whose
``input`` is text or token ids is routed on the KV cache of its first input, as a completion's prompt is: a decoder
pooling model (``LAST`` pooling, e.g. Qwen3-Embedding) caches prefixes and publishes them in KV events like a
generating one, so inputs that share an instruction or a document go where it is cached. The text is tokenized
with the model's tokenizer as vLLM tokenizes it (special tokens added, unless the body's ``add_special_tokens`` is
false; with ``truncate_prompt_tokens``, ``padding`` or chat ``messages`` the tokens vLLM runs are not known here,
and the request is routed on load). A server that caches nothing (encoder models, ``MEAN`` / ``CLS`` pooling)
leaves only the router's own predictions, which expire. The other paths hold no KV cache worth finding again:
routed on load alone (in-flight requests and queues, as any request's cost reads them). All of them go through
the holding queue and count in flight on their server. A request a server did not take (refused connection, a
5xx before it answered) is routed again.
With API keys on, each counts against its tenant's request and in-flight limits; a token limit takes an
embedding, pooling or classification request whose inputs are tokenized here (text, a batch of texts in one
``encode_many``, token ids, a batch of id lists: what vLLM prefills, its ``usage.prompt_tokens``) for their
tokens, any other an estimate of the input (one token per 4 bytes of body: chat ``messages``, a truncation or
padding, the scoring paths; the tokenizer's paths take none, they use no accelerator).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Annotated, Any

import msgspec
from aiohttp import web
from msgspec import Meta

from thunderagent.frontend.protocol import Priority, RequestError
from thunderagent.frontend.relay import RelayFrontend, Routed, decode_body, relaying
from thunderagent.types import SERVER_PATHS, TOKENIZER_INFO_PATH, Passthrough

#: bytes of a request body per input token, for a tenant's token limit (English text and JSON run 3-5)
BYTES_PER_TOKEN = 4
_TOKENIZER_PATHS = frozenset({"/tokenize", "/detokenize"})


# Lenient (unknown fields are the server's): what routing reads, typed.
class _Request(msgspec.Struct, kw_only=True):
    model: Annotated[str, Meta(min_length=1)] | None = None
    priority: Priority = 0
    # the pooling paths' input (vLLM's types, checked by the server: anything else is routed on load)
    input: Any = None
    add_special_tokens: Any = True
    truncate_prompt_tokens: Any = None
    messages: Any = None
    padding: Any = None


_decoder = msgspec.json.Decoder(_Request)


#: the paths whose ``input`` is prefilled as a sequence that a decoder pooling model caches
_INPUT_PATHS = frozenset({"/v1/embeddings", "/pooling", "/classify"})


def pooled_inputs(req: _Request, encode_many: Callable[[Sequence[str], bool], list[list[int]]]
                  ) -> tuple[list[int], int]:
    """The tokens vLLM prefills for the request's first input (text tokenized by ``encode_many``, special tokens
    added unless ``add_special_tokens`` is false; token ids as given) and for all of its inputs together, or
    ``([], -1)`` when they are not known here: no input, chat messages, a truncation or padding, or a type vLLM will
    refuse. An empty first text routes on nothing (its count still stands)."""
    special = req.add_special_tokens
    if (req.messages is not None or req.truncate_prompt_tokens is not None
            or req.padding not in (None, "do_not_pad") or type(special) is not bool):
        return [], -1
    inputs = req.input
    if isinstance(inputs, str) or (isinstance(inputs, list) and inputs and _is_ids(inputs)):
        inputs = [inputs]  # one input
    if not isinstance(inputs, list) or not inputs:
        return [], -1
    if all(isinstance(x, str) for x in inputs):
        ids = encode_many(inputs, special)
        return (ids[0] if inputs[0] else []), sum(map(len, ids))
    if all(isinstance(x, list) and x and _is_ids(x) for x in inputs):
        return list(inputs[0]), sum(map(len, inputs))
    return [], -1


def _is_ids(seq: list[Any]) -> bool:
    return all(type(t) is int and t >= 0 for t in seq)


def charged_tokens(path: str, body: bytes) -> int:
    """What a request on ``path`` takes from its tenant's token limit: an estimate of its input, none for the
    tokenizer's paths."""
    return 0 if path in _TOKENIZER_PATHS else -(-len(body) // BYTES_PER_TOKEN)


class ServerApi:
    """The paths of :data:`~thunderagent.types.SERVER_PATHS` on a relaying fleet (``relay``: its frontend side;
    None: a fleet with no server to relay to, where each is a 404 that says so)."""

    def __init__(self, relay: RelayFrontend | None) -> None:
        self.relay = relay

    async def tokenizer_info(self, request: web.Request) -> web.StreamResponse:
        """``GET /tokenizer_info``: a server's tokenizer configuration, from a server of ``?model=NAME`` (ours, not
        sent on: a fleet of several models' servers) or any server of the fleet."""
        relay = relaying(self.relay, request, frozenset({"model"}))
        model = request.query.get("model")
        if model is not None and not model:
            raise RequestError("`model` is empty", param="model")
        lora = relay.admit(model, lambda: None, TOKENIZER_INFO_PATH.lstrip("/"))
        return await relay.dispatch(request, Routed(1, None, 0, False, None, None), [],
                                    Passthrough(TOKENIZER_INFO_PATH, b"", False, "GET"), lora, "model", plain=0)

    async def relayed(self, request: web.Request) -> web.StreamResponse:
        relay = relaying(self.relay, request)
        path = request.path
        body = await request.read()
        req: _Request = decode_body(_decoder, body)
        lora = relay.admit(req.model, lambda: None, path.lstrip("/"))  # (the fields are the server's to check)
        fields = Routed(1, None, req.priority, False, None, None)
        ids, tokens = await relay.fe.tokenize.run(len(body), pooled_inputs, req, relay.fe.tokenizer.encode_many) \
            if path in _INPUT_PATHS else ([], -1)
        # inputs tokenized here are charged their tokens, anything else an estimate of the body
        return await relay.dispatch(request, fields, ids, Passthrough(path, body, False), lora, "input",
                                    plain=tokens if tokens >= 0 else charged_tokens(path, body))


def add_routes(route: Callable[[str, str, Any], None], api: ServerApi) -> None:
    """Each path of :data:`~thunderagent.types.SERVER_PATHS`, a ``POST`` to :meth:`ServerApi.relayed`, and
    ``GET /tokenizer_info``."""
    for path in SERVER_PATHS:
        route("POST", path, api.relayed)
    route("GET", TOKENIZER_INFO_PATH, api.tokenizer_info)
