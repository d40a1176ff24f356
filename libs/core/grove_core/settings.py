"""Settings of a service, from the environment (`GROVE_` prefix) or defaults."""

from __future__ import annotations

import ssl
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

DEFAULT_NATS_URL = "nats://127.0.0.1:4222"
#: The default of `catch_up_helper_min`: about two seconds of reading in the service itself.
CATCH_UP_HELPER_MIN = 100_000


@dataclass(frozen=True)
class NatsAccess:
    """How to connect to NATS: the URL(s) and credentials, in a form another process can be
    handed (as JSON) to connect the same way."""

    url: str
    user: str | None = None
    password: str | None = None
    creds: str | None = None
    tls_ca: str | None = None

    def options(self) -> dict[str, Any]:
        """nats-py's connection options (credentials, TLS) for this access."""
        options: dict[str, Any] = {}
        if self.user:
            options["user"] = self.user
            options["password"] = self.password or ""
        if self.creds:
            options["user_credentials"] = self.creds
        if self.tls_ca:
            options["tls"] = ssl.create_default_context(cafile=self.tls_ca)
        return options

    def as_dict(self) -> dict[str, str | None]:
        """The access as JSON-able fields (`NatsAccess(**fields)` makes it again)."""
        return asdict(self)


class ServiceSettings(BaseSettings):
    """What every service needs: where NATS is, where its projection lives, its HTTP port."""

    model_config = SettingsConfigDict(env_prefix="GROVE_", extra="ignore")

    nats_url: str = Field(
        default=DEFAULT_NATS_URL, description="NATS server URL(s), comma separated."
    )
    nats_user: str | None = None
    nats_password: str | None = None
    nats_creds: Path | None = Field(default=None, description="A NATS .creds file.")
    nats_tls_ca: Path | None = None
    data_dir: Path = Field(default=Path(".grove"), description="Where local state lives.")
    database_url: str | None = Field(
        default=None, description="SQLAlchemy URL; default sqlite in the data folder."
    )
    config_file: Path | None = Field(
        default=None, description="The AgentGrove config file (limits, profiles)."
    )
    http_host: str = "127.0.0.1"
    http_port: int = Field(default=0, description="Health and metrics port; 0 picks a free one.")
    log_level: str = "INFO"
    catch_up_helper_min: int = Field(
        default=CATCH_UP_HELPER_MIN,
        ge=0,
        description="A projection at least this many events behind reads them through a "
        "helper process, on another CPU (`grove_core.catchup`); 0: never.",
    )
    append_batch_from: int = Field(
        default=0,
        ge=0,
        description="With this many appends unacknowledged, the next ones go out as atomic "
        "batches, which nats-server stores and syncs to disk at once (`grove_core.acks`). Set "
        "it (16) when the server syncs every write (`sync_interval: always`); with the "
        "default sync, batches cost the server more than they save. 0: never.",
    )

    def nats_access(self) -> NatsAccess:
        """The NATS URL and credentials these settings name."""
        return NatsAccess(
            url=self.nats_url,
            user=self.nats_user,
            password=self.nats_password,
            creds=None if self.nats_creds is None else str(self.nats_creds),
            tls_ca=None if self.nats_tls_ca is None else str(self.nats_tls_ca),
        )

    def database_for(self, service: str) -> str:
        """The database URL of one service."""
        if self.database_url:
            return self.database_url
        self.data_dir.mkdir(parents=True, exist_ok=True)
        return f"sqlite:///{(self.data_dir / f'{service}.db').resolve()}"

    def config_path(self) -> Path | None:
        """The config file in use: the setting, else `grove.yaml` in the data folder if present."""
        if self.config_file is not None:
            return self.config_file
        candidate = self.data_dir / "grove.yaml"
        return candidate if candidate.exists() else None
