"""Replay debugging with `grove`: the tree at a point, diffs, subtree replays, export/import."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from agentgrove.stack import Stack
from grove_core.natsserver import LocalNatsServer, free_port
from tests.conftest import NatsEndpoint, StackFactory
from tests.integration.test_cli import assert_one_line_error, grove, tree_json

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]


def replay_items(url: str, *args: str) -> list[dict[str, Any]]:
    """`grove replay --json ARGS` parsed."""
    result = grove(url, "replay", "--json", *args)
    assert result.returncode == 0, result.stderr
    return [json.loads(line) for line in result.stdout.splitlines()]


@pytest.fixture
def stack(make_stack: StackFactory) -> Stack:
    """The services, against the test's nats-server."""
    return make_stack()


@pytest.fixture
def demo_tree(nats_server: NatsEndpoint, stack: Stack) -> str:
    """A root with three children, run to its end; returns the root's id."""
    result = grove(
        nats_server.url, "spawn", "demo", "--entrypoint", "tests.three_children:root", "--wait"
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout.splitlines()[0]


def first_seq(items: list[dict[str, Any]], agent: str, kind: str, status: str | None = None) -> int:
    """The sequence of the first event of `kind` (and status type) about `agent`."""
    for item in items:
        event = item.get("event") or {}
        same = event.get("agent_id") == agent and event.get("type") == kind
        if same and (status is None or event.get("status_type") == status):
            return int(item["seq"])
    raise AssertionError(f"no {kind} {status or ''} for {agent}")


def test_the_tree_at_a_point_and_the_diff_between_two(
    nats_server: NatsEndpoint, demo_tree: str
) -> None:
    url = nats_server.url
    items = replay_items(url)
    root_started = first_seq(items, demo_tree, "status", "started")
    root_ended = first_seq(items, demo_tree, "terminate")

    (then,) = tree_json(url, "--at", str(root_started))
    (now,) = tree_json(url)

    assert then["state"] == "running"
    assert then["children"] == []
    assert now["state"] == "completed"
    assert len(now["children"]) == 3
    by_time = next(i for i in items if i["seq"] == root_started)["event"]["timestamp"]
    (at_time,) = tree_json(url, "--at", by_time)
    assert at_time["state"] in ("admitted", "running")
    text = grove(url, "tree", "--at", str(root_started)).stdout
    assert text.startswith(f"-- the tree at seq {root_started} --")

    result = grove(url, "diff", "--from", str(root_started), "--to", str(root_ended), "--json")
    assert result.returncode == 0, result.stderr
    diff = json.loads(result.stdout)
    assert diff["from_seq"] == root_started
    assert diff["to_seq"] == root_ended
    assert sorted(n["agent_id"] for n in diff["added"]) == sorted(
        c["agent_id"] for c in now["children"]
    )
    assert diff["changed"][demo_tree]["state"] == {"from": "running", "to": "completed"}
    human = grove(url, "diff", "--from", str(root_started)).stdout.splitlines()
    assert human[0].startswith(f"-- changes from seq {root_started} to seq ")
    assert sum(line.startswith("+ ") for line in human) == 3
    assert any(line.startswith(f"~ {demo_tree}") and "completed" in line for line in human)
    nothing = grove(url, "diff", "--from", str(root_ended), "--to", str(root_ended))
    assert "(no change)" in nothing.stdout


def test_replay_of_a_subtree_and_of_a_window(nats_server: NatsEndpoint, demo_tree: str) -> None:
    url = nats_server.url
    everything = replay_items(url)
    children = {
        i["event"]["agent_id"]
        for i in everything
        if i["event"]["type"] == "spawn" and i["event"].get("parent") == demo_tree
    }

    subtree = replay_items(url, "--agent", demo_tree, "--subtree")
    only_root = replay_items(url, "--agent", demo_tree)

    assert {i["event"]["agent_id"] for i in subtree} == {demo_tree, *children}
    assert {i["event"]["agent_id"] for i in only_root} == {demo_tree}
    assert len(subtree) == len(everything)  # the demo tree is all the log holds
    start, end = everything[3]["seq"], everything[8]["seq"]
    windowed = replay_items(url, "--from", str(start), "--to", str(end))
    assert [i["seq"] for i in windowed] == [
        i["seq"] for i in everything if start <= i["seq"] <= end
    ]
    sub_window = replay_items(url, "--agent", demo_tree, "--subtree", "--from", str(start))
    assert [i["seq"] for i in sub_window] == [i["seq"] for i in subtree if i["seq"] >= start]
    assert_one_line_error(grove(url, "replay", "--subtree"), "--subtree needs --agent")
    assert_one_line_error(
        grove(url, "tree", "--at", "yesterday-ish"), "neither a sequence number nor"
    )


def test_export_and_import_reproduce_the_same_tree_elsewhere(
    nats_server: NatsEndpoint, demo_tree: str, tmp_path: Path
) -> None:
    url = nats_server.url
    capture = tmp_path / "incident.jsonl"
    exported = grove(url, "export", str(capture))
    assert exported.returncode == 0, exported.stderr
    lines = capture.read_text().splitlines()
    assert exported.stdout.startswith(f"exported {len(lines)} messages")
    assert all(json.loads(line)["subject"].startswith("grove.") for line in lines)

    with LocalNatsServer(tmp_path / "laptop") as laptop:
        imported = grove(laptop.url, "import", str(capture), "--nats-url", laptop.url)
        assert imported.returncode == 0, imported.stderr
        assert f"imported {len(lines)} messages" in imported.stdout
        assert tree_json(laptop.url) == tree_json(url)
        assert replay_items(laptop.url, "--agent", demo_tree) == replay_items(
            url, "--agent", demo_tree
        )
        again = grove(laptop.url, "import", str(capture), "--nats-url", laptop.url)
        assert_one_line_error(again, "already holds", "--append")
        appended = grove(laptop.url, "import", str(capture), "--nats-url", laptop.url, "--append")
        assert appended.returncode == 0, appended.stderr
        assert f"imported 0 messages, {len(lines)} already there" in appended.stdout


def test_import_into_a_data_folder_starts_its_own_server_for_the_copy(
    nats_server: NatsEndpoint, demo_tree: str, tmp_path: Path
) -> None:
    capture = tmp_path / "incident.jsonl"
    assert grove(nats_server.url, "export", str(capture)).returncode == 0
    folder = tmp_path / "incident"
    nobody = f"nats://127.0.0.1:{free_port()}"

    imported = grove(nobody, "import", str(capture), "--data-dir", str(folder))

    assert imported.returncode == 0, imported.stderr
    assert f"grove up --data-dir {folder}" in imported.stdout
    with LocalNatsServer(folder / "nats") as copy:
        assert tree_json(copy.url) == tree_json(nats_server.url)


def test_a_damaged_export_file_is_refused_before_anything_is_imported(
    nats_server: NatsEndpoint, tmp_path: Path
) -> None:
    capture = tmp_path / "bad.jsonl"
    capture.write_text('{"subject": "grove.spawn.a", "data": "{}"}\nnot json\n')

    result = grove(nats_server.url, "import", str(capture), "--nats-url", nats_server.url)

    assert_one_line_error(result, f"{capture}:2", "not a JSON line")
    assert grove(nats_server.url, "replay").stdout == ""


def test_the_tree_now_is_the_router_s_and_folded_here_without_it(
    nats_server: NatsEndpoint, demo_tree: str, stack: Stack
) -> None:
    from_router = grove(nats_server.url, "tree", "--json")
    assert from_router.returncode == 0, from_router.stderr
    assert from_router.stderr == ""
    stack.services["router"].stop()

    folded = grove(nats_server.url, "tree", "--json")

    assert folded.returncode == 0, folded.stderr
    assert "no router is answering" in folded.stderr
    assert json.loads(folded.stdout) == json.loads(from_router.stdout)
    (root,) = json.loads(folded.stdout)
    assert root["agent_id"] == demo_tree
