"""``execution/form_body.py``: a multipart form's fields found by offset and its ``model`` rewritten, the file's
bytes untouched (the audio paths' bodies)."""

from __future__ import annotations

import random

import pytest

from thunderagent.execution.form_body import FormError, boundary_of, form_fields, text_field, with_field

B = b"xYz0123"


def _form(*parts: tuple[str, bytes, str | None]) -> bytes:
    out = b""
    for name, value, filename in parts:
        disp = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename else "")
        ctype = b"Content-Type: audio/wav\r\n" if filename else b""
        out += b"--" + B + b"\r\n" + f"Content-Disposition: {disp}\r\n".encode() + ctype + b"\r\n" + value + b"\r\n"
    return out + b"--" + B + b"--\r\n"


def test_boundary_of_a_content_type() -> None:
    assert boundary_of("multipart/form-data; boundary=xYz0123") == B
    assert boundary_of('multipart/form-data; boundary="a b"') == b"a b"
    assert boundary_of("multipart/form-data") is None
    assert boundary_of("application/json") is None
    assert boundary_of("multipart/mixed; boundary=abc") is None
    assert boundary_of("multipart/form-data; boundary=" + "a" * 71) is None


def test_fields_by_offset_and_the_file_untouched() -> None:
    audio = b"RIFF\r\n--xYz012\r\n\r\n\x00\xff" * 50  # a near-boundary inside the file
    body = _form(("file", audio, "a.wav"), ("model", b"whisper", None), ("stream", b"", None),
                 ("language", "é".encode(), None))
    fields = form_fields(body, B)
    assert [(f.name, f.filename) for f in fields] == [("file", "a.wav"), ("model", None), ("stream", None),
                                                      ("language", None)]
    assert body[fields[0].start:fields[0].end] == audio
    assert fields[2].start == fields[2].end and body[fields[2].start:fields[2].start + 2] == b"\r\n"
    assert text_field(body, fields, "model") == "whisper"
    assert text_field(body, fields, "stream") == ""
    assert text_field(body, fields, "language") == "é"
    assert text_field(body, fields, "prompt") is None
    with pytest.raises(FormError, match="`file` must be a plain field"):
        text_field(body, fields, "file")
    bad = _form(("model", b"\xff\xfe", None))
    with pytest.raises(FormError, match="not UTF-8"):
        text_field(bad, form_fields(bad, B), "model")


def test_model_replaced_or_added_and_nothing_else_moves() -> None:
    audio = bytes(range(256)) * 10
    body = _form(("model", b"ours", None), ("file", audio, "a.wav"), ("temperature", b"0.2", None))
    out = with_field(body, B, "model", "the-servers-model")
    assert out == _form(("model", b"the-servers-model", None), ("file", audio, "a.wav"),
                        ("temperature", b"0.2", None))
    # none in the form: a part before the closing boundary
    body = _form(("file", audio, "a.wav"))
    assert with_field(body, B, "model", "m") == _form(("file", audio, "a.wav"), ("model", b"m", None))
    # an empty value is replaced where it is
    body = _form(("model", b"", None), ("file", b"x", "a.wav"))
    assert with_field(body, B, "model", "m") == _form(("model", b"m", None), ("file", b"x", "a.wav"))


def test_random_forms_round_trip() -> None:
    rng = random.Random(7)
    for _ in range(200):
        parts = []
        for k in range(rng.randint(1, 5)):
            value = bytes(rng.choice(b"ab\r\n-xYz\x00") for _ in range(rng.randint(0, 40)))
            if B in value or value.endswith(b"\r"):
                value = value.replace(B, b"").rstrip(b"\r")
            parts.append((f"f{k}", value, "f.bin" if rng.random() < 0.3 else None))
        body = _form(*parts)
        fields = form_fields(body, B)
        assert [(f.name, body[f.start:f.end]) for f in fields] == [(n, v) for n, v, _ in parts]
        out = with_field(body, B, "f0", "new") if parts[0][2] is None else body
        if parts[0][2] is None:
            assert out == _form(("f0", b"new", None), *parts[1:])


@pytest.mark.parametrize("body, why", [
    (b"", "does not end"),
    (b"--xYz0123\r\nContent-Disposition: form-data; name=\"a\"\r\n\r\nvalue", "does not end"),
    (b"garbage", "malformed"),
    (b"--xYz0123\r\nContent-Type: text/plain\r\n\r\nv\r\n--xYz0123--\r\n", "no Content-Disposition"),
    (b"--xYz0123\r\nContent-Disposition: form-data\r\n\r\nv\r\n--xYz0123--\r\n", "no name"),
])
def test_a_broken_form_is_refused(body: bytes, why: str) -> None:
    with pytest.raises(FormError, match=why):
        form_fields(body, B)
