//! Where one Idempotency-Key lives (docs/operations.md, "Finding one key"): its store key, the
//! digest the logs show, its caller's tag, the shared-data keys it may occupy, and its etcd key
//! (and cluster). Computed with the plugin's own functions, never by a copy of them.
//!
//! ```text
//! cargo run --bin idempotency-key -- --namespace idem --host api.example.com \
//!     --scope 'Bearer alice' [--scope …] [--capacity 65536] [--clusters etcd_a,etcd_b] \
//!     [--tag-key SECRET] [--json] KEY
//! ```
//!
//! A native tool: the plugin (`cargo build --target wasm32-wasip1 --lib`) never contains it.

use std::process::ExitCode;

use idempotency::caller::{Caller, TagKey};
use idempotency::config::{Config, StoreConfig};
use idempotency::encoding::ENTRIES;
use idempotency::key::{parse_key, StoreKey};
use idempotency::store::etcd::protocol::key_name;
use idempotency::store::etcd::shards::{seed_of, shard_of};
use idempotency::store::table::Layout;
use serde_json::{json, Value};

const USAGE: &str = "\
usage: idempotency-key --host AUTHORITY (--scope VALUE | --absent)... [--also VALUE]
                       [--namespace NS] [--capacity N] [--clusters A,B,...] [--tag-key SECRET]
                       [--json] [--] KEY
       idempotency-key --host AUTHORITY --unscoped [...] KEY

Prints where the plugin keeps the key KEY (the Idempotency-Key header's value, bare or quoted):
its store key, the digest the debug log shows, the caller tag, the shared-data bucket and data
keys it may occupy (the table's, and the etcd store's local replay copies'), and its etcd key.

  --host AUTHORITY  the request's :authority (its Host header) exactly as Envoy saw it, port
                    included if the client sent one
  --scope VALUE     one scope value, in the order the plugin reads them: each of scope_headers
                    (default: authorization) in order, then the mTLS peer (scope_peer), then the
                    JWT claim (scope_jwt_claim). Repeat for several
  --absent          a scope value that was absent (the header not sent, no peer, no claim)
  --also VALUE      another value of the previous --scope's header, sent more than once (the
                    plugin joins a repeated header's values with a NUL byte)
  --unscoped        the policy has no scope at all (scope_headers: [], no peer, no claim)
  --namespace NS    the configuration's namespace (default idem)
  --capacity N      the configuration's capacity (default 65536)
  --clusters A,B    the etcd store's clusters, in the configuration's order: names the one
                    holding the key (one name: that one)
  --tag-key SECRET  the Envoy's secret for callers' tags (32 hex digits, logged once when it
                    made it): the caller tag that Envoy logs (without it: none)
  --json            one JSON object instead of text
";

#[derive(Debug)]
struct Args {
    namespace: String,
    host: String,
    scopes: Vec<Option<Vec<u8>>>,
    unscoped: bool,
    capacity: Option<String>,
    clusters: Vec<String>,
    tag_key: Option<TagKey>,
    json: bool,
    key: String,
}

fn parse_args(argv: impl IntoIterator<Item = String>) -> Result<Args, String> {
    let mut args = Args {
        namespace: "idem".into(),
        host: String::new(),
        scopes: Vec::new(),
        unscoped: false,
        capacity: None,
        clusters: Vec::new(),
        tag_key: None,
        json: false,
        key: String::new(),
    };
    let mut host = None;
    let mut keys = Vec::new();
    let mut argv = argv.into_iter();
    let mut only_keys = false;
    while let Some(arg) = argv.next() {
        if only_keys {
            keys.push(arg);
            continue;
        }
        let mut value = |name: &str| argv.next().ok_or_else(|| format!("{name} needs a value"));
        match arg.as_str() {
            "--namespace" => args.namespace = value("--namespace")?,
            "--host" => host = Some(value("--host")?),
            "--scope" => args.scopes.push(Some(value("--scope")?.into_bytes())),
            "--absent" => args.scopes.push(None),
            "--also" => {
                let more = value("--also")?;
                match args.scopes.last_mut() {
                    Some(Some(previous)) => {
                        previous.push(0);
                        previous.extend_from_slice(more.as_bytes());
                    }
                    _ => return Err("--also must follow a --scope (another value of the same header)".into()),
                }
            }
            "--unscoped" => args.unscoped = true,
            "--capacity" => args.capacity = Some(value("--capacity")?),
            "--clusters" | "--cluster" => {
                args.clusters.extend(value("--clusters")?.split(',').map(str::trim).map(String::from));
            }
            "--tag-key" => {
                let text = value("--tag-key")?;
                args.tag_key = Some(TagKey::from_hex(&text).ok_or("--tag-key: expected 32 hex digits")?);
            }
            "--json" => args.json = true,
            "--" => only_keys = true,
            "-h" | "--help" => return Err(String::new()),
            other if other.starts_with("--") => return Err(format!("unknown option {other}")),
            _ => keys.push(arg),
        }
    }
    args.host = host.ok_or("--host is required: the request's :authority (Host header)")?;
    if args.unscoped && !args.scopes.is_empty() {
        return Err("--unscoped means no scope values: give it without --scope/--absent".into());
    }
    if !args.unscoped && args.scopes.is_empty() {
        return Err("give the request's scope values (--scope VALUE, --absent), or --unscoped when the \
                    policy has none (the default scope is the authorization header)"
            .into());
    }
    match <[String; 1]>::try_from(keys) {
        Ok([key]) => args.key = key,
        Err(keys) => return Err(format!("expected one KEY, got {}", keys.len())),
    }
    Ok(args)
}

/// The plugin's configuration for these options, parsed by the plugin's own parser (so a
/// namespace, capacity or cluster list it would refuse is refused here too).
fn config_of(args: &Args) -> Result<Config, String> {
    let mut config = serde_json::Map::new();
    config.insert("namespace".into(), Value::String(args.namespace.clone()));
    if let Some(capacity) = &args.capacity {
        let n: u64 = capacity.parse().map_err(|_| format!("--capacity: expected a number, got {capacity:?}"))?;
        config.insert("capacity".into(), Value::from(n));
    }
    if !args.clusters.is_empty() {
        config.insert("store".into(), json!({"kind": "etcd", "clusters": args.clusters}));
    }
    Config::parse(Value::Object(config).to_string().as_bytes()).map_err(|e| e.to_string())
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A table's bucket of `key` and the data keys of its 64 entries.
fn table_place(layout: &Layout, key: &StoreKey) -> Result<Value, String> {
    let (bucket, _) = layout.locate(key);
    let entries = u32::try_from(ENTRIES).map_err(|_| "ENTRIES does not fit u32")?;
    let first = bucket.checked_mul(entries).ok_or("slot out of range")?;
    let last = first + (entries - 1);
    Ok(json!({
        "buckets": layout.buckets(),
        "bucket": bucket,
        "bucket_key": layout.bucket_key(bucket),
        "first_data_key": layout.data_key(first),
        "last_data_key": layout.data_key(last),
    }))
}

fn run(args: &Args) -> Result<(Value, Vec<String>), String> {
    let config = config_of(args)?;
    let mut notes = Vec::new();
    let client_key = parse_key(args.key.as_bytes(), 8192).map_err(|e| format!("KEY: {}", e.detail(8192)))?;
    if client_key.len() > 255 {
        notes.push(format!(
            "the key is {} characters long: the plugin answers 400 unless max_key_length allows it (default 255)",
            client_key.len()
        ));
    }
    let scopes: Vec<Option<&[u8]>> = args.scopes.iter().map(|s| s.as_deref()).collect();
    if !scopes.is_empty() && scopes.iter().all(Option::is_none) {
        notes.push(
            "every scope value is absent: with missing_scope \"pass\" (the default) the request is not \
             stored at all, with \"reject\" it is refused; only \"share\" stores it, under this key"
                .into(),
        );
    }
    let key = StoreKey::derive(&config.namespace, args.host.as_bytes(), &scopes, &client_key);
    let table = Layout::new(&config.namespace, config.capacity, config.max_store_bytes);
    let replays = Layout::new(&format!("{}.replays", config.namespace), config.capacity, config.max_store_bytes);
    let etcd_key = String::from_utf8(key_name(&config.namespace, &key.0)).map_err(|e| e.to_string())?;
    let cluster = match &config.store {
        StoreConfig::Etcd(etcd) => {
            let shard = shard_of(etcd.clusters.iter().map(|c| seed_of(c)), &key);
            etcd.clusters.get(shard).cloned().map(Value::String).unwrap_or(Value::Null)
        }
        StoreConfig::SharedData => Value::Null,
    };
    let out = json!({
        "store_key": hex(&key.0),
        "log_digest": key.short(),
        "caller_tag": args.tag_key.map(|k| Caller::of(&k, &scopes).short()),
        "capacity": config.capacity,
        "shared_data": table_place(&table, &key)?,
        "local_replays": table_place(&replays, &key)?,
        "etcd_key": etcd_key,
        "etcd_cluster": cluster,
        "etcd_clusters": args.clusters,
    });
    Ok((out, notes))
}

fn text(out: &Value) -> String {
    let s = |v: &Value| match v {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    };
    let place = |name: &str, what: &str| {
        let p = &out[name];
        format!(
            "{what}\n  bucket        {} (bucket {} of {})\n  data keys     {} .. {} (its entry is one of the bucket's 64)\n",
            s(&p["bucket_key"]),
            s(&p["bucket"]),
            s(&p["buckets"]),
            s(&p["first_data_key"]),
            s(&p["last_data_key"]),
        )
    };
    let mut text = format!(
        "store key       {}\nlog digest      {}\ncaller tag      {}\n",
        s(&out["store_key"]),
        s(&out["log_digest"]),
        match &out["caller_tag"] {
            Value::Null => "(the Envoy's secret: --tag-key)".to_string(),
            tag => s(tag),
        }
    );
    text += &place("shared_data", "shared data (store kind shared_data), in Envoy's shared data:");
    text += &place("local_replays", "local replay copies (store kind etcd, local_replays), in Envoy's shared data:");
    text += &format!("etcd key        {}\n", s(&out["etcd_key"]));
    if let Value::String(cluster) = &out["etcd_cluster"] {
        text += &format!("etcd cluster    {cluster}\n");
    }
    text
}

fn main() -> ExitCode {
    let args = match parse_args(std::env::args().skip(1)) {
        Ok(args) => args,
        Err(e) if e.is_empty() => {
            print!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            eprint!("idempotency-key: {e}\n\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    match run(&args) {
        Ok((out, notes)) => {
            for note in notes {
                eprintln!("note: {note}");
            }
            if args.json {
                println!("{out}");
            } else {
                print!("{}", text(&out));
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("idempotency-key: {e}");
            ExitCode::FAILURE
        }
    }
}
