"""Observability at the edge: the decision log (:mod:`.decision_log`) and its summary
(:mod:`.decision_summary`). File I/O lives here, never in the decision core."""
