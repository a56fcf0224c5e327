"""The bus wire's operator calls to a worker process (``bus.wire`` has the subjects and the other messages). Pure.

    <p>.rpc.<id>.reset_cache   frontend -> worker    ResetCache request; an AdminReply to its reply subject
    <p>.rpc.<id>.adapter       frontend -> worker    SetAdapter request (a LoRA adapter loaded or unloaded); an
                                                     AdminReply to its reply subject
    <p>.rpc.<id>.pause         frontend -> worker    SetPaused request (generation paused or resumed); an
                                                     AdminReply to its reply subject
    <p>.rpc.<id>.call          frontend -> worker    ServerCall request (a parameterless operator path); an
                                                     AdminReply with the server's body
    <p>.frontend.abort_held    frontend -> frontends HeldAbort request (``/abort_requests``: the requests each
                                                     frontend holds); a HeldAborted reply (how many it ended)

These run in the worker process, which holds the server's connection (``control/server_admin.py`` fans them out);
the frontend that asked waits for the answer of the instance it knows. ``HeldAbort`` runs in the other frontends
(``control/abort_peers.py``): a request held in a frontend's queue is on no server yet.
"""

from __future__ import annotations

import msgspec


class ResetCache(msgspec.Struct, array_like=True, frozen=True):
    running: bool  # vLLM's reset_running_requests
    external: bool  # vLLM's reset_external


class SetAdapter(msgspec.Struct, array_like=True, frozen=True):
    name: str
    path: str | None  # None: unload
    inplace: bool = False


class SetPaused(msgspec.Struct, array_like=True, frozen=True):
    paused: bool  # False: resume
    mode: str = "abort"  # vLLM's: abort, wait, keep
    clear_cache: bool = True


class ServerCall(msgspec.Struct, array_like=True, frozen=True):
    path: str  # one of execution/server_admin.SERVER_CALLS (the worker refuses any other)
    query: str = ""  # url-encoded, only the path's own parameters (the worker checks)
    body: bytes = b""  # the JSON body of a path that takes one


class AdminReply(msgspec.Struct, array_like=True, frozen=True):
    instance: str  # the worker process that answers (a frontend takes only the one it knows)
    success: bool
    error: str | None = None
    answer: str | None = None  # the server's body (a ServerCall's)


class HeldAbort(msgspec.Struct, array_like=True, frozen=True):
    origin: str  # the frontend asked (it ends its own held requests itself)
    ids: list[str] | None  # the client ids named (None: every held request)


class HeldAborted(msgspec.Struct, array_like=True, frozen=True):
    ended: int


decode_reset_cache = msgspec.msgpack.Decoder(ResetCache).decode
decode_set_adapter = msgspec.msgpack.Decoder(SetAdapter).decode
decode_set_paused = msgspec.msgpack.Decoder(SetPaused).decode
decode_server_call = msgspec.msgpack.Decoder(ServerCall).decode
decode_admin_reply = msgspec.msgpack.Decoder(AdminReply).decode
decode_held_abort = msgspec.msgpack.Decoder(HeldAbort).decode
decode_held_aborted = msgspec.msgpack.Decoder(HeldAborted).decode
