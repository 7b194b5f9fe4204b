#!/usr/bin/env bash
# A test CA and the certificates of envoy/docker-compose-fleet.yaml, made with openssl into DIR
# (default envoy/.fleet-compose-pki, where the compose file looks unless FLEET_PKI_DIR says
# otherwise). Kept when DIR/ca.crt exists. NOT for production: the keys are made readable by
# every user, since the containers read them as their own users (Envoy as uid 101).
#
#   ca.crt                   the CA both sides trust
#   etcd1.crt/.key ... etcd3 each member's certificate: DNS:etcdN (the compose service name, which
#                            Envoy checks), serverAuth and clientAuth (etcd's JSON gateway dials
#                            its own gRPC port with it)
#   envoy.crt/.key           the replicas' client certificate (etcd runs with --client-cert-auth)
set -euo pipefail
dir=${1:-$(dirname "$0")/../envoy/.fleet-compose-pki}
mkdir -p "$dir" && cd "$dir"
[ -f ca.crt ] && exit 0
ssl() { openssl "$@" >/dev/null 2>&1 </dev/null || { echo "openssl $* failed" >&2; exit 1; }; }
ssl req -x509 -newkey rsa:2048 -nodes -days 30 -subj /CN=idempotency-fleet-test-ca \
  -keyout ca.key -out ca.crt
leaf() {  # name subject-alt-names extended-key-usage
  printf 'subjectAltName=%s\nextendedKeyUsage=%s\nbasicConstraints=CA:FALSE\n' "$2" "$3" > "$1.ext"
  ssl req -newkey rsa:2048 -nodes -subj "/CN=$1" -keyout "$1.key" -out "$1.csr"
  ssl x509 -req -in "$1.csr" -CA ca.crt -CAkey ca.key -CAcreateserial -days 30 \
    -extfile "$1.ext" -out "$1.crt"
  rm -f "$1.csr" "$1.ext"
}
for n in 1 2 3; do
  leaf "etcd$n" "DNS:etcd$n,DNS:localhost,IP:127.0.0.1" serverAuth,clientAuth
done
leaf envoy URI:spiffe://idempotency-fleet/envoy clientAuth
rm -f ca.key ca.srl
chmod 0755 . && chmod 0644 ./*
