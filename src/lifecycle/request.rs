//! A covered request, from its headers (docs/behaviour.md §3.1): the key, the caller's scope, the store
//! key, the fingerprint so far, and what the root needs to send it itself.

use super::problem::Problem;
use crate::caller::{Caller, TagKey};
use crate::config::{Config, Forward, MissingScope, Policy, RouteMatch};
use crate::fingerprint::FingerprintBuilder;
use crate::host::{HeaderMap, Host};
use crate::key::{parse_key, StoreKey};
use crate::metrics::Counter;

/// A covered request whose body is still coming.
pub struct Pending {
    pub key: StoreKey,
    pub fingerprint: FingerprintBuilder,
    /// The request's headers, kept when the root may have to send it (detached forwarding).
    pub headers: Option<HeaderMap>,
    /// Its scope was absent and `missing_scope: "share"` put it in the anonymous scope.
    pub scope_shared: bool,
    /// Whose key it is (fair share): a digest of the scope.
    pub caller: Caller,
}

/// What the request headers say.
pub enum Covered {
    /// Not for the plugin: passes through untouched.
    No,
    /// Answered at once (400, 401), counted.
    Refused(Problem, Counter),
    /// Configured scope absent, `missing_scope: "pass"`: passes through, counted.
    Unscoped,
    Yes(Box<Pending>),
}

/// What the policy decision read of the request's headers.
pub struct Read {
    /// The policy (base or rule) that applies.
    pub policy: usize,
    pub method: Vec<u8>,
    /// The whole header map, when it was read already.
    pub headers: Option<HeaderMap>,
}

/// The policy (base or rule) for a request: its method, path and route name decide.
pub fn policy_for(config: &Config, host: &dyn Host, end_of_stream: bool) -> Read {
    // A request with a body is most likely covered (POST, PATCH …): one read of the whole map
    // costs Envoy less than `:method` first and then the map. One without (a GET) costs one
    // header lookup, and the map is read only if its method is covered.
    let headers = (!end_of_stream).then(|| host.request_headers());
    let header = |name: &str| match &headers {
        Some(map) => map.get(name).map(<[u8]>::to_vec),
        None => host.request_header(name),
    };
    let method = header(":method").unwrap_or_default();
    if config.rules.is_empty() {
        return Read { policy: 0, method, headers };
    }
    let path = header(":path").unwrap_or_default();
    let by_route = config.rules.iter().any(|r| matches!(r.matcher, RouteMatch::RouteName(_)));
    let route_name = if by_route { host.property(&["xds", "route_name"]) } else { None };
    Read { policy: config.policy_for(&path, &method, route_name.as_deref()), method, headers }
}

/// Reads a covered method's headers (unless `headers` has them): the key, the scope, the
/// fingerprint's start. What the request's headers make of it, and whether it is a gRPC call
/// (docs/behaviour.md §3.10).
pub fn read_headers(
    config: &Config,
    policy: &Policy,
    method: &[u8],
    headers: Option<HeaderMap>,
    host: &dyn Host,
    tag_key: &TagKey,
) -> (Covered, bool) {
    let headers = headers.unwrap_or_else(|| host.request_headers());
    let grpc = super::grpc_reply::is_grpc(headers.get("content-type"));
    (covered(config, policy, method, host, headers, grpc, tag_key), grpc)
}

fn covered(
    config: &Config,
    policy: &Policy,
    method: &[u8],
    host: &dyn Host,
    headers: HeaderMap,
    grpc: bool,
    tag_key: &TagKey,
) -> Covered {
    let first_two = {
        let mut keys = headers.values(&policy.key_header);
        (keys.next(), keys.next())
    };
    let raw_key = match first_two {
        (None, _) if policy.require_key => {
            return Covered::Refused(Problem::missing_key(&policy.key_header), Counter::MissingKey)
        }
        (None, _) => return Covered::No,
        (Some(_), Some(_)) => {
            return Covered::Refused(Problem::duplicate_key_header(&policy.key_header), Counter::InvalidKey)
        }
        (Some(v), None) => v,
    };
    let client_key = match parse_key(raw_key, policy.max_key_length) {
        Ok(k) => k,
        Err(e) => return Covered::Refused(Problem::invalid_key(e.detail(policy.max_key_length)), Counter::InvalidKey),
    };
    let scopes = scope_values(policy, &headers, host);
    // No caller to scope the key by (docs/behaviour.md §3.1): `missing_scope` decides.
    let scope_shared = !scopes.is_empty() && scopes.iter().all(Option::is_none);
    if scope_shared {
        match policy.missing_scope {
            MissingScope::Pass => return Covered::Unscoped,
            MissingScope::Reject => return Covered::Refused(Problem::scope_missing(), Counter::ScopeMissing),
            MissingScope::Share => {}
        }
    }
    let source = policy.scope_source.as_deref().filter(|_| !scope_shared).map(Some);
    let mut scope_refs: Vec<Option<&[u8]>> = source.into_iter().chain(scopes.iter().map(|s| s.as_deref())).collect();
    if crate::defects::planted(crate::defects::Defect::ScopeIgnored) {
        scope_refs.clear();
    }
    let authority = headers.get(":authority").unwrap_or_default();
    let (key, retry) = StoreKey::derive_noting_retries(&config.namespace, authority, &scope_refs, &client_key);
    let mut fingerprint =
        FingerprintBuilder::new(method, headers.get(":path").unwrap_or_default()).for_retry_of(retry.then_some(key.0));
    for name in &policy.fingerprint_headers {
        fingerprint.header(name, headers.values(name));
    }
    // A gRPC call sent detached answers its client through the replay loopback (a local
    // reply cannot carry its messages); without it, gRPC calls go through the router.
    let headers = (policy.forward == Forward::Detached && (!grpc || config.grpc_replay_loopback)).then_some(headers);
    let caller = Caller::of(tag_key, &scope_refs);
    Covered::Yes(Box::new(Pending { key, fingerprint, headers, scope_shared, caller }))
}

/// The values that scope the key to a caller: configured headers (all their values), the
/// mTLS peer, a verified JWT claim. `None`: that one is absent.
fn scope_values(policy: &Policy, headers: &HeaderMap, host: &dyn Host) -> Vec<Option<Vec<u8>>> {
    let mut scopes: Vec<Option<Vec<u8>>> = policy
        .scope_headers
        .iter()
        .map(|name| {
            // An empty value is no caller (an empty `Authorization:` is not a scope anyone shares).
            let values: Vec<&[u8]> = headers.values(name).filter(|v| !v.is_empty()).collect();
            (!values.is_empty()).then(|| values.join(&0u8))
        })
        .collect();
    if policy.scope_peer {
        // The peer certificate's first URI SAN (a SPIFFE id under Istio); a certificate
        // without one is no scope.
        let peer = host.property(&["connection", "uri_san_peer_certificate"]).filter(|v| !v.is_empty());
        scopes.push(peer);
    }
    if let Some(jwt) = &policy.scope_jwt_claim {
        let path =
            ["metadata", "filter_metadata", "envoy.filters.http.jwt_authn", jwt.payload.as_str(), jwt.claim.as_str()];
        scopes.push(host.property(&path).filter(|v| !v.is_empty()));
    }
    scopes
}

/// A covered request as the root sends it upstream itself (detached forwarding).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outbound {
    pub cluster: String,
    /// The client's headers as read, every name and value UTF-8.
    pub headers: HeaderMap,
    pub body: Vec<u8>,
}

/// The request as the root would send it, if it can: detached forwarding applies (`headers`
/// kept), the route names a cluster and every header value is UTF-8 (`dispatch_http_call`
/// takes `&str`). Otherwise the router sends it, so nothing is altered. Read in the stream's
/// own event: the route's cluster is a property of the stream. `via` (`detached_via`): the
/// cluster of the internal listener that routes it again, the route's behaviour applied.
pub fn outbound(host: &dyn Host, headers: Option<HeaderMap>, body: Vec<u8>, via: Option<&str>) -> Option<Outbound> {
    let headers = headers?;
    let cluster = String::from_utf8(host.property(&["xds", "cluster_name"])?).ok()?;
    if cluster.is_empty() {
        return None;
    }
    if !headers.is_text() {
        return None;
    }
    let cluster = via.map_or(cluster, str::to_string);
    Some(Outbound { cluster, headers, body })
}
