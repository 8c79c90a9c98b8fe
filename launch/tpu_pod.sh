#!/usr/bin/env bash
# A Cloud TPU pod-slice template: runs the same training command on every TPU VM worker of a slice.
#
#     launch/tpu_pod.sh TPU_NAME ZONE --config=configs/llama3_8b.py --workdir=gs://BUCKET/runs/8b [--config.KEY=VALUE ...]
#
# Each worker runs launch/train.py with config.dist.detect=jax: jax.distributed.initialize() finds the
# coordinator (worker 0), the process count and this worker's id from the TPU VM's metadata. The code must
# already be on every worker at $PARALLAX_DIR (default ~/parallax; e.g. `gcloud compute tpus tpu-vm scp
# --recurse . TPU_NAME:~/parallax --worker=all --zone=ZONE` first) with its dependencies installed, and the
# workdir must be shared (a gs:// bucket). A worker that dies fails the others within
# config.dist.heartbeat_timeout_s; rerunning the same command resumes from the last complete checkpoint.
set -euo pipefail
if [ $# -lt 3 ]; then
  echo "usage: launch/tpu_pod.sh TPU_NAME ZONE --config=... --workdir=gs://... [--config.KEY=VALUE ...]" >&2
  exit 2
fi
tpu=$1 zone=$2
shift 2
dir=${PARALLAX_DIR:-\~/parallax}
args=$(printf ' %q' "$@")
gcloud compute tpus tpu-vm ssh "$tpu" --zone="$zone" --worker=all \
  --command="cd $dir && python3 launch/train.py --config.dist.detect=jax$args"
