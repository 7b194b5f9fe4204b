#!/usr/bin/env bash
# The three error examples of the IETF draft "The Idempotency-Key HTTP Header Field"
# (draft-ietf-httpapi-idempotency-key-header, section "Error Scenarios"), reproduced against a
# running Envoy with the plugin in front of tests/upstream.py:
#
#   1. 400 Bad Request           - the Idempotency-Key is missing (needs "require_key": true,
#                                  for the whole config or a route rule)
#   2. 409 Conflict              - a request is outstanding for this Idempotency-Key
#   3. 422 Unprocessable Content - the Idempotency-Key is reused for another payload
#
# Usage: PORT=10000 tests/ietf_examples.sh   (default 127.0.0.1:10000, the `make run` demo;
# the demo's envoy/envoy.yaml does not set require_key, so there example 1 passes through).
# Example 2 sends a slow first call (the sample upstream honours x-delay-ms) in the
# background, then the same request again while it runs; example 3 reuses that key with
# another body. KEY_SUFFIX makes the keys unique per run (default: this shell's PID and time).
set -euo pipefail

HOST="${HOST:-127.0.0.1}"
PORT="${PORT:-10000}"
URL="http://${HOST}:${PORT}/payments"
SUFFIX="${KEY_SUFFIX:-$$-$(date +%s)}"
KEY="ietf-${SUFFIX}"
# Keys are scoped to the caller (scope_headers: ["authorization"] by default).
AUTH="Authorization: Bearer alice"

echo "### 1. Idempotency-Key missing: 400"
echo "\$ curl -si -X POST $URL -H '$AUTH' -H 'Content-Type: application/json' -d '{\"amount\": 10}'"
curl -si --max-time 10 -X POST "$URL" -H "$AUTH" -H 'Content-Type: application/json' -d '{"amount": 10}'
echo; echo

echo "### 2. A request is outstanding for this Idempotency-Key: 409"
echo "\$ curl -s -o /dev/null -X POST $URL -H '$AUTH' -H 'Idempotency-Key: $KEY' -H 'x-delay-ms: 2000' -H 'Content-Type: application/json' -d '{\"amount\": 10}' &"
curl -s -o /dev/null --max-time 20 -X POST "$URL" -H "$AUTH" -H "Idempotency-Key: $KEY" \
     -H 'x-delay-ms: 2000' -H 'Content-Type: application/json' -d '{"amount": 10}' &
first=$!
sleep 0.5
echo "\$ curl -si -X POST $URL -H '$AUTH' -H 'Idempotency-Key: $KEY' -H 'x-delay-ms: 2000' -H 'Content-Type: application/json' -d '{\"amount\": 10}'"
curl -si --max-time 10 -X POST "$URL" -H "$AUTH" -H "Idempotency-Key: $KEY" \
     -H 'x-delay-ms: 2000' -H 'Content-Type: application/json' -d '{"amount": 10}'
echo; echo
wait "$first"

echo "### 3. Idempotency-Key reused with another payload: 422"
echo "\$ curl -si -X POST $URL -H '$AUTH' -H 'Idempotency-Key: $KEY' -H 'Content-Type: application/json' -d '{\"amount\": 99}'"
curl -si --max-time 10 -X POST "$URL" -H "$AUTH" -H "Idempotency-Key: $KEY" \
     -H 'Content-Type: application/json' -d '{"amount": 99}'
echo
