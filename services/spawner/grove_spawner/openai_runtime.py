"""The `openai` runtime: an OpenAI-compatible chat-completions tool loop.

The model gets the agent's session as its conversation and the control tools of AgentContext
(`spawn_agent`, `task`, `wait`, `stop_agent`, `get_resource_status`, ...). Each response is
recorded in the session (`assistant`, then one `tool_call` entry per call, then one
`tool_result` per result), so a resumed agent goes on with the same conversation and a fork
starts from a copy of it. Tokens used are reported after every call (`report_usage`), so the
governor counts them against the budgets. The loop ends when the model answers without a tool
call (that answer is the result), or fails when it has made `max_iterations` calls.

Where the model is: `openai.base_url`, `openai.api_key` and `openai.model` in the config file,
else OPENAI_BASE_URL, OPENAI_API_KEY and OPENAI_MODEL; the spawn's `config.model` and its
profile's model come first. The API key goes to the endpoint only: never into an event, a
session entry or a log line.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import openai
from openai import AsyncOpenAI

from agentgrove.context import TOOL_ERRORS, AgentContext, ControlTool, SessionEntry, control_tools
from agentgrove.profiles import SubAgentDefinition, profiles_of
from grove_core.config import ConfigError, GroveConfig, load_config
from grove_core.settings import ServiceSettings
from grove_spawner.runtimes import AgentRun, Outcome

#: What the model is told about a tool call that an earlier instance never finished.
INTERRUPTED = json.dumps({"error": "this call was interrupted (the agent was stopped)"})
#: Seconds one model call may take.
REQUEST_TIMEOUT_S = 300.0
#: How much of the last answer a run stopped at max_iterations keeps as a partial result.
PARTIAL_CHARS = 2000


class EndpointError(ValueError):
    """The runtime cannot tell which endpoint, key or model to use."""


@dataclass(frozen=True)
class Endpoint:
    """Where and how one agent calls its model."""

    base_url: str | None
    api_key: str
    model: str
    max_iterations: int
    reasoning_effort: str | None = None

    def __repr__(self) -> str:
        return (
            f"Endpoint(base_url={self.base_url!r}, model={self.model!r}, "
            f"max_iterations={self.max_iterations})"
        )


def resolve_endpoint(
    config: GroveConfig,
    profile: SubAgentDefinition | None,
    spawn_model: str | None,
    environ: dict[str, str],
) -> Endpoint:
    """The endpoint of an agent: spawn, then profile, then config file, then environment."""
    base_url = config.openai.base_url or environ.get("OPENAI_BASE_URL") or None
    if config.openai.api_key is not None:
        api_key = config.openai.api_key.get_secret_value()
    else:
        api_key = environ.get("OPENAI_API_KEY", "")
    if not api_key:
        if base_url is None:
            raise EndpointError(
                "runtime 'openai' needs an API key: set OPENAI_API_KEY in the spawner's "
                "environment or openai.api_key in the config file (or openai.base_url for an "
                "endpoint without keys)"
            )
        api_key = "unused"
    model = (
        spawn_model
        or (profile.model if profile else None)
        or config.openai.model
        or environ.get("OPENAI_MODEL")
    )
    if not model:
        raise EndpointError(
            "runtime 'openai' needs a model: set config.model on the spawn, `model` in the "
            "profile, openai.model in the config file, or OPENAI_MODEL"
        )
    return Endpoint(
        base_url=base_url,
        api_key=api_key,
        model=model,
        max_iterations=profile.max_iterations if profile else config.openai.max_iterations,
        reasoning_effort=profile.reasoning_effort if profile else None,
    )


def _openai_call(entry: SessionEntry) -> dict[str, Any] | None:
    """The entry's JSON when it is one of this runtime's tool calls or results."""
    try:
        data = json.loads(entry.content)
    except ValueError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("id"), str):
        return None
    needed = ("name", "arguments") if entry.kind == "tool_call" else ("name", "content")
    return data if all(isinstance(data.get(k), str) for k in needed) else None


def conversation(entries: Sequence[SessionEntry]) -> list[dict[str, Any]]:
    """The chat messages of a session: system and user entries as they are, answers with
    their tool calls, tool results; a call never answered (the agent stopped while it ran)
    gets a result saying it was interrupted. Other agents' tool entries are left out."""
    messages: list[dict[str, Any]] = []
    open_calls: list[str] = []

    def close_open_calls() -> None:
        messages.extend(
            {"role": "tool", "tool_call_id": call_id, "content": INTERRUPTED}
            for call_id in open_calls
        )
        open_calls.clear()

    for entry in entries:
        if entry.kind in ("system", "user"):
            close_open_calls()
            messages.append({"role": entry.kind, "content": entry.content})
        elif entry.kind == "assistant":
            close_open_calls()
            messages.append({"role": "assistant", "content": entry.content})
        elif (call := _openai_call(entry)) is None:
            continue
        elif entry.kind == "tool_call":
            last = messages[-1] if messages else None
            if last is None or last["role"] != "assistant" or "tool_calls" not in last:
                if last is not None and last["role"] == "assistant" and not open_calls:
                    last["tool_calls"] = []
                else:
                    close_open_calls()
                    messages.append({"role": "assistant", "content": None, "tool_calls": []})
            messages[-1]["tool_calls"].append(
                {
                    "id": call["id"],
                    "type": "function",
                    "function": {"name": call["name"], "arguments": call["arguments"]},
                }
            )
            open_calls.append(call["id"])
        elif call["id"] in open_calls:
            open_calls.remove(call["id"])
            messages.append(
                {"role": "tool", "tool_call_id": call["id"], "content": call["content"]}
            )
    close_open_calls()
    return messages


def _redact(text: str, secret: str) -> str:
    return text.replace(secret, "***") if len(secret) >= 4 else text


class OpenAIRuntime:
    """Runs an agent as a chat-completions tool loop over the control tools."""

    name = "openai"

    def __init__(self, environ: dict[str, str] | None = None) -> None:
        self._environ = environ

    def _config(self) -> GroveConfig:
        return load_config(ServiceSettings().config_path())

    async def run(self, run: AgentRun) -> Outcome:
        """Call the model until it answers without a tool call, or max_iterations."""
        context = run.context
        environ = dict(os.environ if self._environ is None else self._environ)
        try:
            config = self._config()
            profiles = profiles_of(config)
            profile = profiles.get(run.spawn.config.profile or "")
            endpoint = resolve_endpoint(config, profile, run.spawn.config.model, environ)
        except (ConfigError, EndpointError, ValueError) as exc:
            return Outcome(completed=False, error=str(exc))
        tools = {tool.name: tool for tool in control_tools(profiles)}
        client = AsyncOpenAI(
            base_url=endpoint.base_url,
            api_key=endpoint.api_key,
            max_retries=2,
            timeout=REQUEST_TIMEOUT_S,
        )
        try:
            return await self._loop(context, client, endpoint, tools)
        finally:
            await client.close()

    async def _loop(
        self,
        context: AgentContext,
        client: AsyncOpenAI,
        endpoint: Endpoint,
        tools: dict[str, ControlTool],
    ) -> Outcome:
        schemas = [
            {
                "type": "function",
                "function": {
                    "name": t.name,
                    "description": t.description,
                    "parameters": t.parameters(),
                },
            }
            for t in tools.values()
        ]
        extra: dict[str, Any] = {}
        if endpoint.reasoning_effort is not None:
            extra["reasoning_effort"] = endpoint.reasoning_effort
        last_answer = ""
        for iteration in range(1, endpoint.max_iterations + 1):
            await context.pause_point()
            try:
                response = await client.chat.completions.create(
                    model=endpoint.model,
                    messages=conversation(context.history),  # type: ignore[arg-type]
                    tools=schemas,  # type: ignore[arg-type]
                    **extra,
                )
            except openai.OpenAIError as exc:
                detail = _redact(f"{exc.__class__.__name__}: {exc}", endpoint.api_key)
                return Outcome(
                    completed=False,
                    error=f"model call {iteration} failed: {detail}",
                    attempted=list(context.attempted),
                    tokens=context.tokens,
                )
            if response.usage is not None:
                await context.report_usage(
                    response.usage.total_tokens,
                    f"model call {iteration}: {response.usage.total_tokens} tokens",
                )
            if not response.choices:
                return Outcome(
                    completed=False,
                    error=f"model call {iteration} returned no choice",
                    tokens=context.tokens,
                )
            message = response.choices[0].message
            last_answer = message.content or ""
            if last_answer:
                await context.record("assistant", last_answer)
            calls = [c for c in message.tool_calls or [] if c.type == "function"]
            if not calls:
                return Outcome(completed=True, summary=last_answer, tokens=context.tokens)
            for call in calls:
                await context.record(
                    "tool_call",
                    json.dumps(
                        {
                            "id": call.id,
                            "name": call.function.name,
                            "arguments": call.function.arguments,
                        }
                    ),
                )
            context.attempted.extend(f"{c.function.name}({c.function.arguments})" for c in calls)
            results = await asyncio.gather(
                *(self._call(context, tools, c.function.name, c.function.arguments) for c in calls)
            )
            for call, result in zip(calls, results, strict=True):
                await context.record(
                    "tool_result",
                    json.dumps({"id": call.id, "name": call.function.name, "content": result}),
                )
        return Outcome(
            completed=False,
            error=f"stopped at max_iterations={endpoint.max_iterations}: the model made "
            f"{endpoint.max_iterations} calls without a final answer",
            attempted=list(context.attempted),
            partial_results=[last_answer[:PARTIAL_CHARS]] if last_answer else [],
            tokens=context.tokens,
        )

    @staticmethod
    async def _call(
        context: AgentContext, tools: dict[str, ControlTool], name: str, arguments: str
    ) -> str:
        """One tool call's result as JSON text; what the model did wrong comes back as
        `{"error": ...}` for it to correct."""
        tool = tools.get(name)
        if tool is None:
            return json.dumps({"error": f"no tool {name!r}; the tools are {', '.join(tools)}"})
        try:
            result = await tool.invoke(context, arguments)
        except TOOL_ERRORS as exc:
            return json.dumps({"error": str(exc) or exc.__class__.__name__})
        return json.dumps(result, default=str)
