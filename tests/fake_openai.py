"""A local OpenAI-compatible chat-completions server for the tests, driven by a script.

The first user message of a conversation may be a script, JSON:
`{"steps": [{"calls": [{"name": TOOL, "arguments": {...}}, ...]} | {"content": TEXT}, ...],
"loop": false}`. The answer to a request is the step whose index is the number of assistant
messages so far: tool calls, or a final text. Past the last step the server answers
"finished after N steps; last user message: ..." (with `loop`, it repeats the last step). In
arguments and texts, `$tool.N.FIELD` stands for FIELD of the JSON result of the conversation's
N-th tool message. Every call uses 100 prompt and 20 completion tokens. The model
`refuse-and-echo` gets a 401 whose message repeats the Authorization header, as a careless
server might.
"""

from __future__ import annotations

import json
import re
import time
from typing import Any

from aiohttp import web

PROMPT_TOKENS = 100
COMPLETION_TOKENS = 20
TOKENS_PER_CALL = PROMPT_TOKENS + COMPLETION_TOKENS
#: A model the server refuses with a 401 that repeats the credentials it was sent.
REFUSING_MODEL = "refuse-and-echo"
PLACEHOLDER = re.compile(r"\$tool\.(\d+)\.(\w+)")


def _script(messages: list[dict[str, Any]]) -> dict[str, Any]:
    for message in messages:
        if message.get("role") == "user":
            try:
                script = json.loads(message.get("content") or "")
            except ValueError:
                return {}
            return script if isinstance(script, dict) else {}
    return {}


def _fill(value: Any, results: list[dict[str, Any]]) -> Any:
    if isinstance(value, str):
        return PLACEHOLDER.sub(lambda m: str(results[int(m.group(1))].get(m.group(2))), value)
    if isinstance(value, dict):
        return {k: _fill(v, results) for k, v in value.items()}
    if isinstance(value, list):
        return [_fill(v, results) for v in value]
    return value


def answer(messages: list[dict[str, Any]]) -> dict[str, Any]:
    """The assistant message for a conversation, as the module docstring says."""
    script = _script(messages)
    steps: list[dict[str, Any]] = script.get("steps", [])
    index = sum(1 for m in messages if m.get("role") == "assistant")
    results = [json.loads(m["content"]) for m in messages if m.get("role") == "tool"]
    if index < len(steps):
        step = steps[index]
    elif script.get("loop") and steps:
        step = steps[-1]
    else:
        last_user = [m.get("content") for m in messages if m.get("role") == "user"][-1]
        step = {"content": f"finished after {index} steps; last user message: {last_user}"}
    if "content" in step:
        return {"role": "assistant", "content": _fill(step["content"], results)}
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": f"call_{index}_{n}",
                "type": "function",
                "function": {
                    "name": call["name"],
                    "arguments": json.dumps(_fill(call.get("arguments", {}), results)),
                },
            }
            for n, call in enumerate(step["calls"])
        ],
    }


class FakeOpenAI:
    """The server, on 127.0.0.1 and a port the kernel gives it when it starts (so no other
    process can take the port between choosing and binding it); it keeps every request and
    its headers."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.authorizations: list[str | None] = []
        self.port = 0
        self._runner: web.AppRunner | None = None

    @property
    def base_url(self) -> str:
        """What the openai client takes as base_url."""
        return f"http://127.0.0.1:{self.port}/v1"

    async def _completions(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.requests.append(body)
        authorization = request.headers.get("Authorization")
        self.authorizations.append(authorization)
        if body["model"] == REFUSING_MODEL:
            return web.json_response(
                {"error": {"message": f"refused credentials {authorization}"}}, status=401
            )
        message = answer(body["messages"])
        return web.json_response(
            {
                "id": f"chatcmpl-{len(self.requests)}",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": body["model"],
                "choices": [
                    {
                        "index": 0,
                        "finish_reason": "tool_calls" if message.get("tool_calls") else "stop",
                        "message": message,
                    }
                ],
                "usage": {
                    "prompt_tokens": PROMPT_TOKENS,
                    "completion_tokens": COMPLETION_TOKENS,
                    "total_tokens": TOKENS_PER_CALL,
                },
            }
        )

    async def start(self) -> FakeOpenAI:
        """Listen."""
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._completions)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        self.port = int(self._runner.addresses[0][1])
        return self

    async def close(self) -> None:
        """Stop listening."""
        if self._runner is not None:
            await self._runner.cleanup()

    def conversations_of(self, first_user: str) -> list[list[dict[str, Any]]]:
        """The message lists of the requests whose first user message is `first_user`."""
        return [
            r["messages"]
            for r in self.requests
            if next((m["content"] for m in r["messages"] if m["role"] == "user"), None)
            == first_user
        ]
