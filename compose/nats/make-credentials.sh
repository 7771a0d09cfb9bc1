#!/bin/sh
# One random NATS password per splitserve role, for docker-compose's Secrets:
#   compose/nats/make-credentials.sh   # then: docker compose up
# Files: compose/nats/credentials/<role> (the directory 0700: only you; the files are
# readable inside the containers, whose users differ from yours). Run it again to rotate.
set -eu
dir="$(dirname "$0")/credentials"
mkdir -p "$dir"
chmod 700 "$dir"
for role in gateway scheduler prefill decode both planner launcher observer; do
  python3 -c 'import secrets; print(secrets.token_urlsafe(24))' > "$dir/$role"
  chmod 644 "$dir/$role"
done
echo "NATS credentials in $dir"
