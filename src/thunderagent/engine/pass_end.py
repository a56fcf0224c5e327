"""What the simulated engine hands out when a pass ends: tokens, finishes, KV events.

Two ways, one model. Live (``serve``), every token becomes a ``TokenOutput`` the server streams. In
accounting mode (the simulator's replays, ``SimulatedEngine(..., accounting=TokenAccounting())``)
only first tokens and finishes become outputs, and the tokens in between are counted into the
accounting record (``engine/accounting.py``): same scheduling, same times, same KV events, no
per-token objects. Kept apart from the packing code so the engine module stays about scheduling.
"""

from __future__ import annotations

from thunderagent.engine.sim_state import DONE, RUNNING, _Pass, _Seq
from thunderagent.engine.stretch import DecodeStretch
from thunderagent.types import FinishReason, TokenOutput


class PassEnd(DecodeStretch):
    """A link of :class:`~thunderagent.engine.simulated.SimulatedEngine` (``engine/fields.py``): the end of a pass."""

    def _end_pass(self) -> None:
        p = self._pass
        assert p is not None
        if p is self._plain:
            self._end_plain()
            return
        self._pass = None
        t = self._pass_end
        prev = self._last_end
        self._last_end = t
        ts = t / 1e9
        out = self._outbox
        self._events.extend(p.events)
        for seq in p.rejected:  # (one that outgrew the pool while decoding has tokens to count)
            out.append(TokenOutput(seq.req.request_id, [], ts, seq.plen, 0, True, FinishReason.ABORT))
            self._count_final(seq)
        if self._acct is None:
            if self._emit_live(p, ts):
                self._running = [s for s in self._running if s.state == RUNNING]
            return
        if self._emit_counted(p, t, ts, prev):
            self._running = [s for s in self._running if s.state == RUNNING]
        self._open_stretch(t)

    def _emit_live(self, p: _Pass, ts: float) -> bool:
        """Every token as an output (the server streams them)."""
        out = self._outbox
        tok = self._text.token
        finished = False
        for seq in p.emit:
            if seq.state != RUNNING:  # aborted while the pass ran
                continue
            req = seq.req
            g = seq.generated
            ids: list[int]
            reason = None
            if g >= req.max_tokens:  # max_tokens == 0: done once the prompt is in
                ids, reason = [], FinishReason.LENGTH
            elif g == seq.natural:  # the model samples EOS (not returned as a token)
                ids, reason = [], FinishReason.STOP
            else:
                ids = [tok(seq.seed, g + req.resumed)]
                g += 1
                seq.generated = g
                self._dec_tokens += seq.plen + 1 if g == 1 else 1
                if g >= req.max_tokens:
                    reason = FinishReason.LENGTH
            if reason is None:
                out.append(TokenOutput(req.request_id, ids, ts, seq.plen, seq.cached))
                continue
            out.append(TokenOutput(req.request_id, ids, ts, seq.plen, seq.cached, True, reason))
            self._finish(seq)
            finished = True
        return finished

    def _emit_counted(self, p: _Pass, t: int, ts: float, prev: int) -> bool:
        """Accounting mode: first tokens and finishes as outputs, the rest counted. The decoders
        that also emitted at ``prev`` (the engine's previous pass end) share one latency value."""
        acct = self._acct
        assert acct is not None
        out = self._outbox
        tok = self._text.token
        finished = False
        same = 0
        dec = 0  # added to ``_dec_tokens`` once at the end (``_finish`` subtracts; integer sums commute)
        for seq in p.emit:
            if seq.state != RUNNING:  # aborted while the pass ran
                continue
            req = seq.req
            g = seq.generated
            mt = req.max_tokens
            ids: list[int]
            if g >= mt:  # max_tokens == 0: done once the prompt is in
                ids, reason = [], FinishReason.LENGTH
            elif g == seq.natural:  # the model samples EOS (not returned as a token)
                ids, reason = [], FinishReason.STOP
            else:
                last = seq.last_ns
                seq.last_ns = t
                seq.generated = g + 1
                if g:  # not its first token: an inter-token latency
                    if last == prev:
                        same += 1
                    else:
                        acct.add_itl((ts - last / 1e9) * 1e3, 1)
                    dec += 1
                    if g + 1 < mt:
                        continue
                else:
                    dec += seq.plen + 1
                    if 1 < mt:
                        out.append(TokenOutput(req.request_id, [tok(seq.seed, req.resumed)], ts, seq.plen,
                                               seq.cached))
                        continue
                ids, reason = [tok(seq.seed, g + req.resumed)], FinishReason.LENGTH
            out.append(TokenOutput(req.request_id, ids, ts, seq.plen, seq.cached, True, reason))
            self._finish(seq)
            finished = True
        self._dec_tokens += dec
        if same:
            acct.add_itl((ts - prev / 1e9) * 1e3, same)
        return finished

    def _finish(self, seq: _Seq) -> None:
        g = seq.generated
        if g:
            self._dec_tokens -= seq.plen + g
        seq.state = DONE
        self._bm.release(seq.table)
        del self._seqs[seq.req.request_id]
        self._count_final(seq)

    def _count_final(self, seq: _Seq) -> None:
        """Accounting mode: a request leaves; its token count and last token time for the driver."""
        if self._acct is not None:
            g = seq.generated
            self._acct.finals[seq.req.request_id] = (g, seq.last_ns / 1e9 if g else -1.0)
