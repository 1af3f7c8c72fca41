"""The engine model shared by the emulated worker (real time) and the simulator (virtual time)."""

from smetric.engine.model import (
    Batch,
    Cluster,
    Engine,
    EngineConfig,
    EngineRequest,
    GlobalTierConfig,
    IterationEvents,
    Phase,
    RequestTooLarge,
    WorkerLoad,
)

__all__ = [
    "Batch",
    "Cluster",
    "Engine",
    "EngineConfig",
    "EngineRequest",
    "GlobalTierConfig",
    "IterationEvents",
    "Phase",
    "RequestTooLarge",
    "WorkerLoad",
]
