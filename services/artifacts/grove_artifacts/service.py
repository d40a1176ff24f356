"""The artifact-store's application layer. Today it keeps the artifact index up to date."""

from __future__ import annotations

from grove_artifacts.domain import ArtifactIndex, evolve
from grove_core.projection import ProjectionRunner, ProjectionStore
from grove_core.service import Service, run_service
from grove_core.settings import ServiceSettings

NAME = "artifacts"


async def setup(service: Service) -> None:
    """Start the artifact-store inside a service process."""
    assert service.log is not None
    store = ProjectionStore(service.settings.database_for(NAME))
    runner: ProjectionRunner[ArtifactIndex] = ProjectionRunner(
        name=NAME, log=service.log, store=store, state_type=ArtifactIndex, evolve=evolve
    )
    service.ready_checks.append(runner.caught_up.is_set)
    service.spawn(runner.run(), "artifacts-projection")


def main() -> None:
    """`python -m grove_artifacts`."""
    run_service(NAME, setup, ServiceSettings())
