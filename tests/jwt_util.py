"""JWTs for the scoping tests, and Envoy's jwt_authn filter configured two ways: as Istio's
RequestAuthentication configures it (the token is verified, then removed; the payload is kept
in dynamic metadata under the issuer's name; a request without a token passes), and with the
token forwarded."""

import base64
import hashlib
import hmac
import json
import time
import uuid

JWT_SECRET = b"idempotency-test-secret-0123456789abcdef"
# What the shipped Istio manifests name as the issuer (envoy/istio/*.yaml, a placeholder).
ISTIO_ISSUER = "https://issuer.example.com"


def b64url(data):
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def make_jwt(sub, issuer=ISTIO_ISSUER, secret=JWT_SECRET, **claims):
    """An HS256 token for `sub`; a new `jti` every call, so two tokens always differ."""
    header = {"alg": "HS256", "typ": "JWT", "kid": "k1"}
    now = int(time.time())
    payload = {"iss": issuer, "sub": sub, "iat": now, "exp": now + 3600,
               "jti": uuid.uuid4().hex, **claims}
    signing_input = (b64url(json.dumps(header, separators=(",", ":")).encode()) + "." +
                     b64url(json.dumps(payload, separators=(",", ":")).encode()))
    sig = hmac.new(secret, signing_input.encode(), hashlib.sha256).digest()
    return signing_input + "." + b64url(sig)


def _jwks():
    return json.dumps({"keys": [{"kty": "oct", "alg": "HS256", "kid": "k1",
                                 "k": b64url(JWT_SECRET)}]})


def jwt_authn_filter(issuer=ISTIO_ISSUER, payload_name="jwt_payload", forward=True,
                     require=True):
    """jwt_authn with one provider; `require` False lets requests without a token through
    (Istio's RequestAuthentication: only a bad token is refused)."""
    provider = "origins-0"
    requires = {"provider_name": provider}
    if not require:
        requires = {"requires_any": {"requirements": [requires, {"allow_missing": {}}]}}
    return {
        "name": "envoy.filters.http.jwt_authn",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.jwt_authn.v3."
                     "JwtAuthentication",
            "providers": {provider: {
                "issuer": issuer,
                "forward": forward,
                "payload_in_metadata": payload_name,
                "local_jwks": {"inline_string": _jwks()},
            }},
            "rules": [{"match": {"prefix": "/"}, "requires": requires}],
        },
    }


def istio_jwt_authn_filter(issuer=ISTIO_ISSUER):
    """jwt_authn as istiod builds it from a RequestAuthentication jwtRule (forwardOriginalToken
    unset): payload_in_metadata is the issuer, the token is not forwarded, and a request
    without a token passes (an AuthorizationPolicy would be what requires one)."""
    return jwt_authn_filter(issuer, payload_name=issuer, forward=False, require=False)
