"""The weight tuner (``routing.autotune``; ``router/autotune.py`` decides) in the live fleet: fed once per
finished request from the fleet's output stream (its TTFT, prompt, cached and best-known tokens), its
weights exported as ``thunderagent_autotune_weight{name}`` and its state and latest steps (with their
reasons) under ``autotune`` in ``GET /health`` (admin detail). Off: nothing is fed, the gauge shows the
hand-set weights, ``/health`` is unchanged."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Gauge

from thunderagent.config import RoutingConfig
from thunderagent.router.autotune import WeightTuner, feed
from thunderagent.router.router import KvRouter


class AutotuneHook:
    def __init__(self, cfg: RoutingConfig, router: KvRouter, metrics: CollectorRegistry) -> None:
        self.router = router
        self.tuner = WeightTuner(cfg.autotune, cfg.weights) if cfg.autotune.enabled else None
        self.params = cfg.autotune.params
        self.gauge = Gauge("thunderagent_autotune_weight", "The kv_aware cost weights the router uses now "
                           "(routing.autotune moves them; otherwise the hand-set ones)", ["name"], registry=metrics)
        self._export()

    def finished(self, received: float, first_t: float | None, prompt: int, cached: int, best_known: int,
                 now: float) -> None:
        """A request that ended; ``first_t`` is its first output's time (None: it never produced one)."""
        if self.tuner is None or first_t is None:
            return
        before = self.tuner.weights
        feed(self.tuner, self.router, received, first_t - received, prompt, cached, best_known, now)
        if self.tuner.weights is not before:
            self._export()

    def _export(self) -> None:
        w = self.router.cfg.weights
        for p in self.params:
            self.gauge.labels(p).set(getattr(w, p))

    def health(self) -> dict[str, object]:
        return {} if self.tuner is None else {"autotune": self.tuner.summary()}
