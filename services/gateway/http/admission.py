"""Overload control, decided before a seq_id is consumed: 429 with Retry-After.

Counts are this replica's own view (requests it accepted and has not yet seen complete), which
is exact for one gateway; with N replicas behind a load balancer each enforces the limits on its
own share, so together they admit up to N times each limit (docs/operations.md, "Gateway
replicas"). Nothing here decides correctness: claims in KV do.
"""

from __future__ import annotations

from collections import defaultdict

from services.gateway.config import GatewayConfig
from services.gateway.http.errors import Overloaded


class Admission:
    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.per_model: dict[str, set[str]] = defaultdict(set)
        self.per_tenant: dict[str, set[str]] = defaultdict(set)
        self.highest_seq: dict[str, int] = {}
        self.sampling_in_use = 0
        self.sampling_held: dict[str, int] = {}  # request id -> permits, released by its result

    def check_training(self, tenant: str, model_id: str, seq_id: int) -> None:
        """Refuse when the model's queue or the tenant's in-flight set is full.

        A seq_id below the highest one seen fills a hole, so it is always admitted: refusing it
        would leave the queue blocked behind the hole.
        """
        if seq_id < self.highest_seq.get(model_id, -1):
            return
        queued = len(self.per_model.get(model_id, ()))
        if queued >= self.config.max_queue_depth_per_model:
            raise Overloaded(
                f"model {model_id} has {queued} requests queued "
                f"(limit max_queue_depth_per_model={self.config.max_queue_depth_per_model}); retry shortly"
            )
        inflight = len(self.per_tenant.get(tenant, ()))
        if inflight >= self.config.max_inflight_per_tenant:
            raise Overloaded(
                f"tenant has {inflight} requests in flight "
                f"(limit max_inflight_per_tenant={self.config.max_inflight_per_tenant}); retry shortly"
            )

    def admitted(self, tenant: str, model_id: str, seq_id: int, request_id: str) -> None:
        self.per_model[model_id].add(request_id)
        self.per_tenant[tenant].add(request_id)
        self.highest_seq[model_id] = max(self.highest_seq.get(model_id, -1), seq_id)

    def finished(self, tenant: str, model_id: str, request_id: str) -> None:
        """Called for every result on the stream (see `Gateway.on_result`), so unknown ids are common."""
        if (held := self.sampling_held.pop(request_id, None)) is not None:
            self.release_sampling(held)
        for table, key in ((self.per_model, model_id), (self.per_tenant, tenant)):
            pending = table.get(key)
            if pending is not None:
                pending.discard(request_id)
                if not pending:
                    del table[key]

    def queued(self) -> dict[str, int]:
        return {model_id: len(pending) for model_id, pending in self.per_model.items()}

    def acquire_sampling(self, num_samples: int) -> None:
        """Weighted by num_samples: one request takes that many sub-generation permits."""
        if self.sampling_in_use + num_samples > self.config.sampling_capacity:
            raise Overloaded(
                f"sampling is at capacity ({self.sampling_in_use}/{self.config.sampling_capacity} "
                "sub-generations in flight); retry shortly"
            )
        self.sampling_in_use += num_samples

    def hold_sampling(self, request_id: str, num_samples: int) -> None:
        """Permits acquired for an accepted sample stay held until its result is appended."""
        self.sampling_held[request_id] = num_samples

    def release_sampling(self, num_samples: int) -> None:
        self.sampling_in_use = max(0, self.sampling_in_use - num_samples)
