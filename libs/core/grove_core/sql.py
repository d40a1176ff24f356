"""What the services' SQL stores share."""

from __future__ import annotations

import time

from sqlalchemy import MetaData
from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError, OperationalError, ProgrammingError


def create_tables(metadata: MetaData, engine: Engine, attempts: int = 5) -> None:
    """Create the tables of `metadata` that the database lacks.

    Processes sharing a database (spawner replicas, or every service on one PostgreSQL
    database) may start together on an empty one: a table another process creates between
    the check and the CREATE fails this one's CREATE, and the next check finds it.
    """
    for attempt in range(attempts):
        try:
            metadata.create_all(engine)
        except (OperationalError, ProgrammingError, IntegrityError):
            if attempt == attempts - 1:
                raise
            time.sleep(0.1 * (attempt + 1))
        else:
            return
