"""NATS users and subject permissions for the local stack (`grove up --auth`).

The permission matrix is the one Compose and Kubernetes use (`accounts.conf` here is a copy of
`deploy/nats/accounts.conf`, kept equal by a test). Each user gets a random password, kept in
`<data dir>/auth/passwords.json`, readable by its owner only; the nats-server reads them from its
environment, the services from `GROVE_NATS_USER` / `GROVE_NATS_PASSWORD`, callers connect
as the `caller` user through the URL in `<data dir>/nats.url` (also owner-only), and the agent
processes the spawners start as the `agent` user. The `producer` user is for external services
that publish work: it may neither ask nor answer questions nor reach artifacts.
"""

from __future__ import annotations

import json
import os
import secrets
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from urllib.parse import quote, urlsplit, urlunsplit

#: The users of accounts.conf: the system account, the stream set-up, each service, and the
#: three roles outside the services (external producers, callers, agent processes).
USERS = (
    "sys",
    "setup",
    "governor",
    "spawner",
    "router",
    "artifacts",
    "producer",
    "caller",
    "agent",
)

#: Where the `producer` user's replies come back: it may not subscribe to `_INBOX.>`, where the
#: other users' replies (artifacts, answers) arrive.
PRODUCER_INBOX_PREFIX = "_INBOX_producer"


def inbox_prefix(user: str | None) -> str | None:
    """The inbox prefix `user` must connect with (None: the client's default)."""
    return PRODUCER_INBOX_PREFIX if user == "producer" else None


def accounts_conf() -> str:
    """The accounts and permissions file shipped with AgentGrove."""
    return resources.files("grove_core").joinpath("accounts.conf").read_text()


def _private_write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(text)
    os.chmod(path, 0o600)


def url_with_user(url: str, user: str, password: str) -> str:
    """`url` with the user and password in it (nats://user:password@host:port)."""
    parts = urlsplit(url)
    host = parts.hostname or "127.0.0.1"
    netloc = f"{quote(user, safe='')}:{quote(password, safe='')}@{host}"
    if parts.port:
        netloc += f":{parts.port}"
    return urlunsplit((parts.scheme or "nats", netloc, parts.path, "", ""))


def redact(url: str) -> str:
    """`url` without its password, for printing."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = f"{parts.username}:***@{parts.hostname}"
    if parts.port:
        netloc += f":{parts.port}"
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


def without_user(url: str) -> str:
    """`url` (or a comma-separated list of them) with no user or password in it."""
    out = []
    for one in url.split(","):
        parts = urlsplit(one.strip())
        if parts.username is None and parts.password is None:
            out.append(one.strip())
            continue
        netloc = parts.hostname or "127.0.0.1"
        if parts.port:
            netloc += f":{parts.port}"
        out.append(urlunsplit((parts.scheme, netloc, parts.path, "", "")))
    return ",".join(out)


@dataclass(frozen=True)
class LocalAuth:
    """Generated users of one local stack, stored in its data folder."""

    folder: Path
    passwords: dict[str, str]

    @classmethod
    def create(cls, data_dir: Path) -> LocalAuth:
        """Load the data folder's users, or make them (new random passwords) the first time."""
        folder = data_dir / "auth"
        stored = folder / "passwords.json"
        passwords: dict[str, str] = json.loads(stored.read_text()) if stored.exists() else {}
        missing = [user for user in USERS if user not in passwords]
        if missing:  # the first time, or a data folder made before some of the users existed
            # A letter first: nats-server reads a value that starts like a number as one.
            passwords.update({user: "p" + secrets.token_hex(24) for user in missing})
            _private_write(stored, json.dumps(passwords, indent=2))
        auth = cls(folder, passwords)
        _private_write(folder / "accounts.conf", accounts_conf())
        _private_write(folder / "nats.conf", 'include "accounts.conf"\n')
        return auth

    @property
    def config_file(self) -> Path:
        """The nats-server config file (accounts and permissions)."""
        return self.folder / "nats.conf"

    def server_env(self) -> dict[str, str]:
        """The environment the nats-server reads the passwords from."""
        return {f"GROVE_NATS_{user.upper()}_PASSWORD": pw for user, pw in self.passwords.items()}

    def service_env(self, user: str) -> dict[str, str]:
        """The settings a service connects with."""
        return {"GROVE_NATS_USER": user, "GROVE_NATS_PASSWORD": self.passwords[user]}

    def agent_env(self) -> dict[str, str]:
        """What a spawner hands the agent processes it starts: the `agent` user."""
        return {
            "GROVE_AGENT_NATS_USER": "agent",
            "GROVE_AGENT_NATS_PASSWORD": self.passwords["agent"],
        }

    def url_for(self, url: str, user: str) -> str:
        """The URL `user` connects with."""
        return url_with_user(url, user, self.passwords[user])
