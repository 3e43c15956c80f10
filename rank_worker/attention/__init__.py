"""Paged attention: the per-step metadata, the backend interface and its implementations."""

from rank_worker.attention.backend import AttentionBackend, get_backend
from rank_worker.attention.metadata import AttentionMetadata

__all__ = ["AttentionBackend", "AttentionMetadata", "get_backend"]
