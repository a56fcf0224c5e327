"""Self-tuning cost weights (``routing.autotune``; seed 000 §6, learned scheduling).

:class:`WeightTuner` adjusts the kv_aware cost's hit-versus-load weights (``credit_load_scale``: how
fast the cache credit decays with a worker's backlog; ``contention``: the charge for recomputing what
another worker holds; optionally ``overlap_credit``) from the requests it sees finish, by a
coordinate-wise hill climb on mean TTFT, one weight one step at a time:

1. *try*: the kept weights with one weight one step away (``x step`` or ``/ step``, clamped to its
   bounds; the step starts coarse, ``step``, and is refined as below);
2. *alternate*: the router uses the tried and the kept weights in turn, switching every
   ``switch_every`` finished requests, until each has ``window`` requests that arrived under it (a
   switchback experiment: both arms see the same stretch of traffic, so a drift of the load, a cold
   start or a lull, does not pass for a gain, as it would comparing one window with the next);
3. *judge*: keep the step only if the tried weights' mean TTFT is lower than the kept ones' by more
   than ``z`` standard errors of the difference; otherwise revert and try the next move. A kept move
   is tried again in the same direction, from where it led. A reverted move's samples are pooled into
   its next trial (up to ``pool_trials`` windows, and only while the kept weights stay the same): a
   gain smaller than one trial's noise still shows after a few.

Refining: once every move from the kept weights was reverted on a full pool (``pool_trials``
windows per arm) or is at its bound, the step shrinks to its square root, down to ``min_step`` (a
pattern search: a coarse step shows a gain that a fine one is too small to show within the noise,
the fine one then refines it; a coarse move is not given up before its pool is full, since pooling
is what shows a gain smaller than one trial's noise).

Settling: after a round in which every move was reverted (a round without a keep), the kept weights
run alone for ``settle_requests`` finished requests before the next round; each further fruitless
round doubles that rest (up to ``settle_max_requests``) and a keep resets it. A tuner that found
its best weights would otherwise go on sending half its traffic to a worse setting for good;
resting, it still re-checks now and then (the load may drift to where other weights win).

The noise gate: an arm with fewer than ``min_samples`` requests, or whose mean's standard error
exceeds ``max_rel_noise`` of the mean, never decides a keep (the step is reverted as too noisy).
A request counts for the weights in effect when it arrived. Every try / keep / revert / refine / hold is
recorded (:class:`TuneStep`, the newest ``log_steps``) with its reason; the alternation is not.

Pure and synchronous: times are passed in. The router reads its weights from ``router.cfg``; a step
swaps that (frozen) config for a copy with the new weights (:func:`feed`): nothing is allocated
per routing decision.
"""

from __future__ import annotations

import logging
import math
from bisect import bisect_right
from collections import deque
from dataclasses import dataclass, field

from thunderagent.config import CostWeights
from thunderagent.config.autotune import AutotuneConfig
from thunderagent.router.router import KvRouter

log = logging.getLogger(__name__)


@dataclass(slots=True, frozen=True)
class TuneStep:
    at: float
    action: str  # "try" | "keep" | "revert" | "refine" | "hold"
    param: str
    old: float
    new: float
    reason: str


#: a window's blocks (the stretches between two switches it ran in) give its noise only from this many on
MIN_BLOCKS = 8


@dataclass(slots=True)
class Window:
    """Running sums of one window's finished requests (TTFT in seconds, token counts), and per block
    (one stretch of the alternation) the count and TTFT sum."""

    n: int = 0
    total: float = 0.0
    squares: float = 0.0
    prompt: int = 0
    recomputed: int = 0  # prompt tokens prefilled although the best-known worker held them
    blocks: dict[int, list[float]] = field(default_factory=dict)  # block id -> [count, TTFT sum]

    def add(self, ttft_s: float, prompt: int, cached: int, best_known: int, block: int = 0) -> None:
        self.n += 1
        self.total += ttft_s
        self.squares += ttft_s * ttft_s
        self.prompt += prompt
        self.recomputed += max(0, best_known - cached)
        b = self.blocks.get(block)
        if b is None:
            self.blocks[block] = [1.0, ttft_s]
        else:
            b[0] += 1.0
            b[1] += ttft_s

    @property
    def mean(self) -> float:
        return self.total / self.n if self.n else math.nan

    @property
    def se(self) -> float:
        """Standard error of the mean, the larger of two estimates: over the requests (sample variance,
        n - 1), and over the blocks' means. Requests of one block share its queues, so they are not
        independent: the per-request estimate alone came out 1.1-2.1x too small in the simulator, and a
        z = 2 gate on it kept steps that made no difference (``contention`` on a fleet where it acts on
        nothing). The block estimate needs ``MIN_BLOCKS`` blocks."""
        if self.n < 2:
            return math.inf
        var = max(0.0, (self.squares - self.total * self.total / self.n) / (self.n - 1))
        per_request = math.sqrt(var / self.n)
        means = [t / c for c, t in self.blocks.values()]
        if len(means) < MIN_BLOCKS:
            return per_request
        m = sum(means) / len(means)
        bvar = sum((x - m) ** 2 for x in means) / (len(means) - 1)
        return max(per_request, math.sqrt(bvar / len(means)))

    @property
    def recompute_rate(self) -> float:
        return self.recomputed / self.prompt if self.prompt else 0.0

    def summary(self) -> str:
        return (f"mean TTFT {self.mean * 1e3:.1f} ms ± {self.se * 1e3:.1f} "
                f"(n={self.n}, recompute {self.recompute_rate:.1%})")


class WeightTuner:
    def __init__(self, cfg: AutotuneConfig, weights: CostWeights) -> None:
        self.cfg = cfg
        self.start = weights
        self.kept = weights  # the weights every step so far leaves (arm 0 of the running trial)
        self.weights = weights  # the weights in effect now (the router's)
        self.steps: deque[TuneStep] = deque(maxlen=cfg.log_steps)
        self._moves = [(p, d) for p in cfg.params for d in (1, -1)]
        self._move = 0  # the next move tried (index into _moves)
        self._trial: tuple[str, float, float] | None = None  # (param, kept value, tried value)
        self._trial_weights = weights
        self._arms = (Window(), Window())  # 0: kept weights, 1: tried weights
        self._need = 0  # samples each arm must reach before the trial is judged
        #: reverted moves' arms, by (param, tried value), pooled into the move's next trial while the kept
        #: weights stay the same (a small gain needs more samples than one trial gives)
        self._pool: dict[tuple[str, float], tuple[Window, Window]] = {}
        self._switch_at: list[float] = []  # when the arms alternated during the running trial
        self._arm = 1  # the arm in effect now
        self._count = 0  # samples since the latest switch
        self._held = False  # every weight at its bounds: nothing left to try
        self._round: set[int] = set()  # moves reverted since the latest keep, rest or refinement
        #: moves given up at this step: reverted on a full pool (pool_trials windows), or at their bound
        self._spent: set[int] = set()
        self._rest = cfg.settle_requests  # the next rest's length (finished requests)
        self._resting = 0  # finished requests left in the running rest
        self._trials = 0  # trials begun
        self.step = cfg.step  # the factor a move applies now (shrinks to cfg.min_step)
        self.samples = 0  # samples counted (attributed to an arm)

    def observe(self, arrival: float, ttft_s: float, prompt: int, cached: int, best_known: int,
                now: float) -> list[TuneStep]:
        """One finished request. Returns the steps this sample caused (empty almost always). The
        weights in effect (``self.weights``) change with a step and every ``switch_every`` samples."""
        if self._trial is None:
            if self._resting:
                self._resting -= 1
                return []
            return [] if self._held else self._try(now)
        k = bisect_right(self._switch_at, arrival)
        if k == 0:
            return []  # routed before the trial began
        arm = k % 2  # the trial begins with the tried weights (1), then the arms alternate
        # a block: this trial's k-th stretch (trials are numbered: a pooled window spans several)
        self._arms[arm].add(ttft_s, prompt, cached, best_known, self._trials << 32 | k)
        self.samples += 1
        a, b = self._arms
        if a.n >= self._need and b.n >= self._need:
            return self._judge(now)
        self._count += 1
        if self._count >= self.cfg.switch_every:
            self._switch(1 - self._arm, now)
        return []

    def _switch(self, arm: int, now: float) -> None:
        self._arm, self._count = arm, 0
        self.weights = self._trial_weights if arm else self.kept
        self._switch_at.append(now)

    def _noisy(self, w: Window) -> bool:
        return w.n < self.cfg.min_samples or not w.se <= self.cfg.max_rel_noise * w.mean

    def _try(self, now: float) -> list[TuneStep]:
        """The next move that changes a weight (a weight at its bound in that direction is skipped)."""
        for k in range(len(self._moves)):
            i = (self._move + k) % len(self._moves)
            if i in self._round:  # a whole round reverted: a finer step once every move is spent, or a rest
                self._round.clear()
                if self.step > self.cfg.min_step and len(self._spent) == len(self._moves):
                    return self._refine(now)
                if self._rest:
                    return self._settle(now)
            param, d = self._moves[i]
            old = getattr(self.kept, param)
            lo, hi = self.cfg.bounds(param)
            new = min(hi, max(lo, old * self.step if d > 0 else old / self.step))
            if new == old:
                self._spent.add(i)
            else:
                self._move = i
                self._trials += 1
                self._trial = (param, old, new)
                self._trial_weights = self.kept.model_copy(update={param: new})
                self._arms = self._pool.pop((param, new), None) or (Window(), Window())
                if self._arms[1].n >= self.cfg.pool_trials * self.cfg.window:
                    self._arms = (Window(), Window())  # pooled long enough: start afresh
                self._need = max(self._arms[0].n, self._arms[1].n) + self.cfg.window
                self._switch_at = []
                self._switch(1, now)
                return [self._log(TuneStep(now, "try", param, old, new,
                                           f"alternating with {param} = {old:g} every {self.cfg.switch_every} "
                                           f"requests until each has {self.cfg.window}"))]
        self._held = True
        self.weights = self.kept
        return [self._log(TuneStep(now, "hold", "", 0.0, 0.0, "every weight at its bounds"))]

    def _refine(self, now: float) -> list[TuneStep]:
        self._spent.clear()
        old, self.step = self.step, max(self.cfg.min_step, math.sqrt(self.step))
        return [self._log(TuneStep(now, "refine", "", old, self.step,
                                   f"every move by x{old:g} from the kept weights reverted on "
                                   f"{self.cfg.pool_trials} windows: moves by x{self.step:g}")),
                *self._try(now)]

    def _settle(self, now: float) -> list[TuneStep]:
        self._resting, self._rest = self._rest, min(self.cfg.settle_max_requests, 2 * self._rest)
        return [self._log(TuneStep(now, "hold", "", 0.0, 0.0,
                                   f"every move from the kept weights reverted: they run alone for the next "
                                   f"{self._resting} requests"))]

    def _judge(self, now: float) -> list[TuneStep]:
        trial = self._trial
        assert trial is not None
        param, old, new = trial
        self._trial = None
        base, w = self._arms
        gain = base.mean - w.mean
        se = math.sqrt(base.se ** 2 + w.se ** 2)
        vs = f"{param} = {new:g}: {w.summary()}; {param} = {old:g}: {base.summary()}"
        if not self._noisy(w) and not self._noisy(base) and gain > self.cfg.z * se:
            self.kept = self._trial_weights
            self._pool.clear()  # measured against other kept weights
            self._round.clear()
            self._spent.clear()
            self._rest = self.cfg.settle_requests
            step = TuneStep(now, "keep", param, old, new,
                            f"{gain * 1e3:.1f} ms better > {self.cfg.z:g} x {se * 1e3:.1f} ms ({vs})")
        else:
            why = ("too noisy" if self._noisy(w) or self._noisy(base) else
                   f"{-gain * 1e3:.1f} ms worse" if gain < 0 else
                   f"{gain * 1e3:.1f} ms better, within noise ({self.cfg.z:g} x {se * 1e3:.1f} ms)")
            self._round.add(self._move)
            if w.n >= self.cfg.pool_trials * self.cfg.window:  # its pool is full: given up at this step
                self._spent.add(self._move)
            self._move = (self._move + 1) % len(self._moves)
            self._pool[(param, new)] = self._arms
            step = TuneStep(now, "revert", param, new, old, f"{why} ({vs})")
        self.weights = self.kept
        return [self._log(step), *self._try(now)]  # a kept move is tried again, from where it led

    def _log(self, step: TuneStep) -> TuneStep:
        self.steps.append(step)
        return step

    def summary(self) -> dict[str, object]:
        """For ``/health``: the weights kept, in effect now, at the start, the trial, the latest steps."""
        return {
            "kept": {p: getattr(self.kept, p) for p in self.cfg.params},
            "weights": {p: getattr(self.weights, p) for p in self.cfg.params},
            "start": {p: getattr(self.start, p) for p in self.cfg.params},
            "trying": None if self._trial is None else {"param": self._trial[0], "value": self._trial[2],
                                                        "samples": [self._arms[0].n, self._arms[1].n]},
            "resting": self._resting,
            "step": self.step,
            "samples": self.samples,
            "steps": [{"at": s.at, "action": s.action, "param": s.param, "old": s.old, "new": s.new,
                       "reason": s.reason} for s in self.steps],
        }


def feed(tuner: WeightTuner, router: KvRouter, arrival: float, ttft_s: float, prompt: int, cached: int,
         best_known: int, now: float) -> None:
    """One finished request into the tuner; a step swaps the router's config for one with the new
    weights (the only way the router sees them) and logs one line."""
    for s in tuner.observe(arrival, ttft_s, prompt, cached, best_known, now):
        log.info("autotune %s %s %g -> %g: %s", s.action, s.param, s.old, s.new, s.reason)
    if router.cfg.weights is not tuner.weights:  # a step, or the trial's arms alternating
        router.cfg = router.cfg.model_copy(update={"weights": tuner.weights})
