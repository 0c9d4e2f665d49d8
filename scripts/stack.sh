#!/usr/bin/env bash
# The local stack: a Prefect server, an MLflow tracking server, a process work pool and its
# worker, and the deployments in prefect.yaml. `up` records the PIDs it started; `down` stops
# exactly those. All state lives in $RLHF_HOME (default: .rlhf/ in the repository).
#
#   scripts/stack.sh up | down | status | env
#
# Settings (environment): RLHF_HOME, RLHF_HOST (127.0.0.1), RLHF_PREFECT_PORT (4200),
# RLHF_MLFLOW_PORT (5000), RLHF_POOL (rlhf-local), RLHF_WORKER_LIMIT (4), RLHF_PYTHON (.venv/bin/python),
# RLHF_DB (sqlite | postgresql), RLHF_PG_PORT (5433), RLHF_PG_DATA ($RLHF_HOME/postgres).
#
# Databases. SQLite files in $RLHF_HOME by default: nothing to run, one user. RLHF_DB=postgresql
# (a team's stack) runs Debian's PostgreSQL as a fourth service, started and stopped here like the
# others: a cluster in RLHF_PG_DATA (made on first `up`), listening on 127.0.0.1:RLHF_PG_PORT only,
# with a `prefect` and an `mlflow` database; the two servers are its only clients (scram-sha-256,
# a generated password). PostgreSQL refuses to run as root, so under root it runs as the `postgres` user,
# which must be able to reach RLHF_PG_DATA (a folder under /tmp or /var/tmp, say, where $RLHF_HOME
# is private). `env` names the database in use; a stack keeps the database it was made with.
# What a stage logs while it trains waits on disk while the MLflow server is away, up to the config's
# outage_limit_s (flows/records/journal.py); every other MLflow call from a flow run retries with exponential
# backoff (MLflow's own HTTP retry, MLFLOW_HTTP_REQUEST_MAX_RETRIES=5, BACKOFF_FACTOR=1: about 30 s);
# a flow also waits for the server at start (1, 2, 4, 8 s) before it refuses to run. The worker
# asks for new flow runs every second (Prefect's default, 10 s, is a quarter of a demo stage) and
# runs at most RLHF_WORKER_LIMIT (4) flow runs at once; further runs wait their turn. Training
# runs on one machine share its cores, and a burst of flow-run processes starved the Prefect
# server's SQLite writes (HTTP 503) on a 2-core machine. The server's database statements may
# take up to 30 s (Prefect's default, 10 s, is too short under that load).
#
# Authentication (SECURITY.md). The first `up` or `env` generates credentials into
# $RLHF_HOME/credentials (the folder 0700, the file 0600): the Prefect server wants its auth string
# (PREFECT_SERVER_API_AUTH_STRING; clients send PREFECT_API_AUTH_STRING), MLflow runs its basic-auth
# app (user `admin`; clients send MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD; its user
# store in $RLHF_HOME/mlflow-auth.db), and PostgreSQL wants a password (scram-sha-256, local socket
# included). `env` exports what a client needs, so the pipeline, `make demo` and the tests run unchanged.
set -euo pipefail
umask 077  # what the stack writes (databases, credentials, checkpoints, logs) is its user's alone

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
PG_PORT="${RLHF_PG_PORT:-5433}"
PG_DATA="${RLHF_PG_DATA:-$RLHF_HOME/postgres}"
PG_BIN="${RLHF_PG_BIN:-$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -1)}"
AS_POSTGRES=()  # PostgreSQL refuses to run as root: under root its programs run as the postgres user
[[ $EUID -eq 0 ]] && AS_POSTGRES=(runuser -u postgres --)

database() {  # the database this stack uses: what `up` recorded, else RLHF_DB (default sqlite)
  local db recorded
  recorded="$(cat "$RLHF_HOME/database" 2>/dev/null || true)"
  db="${recorded:-${RLHF_DB:-sqlite}}"
  if [[ -n "$recorded" && -n "${RLHF_DB:-}" && "$RLHF_DB" != "$recorded" ]]; then
    echo "error: the stack in $RLHF_HOME keeps its runs on $recorded; RLHF_DB=$RLHF_DB would start an empty one (use another RLHF_HOME)" >&2
    return 2
  fi
  case "$db" in
    sqlite|postgresql) echo "$db" ;;
    *) echo "error: RLHF_DB=$db is not sqlite or postgresql" >&2; return 2 ;;
  esac
}

secret() {  # a fresh random password: 32 letters and digits
  LC_ALL=C tr -dc 'A-Za-z0-9' </dev/urandom | head -c 32 || true
}

credentials() {  # load $RLHF_HOME/credentials (0600), generating what it lacks; one writer at a time
  local file="$RLHF_HOME/credentials" name value lock
  exec {lock}>>"$RLHF_HOME/credentials.lock"
  flock "$lock"
  # shellcheck source=/dev/null
  [[ -f "$file" ]] && source "$file"
  for name in PREFECT_AUTH MLFLOW_PASSWORD MLFLOW_SECRET_KEY PG_PASSWORD; do
    if [[ -z "${!name:-}" ]]; then
      value="$(secret)"
      [[ $name == PREFECT_AUTH ]] && value="rlhf:$value"
      printf '%s="%s"\n' "$name" "$value" >>"$file"
      printf -v "$name" '%s' "$value"
    fi
  done
  chmod 600 "$file"
  flock -u "$lock"
  exec {lock}>&-
}

stack_env() {
  # Everything a client of this stack needs; `eval "$(scripts/stack.sh env)"` loads it.
  mkdir -p "$RLHF_HOME"
  chmod 700 "$RLHF_HOME"
  RLHF_HOME="$(cd "$RLHF_HOME" && pwd)"
  credentials
  local db prefect_db
  db="$(database)" || return
  prefect_db="$(database_url prefect)"
  cat <<ENV
export RLHF_HOME="$RLHF_HOME"
export RLHF_REPO="$REPO"
export RLHF_POOL="$POOL"
export PREFECT_HOME="$RLHF_HOME/prefect"
export PREFECT_API_URL="http://$HOST:$PREFECT_PORT/api"
export PREFECT_UI_URL="http://$HOST:$PREFECT_PORT"
export PREFECT_SERVER_ANALYTICS_ENABLED=false
export PREFECT_WORKER_QUERY_SECONDS="${PREFECT_WORKER_QUERY_SECONDS:-1}"
export RLHF_DB="$db"
export PREFECT_API_DATABASE_CONNECTION_URL="$prefect_db"
export PREFECT_SERVER_DATABASE_TIMEOUT="${PREFECT_SERVER_DATABASE_TIMEOUT:-30}"
export PREFECT_SERVER_DATABASE_CONNECTION_TIMEOUT="${PREFECT_SERVER_DATABASE_CONNECTION_TIMEOUT:-30}"
export PREFECT_API_AUTH_STRING="$PREFECT_AUTH"
export MLFLOW_TRACKING_URI="http://$HOST:$MLFLOW_PORT"
export MLFLOW_TRACKING_USERNAME=admin
export MLFLOW_TRACKING_PASSWORD="$MLFLOW_PASSWORD"
export MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false
export MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT=true
export MLFLOW_HTTP_REQUEST_MAX_RETRIES="${MLFLOW_HTTP_REQUEST_MAX_RETRIES:-5}"
export MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR="${MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR:-1}"
export MLFLOW_HTTP_REQUEST_TIMEOUT="${MLFLOW_HTTP_REQUEST_TIMEOUT:-60}"
export TOKENIZERS_PARALLELISM=false
export PATH="$VENV_BIN:\$PATH"
ENV
}

database_url() {  # prefect | mlflow: the connection URL its server uses
  if [[ "$(database)" == postgresql ]]; then
    local driver; driver="$([[ $1 == prefect ]] && echo asyncpg || echo psycopg)"
    echo "postgresql+$driver://rlhf:$PG_PASSWORD@127.0.0.1:$PG_PORT/$1"
  elif [[ $1 == prefect ]]; then
    echo "sqlite+aiosqlite:///$RLHF_HOME/prefect/prefect.db"
  else
    echo "sqlite:///$RLHF_HOME/mlflow.db"
  fi
}

as_postgres() {  # run a PostgreSQL program as a user it accepts (not root)
  "${AS_POSTGRES[@]}" "$@"
}

postgres_up() {  # the cluster (made on first use), running, with both databases
  if [[ -z "$PG_BIN" || ! -x "$PG_BIN/postgres" ]]; then
    echo "error: RLHF_DB=postgresql needs PostgreSQL's programs (Debian: apt-get install postgresql); none in /usr/lib/postgresql" >&2
    return 1
  fi
  mkdir -p "$PG_DATA"
  [[ $EUID -eq 0 ]] && chown postgres: "$PG_DATA" && chmod 700 "$PG_DATA"
  if ! as_postgres test -w "$PG_DATA"; then
    echo "error: the postgres user cannot write $PG_DATA; set RLHF_PG_DATA to a folder it can reach" >&2
    return 1
  fi
  if [[ ! -f "$PG_DATA/PG_VERSION" ]]; then
    local pwfile; pwfile="$(mktemp)"  # 0600 (the umask), readable by initdb's user alone
    echo "$PG_PASSWORD" >"$pwfile"
    [[ $EUID -eq 0 ]] && chown postgres: "$pwfile"
    as_postgres "$PG_BIN/initdb" -D "$PG_DATA" -U rlhf --auth=scram-sha-256 --pwfile="$pwfile" -E UTF8 \
      >"$LOGS/postgres-initdb.log" 2>&1 || { rm -f "$pwfile"; echo "error: initdb failed; see $LOGS/postgres-initdb.log" >&2; return 1; }
    rm -f "$pwfile"
  elif grep -qE '^[^#]*\btrust\b' "$PG_DATA/pg_hba.conf" 2>/dev/null; then
    upgrade_trust=yes  # a cluster made before the stack had passwords: given one once it runs
  fi
  # The socket goes into the data folder (Debian's default, /var/run/postgresql, may not exist or be writable).
  start postgres "${AS_POSTGRES[@]}" "$PG_BIN/postgres" -D "$PG_DATA" -h 127.0.0.1 -p "$PG_PORT" -k "$PG_DATA" \
    -c max_connections=200
  local deadline=$((SECONDS + 60))
  until "$PG_BIN/pg_isready" -q -h 127.0.0.1 -p "$PG_PORT"; do
    if (( SECONDS > deadline )); then echo "error: PostgreSQL did not start; see $LOGS/postgres.log" >&2; return 1; fi
    sleep 0.5
  done
  export PGPASSWORD="$PG_PASSWORD"
  if [[ "${upgrade_trust:-}" == yes ]]; then
    # The statement on stdin: as `-c` it would put the password in psql's command line.
    "$PG_BIN/psql" -h 127.0.0.1 -p "$PG_PORT" -U rlhf -d postgres -q -v ON_ERROR_STOP=1 \
      <<<"ALTER ROLE rlhf PASSWORD '$PG_PASSWORD'"
    as_postgres sed -i -E 's/\btrust\b/scram-sha-256/' "$PG_DATA/pg_hba.conf"
    "$PG_BIN/psql" -h 127.0.0.1 -p "$PG_PORT" -U rlhf -d postgres -qtAc "SELECT pg_reload_conf()" >/dev/null
  fi
  local name
  for name in prefect mlflow; do
    if [[ -z "$("$PG_BIN/psql" -h 127.0.0.1 -p "$PG_PORT" -U rlhf -d postgres -tAc \
          "SELECT 1 FROM pg_database WHERE datname = '$name'")" ]]; then
      "$PG_BIN/createdb" -h 127.0.0.1 -p "$PG_PORT" -U rlhf "$name"
    fi
  done
  unset PGPASSWORD
}

mlflow_auth_config() {  # MLflow's basic-auth app's settings (0600): its user store and the admin's password
  local ini="$RLHF_HOME/mlflow-auth.ini"
  cat >"$ini" <<INI
[mlflow]
default_permission = READ
database_uri = sqlite:///$RLHF_HOME/mlflow-auth.db
admin_username = admin
admin_password = $MLFLOW_PASSWORD
authorization_function = mlflow.server.auth:authenticate_request_basic_auth
grant_default_workspace_access = false
# A password check is PBKDF2 (~1 s of CPU here): without a cache every request paid it, and the
# MLflow server took half a core through the test suite. One worker, so no other one goes stale.
auth_cache_ttl_seconds = 600
auth_cache_max_size = 1000
INI
  chmod 600 "$ini"
  echo "$ini"
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
  local settings
  settings="$(stack_env)" || return
  eval "$settings"
  credentials  # the servers' side of what `env` gave the clients
  mkdir -p "$PIDS" "$LOGS" "$PREFECT_HOME" "$RLHF_HOME/mlartifacts"
  echo "$RLHF_DB" >"$RLHF_HOME/database"
  [[ "$RLHF_DB" == postgresql ]] && postgres_up
  # Secrets reach the servers in their environment, never on a command line: /proc/<pid>/cmdline is
  # readable by every local user for the server's life (`env NAME=secret cmd` too, until it execs).
  # MLflow's --backend-store-uri reads MLFLOW_BACKEND_STORE_URI (PostgreSQL's URL holds the password);
  # Prefect's server reads PREFECT_API_DATABASE_CONNECTION_URL, exported by `env` above.
  MLFLOW_AUTH_CONFIG_PATH="$(mlflow_auth_config)" MLFLOW_FLASK_SERVER_SECRET_KEY="$MLFLOW_SECRET_KEY" \
    MLFLOW_BACKEND_STORE_URI="$(database_url mlflow)" \
    start mlflow mlflow server --host "$HOST" --port "$MLFLOW_PORT" --app-name basic-auth \
    --artifacts-destination "$RLHF_HOME/mlartifacts" --serve-artifacts --workers 1
  PREFECT_SERVER_API_AUTH_STRING="$PREFECT_AUTH" start prefect prefect server start --host "$HOST" --port "$PREFECT_PORT"
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
  for name in worker prefect mlflow postgres; do  # the database last: the servers are its clients
    [[ -f "$PIDS/$name" ]] || continue
    pid="$(cat "$PIDS/$name")"
    if kill -0 "$pid" 2>/dev/null; then
      # PostgreSQL's fast shutdown is SIGINT (SIGTERM waits for its clients to leave).
      local signal; signal="$([[ $name == postgres ]] && echo INT || echo TERM)"
      kill "-$signal" -- "-$pid" 2>/dev/null || kill "-$signal" "$pid" 2>/dev/null || true
      for _ in $(seq 1 20); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
      kill -KILL -- "-$pid" 2>/dev/null || true
      echo "stopped $name (pid $pid)"
    fi
    rm -f "$PIDS/$name"
  done
}

status() {
  local name
  for name in mlflow prefect worker postgres; do
    [[ $name == postgres && "$(database)" != postgresql ]] && continue
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
