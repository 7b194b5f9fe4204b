#!/usr/bin/env bash
# A Docker engine for the container tests (make tools): nothing to do when `docker info`
# answers; as root, starts Debian's dockerd in the background (no systemd on CI machines) and
# waits for it; otherwise fails with the reason. Never skips silently: the compose tests need it.
set -uo pipefail
docker info >/dev/null 2>&1 && exit 0
command -v dockerd >/dev/null || { echo "no dockerd: apt-get install docker.io (make tools does, as root)"; exit 1; }
if [ "$(id -u)" != 0 ]; then
  echo "the Docker engine does not answer (docker info fails) and only root can start dockerd here"; exit 1
fi
log=${DOCKERD_LOG:-/var/log/dockerd.log}
echo "starting dockerd (log: $log)"
setsid nohup dockerd >"$log" 2>&1 </dev/null &
for _ in $(seq 60); do
  docker info >/dev/null 2>&1 && exit 0
  kill -0 $! 2>/dev/null || break
  sleep 0.5
done
echo "dockerd did not start (docker info still fails); the end of $log:"
tail -20 "$log"
exit 1
