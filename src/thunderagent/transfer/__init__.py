"""The transfer plane: KV moving between workers (prefill -> decode)."""

from thunderagent.transfer.plane import PlaneStats, Transfer, TransferPlane

__all__ = ["PlaneStats", "Transfer", "TransferPlane"]
