#!/usr/bin/env bash
# Runs N processes of launch/train.py on this machine as one multi-process run (JAX's distributed runtime on
# localhost; gloo collectives on CPU):
#
#     launch/local_cluster.sh 2 --config=configs/tiny.py --workdir=/tmp/two --cpu_devices=4 --config.mesh.fsdp=8
#
# --cpu_devices is the devices of each process. Every process gets the same ARGS plus --coordinator=localhost:PORT
# (PORT: $PARALLAX_PORT, or a free one), --num_processes=N and its --process_id. Process i's output goes to
# stdout/stderr prefixed with "[i] ". Exits 0 when every process does, else with the first non-zero status; once
# one process has failed, the others get $PARALLAX_GRACE_S seconds (default 60) to stop by themselves (a lost
# peer fails them within config.dist.heartbeat_timeout_s) and are then killed.
set -u
if [ $# -lt 1 ] || ! [[ "$1" =~ ^[1-9][0-9]*$ ]]; then
  echo "usage: launch/local_cluster.sh N ARGS... (N: number of processes, e.g. 2)" >&2
  exit 2
fi
n=$1
shift
python=${PYTHON:-python3}
here=$(cd "$(dirname "$0")" && pwd)
port=${PARALLAX_PORT:-$("$python" -c 'import socket; s = socket.socket(); s.bind(("localhost", 0)); print(s.getsockname()[1])')}
grace=${PARALLAX_GRACE_S:-60}

declare -A index
pids=()
for ((i = 0; i < n; i++)); do
  "$python" -u "$here/train.py" "$@" --coordinator="localhost:$port" --num_processes="$n" --process_id="$i" \
    > >(sed -u "s/^/[$i] /") 2> >(sed -u "s/^/[$i] /" >&2) &
  pids+=($!)
  index[$!]=$i
done
trap 'kill "${pids[@]}" 2>/dev/null; exit 130' INT TERM

status=0
killer=
running=("${pids[@]}")
while [ ${#running[@]} -gt 0 ]; do
  wait -n -p done_pid "${running[@]}"
  rc=$?
  running=($(for p in "${running[@]}"; do [ "$p" != "$done_pid" ] && echo "$p"; done))
  if [ "$rc" -ne 0 ] && [ "$status" -eq 0 ]; then
    status=$rc
    echo "local_cluster: process ${index[$done_pid]} exited with status $rc" >&2
    if [ ${#running[@]} -gt 0 ]; then  # the others must stop by themselves within the grace period
      (trap 'kill "$sleeper" 2>/dev/null; exit 0' TERM  # cancelled: exit at once (and close our output)
       sleep "$grace" >/dev/null 2>&1 & sleeper=$!
       wait "$sleeper"
       echo "local_cluster: killing the processes still running ${grace}s after that" >&2
       kill -9 "${running[@]}" 2>/dev/null) &
      killer=$!
    fi
  fi
done
[ -n "$killer" ] && kill "$killer" 2>/dev/null
exit "$status"
