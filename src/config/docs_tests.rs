//! docs/configuration.md is the one reference of every field and its default: each default it
//! gives is what the parser yields when the field is left out. A configuration that sets a
//! field to its documented default must parse to the same `Config` as one that leaves it out.

use super::Config;
use serde_json::{json, Value};

const DOC: &str = include_str!("../../docs/configuration.md");

/// The rows (field, default cell) of the table that follows `heading`.
fn rows(heading: &str) -> Vec<(String, String)> {
    let Some(start) = DOC.find(heading) else { panic!("no {heading:?} in docs/configuration.md") };
    let lines = DOC[start..].lines().skip_while(|l| !l.starts_with("| field |")).skip(2);
    lines
        .take_while(|l| l.starts_with('|'))
        .map(|l| {
            let cells: Vec<&str> = l.split(" | ").collect();
            let field = cells.first().map(|c| c.trim_start_matches("| ").trim_matches('`')).unwrap_or_default();
            let default = cells.last().map(|c| c.trim_end_matches(" |").trim()).unwrap_or_default();
            (field.to_string(), default.to_string())
        })
        .collect()
}

/// The default's JSON literal: the cell's first code span, when the cell opens with it.
fn literal(cell: &str) -> Option<Value> {
    let rest = cell.strip_prefix('`')?;
    let end = rest.find('`')?;
    serde_json::from_str(&rest[..end]).ok()
}

fn parse(v: &Value) -> Config {
    Config::parse(v.to_string().as_bytes()).unwrap_or_else(|e| panic!("{v}: {e}"))
}

/// Defaults that are not one JSON value, and why: each is checked below by what it says.
const DESCRIBED: &[&str] = &[
    "scope_jwt_claim", // none
    "detached_via",    // none
    "stat_prefix",     // none
    "fencing_header",  // none
    "store",           // shared data
    "max_response_bytes",
];

#[test]
fn every_documented_default_is_the_parsers() {
    let base = json!({});
    let left_out = parse(&base);
    let fields = rows("## Fields");
    assert!(fields.len() >= 30, "{} rows", fields.len());
    for (field, cell) in &fields {
        if DESCRIBED.contains(&field.as_str()) {
            continue;
        }
        let Some(value) = literal(cell) else { panic!("`{field}`: default {cell:?} is not a JSON value") };
        let mut given = parse(&json!({ field.as_str(): value }));
        if field == "release_statuses" {
            // The same statuses may be held as other ranges (407 and 408 as one).
            let (a, b) = (&given.policy.release_statuses, &left_out.policy.release_statuses);
            assert!((100..600).all(|s| a.contains(s) == b.contains(s)), "`{field}`: {value}");
            given.policy.release_statuses = b.clone();
        }
        assert_eq!(given, left_out, "`{field}`: the documented default {value} is not the parser's");
    }
    let described: Vec<&str> = fields.iter().map(|(f, _)| f.as_str()).filter(|f| DESCRIBED.contains(f)).collect();
    assert_eq!(described.len(), DESCRIBED.len(), "described defaults without a row: {described:?}");
    for (field, cell) in fields.iter().filter(|(f, _)| DESCRIBED.contains(&f.as_str())) {
        match field.as_str() {
            "store" => assert_eq!(cell, "shared data"),
            "max_response_bytes" => assert!(cell.contains("(`131072` with the default")),
            _ => assert!(cell.starts_with("none"), "`{field}`: {cell}"),
        }
    }
    assert_eq!(left_out.store, super::StoreConfig::SharedData);
    assert_eq!(left_out.policy.max_response_bytes, 131_072);
    assert_eq!(left_out.policy.scope_jwt_claim, None);
    assert_eq!(left_out.policy.detached_via, None);
    assert_eq!(left_out.stat_prefix, None);
    assert_eq!(left_out.fencing_header, None);
}

#[test]
fn every_documented_etcd_default_is_the_parsers() {
    let store = json!({"kind": "etcd", "cluster": "etcd"});
    let left_out = parse(&json!({ "store": store }));
    let fields = rows("`store` for etcd");
    assert!(fields.len() >= 8, "{} rows", fields.len());
    for (field, cell) in &fields {
        let value = match (field.as_str(), literal(cell)) {
            // Described, not one value: required unless the other, the cluster's name.
            ("cluster" | "clusters" | "authority", _) => continue,
            (_, Some(value)) => value,
            (_, None) => panic!("`store.{field}`: default {cell:?} is not a JSON value"),
        };
        let mut with = store.clone();
        with[field.as_str()] = value.clone();
        let given = parse(&json!({ "store": with }));
        if field == "api" {
            // "grpc" given is gRPC only; left out, an HTTP/1.1 cluster falls back to the JSON
            // gateway, as the cell says.
            assert!(cell.contains("not given, on an HTTP/1.1 cluster"), "{cell}");
            continue;
        }
        assert_eq!(given, left_out, "`store.{field}`: the documented default {value} is not the parser's");
    }
    assert_eq!(left_out.policy.max_response_bytes, 1 << 20, "etcd: 1 MiB");
}
