#!/usr/bin/env bash
# The local stack: a Prefect server, an MLflow tracking server, a process work pool and its
# worker, and the deployments in prefect.yaml. `up` records the PIDs it started; `down` stops
# exactly those. All state lives in $RLHF_HOME (default: .rlhf/ in the repository).
#
#   scripts/stack.sh up | down | status | env
#
# Settings (environment): RLHF_HOME, RLHF_HOST (127.0.0.1), RLHF_PREFECT_PORT (4200),
# RLHF_MLFLOW_PORT (5000), RLHF_POOL (rlhf-local), RLHF_WORKER_LIMIT (4), RLHF_PYTHON (.venv/bin/python).
# What a stage logs while it trains waits on disk while the MLflow server is away, up to the config's
# outage_limit_s (flows/journal.py); every other MLflow call from a flow run retries with exponential
# backoff (MLflow's own HTTP retry, MLFLOW_HTTP_REQUEST_MAX_RETRIES=5, BACKOFF_FACTOR=1: about 30 s);
# a flow also waits for the server at start (1, 2, 4, 8 s) before it refuses to run. The worker
# asks for new flow runs every second (Prefect's default, 10 s, is a quarter of a demo stage) and
# runs at most RLHF_WORKER_LIMIT (4) flow runs at once; further runs wait their turn. Training
# runs on one machine share its cores, and a burst of flow-run processes starved the Prefect
# server's SQLite writes (HTTP 503) on a 2-core machine. The server's database statements may
# take up to 30 s (Prefect's default, 10 s, is too short under that load).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
RLHF_HOME="${RLHF_HOME:-$REPO/.rlhf}"
HOST="${RLHF_HOST:-127.0.0.1}"
PREFECT_PORT="${RLHF_PREFECT_PORT:-4200}"
MLFLOW_PORT="${RLHF_MLFLOW_PORT:-5000}"
POOL="${RLHF_POOL:-rlhf-local}"
WORKER_LIMIT="${RLHF_WORKER_LIMIT:-4}"
VENV_BIN="$(dirname "${RLHF_PYTHON:-$REPO/.venv/bin/python}")"
PIDS="$RLHF_HOME/pids"
LOGS="$RLHF_HOME/logs"

stack_env() {
  # Everything a client of this stack needs; `eval "$(scripts/stack.sh env)"` loads it.
  mkdir -p "$RLHF_HOME"
  RLHF_HOME="$(cd "$RLHF_HOME" && pwd)"
  cat <<ENV
export RLHF_HOME="$RLHF_HOME"
export RLHF_REPO="$REPO"
export RLHF_POOL="$POOL"
export PREFECT_HOME="$RLHF_HOME/prefect"
export PREFECT_API_URL="http://$HOST:$PREFECT_PORT/api"
export PREFECT_UI_URL="http://$HOST:$PREFECT_PORT"
export PREFECT_SERVER_ANALYTICS_ENABLED=false
export PREFECT_WORKER_QUERY_SECONDS="${PREFECT_WORKER_QUERY_SECONDS:-1}"
export PREFECT_API_DATABASE_CONNECTION_URL="sqlite+aiosqlite:///$RLHF_HOME/prefect/prefect.db"
export PREFECT_SERVER_DATABASE_TIMEOUT="${PREFECT_SERVER_DATABASE_TIMEOUT:-30}"
export PREFECT_SERVER_DATABASE_CONNECTION_TIMEOUT="${PREFECT_SERVER_DATABASE_CONNECTION_TIMEOUT:-30}"
export MLFLOW_TRACKING_URI="http://$HOST:$MLFLOW_PORT"
export MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false
export MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT=true
export MLFLOW_HTTP_REQUEST_MAX_RETRIES="${MLFLOW_HTTP_REQUEST_MAX_RETRIES:-5}"
export MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR="${MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR:-1}"
export MLFLOW_HTTP_REQUEST_TIMEOUT="${MLFLOW_HTTP_REQUEST_TIMEOUT:-60}"
export TOKENIZERS_PARALLELISM=false
export PATH="$VENV_BIN:\$PATH"
ENV
}

wait_http() {  # url seconds name
  local deadline=$((SECONDS + $2))
  until curl -fsS -o /dev/null "$1" 2>/dev/null; do
    if (( SECONDS > deadline )); then
      echo "error: $3 did not answer at $1 within $2 s; see $LOGS/" >&2
      return 1
    fi
    sleep 1
  done
}

start() {  # name command...
  local name="$1"; shift
  if [[ -f "$PIDS/$name" ]] && kill -0 "$(cat "$PIDS/$name")" 2>/dev/null; then
    echo "$name already running (pid $(cat "$PIDS/$name"))"
    return
  fi
  # Job control puts each service in its own process group, so `down` can stop it with its children.
  set -m
  nohup "$@" >"$LOGS/$name.log" 2>&1 &
  echo $! >"$PIDS/$name"
  set +m
}

up() {
  eval "$(stack_env)"
  mkdir -p "$PIDS" "$LOGS" "$PREFECT_HOME" "$RLHF_HOME/mlartifacts"
  start mlflow mlflow server --host "$HOST" --port "$MLFLOW_PORT" \
    --backend-store-uri "sqlite:///$RLHF_HOME/mlflow.db" \
    --artifacts-destination "$RLHF_HOME/mlartifacts" --serve-artifacts --workers 1
  start prefect prefect server start --host "$HOST" --port "$PREFECT_PORT"
  wait_http "$PREFECT_UI_URL/api/health" 120 "Prefect server"
  wait_http "$MLFLOW_TRACKING_URI/health" 120 "MLflow server"
  prefect work-pool inspect "$POOL" >/dev/null 2>&1 || prefect work-pool create "$POOL" --type process >/dev/null
  # Flow runs inherit the worker's environment: their Prefect calls retry for about 17 minutes (2, 4, ...
  # 512 s), past a stage's outage_limit_s, so a Prefect server away that long does not end them.
  start worker env PREFECT_CLIENT_MAX_RETRIES="${PREFECT_CLIENT_MAX_RETRIES:-9}" \
    prefect worker start --pool "$POOL" --type process --limit "$WORKER_LIMIT"
  (cd "$REPO" && prefect --no-prompt deploy --all >"$LOGS/deploy.log" 2>&1) || {
    echo "error: prefect deploy failed; see $LOGS/deploy.log" >&2; return 1; }
  echo "Prefect UI: $PREFECT_UI_URL"
  echo "MLflow UI:  $MLFLOW_TRACKING_URI/#/experiments?workflowType=machine_learning"
}

down() {
  local name pid
  for name in worker prefect mlflow; do
    [[ -f "$PIDS/$name" ]] || continue
    pid="$(cat "$PIDS/$name")"
    if kill -0 "$pid" 2>/dev/null; then
      kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true
      for _ in $(seq 1 20); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
      kill -KILL -- "-$pid" 2>/dev/null || true
      echo "stopped $name (pid $pid)"
    fi
    rm -f "$PIDS/$name"
  done
}

status() {
  local name
  for name in mlflow prefect worker; do
    if [[ -f "$PIDS/$name" ]] && kill -0 "$(cat "$PIDS/$name")" 2>/dev/null; then
      echo "$name: running (pid $(cat "$PIDS/$name"))"
    else
      echo "$name: stopped"
    fi
  done
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  status) status ;;
  env) stack_env ;;
  *) echo "usage: $0 up|down|status|env" >&2; exit 2 ;;
esac
