#!/usr/bin/env bash
# Idempotent set-up for a fresh machine: Java 17+ and Maven (for the embedded Kafka broker),
# a virtualenv in .venv with ksow and its test and Spark extras. Sourced by ops/demo and ops/test.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${KSOW_VENV:-$ROOT/.venv}"
PYTHON="${PYTHON:-python3}"
EXTRAS="${KSOW_EXTRAS:-test}"

need_java() {
  command -v java >/dev/null 2>&1 || return 0
  local major
  major=$(java -version 2>&1 | sed -n 's/.*version "\([0-9]*\).*/\1/p' | head -1)
  [ "${major:-0}" -lt 17 ]
}

if need_java || ! command -v mvn >/dev/null 2>&1; then
  if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
    echo "ksow: installing Java 17 and Maven with apt-get" >&2
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openjdk-17-jre-headless maven >/dev/null
  else
    echo "ksow: the embedded Kafka broker needs Java 17+ and Maven on PATH (or set KAFKA_BOOTSTRAP)" >&2
    exit 1
  fi
fi

stamp="$VENV/.ksow-installed-$EXTRAS"
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
if [ ! -f "$stamp" ] || [ "$ROOT/pyproject.toml" -nt "$stamp" ]; then
  "$VENV/bin/python" -m pip install -q --upgrade pip
  "$VENV/bin/python" -m pip install -q -e "$ROOT[$EXTRAS]"
  touch "$stamp"
fi
