//! The errors the plugin answers itself (SPEC §3.6): `application/problem+json` (RFC 9457)
//! with `type`, `title`, `status`, `detail`, `retryable` and, when retryable, `retry_after`.

use serde_json::json;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    pub status: u16,
    slug: &'static str,
    title: &'static str,
    detail: String,
    /// Seconds the client should wait; `Some` makes the problem retryable.
    pub retry_after: Option<u64>,
}

const TYPE_PREFIX: &str = "urn:idempotency-filter:problem:";

impl Problem {
    pub fn missing_key(header: &str) -> Problem {
        Problem::new(
            400,
            "missing-key",
            "An Idempotency-Key is required for this request",
            format!("This operation requires the `{header}` header."),
            None,
        )
    }

    pub fn invalid_key(detail: String) -> Problem {
        Problem::new(400, "invalid-key", "The Idempotency-Key is malformed", detail, None)
    }

    pub fn duplicate_key_header(header: &str) -> Problem {
        Problem::new(
            400,
            "invalid-key",
            "The Idempotency-Key is malformed",
            format!("The `{header}` header must appear once."),
            None,
        )
    }

    pub fn in_progress(retry_after_s: u64) -> Problem {
        Problem::new(
            409,
            "in-progress",
            "A request is outstanding for this Idempotency-Key",
            "A request with the same Idempotency-Key is still being processed; retry after the advertised delay to get its result.".into(),
            Some(retry_after_s),
        )
    }

    pub fn completed_without_response() -> Problem {
        Problem::new(
            409,
            "response-not-stored",
            "The request for this Idempotency-Key was completed; its response is not stored",
            "The original request completed, but its response was too large to keep. It will not be run again.".into(),
            None,
        )
    }

    pub fn body_too_large(limit: usize) -> Problem {
        Problem::new(
            413,
            "body-too-large",
            "The request body is too large",
            format!("Requests with an Idempotency-Key may carry at most {limit} bytes."),
            None,
        )
    }

    pub fn fingerprint_mismatch() -> Problem {
        Problem::new(
            422,
            "key-reused",
            "The Idempotency-Key was used for a different request",
            "This Idempotency-Key was already used with a different method, path, query, headers or body. Use a new key for a new request.".into(),
            None,
        )
    }

    pub fn store_full(retry_after_s: u64) -> Problem {
        Problem::new(
            503,
            "store-full",
            "The idempotency store is full",
            "No entry is free for this key right now; no work was done.".into(),
            Some(retry_after_s),
        )
    }

    pub fn store_unavailable(retry_after_s: u64) -> Problem {
        Problem::new(
            503,
            "store-unavailable",
            "The idempotency store is unavailable",
            "The request could not be checked against the idempotency store; no work was done.".into(),
            Some(retry_after_s),
        )
    }

    /// The upstream gave no answer (connect failure, reset, timeout); the key was released.
    pub fn upstream_failed(status: u16, reason: &str, retry_after_s: u64) -> Problem {
        let title = match status {
            504 => "The upstream did not answer in time",
            502 => "The upstream connection was reset",
            _ => "The upstream is unavailable",
        };
        Problem::new(
            status,
            "upstream-failed",
            title,
            format!("{reason}; the Idempotency-Key was released and the request may be retried."),
            Some(retry_after_s),
        )
    }

    /// The Envoy filter config lacks `allow_on_headers_stop_iteration: true`: bodies never
    /// reach the plugin, so it cannot fingerprint or forward them.
    pub fn body_unavailable() -> Problem {
        Problem::new(
            500,
            "misconfigured",
            "The idempotency filter cannot read request bodies",
            "The gateway's Wasm filter must set allow_on_headers_stop_iteration: true; no work was done.".into(),
            None,
        )
    }

    fn new(status: u16, slug: &'static str, title: &'static str, detail: String, retry_after: Option<u64>) -> Problem {
        Problem { status, slug, title, detail, retry_after }
    }

    pub fn body(&self) -> Vec<u8> {
        let mut v = json!({
            "type": format!("{TYPE_PREFIX}{}", self.slug),
            "title": self.title,
            "status": self.status,
            "detail": self.detail,
            "retryable": self.retry_after.is_some(),
        });
        if let (Some(s), Some(obj)) = (self.retry_after, v.as_object_mut()) {
            obj.insert("retry_after".into(), json!(s));
        }
        v.to_string().into_bytes()
    }

    /// Response headers besides `:status`.
    pub fn headers(&self) -> Vec<(&'static str, Vec<u8>)> {
        let mut h = vec![("content-type", b"application/problem+json".to_vec())];
        if let Some(s) = self.retry_after {
            h.push(("retry-after", s.to_string().into_bytes()));
        }
        h
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Value;

    #[test]
    fn conflict_matches_the_spec() {
        let p = Problem::in_progress(1);
        let v: Value = serde_json::from_slice(&p.body()).unwrap();
        assert_eq!(v["title"], "A request is outstanding for this Idempotency-Key");
        assert_eq!(v["status"], 409);
        assert_eq!(v["retryable"], true);
        assert_eq!(v["retry_after"], 1);
        assert!(v["type"].as_str().unwrap().starts_with("urn:"));
        assert!(p.headers().contains(&("retry-after", b"1".to_vec())));
        assert!(p.headers().contains(&("content-type", b"application/problem+json".to_vec())));
    }

    #[test]
    fn non_retryable_problems_have_no_retry_after() {
        for p in [
            Problem::fingerprint_mismatch(),
            Problem::completed_without_response(),
            Problem::body_too_large(10),
            Problem::missing_key("idempotency-key"),
        ] {
            let v: Value = serde_json::from_slice(&p.body()).unwrap();
            assert_eq!(v["retryable"], false);
            assert!(v.get("retry_after").is_none());
            assert!(!p.headers().iter().any(|(n, _)| *n == "retry-after"));
        }
    }
}
