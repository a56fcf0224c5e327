"""A ``multipart/form-data`` body (the audio endpoints': ``/v1/audio/transcriptions``, ``/translations``) read
and rewritten without copying or decoding its file.

The frontend reads the form's small fields (``model``, ``stream``, ``response_format``) to route the request; the
worker of a vLLM / SGLang server puts the server's own model name in the ``model`` field, as the JSON paths'
bodies get it (``relay_body.py``). Both take the fields' byte offsets from python-multipart's parser (RFC 7578;
the same parser vLLM's server reads the form with), so the audio itself is never copied field by field: a
rewrite splices the one value into the body as it came.
"""

from __future__ import annotations

from dataclasses import dataclass

from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header


class FormError(ValueError):
    """The body is not a well-formed multipart form (the message says where)."""


@dataclass(slots=True, frozen=True)
class FormField:
    """One part of the form: its ``name``, ``filename`` (None: a plain field) and where its value lies in the
    body (``body[start:end]``)."""

    name: str
    filename: str | None
    start: int
    end: int


def boundary_of(content_type: str) -> bytes | None:
    """The boundary of a ``multipart/form-data`` content type; None for any other type or one without it."""
    kind, params = parse_options_header(content_type)
    boundary = params.get(b"boundary")
    if kind != b"multipart/form-data" or not boundary or len(boundary) > 70:  # (70: RFC 2046's longest)
        return None
    return boundary


class _Collector:
    """python-multipart's callbacks: each part's name, filename and value offsets (one write of the whole body:
    offsets index it; a value may come in several pieces, in order)."""

    def __init__(self, body: bytes) -> None:
        self.body = body
        self.fields: list[FormField] = []
        self.ended = False
        self._header = [b"", b""]  # the header being read: name, value (the parser may split them)
        self._disposition: bytes | None = None
        self._span = [-1, -1]
        self._head_end = 0  # where the last header value read ends (an empty value starts after the blank line)

    def callbacks(self) -> dict[str, object]:
        return {"on_part_begin": self.part_begin, "on_header_field": self.header_field,
                "on_header_value": self.header_value, "on_header_end": self.header_end,
                "on_part_data": self.part_data, "on_part_end": self.part_end, "on_end": self.end}

    def part_begin(self) -> None:
        self._disposition = None
        self._span = [-1, -1]

    def header_field(self, data: bytes, start: int, end: int) -> None:
        self._header[0] += data[start:end]

    def header_value(self, data: bytes, start: int, end: int) -> None:
        self._header[1] += data[start:end]
        self._head_end = end

    def header_end(self) -> None:
        if self._header[0].strip().lower() == b"content-disposition" and self._disposition is None:
            self._disposition = self._header[1]
        self._header = [b"", b""]

    def part_data(self, data: bytes, start: int, end: int) -> None:
        if self._span[0] < 0:
            self._span[0] = start
        self._span[1] = end

    def part_end(self) -> None:
        if self._disposition is None:
            raise FormError("a part of the form has no Content-Disposition")
        _, params = parse_options_header(self._disposition)
        name = params.get(b"name")
        if name is None:
            raise FormError("a part of the form has no name")
        filename = params.get(b"filename")
        if self._span[0] < 0:  # an empty value: no data callback, so no offset; it sits right after the headers
            self._span[0] = self._span[1] = self.body.find(b"\r\n\r\n", self._head_end) + 4
        self.fields.append(FormField(name.decode("utf-8", "replace"),
                                     None if filename is None else filename.decode("utf-8", "replace"),
                                     self._span[0], self._span[1]))

    def end(self) -> None:
        self.ended = True


def form_fields(body: bytes, boundary: bytes) -> list[FormField]:
    """The form's parts in order. Raises :class:`FormError` for a body that is not one form with that boundary
    (a part without a name, a form that never ends)."""
    got = _Collector(body)
    parser = MultipartParser(boundary, got.callbacks())  # type: ignore[arg-type]
    try:
        parser.write(body)
        parser.finalize()
    except MultipartParseError as exc:
        raise FormError(f"the form is malformed: {exc}") from None
    if not got.ended:
        raise FormError("the form does not end (no closing boundary)")
    return got.fields


def text_field(body: bytes, fields: list[FormField], name: str) -> str | None:
    """The value of the plain field ``name`` as text (the first, if repeated); None when the form has none.
    Raises :class:`FormError` when it is not UTF-8 or is a file."""
    for f in fields:
        if f.name == name:
            if f.filename is not None:
                raise FormError(f"`{name}` must be a plain field, not a file")
            try:
                return body[f.start:f.end].decode("utf-8")
            except UnicodeDecodeError:
                raise FormError(f"`{name}` is not UTF-8 text") from None
    return None


def with_field(body: bytes, boundary: bytes, name: str, value: str) -> bytes:
    """``body`` with the plain field ``name`` set to ``value``: its value replaced where the field is (every
    occurrence), or a part appended before the closing boundary when the form has none."""
    fields = form_fields(body, boundary)
    new = value.encode()
    hits = [f for f in fields if f.name == name and f.filename is None]
    if hits:
        out, at = [], 0
        for f in hits:
            out += (body[at:f.start], new)
            at = f.end
        out.append(body[at:])
        return b"".join(out)
    close = body.rfind(b"--" + boundary + b"--")
    if close < 0:  # (form_fields found the end: the closing delimiter is there)
        raise FormError("the form does not end (no closing boundary)")
    part = b'--%s\r\nContent-Disposition: form-data; name="%s"\r\n\r\n%s\r\n' % (boundary, name.encode(), new)
    return body[:close] + part + body[close:]
