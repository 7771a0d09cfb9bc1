#!/bin/sh
# The nats container's entrypoint in docker-compose: each role's password from its Secret
# (/run/secrets/nats-<role>, made by make-credentials.sh) into the variable nats.conf
# reads, then nats-server with the arguments given.
set -eu
for role in gateway scheduler prefill decode both planner launcher observer; do
  upper=$(echo "$role" | tr '[:lower:]' '[:upper:]')
  export "NATS_${upper}_PASSWORD=$(cat "/run/secrets/nats-$role")"
done
exec nats-server "$@"
