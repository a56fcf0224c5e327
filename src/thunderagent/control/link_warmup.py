"""Warming up the prefill/decode links (``kv_cache_transfer.warmup_tokens``): one handoff per link before clients.

Why: the first transfer between two vLLM servers pays NIXL's handshake (1 to 30 s on the CPU test servers),
and a link's estimate is the configured default until a transfer on it is measured. Without a warm-up both
fall on a client's request: its time to first token carries the handshake, and the conditional
disaggregation decision prices that link on a guess.

What: on the health tick, each link from a ``role: prefill`` worker to a decode-capable worker, both
routable, that has not been warmed up runs one plan through the live flow (:meth:`DisaggFlow.run_plan`: the
same halves, plane accounting and fallbacks as a client's): a prompt of ``warmup_tokens`` tokens (whole
blocks) under a cache salt of its own (nothing it computes is found by a client's request), one token
asked. Its decode worker's measure of the pull then teaches the link, as a client's would (``control/pd_plane.py``:
a simulated worker's pull, a vLLM server's NIXL metrics). One warm-up runs at a time (a probe must not share
its link with another); a failed one is tried again after :data:`RETRY_S`, :data:`MAX_TRIES` times in all.
A link whose worker left the fleet is forgotten: added again, it is warmed up again.

Results are in ``/health`` (``pd_warmup``: per link, ok or the cause, and seconds) and in the flow's own
metrics (``thunderagent_pd_transfers_*``, fallbacks by cause).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass

from thunderagent.control.disagg_flow import DisaggFlow
from thunderagent.decision import PdPlan
from thunderagent.execution.handle import WorkerHandle
from thunderagent.kv.hashing import block_hashes, hash_seed
from thunderagent.transfer.plane import TransferPlane
from thunderagent.types import EngineRequest, WorkerState

log = logging.getLogger(__name__)

#: seconds before a failed warm-up of a link is tried again
RETRY_S = 30.0
MAX_TRIES = 3
#: longest a warm-up may take, both halves (the prefill half alone gives up after ``PREFILL_TIMEOUT_S``)
TIMEOUT_S = 300.0
#: the warm-ups' cache salt: their blocks are never a client's prefix
SALT = "thunderagent-link-warmup"
#: token ids of the warm-up prompt cycle through this range: low enough for any real vocabulary (every
#: byte-level one has 256 byte tokens; vLLM refuses an id past its vocabulary: the test model's has about 520),
#: and not a run of one id
_TOKENS = (10, 266)


@dataclass(slots=True)
class Warmed:
    """A link's last warm-up."""

    ok: bool
    cause: str  # "ok", or why its transfer did not land (the flow's fallback causes, "timeout", "error: ...")
    seconds: float
    tries: int
    retry_at: float  # (failed: when it may be tried again)


class LinkWarmup:
    def __init__(self, tokens: int, block_size: int, flow: DisaggFlow, plane: TransferPlane,
                 workers: Mapping[str, WorkerHandle], clock: Callable[[], float]) -> None:
        n = max(block_size, tokens - tokens % block_size)  # whole blocks (at least one): full blocks move
        lo, hi = _TOKENS
        self.prompt = [lo + (k * 7919) % (hi - lo) for k in range(n)]
        self.seed = hash_seed(SALT)
        self.hashes = block_hashes(self.prompt, block_size, self.seed)
        self.flow = flow
        self.plane = plane
        self.workers = workers
        self.clock = clock
        self.links: dict[tuple[str, str], Warmed] = {}  # (prefill worker, decode worker) -> its last warm-up
        self._task: asyncio.Task[None] | None = None
        self._n = 0

    def tick(self, workers: Sequence[WorkerState], now: float) -> None:
        """Start the next link's warm-up, if one is due and none runs."""
        for link in [k for k in self.links if k[0] not in self.workers or k[1] not in self.workers]:
            del self.links[link]  # a worker left: warmed up again if it comes back
        if self._task is not None and not self._task.done():
            return
        prefill = [w.worker_id for w in workers if w.role == "prefill"]
        decode = [w.worker_id for w in workers if w.role != "prefill"]
        for link in ((p, d) for p in prefill for d in decode):
            last = self.links.get(link)
            if last is not None and (last.ok or last.tries >= MAX_TRIES or last.retry_at > now):
                continue
            self._task = asyncio.create_task(self._warm(link, 0 if last is None else last.tries),
                                             name=f"pd-warmup-{link[0]}-{link[1]}")
            return

    async def _warm(self, link: tuple[str, str], tries: int) -> None:
        src, dst = link
        decode = self.workers.get(dst)
        if decode is None:
            return
        self._n += 1
        n = len(self.prompt)
        req = EngineRequest(f"pd-warmup-{self._n}", self.prompt, list(self.hashes), self.seed, 1, True,
                            cache_salt=SALT)
        plan = PdPlan(src, n, self.plane.bytes_for(n), self.plane.estimate(src, dst, self.plane.bytes_for(n)), 0.0,
                      "link warm-up")
        t0 = self.clock()
        ok, cause = False, "aborted"
        try:
            async with asyncio.timeout(TIMEOUT_S):
                ok, cause, _ = await self.flow.run_plan(req, plan, decode)
        except TimeoutError:
            cause = "timeout"
        except Exception as exc:  # noqa: BLE001 (a warm-up never takes the fleet down; the cause is kept)
            cause = f"error: {exc!r}"
        finally:
            now = self.clock()
            secs = now - t0
            self.links[link] = Warmed(ok, cause, round(secs, 3), tries + 1, now + RETRY_S)
            if ok:
                log.info("link %s -> %s warmed up: %d tokens in %.2f s", src, dst, n, secs)
            else:
                log.warning("link %s -> %s: warm-up failed (%s), try %d of %d", src, dst, cause, tries + 1, MAX_TRIES)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def health(self) -> dict[str, object]:
        return {"pd_warmup": [{"src": s, "dst": d} | {k: v for k, v in asdict(r).items() if k != "retry_at"}
                              for (s, d), r in sorted(self.links.items())]}
