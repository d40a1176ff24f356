"""`grove artifacts ls|get|put|rm`: the artifact-store from the command line.

The CLI is no agent: it lists and reads any tree's artifacts (or one tree's, or as one agent
sees them), and stores or deletes artifacts on behalf of an agent named with --agent.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import mimetypes
import sys
from dataclasses import asdict
from pathlib import Path

from agentgrove.artifacts import Artifact, Artifacts
from agentgrove.cli.common import (
    CliError,
    Parser,
    Subcommands,
    agent_id,
    clip,
    connect,
    nats_url,
    out,
    run_async,
)


def artifact_line(artifact: Artifact) -> str:
    """One artifact on one line: id, size, owner, tree, type and name."""
    return (
        f"{artifact.artifact_id}  {artifact.size:>10}  {artifact.agent_id}  "
        f"tree={artifact.tree_id}  {artifact.media_type}  {clip(artifact.name, 60)}"
    )


async def list_artifacts(args: argparse.Namespace) -> int:
    """`grove artifacts ls`: the live artifacts, of all trees, one tree, or as an agent sees."""
    async with connect(nats_url(args)) as conn:
        store = Artifacts(conn.log, agent_id=args.agent, tree_id=args.tree)
        found = await conn.guard(store.list())
    if args.json:
        out(json.dumps([asdict(a) for a in found], indent=2))
    elif not found:
        out("(no artifacts)")
    else:
        for artifact in found:
            out(artifact_line(artifact))
    return 0


async def fetch_artifact(args: argparse.Namespace) -> bytes:
    """An artifact's bytes, read as a caller that is no agent."""
    async with connect(nats_url(args)) as conn:
        return await conn.guard(conn.client.artifacts.get(args.artifact_id))


def get_artifact(args: argparse.Namespace) -> int:
    """`grove artifacts get`: an artifact's bytes to a file, or to stdout."""
    data = asyncio.run(fetch_artifact(args))
    if args.output is None:
        sys.stdout.buffer.write(data)
        sys.stdout.buffer.flush()
    else:
        args.output.write_bytes(data)
    return 0


async def store_artifact(args: argparse.Namespace, data: bytes, name: str) -> Artifact:
    """Store `data` as an artifact of the agent given with --agent."""
    async with connect(nats_url(args)) as conn:
        store = Artifacts(conn.log, agent_id=args.agent)
        return await conn.guard(store.put(data, name=name, media_type=args.media_type))


def put_artifact(args: argparse.Namespace) -> int:
    """`grove artifacts put`: a file stored as an artifact of an agent; prints its id."""
    source: Path = args.file
    if not source.is_file():
        raise CliError(f"{source} is not a readable file; give the path of the file to store")
    data = source.read_bytes()
    args.media_type = args.media_type or mimetypes.guess_type(source.name)[0]
    artifact = asyncio.run(store_artifact(args, data, args.name or source.name))
    out(artifact.artifact_id)
    return 0


async def remove_artifact(args: argparse.Namespace) -> int:
    """`grove artifacts rm`: delete an artifact of the agent's tree."""
    async with connect(nats_url(args)) as conn:
        store = Artifacts(conn.log, agent_id=args.agent)
        artifact = await conn.guard(store.delete(args.artifact_id))
    out(f"deleted {artifact.artifact_id} ({artifact.name})")
    return 0


def add_commands(commands: Subcommands, common: Parser) -> None:
    """Register `artifacts` and its subcommands."""
    group = commands.add_parser(
        "artifacts", parents=[common], help="list, read, store and delete artifacts"
    )
    verbs = group.add_subparsers(dest="artifacts_verb", metavar="VERB", required=True)

    ls = verbs.add_parser("ls", parents=[common], help="the live artifacts, oldest first")
    scope = ls.add_mutually_exclusive_group()
    scope.add_argument("--tree", metavar="ID", type=agent_id, help="only this tree's")
    scope.add_argument(
        "--agent", metavar="ID", type=agent_id, help="those of this agent's tree, as it sees them"
    )
    ls.add_argument("--json", action="store_true", help="as JSON")
    ls.set_defaults(handler=run_async(list_artifacts))

    get = verbs.add_parser("get", parents=[common], help="an artifact's bytes")
    get.add_argument("artifact_id", type=agent_id)
    get.add_argument(
        "-o", "--output", metavar="FILE", type=Path, help="write them here (default: stdout)"
    )
    get.set_defaults(handler=get_artifact)

    put = verbs.add_parser("put", parents=[common], help="store a file as an agent's artifact")
    put.add_argument("file", type=Path)
    put.add_argument("--agent", metavar="ID", type=agent_id, required=True, help="its owner")
    put.add_argument("--name", metavar="N", help="its name (default: the file's)")
    put.add_argument(
        "--media-type", metavar="T", help="e.g. text/markdown (default: guessed from the name)"
    )
    put.set_defaults(handler=put_artifact)

    rm = verbs.add_parser("rm", parents=[common], help="delete an artifact of the agent's tree")
    rm.add_argument("artifact_id", type=agent_id)
    rm.add_argument("--agent", metavar="ID", type=agent_id, required=True, help="who deletes it")
    rm.set_defaults(handler=run_async(remove_artifact))
