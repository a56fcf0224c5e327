"""Plain decode stretches of the simulated engine (accounting mode only).

Most passes of a loaded replay are *plain*: every running request is a decoder that computes its
last sampled token, none crosses a block boundary (no allocation, no caching, no KV event), none
finishes, nothing is admitted, rejected or preempted, and no arrival joins. Such a pass changes no
block, no queue and no request's phase; it only adds one token to each running request, so the
next pass has the same shape with ``A`` (the decoders' summed length) grown by the batch size.

When a regular pass ends, :meth:`DecodeStretch._open_stretch` counts how many passes from there on
are certainly plain: the fewest, over the running requests, until one reaches a block boundary,
its last token or its EOS, and none at all when the waiting queue's head could be admitted (its
admission check only reads blocks and the cache, which a plain pass leaves alone). Those passes
then cost O(1) each: the pass time from the timing model, the decoders' token count and one
inter-token latency value shared by all of them. Per-request counters are brought up to date
(:meth:`DecodeStretch._materialize`) before anything reads them: the next regular pass, an abort.
An arrival due at a pass start ends the stretch (that pass is packed the regular way). Outputs are
unchanged because a plain pass has none in accounting mode (its tokens are neither first nor last).
The live server never opens a stretch: it streams every token.
"""

from __future__ import annotations

from thunderagent.engine.kv_handoff import KvHandoff
from thunderagent.engine.sim_state import PassInfo, _Pass


class DecodeStretch(KvHandoff):
    """A link of :class:`~thunderagent.engine.simulated.SimulatedEngine` (``engine/fields.py``): plain decode passes."""

    def _open_stretch(self, t: int) -> None:
        """The regular pass ending at ``t`` is over: count the plain passes that follow."""
        running = self._running
        n = len(running)
        if not n or n > self._max_tokens or not self._head_stuck(n):
            return
        bs = self._bs
        k = 1 << 62
        A = 0
        for seq in running:
            g = seq.generated
            L = seq.plen + g
            if not g or seq.last_ns != t or seq.computed != L - 1:
                return
            # positions L, L+1, ... are plain up to the next block boundary, or none if the table
            # is full (the next token needs a fresh block)
            m = (-(-L // bs) * bs if len(seq.table) * bs >= L else L) - L
            r = seq.req.max_tokens - g - 1  # its last token ends the request: not plain
            if r < m:
                m = r
            nat = seq.natural  # EOS sampled at g == natural: not plain
            if nat >= g and nat - g < m:
                m = nat - g
            if m < k:
                if m <= 0:
                    return
                k = m
            A += L
        self._plain_left = k
        self._plain_A = A

    def _head_stuck(self, n: int) -> bool:
        """The waiting queue admits nothing in a pass of ``n`` decoders, as long as the blocks and
        the cache stay as they are (``_admit_waiting``'s first checks, without side effects)."""
        waiting = self._waiting
        if not waiting:
            return True
        if self._pp is not None:
            return False
        if self._max_tokens - n <= 0 or n >= self._max_seqs:
            return True
        seq = waiting[0]
        bm, bs = self._bm, self._bs
        L = seq.plen + seq.generated
        need = -(-L // bs)
        if need > bm.num_blocks:  # it would be rejected
            return False
        cap = (L - 1) // bs if seq.generated < seq.req.max_tokens else L // bs
        active_hits = bm.match_prefix(seq.hashes, cap)[1]
        return need - active_hits - (bm.num_blocks - bm.active_blocks) > 0

    def _begin_plain(self, s: int) -> None:
        self._pid += 1
        p = self._plain
        p.pid = self._pid
        A = self._plain_A
        ahead = self._ahead
        dur = ahead.popleft() if ahead else round(self._timing.pass_time(0, A, self._total_kv, True) * 1e9)
        self.busy_ns += dur
        self._stalled = False
        self._pass = p
        self._pass_end = s + dur
        n = len(self._running)
        self.last_pass = PassInfo(s / 1e9, (s + dur) / 1e9, 0, A, 0, n, n)

    def _end_plain(self) -> None:
        self._pass = None
        t = self._pass_end
        prev = self._last_end
        self._last_end = t
        n = len(self._running)
        acct = self._acct
        assert acct is not None
        acct.add_itl((t / 1e9 - prev / 1e9) * 1e3, n)
        self._dec_tokens += n
        self._plain_A += n
        self._plain_left -= 1
        self._plain_done += 1

    def _materialize(self) -> None:
        """Bring the running requests' counters up to date and end the stretch; a plain pass in
        flight becomes a regular one (as the regular packing would have scheduled it)."""
        d = self._plain_done
        inflight = self._pass is self._plain
        self._plain_done = 0
        self._plain_left = 0
        self._ahead.clear()
        if not (d or inflight):
            return
        running = self._running
        if d:
            last = self._last_end
            for seq in running:
                seq.generated += d
                seq.computed += d
                seq.last_ns = last
        if inflight:
            pid = self._pid
            p = _Pass(pid, self._max_tokens - len(running))
            for seq in running:
                seq.s_pass = pid
                seq.s_before = seq.computed
                seq.computed += 1
            p.emit = list(running)
            p.A = self._plain_A
            p.n_dec = len(running)
            self._pass = p

    def _plain_horizon(self) -> int:
        """With a plain pass in flight: the end of the last pass of the stretch that is certain to
        run (before the next buffered arrival joins). Nothing observable happens at the ends of
        the passes before it, so a replay driver need not wake there (``next_wakeup``)."""
        e = self._pass_end
        left = self._plain_left - 1
        if left <= 0:
            return e
        arr = self._arrivals
        due = arr[0].arrival_ns if arr else 1 << 62
        ahead = self._ahead
        n = len(self._running)
        A = self._plain_A
        for j in range(left):
            if due <= e:  # that pass starts with an arrival: packed the regular way
                break
            A += n
            if j == len(ahead):
                ahead.append(round(self._timing.pass_time(0, A, self._total_kv, True) * 1e9))
            e += ahead[j]
        return e
