//! The plugin configuration: JSON in, a validated [`Config`] out, parsed once at `on_configure`.
//!
//! Parsing is done by hand over `serde_json::Value` so that every error names the field and
//! says what was expected (serde's derive would report "invalid type at line 1 column 42").

use serde_json::{Map, Value};
use std::fmt;

/// What to do with a duplicate that meets an in-progress first call (SPEC §3.3).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OnConflict {
    /// Answer 409 at once.
    Reject,
    /// Hold the duplicate until the first call finishes (or `wait_max_ms`).
    Wait,
}

/// Who sends a covered request upstream (SPEC §3.2).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Forward {
    /// The plugin sends it itself (`dispatch_http_call`), so the client's departure does not
    /// cancel it.
    Detached,
    /// Envoy's router sends it: route timeouts, retries and header rules apply.
    Router,
}

/// Upstream statuses that release the key instead of completing it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StatusSet {
    ranges: Vec<(u16, u16)>,
}

impl StatusSet {
    pub fn contains(&self, status: u16) -> bool {
        self.ranges.iter().any(|&(lo, hi)| lo <= status && status <= hi)
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StoreConfig {
    SharedData,
}

/// The validated configuration. Header names are lower-case, methods upper-case.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Config {
    pub key_header: String,
    pub methods: Vec<String>,
    pub require_key: bool,
    pub max_key_length: usize,
    pub scope_headers: Vec<String>,
    pub fingerprint_headers: Vec<String>,
    pub fingerprint_body: bool,
    pub lease_ms: u64,
    pub retention_s: u64,
    pub retry_after_s: u64,
    pub on_conflict: OnConflict,
    pub wait_max_ms: u64,
    pub max_waiters: usize,
    pub release_statuses: StatusSet,
    pub max_request_body_bytes: usize,
    pub max_response_bytes: usize,
    pub capacity: usize,
    pub forward: Forward,
    pub upstream_timeout_ms: u64,
    pub namespace: String,
    pub store: StoreConfig,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            key_header: "idempotency-key".into(),
            methods: vec!["POST".into(), "PATCH".into()],
            require_key: false,
            max_key_length: 255,
            scope_headers: vec!["authorization".into()],
            fingerprint_headers: vec!["content-type".into()],
            fingerprint_body: true,
            lease_ms: 10_000,
            retention_s: 86_400,
            retry_after_s: 1,
            on_conflict: OnConflict::Reject,
            wait_max_ms: 5_000,
            max_waiters: 1_024,
            release_statuses: StatusSet { ranges: vec![(500, 599), (408, 408), (425, 425), (429, 429)] },
            max_request_body_bytes: 1 << 20,
            max_response_bytes: 1 << 20,
            capacity: 65_536,
            forward: Forward::Detached,
            upstream_timeout_ms: 30_000,
            namespace: "idem".into(),
            store: StoreConfig::SharedData,
        }
    }
}

/// A configuration error: the field (a JSON path such as `store.kind`) and why it was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    pub field: String,
    pub reason: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.field.is_empty() {
            write!(f, "invalid configuration: {}", self.reason)
        } else {
            write!(f, "invalid configuration: field `{}`: {}", self.field, self.reason)
        }
    }
}

fn err(field: &str, reason: impl Into<String>) -> ConfigError {
    ConfigError { field: field.into(), reason: reason.into() }
}

/// Largest values we accept: they keep arithmetic on milliseconds and sizes far from overflow
/// and catch unit mistakes (seconds given as milliseconds).
const MAX_MS: u64 = 24 * 3600 * 1000;
const MAX_RETENTION_S: u64 = 30 * 24 * 3600;
const MAX_BODY: u64 = 64 << 20;
const MAX_CAPACITY: u64 = 1 << 22;

impl Config {
    /// Parses and validates the plugin configuration. Empty input means all defaults.
    pub fn parse(bytes: &[u8]) -> Result<Config, ConfigError> {
        if bytes.iter().all(|b| b.is_ascii_whitespace()) {
            return Ok(Config::default());
        }
        let value: Value = serde_json::from_slice(bytes)
            .map_err(|e| err("", format!("not valid JSON: {e}")))?;
        let Value::Object(map) = value else {
            return Err(err("", "expected a JSON object"));
        };
        Self::from_map(&map)
    }

    fn from_map(map: &Map<String, Value>) -> Result<Config, ConfigError> {
        let mut c = Config::default();
        for (name, v) in map {
            let f = name.as_str();
            match f {
                "key_header" => c.key_header = header_name(f, v)?,
                "methods" => c.methods = methods(f, v)?,
                "require_key" => c.require_key = boolean(f, v)?,
                "max_key_length" => c.max_key_length = int(f, v, 1, 8192)? as usize,
                "scope_headers" => c.scope_headers = header_names(f, v)?,
                "fingerprint_headers" => c.fingerprint_headers = header_names(f, v)?,
                "fingerprint_body" => c.fingerprint_body = boolean(f, v)?,
                "lease_ms" => c.lease_ms = int(f, v, 100, MAX_MS)?,
                "retention_s" => c.retention_s = int(f, v, 1, MAX_RETENTION_S)?,
                "retry_after_s" => c.retry_after_s = int(f, v, 1, 3600)?,
                "on_conflict" => {
                    c.on_conflict = match string(f, v)? {
                        "reject" => OnConflict::Reject,
                        "wait" => OnConflict::Wait,
                        other => return Err(err(f, format!("expected \"reject\" or \"wait\", got {other:?}"))),
                    }
                }
                "wait_max_ms" => c.wait_max_ms = int(f, v, 1, MAX_MS)?,
                "max_waiters" => c.max_waiters = int(f, v, 0, 1 << 20)? as usize,
                "release_statuses" => c.release_statuses = statuses(f, v)?,
                "max_request_body_bytes" => c.max_request_body_bytes = int(f, v, 0, MAX_BODY)? as usize,
                "max_response_bytes" => c.max_response_bytes = int(f, v, 0, MAX_BODY)? as usize,
                "capacity" => c.capacity = int(f, v, 1, MAX_CAPACITY)? as usize,
                "forward" => {
                    c.forward = match string(f, v)? {
                        "detached" => Forward::Detached,
                        "router" => Forward::Router,
                        other => return Err(err(f, format!("expected \"detached\" or \"router\", got {other:?}"))),
                    }
                }
                "upstream_timeout_ms" => c.upstream_timeout_ms = int(f, v, 0, MAX_MS)?,
                "namespace" => c.namespace = namespace(f, v)?,
                "store" => c.store = store(f, v)?,
                other => return Err(err(other, "unknown field")),
            }
        }
        Ok(c)
    }
}

fn boolean(f: &str, v: &Value) -> Result<bool, ConfigError> {
    v.as_bool().ok_or_else(|| err(f, format!("expected true or false, got {v}")))
}

fn string<'a>(f: &str, v: &'a Value) -> Result<&'a str, ConfigError> {
    v.as_str().ok_or_else(|| err(f, format!("expected a string, got {v}")))
}

fn int(f: &str, v: &Value, min: u64, max: u64) -> Result<u64, ConfigError> {
    match v.as_u64() {
        Some(n) if (min..=max).contains(&n) => Ok(n),
        _ => Err(err(f, format!("expected an integer from {min} to {max}, got {v}"))),
    }
}

fn array<'a>(f: &str, v: &'a Value) -> Result<&'a Vec<Value>, ConfigError> {
    v.as_array().ok_or_else(|| err(f, format!("expected an array, got {v}")))
}

/// RFC 9110 token characters: what a header name or a method may contain.
fn is_token(s: &str) -> bool {
    !s.is_empty()
        && s.bytes().all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
}

fn header_name(f: &str, v: &Value) -> Result<String, ConfigError> {
    let s = string(f, v)?;
    if !is_token(s) {
        return Err(err(f, format!("{s:?} is not a valid header name")));
    }
    Ok(s.to_ascii_lowercase())
}

fn header_names(f: &str, v: &Value) -> Result<Vec<String>, ConfigError> {
    let mut out: Vec<String> = Vec::new();
    for (i, item) in array(f, v)?.iter().enumerate() {
        let name = header_name(&format!("{f}[{i}]"), item)?;
        if !out.contains(&name) {
            out.push(name);
        }
    }
    Ok(out)
}

fn methods(f: &str, v: &Value) -> Result<Vec<String>, ConfigError> {
    let mut out: Vec<String> = Vec::new();
    for (i, item) in array(f, v)?.iter().enumerate() {
        let field = format!("{f}[{i}]");
        let s = string(&field, item)?;
        if !is_token(s) {
            return Err(err(&field, format!("{s:?} is not a valid HTTP method")));
        }
        let m = s.to_ascii_uppercase();
        if !out.contains(&m) {
            out.push(m);
        }
    }
    Ok(out)
}

fn statuses(f: &str, v: &Value) -> Result<StatusSet, ConfigError> {
    let mut ranges = Vec::new();
    for (i, item) in array(f, v)?.iter().enumerate() {
        let field = format!("{f}[{i}]");
        let range = match item {
            Value::Number(_) => {
                let n = int(&field, item, 100, 599)? as u16;
                (n, n)
            }
            Value::String(s) => match s.as_bytes() {
                [c @ b'1'..=b'5', b'x' | b'X', b'x' | b'X'] => {
                    let lo = u16::from(c - b'0') * 100;
                    (lo, lo + 99)
                }
                _ => return Err(err(&field, format!("expected a status (100-599) or a class like \"5xx\", got {s:?}"))),
            },
            other => return Err(err(&field, format!("expected a status (100-599) or a class like \"5xx\", got {other}"))),
        };
        ranges.push(range);
    }
    Ok(StatusSet { ranges })
}

fn namespace(f: &str, v: &Value) -> Result<String, ConfigError> {
    let s = string(f, v)?;
    let ok = !s.is_empty()
        && s.len() <= 64
        && s.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b));
    if !ok {
        return Err(err(f, format!("expected 1 to 64 characters from [A-Za-z0-9._-], got {s:?}")));
    }
    Ok(s.to_string())
}

fn store(f: &str, v: &Value) -> Result<StoreConfig, ConfigError> {
    let Value::Object(map) = v else {
        return Err(err(f, format!("expected an object like {{\"kind\":\"shared_data\"}}, got {v}")));
    };
    let kind_field = format!("{f}.kind");
    let kind = match map.get("kind") {
        Some(k) => string(&kind_field, k)?,
        None => return Err(err(&kind_field, "missing")),
    };
    match kind {
        "shared_data" => {
            if let Some(extra) = map.keys().find(|k| k.as_str() != "kind") {
                return Err(err(&format!("{f}.{extra}"), "unknown field for store kind \"shared_data\""));
            }
            Ok(StoreConfig::SharedData)
        }
        "etcd" => Err(err(&kind_field, "\"etcd\" is not available in this build; use \"shared_data\"")),
        other => Err(err(&kind_field, format!("expected \"shared_data\" or \"etcd\", got {other:?}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(s: &str) -> Result<Config, ConfigError> {
        Config::parse(s.as_bytes())
    }

    #[test]
    fn empty_and_empty_object_give_defaults() {
        assert_eq!(parse("").unwrap(), Config::default());
        assert_eq!(parse(" {} ").unwrap(), Config::default());
    }

    #[test]
    fn fields_are_parsed_and_normalised() {
        let c = parse(
            r#"{"key_header":"X-Idem","methods":["post","put","POST"],"require_key":true,
                "lease_ms":2000,"retention_s":60,"release_statuses":["4xx",503],
                "forward":"router","namespace":"shop","capacity":1024,
                "scope_headers":["X-Tenant"],"store":{"kind":"shared_data"}}"#,
        )
        .unwrap();
        assert_eq!(c.key_header, "x-idem");
        assert_eq!(c.methods, vec!["POST", "PUT"]);
        assert!(c.require_key);
        assert_eq!((c.lease_ms, c.retention_s, c.capacity), (2000, 60, 1024));
        assert!(c.release_statuses.contains(404) && c.release_statuses.contains(503));
        assert!(!c.release_statuses.contains(500) && !c.release_statuses.contains(201));
        assert_eq!(c.forward, Forward::Router);
        assert_eq!(c.scope_headers, vec!["x-tenant"]);
    }

    #[test]
    fn default_release_statuses_follow_the_spec() {
        let s = Config::default().release_statuses;
        for code in [500, 503, 599, 408, 425, 429] {
            assert!(s.contains(code), "{code}");
        }
        for code in [200, 201, 400, 404, 409, 422, 600] {
            assert!(!s.contains(code), "{code}");
        }
    }

    #[test]
    fn errors_name_the_field() {
        let cases = [
            (r#"{"lease_ms":"10s"}"#, "lease_ms"),
            (r#"{"lease_ms":0}"#, "lease_ms"),
            (r#"{"lease":1000}"#, "lease"),
            (r#"{"methods":["PO ST"]}"#, "methods[0]"),
            (r#"{"release_statuses":[200,"6xx"]}"#, "release_statuses[1]"),
            (r#"{"release_statuses":[99]}"#, "release_statuses[0]"),
            (r#"{"on_conflict":"queue"}"#, "on_conflict"),
            (r#"{"forward":"proxy"}"#, "forward"),
            (r#"{"store":{"kind":"redis"}}"#, "store.kind"),
            (r#"{"store":{"kind":"shared_data","x":1}}"#, "store.x"),
            (r#"{"store":{}}"#, "store.kind"),
            (r#"{"namespace":"a/b"}"#, "namespace"),
            (r#"{"capacity":0}"#, "capacity"),
            (r#"{"key_header":""}"#, "key_header"),
            (r#"{"require_key":"yes"}"#, "require_key"),
            (r#"{"scope_headers":"authorization"}"#, "scope_headers"),
        ];
        for (json, field) in cases {
            let e = parse(json).unwrap_err();
            assert_eq!(e.field, field, "{json}: {e}");
            assert!(e.to_string().contains(field));
        }
    }

    #[test]
    fn non_objects_are_refused() {
        assert!(parse("[]").is_err());
        assert!(parse("{").is_err());
        assert!(parse("\"x\"").is_err());
    }
}
