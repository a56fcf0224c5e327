"""Taking requests out of the simulated engine's batch: vLLM's LIFO preemption when a pass cannot
allocate, priority preemption when it pays (``engine/preemption.py`` decides which), and rejecting a
waiting request that can never run.

A link of :class:`~thunderagent.engine.simulated.SimulatedEngine`'s class chain: a victim leaves ``running`` with
recompute semantics (its blocks released, its work in the pass being packed undone) and goes back to
the waiting queue; a rejected request leaves the engine, reported at the pass's end.
"""

from __future__ import annotations

from thunderagent.engine.fields import EngineFields
from thunderagent.engine.sim_state import DONE, WAITING, _Pass, _Seq


class Eviction(EngineFields):
    """A link of :class:`~thunderagent.engine.simulated.SimulatedEngine` (``engine/fields.py``)."""

    def _preempt_for(self, seq: _Seq, p: _Pass, hits: int, deficit: int, full: bool) -> bool:
        """Evict the lower-priority running requests ``seq`` needs room from, when it pays."""
        assert self._pp is not None
        victims = self._pp.victims(seq, self._running, self._bm, hits, deficit, full, self._dec_tokens)
        for v in victims:
            self._evict(v, p)
            # after every higher tier (``seq`` included), first of its own: it was admitted before
            # the others of its tier that wait
            self._enqueue(v, front=True)
        self.priority_preemptions += len(victims)
        return bool(victims)

    def _preempt_last(self, p: _Pass) -> _Seq | None:
        """Allocation failure: LIFO preemption, the victim to the front of the waiting queue."""
        if not self._running:
            return None
        v = self._running[-1]
        self._evict(v, p)
        self._waiting.appendleft(v)
        p.preempted += 1
        self.preemptions += 1
        return v

    def _evict(self, v: _Seq, p: _Pass) -> None:
        """Take ``v`` out of ``running`` with recompute semantics; undo its work in this pass. The
        caller puts it back in the waiting queue."""
        if self._running[-1] is v:
            self._running.pop()
        else:
            self._running.remove(v)
        if v.s_pass == p.pid:
            p.undo(v)
        v.s_pass = -1
        self._q_prefill += min(v.computed, v.plen)
        if v.generated:
            self._dec_tokens -= v.plen + v.generated
        self._bm.release(v.table)
        v.computed = 0
        v.state = WAITING

    def _reject_head(self, p: _Pass) -> None:
        """The waiting queue's head can never run here (longer than the pool, or than a whole pass
        without chunked prefill): it leaves the engine, reported at the end of ``p``."""
        seq = self._waiting.popleft()
        self._seqs.pop(seq.req.request_id, None)
        self._q_prefill -= seq.plen
        self._unexpect(seq)
        seq.state = DONE
        p.rejected.append(seq)

    def _unexpect(self, seq: _Seq) -> None:
        self._q_hit -= seq.expect
        seq.expect = 0
