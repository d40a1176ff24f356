"""The `grove` command: run the local stack, spawn and steer agents, watch and replay the log."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import os
import shlex
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nats.errors
import nats.js.errors
from pydantic import ValidationError

from agentgrove.cli import artifacts, control, debug, mcp, routing
from agentgrove.cli.common import (
    ALL_SUBJECTS,
    CliError,
    Connection,
    Handler,
    Parser,
    Subcommands,
    agent_id,
    clip,
    connect,
    data_dir,
    decode_item,
    format_json,
    format_line,
    nats_url,
    out,
    positive_float,
    positive_int,
    reachable,
    records,
    render_tree,
    require_agent,
    run_async,
    short_id,
    tip,
)
from agentgrove.client import UnknownAgent, build_config
from agentgrove.demo import LLM_ROOT_TASK, ROOT_ENTRYPOINT, documentation_folder, root_task
from agentgrove.stack import Stack, StackError
from grove_core.auth import redact
from grove_core.log import EventLog, LogError
from grove_core.natsserver import NatsServerError, free_port
from grove_core.records import Recorded
from grove_core.tree import AgentNode, TreeState, evolve
from grove_events import (
    AgentConfig,
    HitlEvent,
    TerminateEvent,
    agent_wildcard,
)

DEFAULT_NATS_PORT = 4222
#: How often `grove up` looks for services that died.
SUPERVISE_INTERVAL_S = 1.0
#: How long `grove demo` waits for its root agent to end.
DEMO_TIMEOUT_S = 90.0
#: How long when a person answers the demo's question at the terminal.
DEMO_INTERACTIVE_TIMEOUT_S = 900.0
#: How often `grove demo` looks whether the tree changed.
REFRESH_S = 0.1


def command_argv(args: argparse.Namespace) -> list[str] | None:
    """The command agent's argv: the words after `--`, or the --command string split."""
    trailing: list[str] = args.argv
    given: str | None = args.command
    if given is not None and trailing:
        raise CliError("give the command either with --command 'STRING' or after --, not both")
    if given is None:
        return trailing or None
    try:
        argv = shlex.split(given)
    except ValueError as exc:
        raise CliError(f"cannot split --command {given!r}: {exc}") from None
    if not argv:
        raise CliError("--command is empty")
    return argv


async def spawn_agent(args: argparse.Namespace) -> int:
    """`grove spawn`: publish a spawn; with --wait, wait for the end and print the result."""
    argv = command_argv(args)
    if (argv is None) == (args.entrypoint is None):
        raise CliError("give exactly one of --command (or an argv after --) and --entrypoint")
    if args.timeout is not None and not args.wait:
        raise CliError("--timeout is how long --wait waits; give --wait too")
    if argv is not None:
        config = build_config("command", command=argv)
    else:
        config = build_config("python", entrypoint=args.entrypoint)
    async with connect(nats_url(args)) as conn:
        if args.parent is not None:
            await require_agent(conn.client, args.parent)
        agent_id = await conn.client.spawn(args.task, config, parent=args.parent)
        out(agent_id)
        if not args.wait:
            return 0
        try:
            result = await conn.guard(conn.client.wait(agent_id, args.timeout))
        except TimeoutError:
            raise CliError(
                f"agent {agent_id} did not end within {args.timeout:g}s; it goes on "
                f"(`grove stop {agent_id}` ends it)"
            ) from None
    out(f"reason: {result.reason}")
    if result.summary:
        out(f"summary: {result.summary.rstrip()}")
    if result.error:
        out(f"error: {result.error}")
    return 0 if result.ok else 1


async def stop_agent(args: argparse.Namespace) -> int:
    """`grove stop`: ask for an agent to be stopped."""
    async with connect(nats_url(args)) as conn:
        await require_agent(conn.client, args.agent_id)
        last = await conn.log.get_last(agent_wildcard(args.agent_id))
        ended = decode_item(last)[1] if last is not None else None
        if isinstance(ended, Recorded) and isinstance(ended.event, TerminateEvent):
            out(f"agent {args.agent_id} already ended ({ended.event.reason}); nothing to stop")
            return 0
        await conn.client.stop(args.agent_id, args.reason)
    out(f"stop requested for {args.agent_id}")
    return 0


async def tail_log(args: argparse.Namespace) -> int:
    """`grove tail`: print events as they are appended, until interrupted."""
    show = format_json if args.json else format_line
    async with connect(nats_url(args)) as conn:
        subjects = ALL_SUBJECTS
        if args.agent is not None:
            await require_agent(conn.client, args.agent)
            subjects = agent_wildcard(args.agent)
        start = args.from_seq if args.from_seq is not None else await tip(conn.log) + 1

        async def follow() -> None:
            async for item in records(conn.log, start, subjects=subjects, follow=True):
                out(show(item))

        await conn.guard(follow())
    return 0


# -- grove up -------------------------------------------------------------------------------------


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    """Whether a TCP port can be bound on `host` right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def check_not_running(folder: Path) -> None:
    """Refuse to start a second stack on a data folder whose stack answers."""
    url_file = folder / "nats.url"
    if not url_file.exists():
        return
    url = url_file.read_text().strip()
    if url and asyncio.run(reachable(url)):
        raise CliError(
            f"a stack already runs with data folder {folder} (NATS at {url}); "
            "stop it first or give another --data-dir"
        )


def build_stack(args: argparse.Namespace, folder: Path) -> Stack:
    """The stack `grove up` runs, from its options."""
    if args.port is not None:
        port = args.port
    else:
        port = DEFAULT_NATS_PORT if port_is_free(DEFAULT_NATS_PORT) else free_port()
    config: Path | None = args.config
    if config is not None and not config.is_file():
        raise CliError(f"config file {config} does not exist")
    return Stack(
        folder,
        nats_url=args.nats_url,
        spawners=args.spawners,
        config_file=config,
        nats_port=port,
        auth=args.auth,
    )


def start_stack(stack: Stack) -> Stack:
    """Start the stack; a start-up failure becomes one line that says where the logs are."""
    try:
        return stack.start()
    except StackError as exc:
        stack.stop()
        first = str(exc).splitlines()[0] if str(exc) else "the stack did not start"
        raise CliError(f"{first.rstrip(':')} (logs in {stack.data_dir / 'logs'})") from None
    except BaseException:
        stack.stop()
        raise


def supervise(stack: Stack) -> None:
    """Restart the services that died, and say so; once."""
    dead = {
        s.name: s.process.returncode
        for s in stack.services.values()
        if s.process is not None and not s.alive
    }
    if stack.nats is not None and stack.nats.process is not None:
        code = stack.nats.process.poll()
        if code is not None:
            out(f"grove: nats-server exited with code {code}; restarting it")
            stack.nats.start()
    for name in stack.supervise_once():
        log_path = stack.services[name].log_path
        out(f"grove: {name} exited with code {dead.get(name)}; restarted it (log: {log_path})")


def run_up(args: argparse.Namespace) -> int:
    """`grove up`: start the stack, supervise it until Ctrl-C or SIGTERM, stop it."""
    folder = data_dir(args)
    check_not_running(folder)
    stack = build_stack(args, folder)
    out(f"grove: starting AgentGrove in {folder}")
    start_stack(stack)
    try:
        out(f"grove: NATS at {redact(stack.caller_url)}")
        if stack.local_auth is not None:
            out(
                f"grove: NATS users and permissions on; callers connect as 'caller' "
                f"(the URL with its password is in {folder / 'nats.url'})"
            )
        out(f"grove: service logs in {folder / 'logs'}")
        if stack.nats is not None:
            out(f"grove: nats-server log in {stack.nats.data_dir / 'nats-server.log'}")
        out("grove: up; Ctrl-C stops it")
        with contextlib.suppress(KeyboardInterrupt):
            while True:
                time.sleep(SUPERVISE_INTERVAL_S)
                supervise(stack)
    finally:
        ignore_interrupts()
        out("grove: stopping")
        stack.stop()
    out("grove: stopped")
    return 0


def ignore_interrupts() -> None:
    """Let a clean stop finish: further Ctrl-C or SIGTERM are ignored."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


# -- grove demo -----------------------------------------------------------------------------------


@dataclass
class TreeWatch:
    """The agent tree folded from the log as it grows, the newest sequence folded, and the
    questions for a person its agents asked that are still to be answered."""

    state: TreeState = field(default_factory=TreeState)
    seq: int = 0
    questions: list[HitlEvent] = field(default_factory=list)


async def follow_tree(log: EventLog, watch: TreeWatch, root_id: str, from_seq: int) -> None:
    """Fold the log from `from_seq` into `watch` until the root agent ends."""
    async for record, item in records(log, from_seq, follow=True):
        if isinstance(item, Recorded):
            watch.state = evolve(watch.state, item)
            event = item.event
            if isinstance(event, HitlEvent) and event.action == "request":
                node = watch.state.agents.get(event.agent_id)
                if node is not None and node.tree_id == root_id:
                    watch.questions.append(event)
        watch.seq = record.seq
        root = watch.state.agents.get(root_id)
        if root is not None and root.ended:
            return
    raise CliError("the log stopped before the demo ended")


async def answer_question(conn: Connection, question: HitlEvent, auto: bool) -> None:
    """Answer a question of the demo tree: at the terminal, or with its first option."""
    asker = short_id(question.agent_id)
    options = f" [{' / '.join(question.options)}]" if question.options else ""
    out(f"?? {asker} asks: {question.prompt}{options}")
    if auto:
        answer = question.options[0] if question.options else "yes"
        out(f"   answered automatically (--yes, or no terminal): {answer}")
    else:
        typed = await asyncio.to_thread(input, "   your answer> ")
        answer = typed.strip() or (question.options[0] if question.options else "yes")
    await conn.client.answer(question.request_id, answer)


async def watch_tree(
    conn: Connection, root_id: str, from_seq: int, *, auto_answer: bool = True
) -> TreeState:
    """Follow the root's tree to its end, printing a fresh snapshot whenever it changed and
    answering the questions its agents ask."""
    watch = TreeWatch()
    folding = asyncio.ensure_future(follow_tree(conn.log, watch, root_id, from_seq))
    shown = ""
    try:
        while True:
            await asyncio.wait({folding}, timeout=REFRESH_S)
            root = watch.state.agents.get(root_id)
            text = render_tree(watch.state, [root]) if root is not None else ""
            if text != shown:
                out(f"-- tree at seq {watch.seq} --")
                out(text)
                shown = text
            while watch.questions:
                await answer_question(conn, watch.questions.pop(0), auto_answer)
            if folding.done():
                folding.result()
                return watch.state
    finally:
        folding.cancel()
        await asyncio.gather(folding, return_exceptions=True)


def print_results(state: TreeState, root_id: str) -> None:
    """Every agent of the root's tree with its result."""
    out()
    out("results:")
    for node in state.subtree(root_id):
        depth = len(state.path(node.agent_id)) - 1
        result = node.summary.strip() or "(no summary)"
        line = f"{'  ' * depth}{short_id(node.agent_id)} {node.state}: {clip(result, 200)}"
        out(line + (f" error: {clip(node.error, 200)}" if node.error else ""))


def print_replay_hint(grove: str, root: AgentNode, note: str | None) -> None:
    """How to look at the run again, with `grove` the command line prefix that reaches it."""
    out()
    if note:
        out(note)
    out(f"replay this run:  {grove} replay --from-seq {root.spawn_seq}")
    out(f"see its tree:     {grove} tree --agent {root.agent_id}")


def demo_root(llm: bool) -> tuple[str, AgentConfig]:
    """The demo root's task and config: the python root, or with `llm` the openai one."""
    docs = documentation_folder()
    if not llm:
        return root_task(docs), build_config("python", entrypoint=ROOT_ENTRYPOINT)
    if not os.environ.get("OPENAI_API_KEY"):
        raise CliError(
            "grove demo --llm needs OPENAI_API_KEY (and OPENAI_BASE_URL for an endpoint other "
            "than OpenAI's) in the environment of the stack's spawners"
        )
    return f"{LLM_ROOT_TASK}workspace: {docs}", build_config(
        "openai", model=os.environ.get("OPENAI_MODEL") or None
    )


async def run_demo_on(
    url: str, *, llm: bool = False, auto_answer: bool = True
) -> tuple[TreeState, str]:
    """Spawn the demonstration root on the stack at `url` and watch it to its end."""
    task, config = demo_root(llm)
    async with connect(url) as conn:
        start = await tip(conn.log) + 1
        root_id = await conn.client.spawn(task, config)
        out(f"grove: spawned the demo root agent {root_id}")
        limit = DEMO_TIMEOUT_S if auto_answer else DEMO_INTERACTIVE_TIMEOUT_S
        try:
            state = await conn.guard(
                asyncio.wait_for(watch_tree(conn, root_id, start, auto_answer=auto_answer), limit)
            )
        except TimeoutError:
            raise CliError(
                f"the demo did not end within {limit:g}s; are the services running (`grove up`)?"
            ) from None
    return state, root_id


def demo_result(args: argparse.Namespace, url: str, grove: str | None, note: str | None) -> int:
    """Run the demo against `url` and print its results; 0 when the root completed.

    `grove` is the command line prefix that reaches this log later (None: it will be gone).
    """
    auto = args.yes or not sys.stdin.isatty()
    state, root_id = asyncio.run(run_demo_on(url, llm=args.llm, auto_answer=auto))
    print_results(state, root_id)
    root = state.agents[root_id]
    if grove is not None:
        print_replay_hint(grove, root, note)
    elif note:
        out()
        out(note)
    if root.state != "completed":
        raise CliError(f"the demo root agent ended as {root.state}: {root.error or root.summary}")
    return 0


@contextlib.contextmanager
def embedded_stack(given: Path | None) -> Iterator[Stack]:
    """A stack for the demo's duration, in `given` or in a temporary folder removed after."""
    folder = given or Path(tempfile.mkdtemp(prefix="grove-demo-"))
    out(f"grove: no stack is reachable; starting one in {folder} for the demo")
    stack = Stack(folder)
    try:
        yield start_stack(stack)
    finally:
        ignore_interrupts()
        out("grove: stopping the demo stack")
        stack.stop()
        if given is None:
            shutil.rmtree(folder, ignore_errors=True)


def run_demo(args: argparse.Namespace) -> int:
    """`grove demo`: run the demonstration tree, on the running stack or an embedded one."""
    url = nats_url(args)
    if asyncio.run(reachable(url)):
        out(f"grove: using the stack at {url}")
        grove = "grove"
        if args.nats_url:
            grove += f" --nats-url {args.nats_url}"
        elif args.data_dir:
            grove += f" --data-dir {args.data_dir}"
        return demo_result(args, url, grove, None)
    if args.nats_url:
        raise CliError(f"cannot reach NATS at {url}; start the stack with `grove up`")
    with embedded_stack(args.data_dir) as stack:
        if args.data_dir is None:
            note = (
                "(the demo's stack and log are removed when it ends; "
                "`grove demo --data-dir DIR` keeps them for `grove replay`)"
            )
            return demo_result(args, stack.caller_url, None, note)
        note = f"(first start the stack again: grove up --data-dir {args.data_dir})"
        return demo_result(args, stack.caller_url, f"grove --data-dir {args.data_dir}", note)


# -- the parser -----------------------------------------------------------------------------------


def _global_options(parser: Parser, default: Any) -> None:
    parser.add_argument(
        "--nats-url",
        metavar="URL",
        default=default,
        help="NATS URL (default: $GROVE_NATS_URL, else the URL `grove up` wrote in the data folder)",
    )
    parser.add_argument(
        "--data-dir",
        metavar="DIR",
        type=Path,
        default=default,
        help="data folder (default: $GROVE_DATA_DIR, else ./.grove)",
    )


def _add_up(commands: Subcommands, common: Parser) -> None:
    up = commands.add_parser("up", parents=[common], help="run the local stack in the foreground")
    up.add_argument(
        "--port", metavar="N", type=positive_int, help="NATS port (default 4222 if free)"
    )
    up.add_argument(
        "--spawners", metavar="N", type=positive_int, default=1, help="spawner replicas"
    )
    up.add_argument(
        "--config", metavar="FILE", type=Path, help="AgentGrove config file (limits, profiles)"
    )
    up.add_argument(
        "--auth",
        action="store_true",
        help="NATS users with per-service subject permissions (as in Compose and Kubernetes)",
    )
    up.set_defaults(handler=run_up)


def _add_spawn(commands: Subcommands, common: Parser) -> None:
    spawn = commands.add_parser(
        "spawn",
        parents=[common],
        help="spawn a root agent (or a child with --parent)",
        usage="grove spawn TASK (--command STRING | -- ARGV... | --entrypoint MODULE:FUNCTION) "
        "[--parent ID] [--wait] [--timeout S]",
        description="Spawn an agent. A command agent's argv comes after `--` (verbatim) or "
        "as one --command string (split like a shell would); it reads the task on stdin.",
    )
    spawn.add_argument("task", help="what the agent is to do")
    spawn.add_argument("--command", metavar="STRING", help="the command agent's argv as one string")
    spawn.add_argument(
        "--entrypoint", metavar="MODULE:FUNCTION", help="a python agent, as module:function"
    )
    spawn.add_argument("--parent", metavar="ID", type=agent_id, help="the parent agent's id")
    spawn.add_argument("--wait", action="store_true", help="wait for the end, print the result")
    spawn.add_argument(
        "--timeout", metavar="S", type=positive_float, help="seconds --wait waits at most"
    )
    spawn.set_defaults(handler=run_async(spawn_agent))


def _add_stop(commands: Subcommands, common: Parser) -> None:
    stop = commands.add_parser("stop", parents=[common], help="stop an agent")
    stop.add_argument("agent_id", type=agent_id)
    stop.add_argument(
        "--reason", metavar="TEXT", default="stopped by caller", help="why (kept in the log)"
    )
    stop.set_defaults(handler=run_async(stop_agent))


def _add_reading(commands: Subcommands, common: Parser) -> None:
    tail = commands.add_parser("tail", parents=[common], help="print events as they happen")
    tail.add_argument("--json", action="store_true", help="JSON lines")
    tail.add_argument("--agent", metavar="ID", type=agent_id, help="only this agent's events")
    tail.add_argument(
        "--from-seq", metavar="N", type=positive_int, help="start here (default: the tip + 1)"
    )
    tail.set_defaults(handler=run_async(tail_log))


def _add_demo(commands: Subcommands, common: Parser) -> None:
    demo = commands.add_parser(
        "demo", parents=[common], help="run the demonstration tree (starts a stack if needed)"
    )
    demo.add_argument(
        "--yes",
        action="store_true",
        help="answer the demo's question automatically (also when there is no terminal)",
    )
    demo.add_argument(
        "--llm",
        action="store_true",
        help="run the root on the openai runtime (needs OPENAI_API_KEY; OPENAI_BASE_URL, "
        "OPENAI_MODEL optional)",
    )
    demo.set_defaults(handler=run_demo)


def build_parser() -> Parser:
    """The `grove` argument parser; global options go before or after the command."""
    parser = Parser(prog="grove", description="AgentGrove: a control plane for trees of agents.")
    _global_options(parser, None)
    common = Parser(add_help=False)
    _global_options(common, argparse.SUPPRESS)
    commands = parser.add_subparsers(dest="command_name", metavar="COMMAND", required=True)
    _add_up(commands, common)
    _add_spawn(commands, common)
    _add_stop(commands, common)
    _add_reading(commands, common)
    _add_demo(commands, common)
    control.add_commands(commands, common)
    debug.add_commands(commands, common)
    routing.add_commands(commands, common)
    artifacts.add_commands(commands, common)
    mcp.add_commands(commands, common)
    return parser


def parse(argv: Sequence[str]) -> argparse.Namespace:
    """Parse the command line; for `spawn`, what follows `--` is the command agent's argv."""
    words = list(argv)
    trailing: list[str] = []
    if "--" in words:
        cut = words.index("--")
        words, trailing = words[:cut], words[cut + 1 :]
    args = build_parser().parse_args(words)
    if trailing and args.command_name != "spawn":
        build_parser().error("arguments after -- are only for `grove spawn`")
    if args.command_name == "spawn":
        args.argv = trailing
    return args


# -- the entry point ------------------------------------------------------------------------------


def one_line(message: str) -> str:
    """A message on one line."""
    return " | ".join(line.strip() for line in message.splitlines() if line.strip())


def error_message(exc: BaseException) -> str:
    """What to tell the user about an error, in one line."""
    if isinstance(exc, UnknownAgent):
        return str(exc)
    if isinstance(exc, ValidationError):
        first = exc.errors(include_url=False)[0]
        where = ".".join(str(p) for p in first["loc"])
        return f"invalid {where or 'input'}: {first['msg']}"
    if isinstance(exc, nats.errors.Error):
        return f"NATS: {exc.__class__.__name__}: {exc}"
    return str(exc) or exc.__class__.__name__


def _utf8_safe_output() -> None:
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, io.TextIOWrapper):
            stream.reconfigure(errors="replace")


KNOWN_ERRORS = (
    CliError,
    LogError,
    UnknownAgent,
    ValidationError,
    StackError,
    NatsServerError,
    nats.errors.Error,
    OSError,
)


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of `grove`: run one command, exit with its code."""
    _utf8_safe_output()
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    args = parse(sys.argv[1:] if argv is None else argv)
    handler: Handler = args.handler
    try:
        code = handler(args)
    except KNOWN_ERRORS as exc:
        print(f"grove: error: {one_line(error_message(exc))}", file=sys.stderr, flush=True)
        code = 1
    except KeyboardInterrupt:
        code = 0 if args.command_name == "tail" else 130
    sys.exit(code)


if __name__ == "__main__":
    main()
