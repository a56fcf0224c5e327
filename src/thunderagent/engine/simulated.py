"""The simulated engine: the vLLM engine model of NVIDIA Dynamo 1.6.1's mocker (``dynamo.mocker``, shipped in
the ``ai-dynamo-runtime`` wheel of the ``compare`` extra), rebuilt in Python.

One forward pass at a time, back to back. A pass starts at ``max(previous end, arrival)``; requests arriving during a
pass join the waiting queue at its end (one arriving exactly at a boundary joins the pass starting then). Packing
(§2.2): running requests first in admission order (a decoder takes 1 token, a partial prefill its next chunk), then
FIFO admissions gated by vLLM's block check (§2.3). Prefix hits (§2.4) are chains of cached full blocks capped at
``floor((len-1)/bs)``, and blocks a request computes are visible to later requests of the same pass. Allocation
failure preempts the last running request (LIFO, recompute; §2.5); with ``preempt`` (``routing.preempt_enabled``) a
waiting request may also evict lower-priority running ones when it pays (``engine/preemption.py``). Pass time: §3.

A pass is decided when it starts (as in the mocker); its tokens and KV events come out when it ends. Time is integer
nanoseconds inside (the mocker's pass ends are whole ns too, and long replays accumulate no float drift); seconds at
the API.

Driver contract: add every arrival of an instant before calling ``next_wakeup()`` for it.
``advance``/``add_request``/``abort``/``load`` first run the passes ending by ``now``; a pass due to
*start* exactly at ``now`` is fixed only by ``next_wakeup()`` or a later call, so arrivals of that
instant still join it.

Accounting mode (``accounting=TokenAccounting()``, the simulator's replays; never the live server, which streams every
token): only first tokens and finishes become outputs, the tokens between are counted (``engine/pass_end.py``), plain
decode passes cost O(1) and ``next_wakeup`` gives the end of a plain stretch rather than of the pass in flight
(``engine/stretch.py``). Same passes, times, KV events and loads as the live mode (tests/unit/test_sim_accounting.py).
"""

from __future__ import annotations

from collections import deque
from heapq import heappush

from thunderagent.config import NodeConfig
from thunderagent.engine.accounting import TokenAccounting
from thunderagent.engine.blocks import BlockManager
from thunderagent.engine.pass_end import PassEnd
from thunderagent.engine.preemption import PreemptKnobs, PriorityPreemption
from thunderagent.engine.textgen import CorpusText, TextSource
from thunderagent.engine.timing import TimingModel, make_timing
from thunderagent.types import EngineRequest, FinishReason, KvEvent, LoadReport, TokenOutput

from thunderagent.engine.sim_state import (  # noqa: F401  (PassInfo is part of this module's API)
    BLOCKED, BUFFERED, DONE, NEVER, RUNNING, SCHEDULED, SELF_PREEMPTED, WAITING, PassInfo, _Pass, _Seq, extend_hashes,
    text_seed,
)


def _ns(t: float) -> int:
    return round(t * 1e9)


_FOREVER = 1 << 62  # ``_quiet_ns`` of an engine with nothing to run and nothing buffered


class SimulatedEngine(PassEnd):
    """Engine protocol implementation backed by the mocker model (see module docstring; handoffs: kv_handoff.py)."""

    def __init__(
        self,
        worker_id: str,
        node: NodeConfig,
        *,
        eos_token_id: int = 256,
        text: TextSource | None = None,
        cache_generated: bool = True,
        timing: TimingModel | None = None,
        preempt: PreemptKnobs | None = None,
        accounting: TokenAccounting | None = None,
    ) -> None:
        self.worker_id = worker_id
        self.block_size = node.block_size
        self.node = node
        self.eos_token_id = eos_token_id
        self._bs = node.block_size
        self._max_seqs = node.max_batch_size
        self._max_tokens = node.max_num_batched_tokens
        self._chunked = node.enable_chunked_prefill
        self._total_kv = node.kv_blocks * node.block_size
        self._timing = timing or make_timing(node.timing)
        # routing.preempt_enabled: a waiting request may evict lower-priority running ones when it pays
        self._pp = None if preempt is None else PriorityPreemption(preempt, self._timing, self._total_kv,
                                                                   self._max_tokens)
        self._text = text or CorpusText()
        self._tokens = getattr(self._text, "tokens", None)  # optional bulk accessor: faster block hashing
        self._cache_gen = cache_generated
        self._acct = accounting  # replays: tokens counted, not handed out one by one (engine/pass_end.py)
        self._plain = _Pass(0, 0)  # plain decode stretches, accounting mode only (engine/stretch.py)
        self._plain_left = self._plain_done = self._plain_A = 0
        self._ahead: deque[int] = deque()
        self._bm = BlockManager(node.kv_blocks, node.block_size, worker_id)
        self._seqs: dict[str, _Seq] = {}
        self._arrivals: deque[_Seq] = deque()
        self._waiting: deque[_Seq] = deque()
        self._running: list[_Seq] = []
        self._outbox: list[TokenOutput] = []
        self._events: list[KvEvent] = []
        self._pass: _Pass | None = None
        self._pass_end = NEVER
        self._last_end = NEVER
        self._seen_ns = 0
        self._pid = 0
        self._stalled = False
        self._q_prefill = 0  # prompt tokens not computed yet: buffered + waiting + partial prefills
        # Of those, the tokens queued requests are expected to find cached (matched at arrival). Reported load
        # subtracts them: a queued request mostly hitting the cache is little work (counting it all repels routing).
        self._q_hit = 0
        self._dec_tokens = 0  # sum of sequence lengths of running requests past their first token
        self.preemptions = 0  # allocation failures (LIFO, vLLM's)
        self.priority_preemptions = 0  # victims evicted for a higher-priority waiting request (``_pp``)
        self.busy_ns = 0  # time spent in passes (utilization = busy / elapsed)
        self.prefill_tokens = 0  # prompt tokens computed (cache hits excluded, recomputes included)
        self.last_pass: PassInfo | None = None
        # From when the last ``load()`` report may be out of date (ns; -1: at once). Set by ``load`` only;
        # cleared (``_touch``) by every call that may change the engine, which tells ``watch_load``'s heap.
        self._quiet_ns = -1
        self._watch: tuple[list[tuple[int, int]], int] | None = None
        self._handoff_init()

    @property
    def blocks(self) -> BlockManager:
        self._touch()  # the caller may change the pool
        return self._bm

    # ------------------------------------------------------------------------------ protocol
    def add_request(self, req: EngineRequest, now: float) -> None:
        rid = req.request_id
        if rid in self._seqs:
            raise ValueError(f"duplicate request id {rid!r}")
        prompt = req.prompt_tokens
        plen = len(prompt)
        if plen == 0:
            raise ValueError(f"request {rid!r} has an empty prompt")
        bs = self._bs
        if len(req.block_hashes) != plen // bs:
            raise ValueError(f"request {rid!r}: {len(req.block_hashes)} block hashes, {plen // bs} full blocks")
        t = _ns(now)
        self._touch()
        self._run_until(t)
        req.arrival = now
        if req.remote_decode or req.kv_from is not None:
            self._handoff_arrival(req)
        hashes = req.block_hashes
        seed = text_seed(req, bs)  # a migrated request continues its original completion
        natural = -1 if req.ignore_eos else max(0, self._text.natural_length(seed) - req.resumed)
        seq = _Seq(req, plen, hashes, seed, natural, t)
        if req.check_hashes is not None and len(req.check_hashes) == len(hashes):
            seq.checks = req.check_hashes
        seq.expect = self._bm.match_prefix(hashes, (plen - 1) // bs)[0] * bs
        self._seqs[rid] = seq
        self._q_prefill += plen
        self._q_hit += seq.expect
        arr = self._arrivals
        i = len(arr)
        while i and arr[i - 1].arrival_ns > t:  # an out-of-order driver: keep the buffer sorted
            i -= 1
        arr.insert(i, seq)

    def abort(self, request_id: str, now: float) -> None:
        t = _ns(now)
        self._touch()
        self._run_until(t)
        self._materialize()
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            return
        st = seq.state
        self._unexpect(seq)
        if st == BUFFERED:
            self._arrivals.remove(seq)
        elif st == WAITING:
            self._waiting.remove(seq)
        else:  # running; if the pass in flight computes it, its token is dropped at the pass end
            self._running.remove(seq)
            self._bm.release(seq.table)
            if seq.generated:
                self._dec_tokens -= seq.plen + seq.generated
        self._q_prefill -= seq.plen - min(seq.computed, seq.plen)
        seq.state = DONE
        self._count_final(seq)
        self._stalled = False
        self._outbox.append(TokenOutput(request_id, [], now, seq.plen, seq.cached, True, FinishReason.ABORT))

    def advance(self, now: float) -> list[TokenOutput]:
        self._touch()
        self._run_until(_ns(now))
        out = self._outbox
        self._outbox = []
        return self._handoff_outputs(out) if self._remote_jobs else out

    def next_wakeup(self) -> float | None:
        self._touch()  # it may begin a pass (admissions change the load)
        while self._pass is None:
            s = self._next_start()
            if s is None:  # idle; outputs a load report's run left behind (rejections: no time) are due now
                return self._seen_ns / 1e9 if self._outbox else None
            if self._begin_pass(s):
                break
        if self._pass is self._plain:  # replays: wake at the stretch's end (engine/stretch.py)
            return self._plain_horizon() / 1e9
        return self._pass_end / 1e9

    def drain_events(self) -> list[KvEvent]:
        ev = self._events
        self._events = []
        return ev

    def load(self, now: float) -> LoadReport:
        self._run_until(_ns(now))
        bm = self._bm
        waiting = len(self._waiting) + len(self._arrivals)
        # Nothing changes before the pass in flight ends or the next one starts (:meth:`load_unchanged`).
        if self._pass is not None:
            q = self._pass_end
        else:
            s = self._next_start()
            q = _FOREVER if s is None else s + 1  # a pass starting at s runs for ``_run_until(t > s)`` only
        self._quiet_ns = q
        if self._watch is not None and q != _FOREVER:
            heappush(self._watch[0], (q, self._watch[1]))
        return LoadReport(
            self.worker_id, now, len(self._running), waiting, self._q_prefill - self._q_hit, self._dec_tokens,
            bm.active_blocks, bm.cached_blocks, bm.num_blocks,
        )  # fmt: skip

    def watch_load(self, heap: list[tuple[int, int]], slot: int) -> None:
        """A replay driver's heap of ``(ns, slot)``: from ``ns`` on this engine's load report may differ
        from its last one (-1: at once). Each report and each change by another call pushes an entry;
        entries are not removed, so a popped one may be stale (:meth:`load_unchanged` tells)."""
        self._watch = (heap, slot)
        heappush(heap, (-1, slot))

    def _touch(self) -> None:
        if self._quiet_ns >= 0 and self._watch is not None:
            heappush(self._watch[0], (-1, self._watch[1]))
        self._quiet_ns = -1

    def load_unchanged(self, now: float) -> bool:
        """True when ``load(now)`` would repeat the last ``load`` report but for its time: nothing was
        called on the engine since, and no pass ends (or starts) by ``now`` (``sim/driver.py`` skips it)."""
        return _ns(now) < self._quiet_ns

    def cache_snapshot(self) -> list[int]:
        return self._bm.cached_hashes()

    def cache_checks(self) -> list[int] | None:
        """Check hashes of :meth:`cache_snapshot`'s hashes, same order (None: some block has none)."""
        return self._bm.cached_checks()

    def reset(self) -> None:
        """Drop the prefix cache (emits ``AllBlocksCleared``); running requests keep their blocks."""
        self._touch()
        if self._pass is not None:  # keep sequence order: the pass's events go out first
            self._events.extend(self._pass.events)
            self._pass.events = []
        self._bm.reset()
        self._events.extend(self._bm.drain_events())

    # ------------------------------------------------------------------------------ clock
    def _next_start(self) -> int | None:
        if (self._running or self._waiting) and not self._stalled:
            return self._last_end
        if self._arrivals:
            t = self._arrivals[0].arrival_ns
            return t if t > self._last_end else self._last_end
        return None

    def _run_until(self, t: int) -> None:
        """End the passes that end at or before ``t``; fix the passes that start before ``t``."""
        if t > self._seen_ns:
            self._seen_ns = t  # the latest instant asked for: outputs up to it are due (``next_wakeup``)
        while True:
            if self._pass is None:
                s = self._next_start()
                if s is None or s >= t:
                    return
                if not self._begin_pass(s):  # nothing could run: wait for an arrival or an abort
                    continue
            if self._pass_end > t:
                return
            self._end_pass()

    # ------------------------------------------------------------------------------ packing
    def _begin_pass(self, s: int) -> bool:
        """Pack the pass starting at ``s`` (vLLM's scheduler step) and fix its end time. False when
        nothing could run (no pass in flight: callers learn it here, as a re-read of ``_pass`` after
        the call would be narrowed away by the type checker, and the compiled build follows it)."""
        arr = self._arrivals
        if self._plain_left or self._plain_done:
            if self._plain_left and not (arr and arr[0].arrival_ns <= s):
                self._begin_plain(s)
                return True
            self._materialize()
        self._pid += 1
        p = _Pass(self._pid, self._max_tokens)
        while arr and arr[0].arrival_ns <= s:
            self._enqueue(arr.popleft())
        self._stalled = False
        self._step_running(p)
        self._admit_waiting(p)
        # Pass time: T is the mocker's n*(floor(sum(prefix+chunk)/n) - floor(sum(prefix)/n)).
        n = p.n_pf
        T = n * (p.isl // n - p.prefix // n) if n else 0
        p.events = self._bm.drain_events()
        # Nothing can run (blocks pinned...): idle till a change. A pass that only preempted is a change:
        # the next one admits the victim or, grown past the pool, rejects it (idling stranded its queue).
        if not (p.progress or p.emit or p.rejected or p.preempted):
            self._stalled = True
            self._last_end = max(self._last_end, s)
            self._events.extend(p.events)
            return False
        dur = round(self._timing.pass_time(T, p.A, self._total_kv, p.A > 0) * 1e9)
        self.busy_ns += dur
        self.prefill_tokens += p.isl - p.prefix
        self._pass = p
        self._pass_end = s + dur
        self.last_pass = PassInfo(s / 1e9, (s + dur) / 1e9, T, p.A, n, p.n_dec, self._max_tokens - p.budget)
        return True

    def _step_running(self, p: _Pass) -> None:
        """(a) Running requests, in admission order, while the token budget lasts."""
        bm, bs = self._bm, self._bs
        running = self._running
        emit = p.emit
        pid = p.pid
        # The fast path's accumulators live in locals (a pass visits every running request) and are written
        # back to ``p`` before anything else reads or changes it (``_schedule``, which may undo earlier entries
        # of this pass when it preempts). Integer sums: same totals.
        budget = p.budget
        A = nd = 0
        n = len(running)
        i = 0
        while i < n and budget > 0:
            seq = running[i]
            g = seq.generated
            L = seq.plen + g
            c = seq.computed
            # Fast path, the common case: a decoder computes its last sampled token.
            if g and c == L - 1 and (L <= len(seq.table) * bs or bm.append_fresh(seq.table)):
                seq.computed = L
                seq.s_pass = pid
                seq.s_before = c
                budget -= 1
                A += L
                nd += 1
                emit.append(seq)
                if L % bs == 0:  # the decode filled a block: cache it
                    self._cache(seq, c // bs, L // bs)
                i += 1
                continue
            p.budget = budget
            p.A += A
            p.n_dec += nd
            A = nd = 0
            r = self._schedule(seq, p, False, 0)
            budget = p.budget
            n = len(running)
            if r == SCHEDULED:
                i += 1
            elif r == BLOCKED:
                break
            # SELF_PREEMPTED: it left ``running``; the next one moved into slot i
        p.budget = budget
        p.A += A
        p.n_dec += nd

    def _admit_waiting(self, p: _Pass) -> None:
        """(b) Admissions from the waiting queue (FIFO / priority), with head-of-line blocking."""
        bm, bs = self._bm, self._bs
        running = self._running
        waiting = self._waiting
        nb = bm.num_blocks
        tried = None  # the head a priority preemption was tried for in this pass (once per head)
        while not p.preempted and waiting and p.budget > 0:
            seq = waiting[0]
            full = len(running) >= self._max_seqs
            if full and self._pp is None:
                break
            L = seq.plen + seq.generated
            need = -(-L // bs)
            if need > nb:  # can never fit this pool: reject outright
                self._reject_head(p)
                continue
            # The last token must be computed to get logits: cap the hit at floor((len-1)/bs).
            cap = (L - 1) // bs if seq.generated < seq.req.max_tokens else L // bs
            hits, active_hits = bm.match_prefix(seq.hashes, cap)
            if not self._chunked and p.budget == self._max_tokens and seq.plen - min(seq.plen, hits * bs) > p.budget:
                self._reject_head(p)  # its prompt needs more than a whole pass: it would block the queue for good
                continue
            deficit = need - active_hits - (nb - bm.active_blocks)
            if full or deficit > 0:
                if self._pp is None or tried is seq or not self._preempt_for(seq, p, hits, deficit, full):
                    break
                tried = seq
                continue
            waiting.popleft()
            before = p.preempted
            r = self._schedule(seq, p, True, hits * bs)
            if r != SCHEDULED:
                waiting.insert(p.preempted - before, seq)  # behind victims it pushed to the front
                break

    def _schedule(self, seq: _Seq, p: _Pass, from_waiting: bool, cached: int) -> int:
        """Schedule ``seq``'s next chunk in pass ``p`` (vLLM ``schedule_request``)."""
        bm, bs = self._bm, self._bs
        P = seq.plen
        g = seq.generated
        L = P + g
        old = seq.computed
        # A preempted request recomputes up to its last sampled token (L-1); the next pass is then an ordinary
        # decode step over the full sequence, which emits the next token.
        K = L - 1 if g and old < L - 1 else L
        before = old + cached
        pb = before if before < P else P
        remaining = K - before
        if P > pb and not self._chunked and P - pb > p.budget:
            return BLOCKED
        want = remaining if remaining < p.budget else p.budget
        if want <= 0 < remaining:
            return BLOCKED
        after = before + want
        need = -(-after // bs)
        hits = cached // bs
        while need > len(seq.table) and not bm.allocate(seq.table, seq.hashes, hits, need):
            victim = self._preempt_last(p)
            if victim is None:
                return BLOCKED
            if victim is seq:
                return SELF_PREEMPTED
        seq.computed = after
        seq.s_pass = p.pid
        seq.s_before = before
        if after // bs > before // bs:
            self._cache(seq, before // bs, after // bs)
        pa = after if after < P else P
        if pa > pb:
            p.n_pf += 1
            p.isl += pa
            p.prefix += pb
        p.budget -= want
        p.progress = True
        self._q_prefill -= pa - (old if old < P else P)
        if after == L:
            p.emit.append(seq)
            if g:
                p.A += L
                p.n_dec += 1
        if from_waiting:
            self._admit(seq, cached if cached < P else P, L if g else 0)
        return SCHEDULED

    def _admit(self, seq: _Seq, cached: int, decode_tokens: int) -> None:
        """``seq`` moves from waiting to running, ``cached`` prompt tokens served from the cache."""
        self._unexpect(seq)
        seq.state = RUNNING
        running = self._running
        pr = seq.req.priority
        if running and running[-1].req.priority < pr:
            # vLLM's priority policy: running requests get the budget (and escape LIFO preemption) in priority
            # order; equal priorities keep admission order, so traces without priorities schedule as before
            i = len(running)
            while i and running[i - 1].req.priority < pr:
                i -= 1
            running.insert(i, seq)
        else:
            running.append(seq)
        if cached > seq.cached:
            seq.cached = cached
        self._dec_tokens += decode_tokens

    def _enqueue(self, seq: _Seq, front: bool = False) -> None:
        """Waiting queue: higher ``priority`` first, FIFO within a priority (``front``: first of its tier)."""
        seq.state = WAITING
        w = self._waiting
        pr = seq.req.priority
        i = len(w)  # almost always stays len(w): an append
        while i and (w[i - 1].req.priority < pr or front and w[i - 1].req.priority == pr):
            i -= 1
        w.insert(i, seq)

    def _cache(self, seq: _Seq, first: int, last: int) -> None:
        """Register ``seq``'s blocks ``first..last-1``, now full, in the prefix cache."""
        hs = seq.hashes
        if last > len(hs):
            if self._cache_gen:
                hs = extend_hashes(seq, last, self._bs, self._text, self._tokens)
            else:
                last = len(hs)
                if last <= first:
                    return
        cs = seq.checks
        self._bm.cache_blocks(seq.table, hs, first, last, cs if cs is not None and len(cs) >= last else None)
