"""The AgentGrove SDK: a client for callers and the context handed to python agents."""

from agentgrove.client import (
    GroveClient,
    SyncGroveClient,
    UnknownAgent,
    build_config,
    discover_url,
)
from agentgrove.context import AgentContext
from agentgrove.profiles import SubAgentDefinition, SubAgentResult
from agentgrove.results import AgentResult

__all__ = [
    "AgentContext",
    "AgentResult",
    "GroveClient",
    "SubAgentDefinition",
    "SubAgentResult",
    "SyncGroveClient",
    "UnknownAgent",
    "build_config",
    "discover_url",
]
