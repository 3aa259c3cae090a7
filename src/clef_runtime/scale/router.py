"""The Ray Serve request router of the model replicas: state affinity (`clef_runtime.scale.affinity.choose`).

Ray Serve calls `choose_replicas` for each request sent through the model deployment's handle; the ingress
passes the request's state key as the ``state_key`` keyword argument (hex, or None for a request without a
cacheable state). Queue lengths come from Ray Serve's own cache of the replicas' ongoing requests.
"""

from __future__ import annotations

from typing import Any

from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica

from clef_runtime.scale.affinity import DEFAULT_MAX_OWNER_QUEUE, choose

__all__ = ["StateAffinityRouter"]


class StateAffinityRouter(FIFOMixin, RequestRouter):
    """Routes a request to the replica that owns its state key (consistent hashing over the live replicas),
    the less loaded of two stable candidates when the owner's queue is too long, and spreads requests
    without a state over two random choices."""

    def initialize_state(self, max_owner_queue: int = DEFAULT_MAX_OWNER_QUEUE, **kwargs: Any) -> None:
        """Ray Serve passes ``request_router_kwargs`` here."""
        self._max_owner_queue = max_owner_queue

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        """One rank per preference: the chosen replica first, the fallback second."""
        key_hex = None if pending_request is None else pending_request.kwargs.get("state_key")
        key = bytes.fromhex(key_hex) if isinstance(key_hex, str) else None
        cache = self.replica_queue_len_cache
        ranked = choose(
            candidate_replicas,
            lambda replica: replica.replica_id.unique_id,
            key,
            lambda replica: cache.get(replica.replica_id),
            max_owner_queue=getattr(self, "_max_owner_queue", DEFAULT_MAX_OWNER_QUEUE),
        )
        return [[replica] for replica in ranked]
