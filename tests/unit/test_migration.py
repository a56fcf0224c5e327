"""Mid-stream migration with simulated workers: a request whose worker fails, hangs or dies after
it streamed tokens continues on another worker, in the same stream, with exactly the tokens an
unbroken run produces (the simulated engine's completion is a function of the original prompt)."""

from __future__ import annotations


import pytest

from thunderagent.assemble import build_fleet
from thunderagent.config import parse_config
from thunderagent.control.fleet import Fleet, Generation
from thunderagent.frontend.tokenizer import ByteTokenizer
from thunderagent.types import FinishReason, TokenOutput

from support.faults import crash_engine

PROMPT = list(b"Tell me about the river and the mill, please. " * 3)


def make_config(workers: int = 2, limit: int = 3) -> object:
    return parse_config({
        "control_plane": {"heartbeat_interval": 0.05, "heartbeat_misses": 4},
        "simulation": {"speedup": 2.0},
        "routing": {"seed": 7, "migration_limit": limit},
        "execution_group": {"nodes": [{"count": workers}]},
    }, "test")


async def started(workers: int = 2, limit: int = 3) -> Fleet:
    fleet = build_fleet(make_config(workers, limit), ByteTokenizer())  # type: ignore[arg-type]
    await fleet.start()
    return fleet


async def run(fleet: Fleet, gen: Generation, fault_after: int = -1, fault=None) -> list[TokenOutput]:
    """All outputs of ``gen``; ``fault(gen)`` is called once ``fault_after`` tokens came."""
    outs: list[TokenOutput] = []
    n = 0
    async for out in fleet.outputs(gen):
        outs.append(out)
        n += len(out.token_ids)
        if fault is not None and n >= fault_after:
            fault(gen)
            fault = None
    return outs


def ids(outs: list[TokenOutput]) -> list[int]:
    return [t for o in outs for t in o.token_ids]


async def reference(fleet: Fleet, max_tokens: int = 40) -> list[int]:
    gen = await fleet.start_generation(PROMPT, max_tokens, ignore_eos=True)
    outs = await run(fleet, gen)
    assert outs[-1].finish_reason == FinishReason.LENGTH and gen.migrations == 0
    return ids(outs)


def fail_engine(gen: Generation) -> None:
    """The engine of the request's worker raises in its next step (a crashed engine)."""
    crash_engine(gen.worker)
    gen.worker._wake.set()  # type: ignore[attr-defined]


def kill(gen: Generation) -> None:
    """The request's worker stops dead: no output, no heartbeat, no keepalive (kill -9)."""
    for t in gen.worker._tasks:  # type: ignore[attr-defined]
        t.cancel()


def hang(gen: Generation) -> None:
    """The request's worker hangs as the fleet sees it (its engine keeps running)."""
    gen.worker.heartbeats_paused = True  # type: ignore[attr-defined]


@pytest.mark.parametrize("fault", [fail_engine, kill, hang], ids=["engine_failed", "killed", "hung"])
async def test_cut_request_continues_on_another_worker_with_the_same_tokens(fault) -> None:
    fleet = await started()
    try:
        want = await reference(fleet, 200)  # long enough to outlive a lease (0.2 s): about 0.6 s
        assert len(want) == 200
        gen = await fleet.start_generation(PROMPT, 200, ignore_eos=True)
        first = gen.worker.worker_id
        outs = await run(fleet, gen, 10, fault)
        assert ids(outs) == want, "no token lost, none repeated, the same completion"
        last = outs[-1]
        assert last.finished and last.finish_reason == FinishReason.LENGTH
        assert gen.migrations == 1 and gen.tried == (first,) and gen.worker.worker_id != first
        # usage as the client sent it: the original prompt, cache hits capped at it
        assert gen.prompt_tokens == len(PROMPT) and all(o.prompt_tokens == len(PROMPT) for o in outs)
        assert all(o.cached_tokens <= len(PROMPT) for o in outs)
        assert gen.origin is not None and len(gen.request.prompt_tokens) == len(PROMPT) + gen.request.resumed
        assert fleet.metrics.migrations._metrics  # type: ignore[attr-defined]
        counters = fleet.metrics.migrations._metrics.values()  # type: ignore[attr-defined]
        assert sum(c._value.get() for c in counters) == 1
    finally:
        await fleet.stop()


async def test_natural_stop_is_kept_across_a_migration() -> None:
    """Without ignore_eos the completion stops where the unbroken run stops (EOS index carried)."""
    fleet = await started()
    try:
        gen = await fleet.start_generation(PROMPT, 1000)
        want = ids(await run(fleet, gen))
        gen = await fleet.start_generation(PROMPT, 1000)
        outs = await run(fleet, gen, 5, fail_engine)
        assert ids(outs) == want and outs[-1].finish_reason == FinishReason.STOP and gen.migrations == 1
    finally:
        await fleet.stop()


async def test_no_migration_when_off_or_no_other_worker() -> None:
    for workers, limit in ((2, 0), (1, 3)):
        fleet = await started(workers, limit)
        try:
            want = await reference(fleet)
            gen = await fleet.start_generation(PROMPT, 40, ignore_eos=True)
            outs = await run(fleet, gen, 10, fail_engine)
            got = ids(outs)
            assert outs[-1].finish_reason == FinishReason.ERROR and gen.migrations == 0
            assert 10 <= len(got) < 40 and got == want[: len(got)]
            assert fleet.metrics.migration_failed._value.get() == 1  # type: ignore[attr-defined]
        finally:
            await fleet.stop()


async def test_migration_limit_bounds_the_moves() -> None:
    fleet = await started(3, limit=1)
    try:
        want = await reference(fleet)
        gen = await fleet.start_generation(PROMPT, 40, ignore_eos=True)
        outs: list[TokenOutput] = []
        async for out in fleet.outputs(gen):
            outs.append(out)
            if len(ids(outs)) in (8, 16) and not out.finished and not gen.worker.failed:  # type: ignore[attr-defined]
                fail_engine(gen)
        got = ids(outs)
        assert gen.migrations == 1 and outs[-1].finish_reason == FinishReason.ERROR
        assert 16 <= len(got) < 40 and got == want[: len(got)]
    finally:
        await fleet.stop()


# -- the client's text across a cut, when the engine sent text (vLLM) -------------------------------
async def _text(outs: list[TokenOutput]) -> str:
    from thunderagent.frontend.streaming import stream_text

    async def it():  # type: ignore[no-untyped-def]
        for o in outs:
            yield o

    return "".join([c.text async for c in stream_text(it(), ByteTokenizer().decoder(), [])])


def _out(ids: bytes, text: str | None, last: bool = False) -> TokenOutput:
    return TokenOutput("r", list(ids), 0.0, 4, 0, last, FinishReason.LENGTH if last else None, text=text)


async def test_text_goes_on_from_the_engines_text_when_a_continuation_sends_none() -> None:
    """The engine's text stops at the cut (``settle`` drops a continuation's: vLLM's first one can
    repeat the prompt); the frontend decodes the rest, with the bytes the engine held back (an
    incomplete character) and without repeating what it emitted."""
    e = "é".encode()
    outs = [_out(b"a", "a"), _out(b"b", "b"), _out(e[:1], ""),  # the engine holds back half of "é"
            _out(e[1:], None), _out(b"!", None, last=True)]
    assert await _text(outs) == "abé!"
    # cut right after an emitted character, and an unbroken engine-text stream: unchanged
    assert await _text([_out(b"a", "a"), _out(e, None), _out(b"!", None, last=True)]) == "aé!"
    assert await _text([_out(b"a", "a"), _out(e[:1], ""), _out(e[1:], "é", last=True)]) == "aé"
