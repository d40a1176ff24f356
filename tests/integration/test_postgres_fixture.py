"""The `postgres` fixture's server: a port another process binds first is chosen again."""

from __future__ import annotations

import psycopg
import pytest

from tests import postgres
from tests.conftest import held_port
from tests.postgres import LocalPostgres, postgres_bin_dir

pytestmark = pytest.mark.integration


def test_a_port_taken_before_postgres_binds_it_is_chosen_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    bin_dir = postgres_bin_dir()
    if bin_dir is None:
        pytest.skip("no PostgreSQL server binaries (initdb, postgres) on this machine")
    with held_port() as taken:
        # The first port chosen is one another process holds, as a test beside this one might.
        ports = iter([taken])
        real_free_port = postgres._free_port
        monkeypatch.setattr(postgres, "_free_port", lambda: next(ports, None) or real_free_port())

        server = LocalPostgres(bin_dir)
        try:
            server.start()
            assert server.port != taken
            assert "Address already in use" in (server.folder / "server.log").read_text()
            with psycopg.connect(server.dsn("postgres")) as conn:
                assert conn.execute("SELECT 1").fetchone() == (1,)
        finally:
            server.stop()
