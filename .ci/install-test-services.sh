#!/usr/bin/env bash
# System packages the test suite talks to for real (Debian packages), and
# Grafana's dashboard schema with the TypeScript compiler (npm registry,
# pinned, into build/grafana-schema/: the dashboard test type-checks the JSON
# with them). Each is installed only when missing, so re-runs cost nothing.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"

need=()
command -v prometheus >/dev/null 2>&1 || need+=(prometheus)
command -v promtool >/dev/null 2>&1 || need+=(prometheus)
command -v chromium >/dev/null 2>&1 || need+=(chromium)
command -v node >/dev/null 2>&1 || need+=(nodejs)
command -v npm >/dev/null 2>&1 || need+=(npm)
command -v ip >/dev/null 2>&1 || need+=(iproute2)  # the two-host topology test's namespaces
# Mooncake's transfer engine loads libibverbs even for its TCP transport (docs/rig.md, "Topologies").
ldconfig -p 2>/dev/null | grep -q 'libibverbs.so.1 ' || need+=(libibverbs1)
if [ ${#need[@]} -gt 0 ]; then
  export DEBIAN_FRONTEND=noninteractive
  sudo_cmd=""
  [ "$(id -u)" -ne 0 ] && sudo_cmd="sudo"
  $sudo_cmd apt-get update -qq
  $sudo_cmd apt-get install -y -qq --no-install-recommends $(printf '%s\n' "${need[@]}" | sort -u) >/dev/null
fi

# The versions tests/observability/test_grafana_schema.py checks against (it reads them here).
GRAFANA_SCHEMA_VERSION=13.2.3
TYPESCRIPT_VERSION=5.9.3
schema_dir="$root/build/grafana-schema"
stamp="$schema_dir/.installed-grafana-schema-$GRAFANA_SCHEMA_VERSION-typescript-$TYPESCRIPT_VERSION"
if [ ! -f "$stamp" ]; then
  rm -rf "$schema_dir"
  mkdir -p "$schema_dir"
  printf '{\n  "name": "dsv4-idxk-probe-grafana-schema",\n  "private": true\n}\n' >"$schema_dir/package.json"
  npm install --prefix "$schema_dir" --no-audit --no-fund --ignore-scripts --save-exact --loglevel=error \
    "@grafana/schema@$GRAFANA_SCHEMA_VERSION" "typescript@$TYPESCRIPT_VERSION" >/dev/null
  touch "$stamp"
fi
