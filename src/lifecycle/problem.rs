//! The errors the plugin answers itself (docs/behaviour.md §3.6): `application/problem+json` (RFC 9457)
//! with `type`, `title`, `status`, `detail`, `retryable` and, when retryable, `retry_after`.

use std::borrow::Cow;
use std::cell::RefCell;
use std::io::Write;
use std::rc::Rc;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    pub status: u16,
    slug: &'static str,
    title: &'static str,
    /// Borrowed when it is a constant: most problems allocate nothing for it.
    detail: Cow<'static, str>,
    /// Seconds the client should wait; `Some` makes the problem retryable.
    pub retry_after: Option<u64>,
}

const TYPE_PREFIX: &str = "urn:idempotency-filter:problem:";

/// Bodies of problems whose texts are all constants, rendered once: the 409s of a retry storm
/// would otherwise escape and format the same JSON on every request (a tenth of a 409's Wasm
/// work). Kinds × the policies' `retry_after_s`; a few, bounded all the same.
const RENDERED_MAX: usize = 32;

struct Rendered {
    status: u16,
    slug: &'static str,
    detail: &'static str,
    retry_after: Option<u64>,
    body: Rc<[u8]>,
}

thread_local! {
    static RENDERED: RefCell<Vec<Rendered>> = const { RefCell::new(Vec::new()) };
}

impl Problem {
    pub fn missing_key(header: &str) -> Problem {
        Problem::new(
            400,
            "missing-key",
            "An Idempotency-Key is required for this request",
            format!("This operation requires the `{header}` header.").into(),
            None,
        )
    }

    pub fn invalid_key(detail: String) -> Problem {
        Problem::new(400, "invalid-key", "The Idempotency-Key is malformed", detail.into(), None)
    }

    pub fn duplicate_key_header(header: &str) -> Problem {
        Problem::new(
            400,
            "invalid-key",
            "The Idempotency-Key is malformed",
            format!("The `{header}` header must appear once.").into(),
            None,
        )
    }

    /// The configured scope is absent and `missing_scope` is `"reject"` (docs/behaviour.md §3.1).
    pub fn scope_missing() -> Problem {
        Problem::new(
            401,
            "scope-missing",
            "The caller's identity is required for this Idempotency-Key",
            "Keys are scoped to the caller, and this request carries no identity to scope it by; no work was done."
                .into(),
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
            format!("Requests with an Idempotency-Key may carry at most {limit} bytes.").into(),
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
            "Every entry of this key's part of the store is a request in progress or an answer kept for its replay window (min_retention_s); no work was done.".into(),
            Some(retry_after_s),
        )
    }

    /// A fleet Envoy's share of etcd is full and this caller wrote the most of it lately.
    pub fn share_full(retry_after_s: u64) -> Problem {
        Problem::new(
            429,
            "share-full",
            "This caller's share of the idempotency store is full",
            "This gateway's share of the idempotency store is full, and this caller wrote the most of it lately; no work was done. Requests with keys already stored still replay.".into(),
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

    /// A detached call's answer too large to relay: its work ran and its key completed (a retry
    /// gets the 409 `response-not-stored`), or the key was released (`retry_after_s`).
    pub fn answer_too_large(retry_after_s: Option<u64>) -> Problem {
        let detail = match retry_after_s {
            Some(_) => "The upstream's answer was too large to relay (max_buffered_bytes) and releases the Idempotency-Key; the request may be retried.",
            None => "The upstream's answer was too large to relay (max_buffered_bytes); the request was processed and its Idempotency-Key completed. Use forward: \"router\" for routes with such answers.",
        };
        Problem::new(
            502,
            "answer-too-large",
            "The upstream's answer is too large to relay",
            detail.into(),
            retry_after_s,
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
            format!("{reason}; the Idempotency-Key was released and the request may be retried.").into(),
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

    /// The last part of its `type`: what happened, for the gRPC mapping.
    pub fn slug(&self) -> &'static str {
        self.slug
    }

    pub fn title(&self) -> &'static str {
        self.title
    }

    fn new(
        status: u16,
        slug: &'static str,
        title: &'static str,
        detail: Cow<'static, str>,
        retry_after: Option<u64>,
    ) -> Problem {
        Problem { status, slug, title, detail, retry_after }
    }

    /// The JSON body, members in alphabetical order. Written directly (serde_json escapes the
    /// strings): building a `serde_json::Value` map first cost 2 µs a 409 natively, more than
    /// three times the table lookup that decided it.
    pub fn body(&self) -> Rc<[u8]> {
        let Cow::Borrowed(detail) = self.detail else { return self.render().into() };
        // The texts are constants: the same address is the same text (an equal text elsewhere
        // is only rendered again).
        let same = |r: &Rendered| {
            r.status == self.status
                && std::ptr::eq(r.slug, self.slug)
                && std::ptr::eq(r.detail, detail)
                && r.retry_after == self.retry_after
        };
        if let Some(body) = RENDERED.with(|r| r.borrow().iter().find(|r| same(r)).map(|r| Rc::clone(&r.body))) {
            return body;
        }
        let body: Rc<[u8]> = self.render().into();
        let rendered = Rendered {
            status: self.status,
            slug: self.slug,
            detail,
            retry_after: self.retry_after,
            body: Rc::clone(&body),
        };
        RENDERED.with(|r| {
            let mut r = r.borrow_mut();
            if r.len() >= RENDERED_MAX {
                r.remove(0);
            }
            r.push(rendered);
        });
        body
    }

    fn render(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(128 + self.title.len() + self.detail.len());
        out.extend_from_slice(b"{\"detail\":");
        json_string(&mut out, &self.detail);
        if let Some(s) = self.retry_after {
            let _ = write!(out, ",\"retry_after\":{s}");
        }
        let _ = write!(out, ",\"retryable\":{},\"status\":{},\"title\":", self.retry_after.is_some(), self.status);
        json_string(&mut out, self.title);
        // The prefix and slugs are plain ASCII: nothing to escape.
        let _ = write!(out, ",\"type\":\"{TYPE_PREFIX}{}\"}}", self.slug);
        out
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

/// Appends `s` as a JSON string.
fn json_string(out: &mut Vec<u8>, s: &str) {
    // Writing a `&str` into a `Vec` cannot fail.
    let _ = serde_json::to_writer(out, s);
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

    /// The body is what a `serde_json::Value` map of the members renders: the same bytes.
    #[test]
    fn body_is_the_json_of_its_members() {
        for p in [
            Problem::in_progress(7),
            Problem::fingerprint_mismatch(),
            Problem::completed_without_response(),
            Problem::body_too_large(10),
            Problem::missing_key("x-\"quoted\"\\key"),
            Problem::invalid_key("control \u{1} and é".into()),
            Problem::upstream_failed(504, "late", 3),
            Problem::body_unavailable(),
            Problem::scope_missing(),
        ] {
            let mut v = serde_json::json!({
                "type": format!("{TYPE_PREFIX}{}", p.slug),
                "title": p.title,
                "status": p.status,
                "detail": p.detail,
                "retryable": p.retry_after.is_some(),
            });
            if let Some(s) = p.retry_after {
                v.as_object_mut().unwrap().insert("retry_after".into(), s.into());
            }
            assert_eq!(String::from_utf8(p.body().to_vec()).unwrap(), v.to_string());
        }
    }

    /// Rendered once per kind and `retry_after`: the same bytes as a fresh rendering, each
    /// `retry_after` its own, texts that are not constants rendered every time; bounded.
    #[test]
    fn constant_bodies_are_rendered_once() {
        let first = Problem::in_progress(1).body();
        assert!(Rc::ptr_eq(&first, &Problem::in_progress(1).body()), "rendered again");
        assert_eq!(&first[..], &Problem::in_progress(1).render()[..]);
        let other = Problem::in_progress(2).body();
        assert_eq!(&other[..], &Problem::in_progress(2).render()[..]);
        assert!(!Rc::ptr_eq(&Problem::body_too_large(10).body(), &Problem::body_too_large(10).body()));
        for s in 0..100 {
            assert_eq!(&Problem::store_full(s).body()[..], &Problem::store_full(s).render()[..]);
        }
        assert!(RENDERED.with(|r| r.borrow().len()) <= RENDERED_MAX);
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
