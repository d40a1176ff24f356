"""Request-reply for the services' queries, served through FastStream.

A service answers `grove.rpc.<service>.<verb>`: a JSON object in, a JSON value out. A request
may carry `after_seq`; the answer then waits until the service has folded the log at least
that far (so a caller who has just appended an event sees it), or says the service is behind
(a refusal whose text holds `grove_events.RPC_BEHIND`). `after_seq_wait` (seconds) shortens
that wait: a caller that asks again after a short wait learns sooner that a service died with
its request. A refusal is an object with `error` alone; an unexpected failure is answered the same way,
naming it, so a caller never waits out its timeout because a handler broke. Requests run
concurrently (a long poll does not hold up the others), up to `max_workers` at once.

The server has a FastStream NATS broker of its own (a second connection, same credentials and
TLS as the service's log), so the service's `/metrics` also carries FastStream's NATS
middleware metrics (`faststream_received_messages_total`, `..._processed_messages_duration_
seconds` and the rest, labelled `app_name` = the service and `handler` = the subject).
"""

from __future__ import annotations

import json
import logging
import ssl
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from faststream.nats import (
    NatsBroker,
    NatsCredentials,
    NatsMessage,
    NatsSecurity,
    NatsUserPassword,
)
from faststream.nats.prometheus import NatsPrometheusMiddleware
from prometheus_client import REGISTRY, Counter

from grove_events import RPC_BEHIND, rpc_subject

log = logging.getLogger(__name__)
#: FastStream's own messages (one per task it starts or ends at INFO): warnings and errors only.
FASTSTREAM_LOG = logging.getLogger(f"{__name__}.faststream")
FASTSTREAM_LOG.setLevel(logging.WARNING)

#: One verb: the request object in, the answer out.
Verb = Callable[[dict[str, Any]], Awaitable[Any]]
#: Waits until the service has folded the log to a sequence, for at most the seconds given
#: (None: the service's own limit); raises a refusal when behind (see `behind`).
WaitApplied = Callable[[int, float | None], Awaitable[None]]

#: Requests one server handles at once, per verb.
MAX_WORKERS = 64

REQUESTS = Counter(
    "grove_rpc_requests_total",
    "Requests answered over request-reply, by service, verb and outcome (ok, refused, failed).",
    ["service", "verb", "outcome"],
)


def prometheus_middleware(service: str) -> NatsPrometheusMiddleware:
    """FastStream's NATS metrics, on the registry the service's `/metrics` serves (its
    families are registered once, the first time)."""
    return NatsPrometheusMiddleware(registry=REGISTRY, app_name=service)


class Refusal(Exception):
    """A request refused for a reason the caller can act on; `reason` labels the metric."""

    def __init__(self, message: str, reason: str = "refused") -> None:
        super().__init__(message)
        self.reason = reason


def parse_request(data: bytes) -> dict[str, Any]:
    """The request object; a Refusal when it is not a JSON object."""
    try:
        request = json.loads(data or b"{}")
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise Refusal("the request must be JSON", "bad_request") from None
    if not isinstance(request, dict):
        raise Refusal("the request must be a JSON object", "bad_request")
    return request


def after_seq(request: dict[str, Any]) -> int | None:
    """The request's `after_seq`, checked."""
    after = request.get("after_seq")
    if after is None:
        return None
    if isinstance(after, bool) or not isinstance(after, int) or after < 0:
        raise Refusal("'after_seq' must be a whole number of at least 0", "bad_request")
    return after


def after_seq_wait(request: dict[str, Any]) -> float | None:
    """The request's `after_seq_wait`, checked (None: not given)."""
    wait = request.get("after_seq_wait")
    if wait is None:
        return None
    if isinstance(wait, bool) or not isinstance(wait, int | float) or wait < 0:
        raise Refusal("'after_seq_wait' must be a number of seconds of at least 0", "bad_request")
    return float(wait)


def behind(service: str, applied: int, seq: int, waited: float) -> str:
    """The text of a refusal because the service's fold has not reached `seq` in time."""
    return (
        f"the {service} {RPC_BEHIND} {seq} within {waited:g} s (its last event is at seq "
        f"{applied}); retry in a moment"
    )


def nats_security(
    user: str | None,
    password: str | None,
    user_credentials: str | None,
    tls: ssl.SSLContext | None,
) -> NatsSecurity | None:
    """FastStream's form of the connection's user and password or credentials file, and TLS."""
    if user_credentials:
        return NatsCredentials(user_credentials, ssl_context=tls)
    if user:
        return NatsUserPassword(username=user, password=password or "", ssl_context=tls)
    if tls is not None:
        return NatsSecurity(ssl_context=tls)
    return None


class RpcServer:
    """Answers `grove.rpc.<service>.<verb>` for each verb, through a FastStream broker."""

    def __init__(
        self,
        service: str,
        verbs: Mapping[str, Verb],
        *,
        wait_applied: WaitApplied | None = None,
        refusals: tuple[type[Exception], ...] = (),
        on_refused: Callable[[Exception], None] | None = None,
        max_workers: int = MAX_WORKERS,
    ) -> None:
        self.service = service
        self.verbs = dict(verbs)
        self.wait_applied = wait_applied
        self.refusals: tuple[type[Exception], ...] = (Refusal, *refusals)
        self.on_refused = on_refused
        self.max_workers = max_workers
        self.broker: NatsBroker | None = None

    async def answer(self, verb: str, data: bytes) -> Any:
        """The answer to one request (never raises: a failure is answered as an error)."""
        try:
            request = parse_request(data)
            after = after_seq(request)
            if after is not None and self.wait_applied is not None:
                await self.wait_applied(after, after_seq_wait(request))
            answer = await self.verbs[verb](request)
        except self.refusals as exc:
            REQUESTS.labels(self.service, verb, "refused").inc()
            if self.on_refused is not None:
                self.on_refused(exc)
            return {"error": str(exc)}
        except Exception as exc:
            log.exception("%s: %s failed", self.service, verb)
            REQUESTS.labels(self.service, verb, "failed").inc()
            return {"error": f"the {self.service} failed on {verb}: {exc!r}; retry"}
        REQUESTS.labels(self.service, verb, "ok").inc()
        return answer

    def _handler(self, verb: str) -> Callable[[NatsMessage], Awaitable[bytes]]:
        async def handle(message: NatsMessage) -> bytes:
            return json.dumps(await self.answer(verb, message.body)).encode()

        handle.__name__ = f"{self.service}_{verb}"
        return handle

    async def start(
        self,
        url: str,
        *,
        user: str | None = None,
        password: str | None = None,
        user_credentials: str | None = None,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        """Connect and answer every verb."""
        servers = [u.strip() for u in url.split(",") if u.strip()]
        broker = NatsBroker(
            servers,
            name=f"grove-{self.service}-rpc",
            security=nats_security(user, password, user_credentials, tls),
            middlewares=[prometheus_middleware(self.service)],
            max_reconnect_attempts=-1,
            logger=FASTSTREAM_LOG,
            log_level=logging.DEBUG,
        )
        for verb in self.verbs:
            broker.subscriber(rpc_subject(self.service, verb), max_workers=self.max_workers)(
                self._handler(verb)
            )
        await broker.start()
        # Once the server has answered a ping it has every subscription: only then does the
        # service count as serving (a request sent earlier would find no responders).
        await (await broker.connect()).flush()
        self.broker = broker

    def is_serving(self) -> bool:
        """Whether it answers (a readiness check: register it before the server starts)."""
        return self.broker is not None

    async def close(self) -> None:
        """Stop answering and disconnect."""
        if self.broker is not None:
            await self.broker.stop()
            self.broker = None
