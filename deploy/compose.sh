#!/usr/bin/env bash
# docker-compose for deploy/compose.yaml, with what it needs checked first, so that a missing
# piece is an error naming it rather than a failed pull or a node that finds no data:
#
#   deploy/compose.sh up --scale node=4        (any docker-compose arguments)
#
# Before `up`, `run` or `create` (wherever among the arguments) it checks that a Docker engine answers, that the run
# manifest and its token shards are where RUN_MANIFEST and RUN_DATA say, and that the image
# exists here (nothing can be pulled: `make image` builds it). Relative RUN_MANIFEST and
# RUN_DATA are taken from the current directory (compose itself would take them from deploy/).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
die() { echo "compose: $*" >&2; exit 1; }

command -v docker-compose >/dev/null || die "docker-compose is not installed"
docker info >/dev/null 2>&1 || die "no Docker engine answers (docker info failed)"

export GASLOC_IMAGE=${GASLOC_IMAGE:-gasloc:latest}
RUN_MANIFEST=$(realpath -m "${RUN_MANIFEST:-$here/../examples/runs/demo.toml}")
RUN_DATA=$(realpath -m "${RUN_DATA:-$here/../datasets/shakespeare-byte}")
export RUN_MANIFEST RUN_DATA

starts=0
for arg in "$@"; do
  case "$arg" in up | run | create) starts=1 ;; esac
done
if [ $starts = 1 ]; then
  [ -f "$RUN_MANIFEST" ] || die "no run manifest at $RUN_MANIFEST (RUN_MANIFEST)"
  [ -d "$RUN_DATA" ] || die "no data directory $RUN_DATA (RUN_DATA; \`make setup\` prepares the demo's)"
  compgen -G "$RUN_DATA/*_val_*.bin" >/dev/null ||
    die "no validation shard (*_val_*.bin) in $RUN_DATA (RUN_DATA): prepare the run's data with \`gasloc-node data prepare\`"
  compgen -G "$RUN_DATA/*_train_*.bin" >/dev/null ||
    die "no training shard (*_train_*.bin) in $RUN_DATA (RUN_DATA)"
  docker image inspect "$GASLOC_IMAGE" >/dev/null 2>&1 ||
    die "no image $GASLOC_IMAGE on this machine: run \`make image\` (no registry is asked)"
fi
exec docker-compose -f "$here/compose.yaml" "$@"
