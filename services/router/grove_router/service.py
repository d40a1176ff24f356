"""The router's application layer. Today it keeps the tree projection up to date."""

from __future__ import annotations

from grove_core.projection import ProjectionRunner, ProjectionStore
from grove_core.service import Service, run_service
from grove_core.settings import ServiceSettings
from grove_core.tree import TreeState, evolve

NAME = "router"


async def setup(service: Service) -> None:
    """Start the router inside a service process."""
    assert service.log is not None
    store = ProjectionStore(service.settings.database_for(NAME))
    runner: ProjectionRunner[TreeState] = ProjectionRunner(
        name=NAME, log=service.log, store=store, state_type=TreeState, evolve=evolve
    )
    service.ready_checks.append(runner.caught_up.is_set)
    service.spawn(runner.run(), "router-projection")


def main() -> None:
    """`python -m grove_router`."""
    run_service(NAME, setup, ServiceSettings())
