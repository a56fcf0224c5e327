"""Self-tuning cost weights (``routing.autotune``; seed 000 §6, learned scheduling).

:class:`WeightTuner` adjusts the kv_aware cost's hit-versus-load weights (``credit_load_scale``: how
fast the cache credit decays with a worker's backlog; ``contention``: the charge for recomputing what
another worker holds; optionally ``overlap_credit``) from the requests it sees finish, by a
coordinate-wise hill climb on mean TTFT:

1. *measure*: ``window`` finished requests routed under the current weights (the baseline);
2. *try*: one weight one step (``x step`` or ``/ step``, clamped to its bounds), the next ``window``;
3. *judge*: keep the step only if the trial window's mean TTFT is lower than the baseline's by more
   than ``z`` standard errors of the difference; otherwise revert (and measure a fresh baseline:
   the load drifts, a stale baseline would let drift pass for a gain). A kept step is tried again in
   the same direction from the trial window, which becomes the baseline.

The noise gate: a window with fewer than ``min_samples`` requests, or whose mean's standard error
exceeds ``max_rel_noise`` of the mean, is never used to step or to judge (a too-noisy trial is
reverted). Samples of requests that arrived before the latest switch are dropped: they were routed
under other weights. Every try / keep / revert / hold is recorded (:class:`TuneStep`, the newest
``log_steps``) with its reason.

Pure and synchronous: times are passed in. The router reads its weights from ``router.cfg``; a step
swaps that (frozen) config for a copy with the new weights (:func:`feed`): nothing is allocated
per routing decision.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from dataclasses import dataclass

from thunderagent.config import CostWeights
from thunderagent.config.autotune import AutotuneConfig
from thunderagent.router.router import KvRouter

log = logging.getLogger(__name__)


@dataclass(slots=True, frozen=True)
class TuneStep:
    at: float
    action: str  # "try" | "keep" | "revert" | "hold"
    param: str
    old: float
    new: float
    reason: str


@dataclass(slots=True)
class Window:
    """Running sums of one window's finished requests (TTFT in seconds, token counts)."""

    n: int = 0
    total: float = 0.0
    squares: float = 0.0
    prompt: int = 0
    recomputed: int = 0  # prompt tokens prefilled although the best-known worker held them

    def add(self, ttft_s: float, prompt: int, cached: int, best_known: int) -> None:
        self.n += 1
        self.total += ttft_s
        self.squares += ttft_s * ttft_s
        self.prompt += prompt
        self.recomputed += max(0, best_known - cached)

    @property
    def mean(self) -> float:
        return self.total / self.n if self.n else math.nan

    @property
    def se(self) -> float:
        """Standard error of the mean (sample variance, n - 1)."""
        if self.n < 2:
            return math.inf
        var = max(0.0, (self.squares - self.total * self.total / self.n) / (self.n - 1))
        return math.sqrt(var / self.n)

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
        self.weights = weights
        self.steps: deque[TuneStep] = deque(maxlen=cfg.log_steps)
        self._moves = [(p, d) for p in cfg.params for d in (1, -1)]
        self._move = 0  # the next move tried (index into _moves)
        self._since = -math.inf  # arrivals before this were routed under other weights
        self._base: Window | None = None  # the current weights' measured window
        self._trial: tuple[str, float, float] | None = None  # (param, old, new) while trying
        self._cur = Window()
        self.samples = 0  # samples counted (after the arrival filter)

    def observe(self, arrival: float, ttft_s: float, prompt: int, cached: int, best_known: int,
                now: float) -> list[TuneStep]:
        """One finished request. Returns the steps this sample caused (empty almost always); the
        weights changed iff one of them is a try or a revert."""
        if arrival < self._since:
            return []
        self.samples += 1
        cur = self._cur
        cur.add(ttft_s, prompt, cached, best_known)
        if cur.n < self.cfg.window:
            return []
        self._cur = Window()
        return self._judge(cur, now) if self._trial is not None else self._baseline(cur, now)

    def _noisy(self, w: Window) -> bool:
        return w.n < self.cfg.min_samples or not w.se <= self.cfg.max_rel_noise * w.mean

    def _baseline(self, w: Window, now: float) -> list[TuneStep]:
        if self._noisy(w):
            self._base = None
            return [self._log(TuneStep(now, "hold", "", 0.0, 0.0, f"baseline too noisy: {w.summary()}"))]
        self._base = w
        return self._try(now)

    def _try(self, now: float) -> list[TuneStep]:
        """The next move that changes a weight (a weight at its bound in that direction is skipped)."""
        base = self._base
        assert base is not None
        for k in range(len(self._moves)):
            i = (self._move + k) % len(self._moves)
            param, d = self._moves[i]
            old = getattr(self.weights, param)
            lo, hi = self.cfg.bounds(param)
            new = min(hi, max(lo, old * self.cfg.step if d > 0 else old / self.cfg.step))
            if new != old:
                self._move = i
                self._trial = (param, old, new)
                self._set(param, new, now)
                return [self._log(TuneStep(now, "try", param, old, new, f"baseline {base.summary()}"))]
        return [self._log(TuneStep(now, "hold", "", 0.0, 0.0, "every weight at its bounds"))]

    def _judge(self, w: Window, now: float) -> list[TuneStep]:
        base, trial = self._base, self._trial
        assert base is not None and trial is not None
        param, old, new = trial
        self._trial = None
        gain = base.mean - w.mean
        se = math.sqrt(base.se ** 2 + w.se ** 2)
        if not self._noisy(w) and gain > self.cfg.z * se:
            self._base = w  # the trial's window measures the weights now in effect
            kept = self._log(TuneStep(now, "keep", param, old, new, f"{w.summary()} vs baseline {base.summary()}: "
                                      f"{gain * 1e3:.1f} ms better > {self.cfg.z:g} x {se * 1e3:.1f} ms"))
            return [kept, *self._try(now)]  # the same move again, from here
        why = ("trial window too noisy" if self._noisy(w) else
               f"{-gain * 1e3:.1f} ms worse" if gain < 0 else
               f"{gain * 1e3:.1f} ms better, within noise ({self.cfg.z:g} x {se * 1e3:.1f} ms)")
        self._set(param, old, now)
        self._base = None  # measure afresh: the load may have moved
        self._move = (self._move + 1) % len(self._moves)
        why = f"{why}: {w.summary()} vs baseline {base.summary()}"
        return [self._log(TuneStep(now, "revert", param, new, old, why))]

    def _set(self, param: str, value: float, now: float) -> None:
        self.weights = self.weights.model_copy(update={param: value})
        self._since = now

    def _log(self, step: TuneStep) -> TuneStep:
        self.steps.append(step)
        return step

    def summary(self) -> dict[str, object]:
        """For ``/health``: the weights now, the start, whether a trial runs, the latest steps."""
        return {
            "weights": {p: getattr(self.weights, p) for p in self.cfg.params},
            "start": {p: getattr(self.start, p) for p in self.cfg.params},
            "trying": self._trial[0] if self._trial is not None else None,
            "samples": self.samples,
            "steps": [{"at": s.at, "action": s.action, "param": s.param, "old": s.old, "new": s.new,
                       "reason": s.reason} for s in self.steps],
        }


def feed(tuner: WeightTuner, router: KvRouter, arrival: float, ttft_s: float, prompt: int, cached: int,
         best_known: int, now: float) -> None:
    """One finished request into the tuner; a step swaps the router's config for one with the new
    weights (the only way the router sees them) and logs one line."""
    steps = tuner.observe(arrival, ttft_s, prompt, cached, best_known, now)
    for s in steps:
        log.info("autotune %s %s %g -> %g: %s", s.action, s.param, s.old, s.new, s.reason)
    if steps and router.cfg.weights is not tuner.weights:
        router.cfg = router.cfg.model_copy(update={"weights": tuner.weights})
