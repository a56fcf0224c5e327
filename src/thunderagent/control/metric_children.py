"""A labelled Prometheus metric's children, each looked up once.

prometheus-client's ``labels()`` validates and joins the label values on every call: a cost per
request on the hot path. Label values used with this are bounded (workers, decision kinds, the routes
and statuses the app answers with) and no child is ever removed, so a kept child stays exported.
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
