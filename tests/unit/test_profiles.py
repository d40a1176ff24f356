"""Subagent profiles: what a valid definition is, how the config file's list is read, and the
built-in agents' pure parts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from agentgrove import SubAgentDefinition
from agentgrove.profiles import (
    analyse,
    builtin_profiles,
    check_task_arguments,
    evaluate,
    explore,
    explore_report,
    incomplete_content,
    load_profiles,
    parse_profiles,
    search_terms,
    workspace_of,
)
from grove_core.config import ConfigError

pytestmark = pytest.mark.unit


def definition(**fields: Any) -> SubAgentDefinition:
    base: dict[str, Any] = {
        "name": "critic",
        "description": "reviews a draft",
        "runtime": "python",
        "entrypoint": "tests.task_agents:echo",
    }
    return SubAgentDefinition.model_validate({**base, **fields})


def error_of(**fields: Any) -> str:
    with pytest.raises(ValidationError) as caught:
        definition(**fields)
    return str(caught.value)


def test_a_valid_definition_makes_the_child_config() -> None:
    profile = definition(model="m1", permissions=["fs.read"], return_budget=300)
    config = profile.agent_config()
    assert (config.runtime, config.entrypoint, config.profile) == (
        "python",
        "tests.task_agents:echo",
        "critic",
    )
    assert (config.model, config.permissions, config.return_budget) == ("m1", ["fs.read"], 300)
    assert profile.max_iterations == 20


@pytest.mark.parametrize("name", ["Critic", "1critic", "crit ic", "", "c" * 65, "-x", "crit.ic"])
def test_a_bad_name_is_refused_with_the_rule(name: str) -> None:
    assert "must start with a lowercase letter" in error_of(name=name)


@pytest.mark.parametrize("name", ["c", "critic-2", "deep_thought", "a" * 64])
def test_good_names(name: str) -> None:
    assert definition(name=name).name == name


@pytest.mark.parametrize("description", ["", "   "])
def test_an_empty_description_is_refused(description: str) -> None:
    assert "non-empty description" in error_of(description=description)


@pytest.mark.parametrize("field", ["max_iterations", "return_budget"])
@pytest.mark.parametrize("value", [0, -3])
def test_limits_must_be_positive(field: str, value: int) -> None:
    assert f"must be a positive number, not {value}" in error_of(**{field: value})


def test_a_profile_that_cannot_run_is_refused() -> None:
    assert "needs config.entrypoint" in error_of(entrypoint=None)
    assert "needs config.command" in error_of(runtime="command", entrypoint=None)
    assert "reasoning_effort" in error_of(reasoning_effort="extreme")
    assert "Extra inputs" in error_of(colour="blue")


def test_openai_profiles_need_no_entrypoint() -> None:
    profile = definition(runtime="openai", entrypoint=None, reasoning_effort="low")
    assert profile.agent_config().runtime == "openai"


def test_the_config_list_adds_and_replaces_profiles() -> None:
    profiles = parse_profiles(
        [
            {"name": "critic", "description": "reviews", "entrypoint": "m:f"},
            {"name": "explore", "description": "my own explorer", "entrypoint": "m:g"},
        ]
    )
    assert sorted(profiles) == ["critic", "explore", "reasoning"]
    assert profiles["explore"].description == "my own explorer"


def test_duplicate_and_invalid_entries_name_their_place() -> None:
    same = {"name": "critic", "description": "reviews", "entrypoint": "m:f"}
    with pytest.raises(ValueError, match=r"profiles\[1\]: duplicate profile name 'critic'"):
        parse_profiles([same, same])
    with pytest.raises(ValueError, match=r"profiles\[0\] \(x\)\.description: .*non-empty"):
        parse_profiles([{"name": "x", "description": "", "entrypoint": "m:f"}])


def test_builtins_run_offline_unless_an_endpoint_is_configured() -> None:
    offline = {p.name: p for p in builtin_profiles()}
    assert offline["explore"].entrypoint == "agentgrove.profiles:explore_agent"
    assert offline["reasoning"].runtime == "python"
    assert offline["reasoning"].permissions == []
    assert {p.runtime for p in builtin_profiles(llm=True)} == {"openai"}


def test_loading_from_the_config_file(tmp_path: Path) -> None:
    path = tmp_path / "grove.yaml"
    path.write_text(
        "openai:\n  base_url: http://127.0.0.1:9/v1\nprofiles:\n"
        "  - name: critic\n    description: reviews\n    runtime: openai\n"
    )
    profiles = load_profiles(path)
    assert profiles["critic"].runtime == "openai"
    assert profiles["explore"].runtime == "openai"
    path.write_text("profiles:\n  - name: Critic\n    description: reviews\n")
    with pytest.raises(ConfigError, match=r"grove\.yaml: profiles\[0\] \(Critic\)\.name"):
        load_profiles(path)


def test_task_argument_bounds() -> None:
    check_task_arguments("d" * 120, "p" * 100_000)
    for description, prompt, what in [
        ("", "p", "description"),
        ("d" * 121, "p", "description"),
        ("d", "", "prompt"),
        ("d", "p" * 100_001, "prompt"),
    ]:
        with pytest.raises(ValueError, match=f"task {what} must be 1 to"):
            check_task_arguments(description, prompt)
    with pytest.raises(ValueError, match="task prompt is blank"):
        check_task_arguments("d", " \n ")


def test_an_incomplete_report_begins_with_the_notice_and_keeps_the_budget() -> None:
    text = incomplete_content("was stopped", "half of it " * 20, 80)
    assert text.startswith("[incomplete report: the subagent was stopped;")
    assert len(text) == 80


def test_explore_finds_terms_with_paths(tmp_path: Path) -> None:
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "billing.py").write_text("def invoice_total(lines):\n    return 0\n")
    (tmp_path / "notes.md").write_text("The invoice is sent monthly.\nNothing else.\n")
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "invoice").write_text("invoice")
    (tmp_path / "blob.bin").write_bytes(b"\0invoice")
    root, rest = workspace_of(
        f"Where is the invoice total computed?\nworkspace: {tmp_path}", Path()
    )
    assert root == tmp_path
    terms = search_terms(rest)
    assert terms == ["invoice", "total", "computed"]
    scanned, findings = explore(root, terms)
    assert scanned == 3
    assert [(f.path, f.line) for f in findings] == [("src/billing.py", 1), ("notes.md", 1)]
    report = explore_report(root, terms, scanned, findings)
    assert "- src/billing.py:1: def invoice_total(lines):" in report


def test_reasoning_analysis_is_deterministic() -> None:
    text = "We must ship by Friday. If the build fails, who fixes it? Cost is 12 * 7 + 6."
    report = analyse(text)
    assert report == analyse(text)
    assert "- We must ship by Friday." in report
    assert "- If the build fails, who fixes it?" in report
    assert "12 * 7 + 6 = 90" in report
    assert evaluate("2 ** 10") is None
    assert evaluate("__import__('os')") is None
