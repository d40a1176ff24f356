"""The AgentGrove config file (YAML): resource limits and, later, subagent profiles."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, SecretStr, ValidationError

from grove_events import GlobalLimits, Model, ResourceLimits

#: Limits used when the config file sets none.
DEFAULT_LIMITS = ResourceLimits(**{"global": GlobalLimits(max_concurrent_agents=64)})


class ConfigError(ValueError):
    """The config file is missing, not YAML, or does not match the schema."""


class OpenAIEndpoint(Model):
    """An OpenAI-compatible chat-completions endpoint for the `openai` runtime.

    Unset values fall back to OPENAI_BASE_URL, OPENAI_API_KEY and OPENAI_MODEL.
    """

    base_url: str | None = None
    api_key: SecretStr | None = None
    model: str | None = Field(
        default=None, description="Used when neither spawn nor profile sets one."
    )
    max_iterations: int = Field(default=20, ge=1, description="Model calls per agent instance.")


class ArtifactLimits(Model):
    """Size limits of the artifact-store, in bytes."""

    max_artifact_bytes: int = Field(
        default=64 * 1024 * 1024, ge=1, description="Largest single artifact."
    )
    max_tree_bytes: int = Field(
        default=1024 * 1024 * 1024,
        ge=1,
        description="Bytes of live artifacts one tree may hold (each artifact counted whole).",
    )
    max_store_bytes: int | None = Field(
        default=None,
        ge=1,
        description="Size limit of the artifact bucket (every blob, all trees); a put that "
        "does not fit is refused as `store_full`. Null: only the server's own limits.",
    )


class GroveConfig(Model):
    """Everything the config file may hold."""

    resources: ResourceLimits = Field(default_factory=lambda: DEFAULT_LIMITS)
    profiles: list[dict[str, Any]] = Field(
        default_factory=list,
        description="Subagent profiles, each validated as agentgrove.SubAgentDefinition.",
    )
    openai: OpenAIEndpoint = Field(default_factory=OpenAIEndpoint)
    artifacts: ArtifactLimits = Field(default_factory=ArtifactLimits)


def load_config(path: Path | None) -> GroveConfig:
    """Read the config file; no file means the defaults."""
    if path is None:
        return GroveConfig()
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path} is not valid YAML: {exc}") from None
    try:
        return GroveConfig.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()
        )
        raise ConfigError(f"config file {path}: {problems}") from None
