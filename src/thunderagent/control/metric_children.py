"""A labelled Prometheus metric's children, each looked up once.

prometheus-client's ``labels()`` validates and joins the label values on every call: a cost per
request on the hot path. Label values used with this are bounded (workers, decision kinds, the routes
and statuses the app answers with); a worker that left has its series removed
(``Metrics.forget_worker``), and its children here go with them (``forget``), so a kept child is
always an exported one.
"""

from __future__ import annotations

from typing import Any


class LabelledChildren:
    """``children(*values)`` is ``metric.labels(*values)``, looked up once per distinct values."""

    __slots__ = ("_by", "_metric")

    def __init__(self, metric: Any) -> None:
        self._metric = metric
        self._by: dict[tuple[str, ...], Any] = {}

    def __call__(self, *values: str) -> Any:
        child = self._by.get(values)
        if child is None:
            child = self._by[values] = self._metric.labels(*values)
        return child

    def forget(self, position: int, value: str) -> None:
        """Drop the cached children whose label at ``position`` is ``value`` (their series were removed)."""
        for values in [v for v in self._by if v[position] == value]:
            del self._by[values]
