"""Settings of a service, from the environment (`GROVE_` prefix) or defaults."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

DEFAULT_NATS_URL = "nats://127.0.0.1:4222"


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
