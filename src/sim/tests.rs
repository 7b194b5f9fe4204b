//! The matrix in `cargo test`, one seed replayed with its trace (`make sim`), and the long
//! run (`make sim-long`).

use super::*;

/// Seeds per combination in `cargo test` (`SIM_SEEDS` overrides).
const SEEDS: u64 = 20;

fn env_u64(name: &str) -> Option<u64> {
    std::env::var(name).ok()?.parse().ok()
}

#[test]
#[cfg_attr(debug_assertions, ignore = "slow unoptimised: `make unit` runs it with --release")]
fn every_combination_keeps_every_invariant() {
    let seeds = env_u64("SIM_SEEDS").unwrap_or(SEEDS);
    let start = std::time::Instant::now();
    let mut failures = Vec::new();
    let mut requests = 0;
    for combo in Combo::all() {
        let (mut combo_requests, mut combo_effects, mut combo_etcd) = (0, 0, EtcdCalls::default());
        for seed in 0..seeds {
            let report = run(seed, combo, false);
            combo_requests += report.requests;
            combo_effects += report.effects;
            combo_etcd += report.etcd;
            for v in report.violations {
                failures.push(format!("SEED={seed} COMBO={} {v}", combo.name()));
            }
        }
        requests += combo_requests;
        let etcd = if combo.is_etcd() { format!(", {combo_etcd}") } else { String::new() };
        eprintln!(
            "sim {}: seeds 0..{seeds}, {combo_requests} requests, {combo_effects} upstream effects{etcd}",
            combo.name()
        );
    }
    eprintln!(
        "simulated {} combinations x {seeds} seeds: {requests} requests in {:.1} s",
        Combo::all().len(),
        start.elapsed().as_secs_f64()
    );
    assert!(failures.is_empty(), "{} violations:\n{}", failures.len(), failures.join("\n"));
}

/// `make sim SEED=… COMBO=…`: one seed of one combination (every combination without
/// `COMBO`), with its trace of events and effects.
#[test]
#[ignore]
fn one_seed() {
    let seed = env_u64("SIM_SEED").unwrap_or(0);
    let combos = match std::env::var("SIM_COMBO") {
        Ok(name) if !name.is_empty() => vec![Combo::parse(&name).unwrap_or_else(|| panic!("no combination {name}"))],
        _ => Combo::all(),
    };
    let mut failed = 0;
    for combo in combos {
        let start = std::time::Instant::now();
        let report = run(seed, combo, true);
        if std::env::var("SIM_TRACE").is_ok_and(|t| t == "1") || !report.violations.is_empty() {
            for line in &report.trace {
                println!("{line}");
            }
        }
        println!(
            "SEED={seed} COMBO={}: {} requests, {} upstream effects, {} events, {:.1} ms{}",
            combo.name(),
            report.requests,
            report.effects,
            report.events,
            start.elapsed().as_secs_f64() * 1e3,
            if combo.is_etcd() { format!(", {}", report.etcd) } else { String::new() }
        );
        for v in &report.violations {
            println!("  VIOLATION {v}");
        }
        failed += report.violations.len();
    }
    assert_eq!(failed, 0);
}

/// `make sim-long SECONDS=…`: seeds of every combination, for as long as asked; prints the
/// requests simulated, the seeds, and the violations by invariant with the first seed of each.
#[test]
#[ignore]
fn long() {
    let seconds = env_u64("SIM_SECONDS").unwrap_or(60);
    let first_seed = env_u64("SIM_FIRST_SEED").unwrap_or(1_000);
    let start = std::time::Instant::now();
    let combos = Combo::all();
    let (mut seeds, mut runs, mut requests, mut effects) = (0u64, 0u64, 0usize, 0usize);
    let mut by_invariant: std::collections::BTreeMap<&str, (usize, String)> = Default::default();
    while start.elapsed().as_secs() < seconds {
        let seed = first_seed + seeds;
        for combo in &combos {
            let report = run(seed, *combo, false);
            runs += 1;
            requests += report.requests;
            effects += report.effects;
            for v in report.violations {
                let e = by_invariant.entry(v.invariant).or_insert((0, String::new()));
                if e.0 == 0 {
                    e.1 = format!("SEED={seed} COMBO={} {v}", combo.name());
                }
                e.0 += 1;
            }
        }
        seeds += 1;
    }
    println!(
        "sim-long: {seeds} seeds x {} combinations = {runs} runs, {requests} requests, {effects} upstream effects, {:.0} s",
        combos.len(),
        start.elapsed().as_secs_f64()
    );
    for (name, _) in check::INVARIANTS {
        match by_invariant.get(name) {
            Some((n, first)) => println!("  {name}: {n} runs, first: {first}"),
            None => println!("  {name}: 0"),
        }
    }
    assert!(by_invariant.is_empty());
}
