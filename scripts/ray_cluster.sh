#!/usr/bin/env bash
# A Ray cluster of two nodes on this machine, as close to two machines as one can be: two raylets,
# a head (`ray start --head`) and a worker node (`ray start --address`), each with its own CPUs.
#
#   scripts/ray_cluster.sh up       start both (`make ray-up`), or a lost worker node again; prints the address
#   scripts/ray_cluster.sh down     stop exactly the processes `up` started (`make ray-down`, `make down`)
#   scripts/ray_cluster.sh status   the nodes and what they hold
#   scripts/ray_cluster.sh address  the head's address, for `launch.ray_address` (`auto` finds it too)
#
# `ray stop` would end every Ray process on the machine, another user's cluster included, so each
# node runs as `ray start --block` in a session of its own, and `down` ends those two sessions.
# RLHF_RAY_PORT (6390), RLHF_RAY_NODE_CPUS (1 per node) and RLHF_HOME (.rlhf) move it.
#
# Ray's head listens on every interface, so the cluster requires a token (Ray's token
# authentication): one of its own, made at `up` in $RLHF_HOME/ray/auth_token, which
# `launch.ray_address: auto` picks up with the address. Left to itself, `ray start --head` turns
# token authentication on whenever ~/.ray/auth_token exists (any local `ray.init()` writes one),
# and clients that do not know it then cannot connect: the mode is set here, never guessed.
set -euo pipefail
cd "$(dirname "$0")/.."

STATE="$(realpath -m "${RLHF_HOME:-.rlhf}")/ray"
export RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH="$STATE/auth_token"
unset RAY_AUTH_TOKEN
RAY="$PWD/.venv/bin/ray"
PORT="${RLHF_RAY_PORT:-6390}"
CPUS="${RLHF_RAY_NODE_CPUS:-1}"
ADDRESS="127.0.0.1:$PORT"
# Ray's sockets live under its temp folder, whose path must stay short (a Unix socket path has 107 bytes).
TEMP="/tmp/rlhf-ray-$(id -u)-$PORT"

alive_nodes() {
    "$PWD/.venv/bin/python" - "$ADDRESS" <<'EOF' 2>/dev/null || echo 0
import sys, ray
ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
print(sum(n["Alive"] for n in ray.nodes()))
EOF
}

wait_for_nodes() {  # N within 90 s, or fail naming the logs
    for _ in $(seq 90); do
        [ "$(alive_nodes | tail -1)" -ge "$1" ] && return 0
        sleep 1
    done
    echo "the Ray cluster at $ADDRESS did not reach $1 live nodes within 90 s; logs: $STATE/*.log" >&2
    return 1
}

start_node() {  # NAME ARGS...: `ray start --block ARGS` in a session of its own, its pid recorded
    local name="$1"; shift
    setsid "$RAY" start --block --disable-usage-stats --node-ip-address 127.0.0.1 --num-cpus "$CPUS" \
        --resources "{\"rlhf_node_$name\": 1}" "$@" >"$STATE/$name.log" 2>&1 < /dev/null &
    echo $! >"$STATE/$name.pid"
}

# Each node's agents and workers on ports of their own: on one machine Ray's defaults would collide
# between the two nodes, and between two clusters (the test suite's workers each start one).
OWN_PORTS=(--min-worker-port 0 --max-worker-port 0 --dashboard-agent-listen-port 0 --dashboard-agent-grpc-port 0
           --metrics-export-port 0 --runtime-env-agent-port 0)

start_worker() {  # the second node
    start_node worker --address "$ADDRESS" "${OWN_PORTS[@]}"
    wait_for_nodes 2
}

up() {
    mkdir -p "$STATE"
    if [ -f "$STATE/head.pid" ] && kill -0 "$(cat "$STATE/head.pid")" 2>/dev/null; then
        if ! { [ -f "$STATE/worker.pid" ] && kill -0 "$(cat "$STATE/worker.pid")" 2>/dev/null; }; then
            start_worker  # the worker node was lost (killed, its machine gone): it joins again
            echo "the Ray cluster at $ADDRESS has its worker node again"
            return 0
        fi
        echo "a Ray cluster started here already runs at $ADDRESS (scripts/ray_cluster.sh down stops it)"
        return 0
    fi
    if (exec 3<>"/dev/tcp/127.0.0.1/$PORT") 2>/dev/null; then
        echo "port $PORT is taken (another Ray cluster?): set RLHF_RAY_PORT" >&2
        return 1
    fi
    (umask 077 && "$PWD/.venv/bin/python" -c 'import secrets; print(secrets.token_hex(32))' >"$RAY_AUTH_TOKEN_PATH")
    start_node head --head --port "$PORT" --temp-dir "$TEMP" --include-dashboard false "${OWN_PORTS[@]}"
    wait_for_nodes 1
    start_worker
    echo "$ADDRESS" >"$STATE/address"
    echo "Ray cluster of 2 nodes ($CPUS CPU each) at $ADDRESS; stop it with: make ray-down"
}

down() {
    local pids=() name
    for name in worker head; do  # the worker node first, as a real cluster is taken down
        [ -f "$STATE/$name.pid" ] || continue
        local pid; pid=$(cat "$STATE/$name.pid")
        kill -TERM "$pid" 2>/dev/null && pids+=("$pid")
        for _ in $(seq 30); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
        kill -KILL -- "-$pid" 2>/dev/null || true  # whatever of its session is left
        rm -f "$STATE/$name.pid"
    done
    rm -f "$STATE/address" "$RAY_AUTH_TOKEN_PATH"
    [ ${#pids[@]} -eq 0 ] || echo "Ray cluster at $ADDRESS stopped"
}

case "${1:-}" in
    up) up ;;
    down) down ;;
    status) "$RAY" status --address "$ADDRESS" ;;
    address) echo "$ADDRESS" ;;
    *) echo "usage: scripts/ray_cluster.sh up | down | status | address" >&2; exit 2 ;;
esac
