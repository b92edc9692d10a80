//! Sync benchmark: programs N services × 2 endpoints with each backend inside a fresh network
//! namespace and prints a table: full sync at 1k/10k/30k, +1 service at 10k, endpoint change at
//! 10k, and the RSS of a fresh process holding the agent's state for 10k services (tracker +
//! backend), each measurement in its own process and network namespace.
//!
//! Run as root: `cargo run --release -p switchyard-agent --bin sync-bench [-- --sizes 1000,10000,30000]`.
#![cfg_attr(not(test), warn(clippy::too_many_lines))]

use std::{
    net::Ipv4Addr,
    process::Command,
    time::{Duration, Instant},
};

use k8s_openapi::api::{core::v1::Service, discovery::v1::EndpointSlice};
use serde_json::json;
use switchyard_agent::{
    backend::{Backend, Settings, iptables::IptablesBackend, nftables::NftablesBackend},
    model::{Changes, NodeInfo, tracker::Tracker},
    sys::iptables::Variant,
};

fn service(i: usize) -> Service {
    let ip = Ipv4Addr::from(u32::from(Ipv4Addr::new(10, 96, 0, 0)) + i as u32 + 10);
    serde_json::from_value(json!({
        "metadata": {"namespace": "bench", "name": format!("svc-{i}")},
        "spec": {"clusterIP": ip.to_string(), "ports": [{"name": "http", "port": 80, "protocol": "TCP"}]},
    }))
    .unwrap_or_default()
}

fn slice(i: usize, generation: u32) -> EndpointSlice {
    let base = u32::from(Ipv4Addr::new(10, 128, 0, 0)) + (i as u32) * 4 + generation * 2;
    serde_json::from_value(json!({
        "metadata": {"namespace": "bench", "name": format!("svc-{i}-abc"), "labels": {"kubernetes.io/service-name": format!("svc-{i}")}},
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
        "endpoints": [
            {"addresses": [Ipv4Addr::from(base).to_string()], "nodeName": "node-2", "conditions": {"ready": true}},
            {"addresses": [Ipv4Addr::from(base + 1).to_string()], "nodeName": "node-3", "conditions": {"ready": true}},
        ],
    }))
    .unwrap_or_default()
}

fn settings() -> Settings {
    Settings {
        node: NodeInfo {
            name: "node-1".into(),
            addresses: vec![Ipv4Addr::new(10, 250, 0, 11).into()],
            zone: None,
        },
        cluster_cidrs: "10.128.0.0/9".parse().into_iter().collect(),
        ..Default::default()
    }
}

fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .unwrap_or_default()
        .lines()
        .find_map(|l| {
            l.strip_prefix("VmRSS:")
                .and_then(|v| v.split_whitespace().next()?.parse().ok())
        })
        .unwrap_or(0)
}

struct Netns(String);
impl Netns {
    fn new(tag: &str) -> Self {
        let name = format!("swyb{}-{tag}", std::process::id());
        let _ = Command::new("ip")
            .args(["netns", "del", &name])
            .stderr(std::process::Stdio::null())
            .status();
        let _ = Command::new("ip").args(["netns", "add", &name]).status();
        Self(name)
    }
}
impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.0]).status();
    }
}

#[derive(Clone, Copy)]
enum Kind {
    Nft,
    IptLegacy,
    IptNft,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Nft => "nftables (netlink)",
            Kind::IptLegacy => "iptables-legacy",
            Kind::IptNft => "iptables-nft",
        }
    }
    fn backend(self) -> Box<dyn Backend> {
        match self {
            Kind::Nft => Box::new(NftablesBackend::new(settings())),
            Kind::IptLegacy => Box::new(IptablesBackend::new(Variant::Legacy, settings())),
            Kind::IptNft => Box::new(IptablesBackend::new(Variant::Nft, settings())),
        }
    }
    fn arg(self) -> &'static str {
        match self {
            Kind::Nft => "nft",
            Kind::IptLegacy => "legacy",
            Kind::IptNft => "iptnft",
        }
    }
}

struct Row {
    full: Vec<(usize, Result<Duration, String>)>,
    add_one: Option<Duration>,
    endpoint_change: Option<Duration>,
    rss_mib: Option<f64>,
}

/// Runs one measurement in this process (already inside the benchmark's netns) and prints
/// `RESULT <full_ms|error> <add_ms|-> <endpoint_ms|-> <rss_kib>`.
fn child(kind: Kind, n: usize, incremental: bool) {
    let mut tracker = Tracker::new(None);
    let services: Vec<Service> = (0..n).map(service).collect();
    let slices: Vec<EndpointSlice> = (0..n).map(|i| slice(i, 0)).collect();
    tracker.reset_services(&services);
    tracker.reset_slices(&slices);
    drop((services, slices));
    let mut backend = kind.backend();
    let snapshot = tracker.snapshot();
    tracker.take_changes();
    let start = Instant::now();
    let full = backend
        .sync(&snapshot, &Changes::default(), true)
        .map(|_| start.elapsed());
    drop(snapshot);
    let full = match full {
        Ok(d) => d,
        Err(e) => {
            println!("RESULT error:{} - - 0", e.to_string().replace(' ', "_"));
            return;
        }
    };
    let ms = |d: Duration| format!("{:.3}", d.as_secs_f64() * 1000.0);
    let (mut add, mut ep) = ("-".to_owned(), "-".to_owned());
    if incremental {
        tracker.apply_service(&service(n));
        tracker.apply_slice(&slice(n, 0));
        let snapshot = tracker.snapshot();
        let changes = tracker.take_changes();
        let start = Instant::now();
        if backend.sync(&snapshot, &changes, false).is_ok() {
            add = ms(start.elapsed());
        }
        drop(snapshot);
        tracker.apply_slice(&slice(n / 2, 1));
        let snapshot = tracker.snapshot();
        let changes = tracker.take_changes();
        let start = Instant::now();
        if backend.sync(&snapshot, &changes, false).is_ok() {
            ep = ms(start.elapsed());
        }
    }
    if incremental && matches!(kind, Kind::Nft) && std::env::var_os("SWITCHYARD_BENCH_BREAKDOWN").is_some() {
        breakdown();
    }
    println!("RESULT {} {add} {ep} {}", ms(full), rss_kib());
}

/// Where incremental nftables time goes: one plain set element (no rule, no verdict) versus one
/// chain rewrite with DNAT rules, each as its own transaction on the loaded table.
fn breakdown() {
    use switchyard_agent::{
        backend::nftables::{
            encode::Batch,
            ir::{Element, Expr, Key, Rule},
        },
        model::{IpFamily, Protocol},
        sys,
    };
    // One socket for all: closing one waits for the kernel to destroy what the sync deleted.
    let mut session = sys::nft::Session::default();
    let mut time = |batch: Batch| {
        let start = Instant::now();
        let ok = matches!(session.apply(batch), Ok(Ok(())));
        (start.elapsed().as_secs_f64() * 1000.0, ok)
    };
    let mut b = Batch::new(IpFamily::V4);
    let e = Element {
        key: Key::Addr(Ipv4Addr::new(10, 99, 0, 1).into()),
        verdict: None,
        dnat: None,
        comment: None,
    };
    b.elements("cluster-ips", &[&e], true);
    eprintln!("breakdown: add one plain set element: {:?} ms", time(b));
    let mut b = Batch::new(IpFamily::V4);
    b.add_chain("bench-extra", None);
    b.add_rule(
        "bench-extra",
        &Rule::new(vec![
            Expr::L4Proto(Protocol::Tcp),
            Expr::Dnat(Ipv4Addr::new(10, 128, 0, 1).into(), 80),
        ]),
    );
    eprintln!(
        "breakdown: add one unreferenced chain with a DNAT rule: {:?} ms",
        time(b)
    );
    let mut b = Batch::new(IpFamily::V4);
    b.add_table("rules for switchyard");
    eprintln!("breakdown: empty transaction (add table): {:?} ms", time(b));
}

fn run_size(
    kind: Kind,
    n: usize,
    incremental: bool,
) -> (
    Result<Duration, String>,
    Option<Duration>,
    Option<Duration>,
    Option<f64>,
) {
    let ns = Netns::new(&format!("{n}"));
    let exe = std::env::current_exe()
        .map(|p| p.display().to_string())
        .unwrap_or_default();
    let out = Command::new("ip")
        .args([
            "netns",
            "exec",
            &ns.0,
            &exe,
            "--child",
            kind.arg(),
            &n.to_string(),
            if incremental { "1" } else { "0" },
        ])
        .output();
    let text = out
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default();
    let Some(line) = text.lines().find_map(|l| l.strip_prefix("RESULT ")) else {
        return (Err("child produced no result".into()), None, None, None);
    };
    let f: Vec<&str> = line.split_whitespace().collect();
    let dur = |s: Option<&&str>| {
        s.and_then(|v| v.parse::<f64>().ok())
            .map(|ms| Duration::from_secs_f64(ms / 1000.0))
    };
    let full = match f.first() {
        Some(v) if v.starts_with("error:") => Err(v.trim_start_matches("error:").replace('_', " ")),
        v => dur(v).ok_or_else(|| "unparsable".to_owned()),
    };
    let rss = f
        .get(3)
        .and_then(|v| v.parse::<f64>().ok())
        .map(|k| k / 1024.0)
        .filter(|_| incremental);
    (full, dur(f.get(1)), dur(f.get(2)), rss)
}

fn fmt(d: &Result<Duration, String>) -> String {
    match d {
        Ok(d) => format!("{:.3} s", d.as_secs_f64()),
        Err(e) => format!("error: {e}"),
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("--child") {
        let kind = match args.get(2).map(String::as_str) {
            Some("legacy") => Kind::IptLegacy,
            Some("iptnft") => Kind::IptNft,
            _ => Kind::Nft,
        };
        let n = args.get(3).and_then(|v| v.parse().ok()).unwrap_or(1000);
        child(kind, n, args.get(4).map(String::as_str) == Some("1"));
        return;
    }
    let sizes: Vec<usize> = args
        .iter()
        .position(|a| a == "--sizes")
        .and_then(|i| args.get(i + 1))
        .map(|s| s.split(',').filter_map(|x| x.parse().ok()).collect())
        .unwrap_or_else(|| vec![1000, 10_000, 30_000]);
    let incremental_at = if sizes.contains(&10_000) {
        10_000
    } else {
        sizes.iter().copied().max().unwrap_or(0)
    };
    println!(
        "Switchyard sync benchmark: N ClusterIP services × 2 endpoints, fresh netns per run, {} cores",
        std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1)
    );
    let mut rows = Vec::new();
    for kind in [Kind::Nft, Kind::IptLegacy, Kind::IptNft] {
        let mut row = Row {
            full: Vec::new(),
            add_one: None,
            endpoint_change: None,
            rss_mib: None,
        };
        let mut skip_rest = false;
        for &n in &sizes {
            if skip_rest {
                row.full
                    .push((n, Err("skipped (previous size took > 20 s)".into())));
                continue;
            }
            let (full, add, ep, rss) = run_size(kind, n, n == incremental_at);
            if let Ok(d) = &full {
                skip_rest = d.as_secs() > 20;
            }
            eprintln!("{} {n}: {}", kind.name(), fmt(&full));
            row.full.push((n, full));
            if n == incremental_at {
                (row.add_one, row.endpoint_change, row.rss_mib) = (add, ep, rss);
            }
        }
        rows.push((kind, row));
    }
    let header: Vec<String> = sizes.iter().map(|n| format!("full {}k", n / 1000)).collect();
    println!(
        "| backend | {} | +1 svc @{k}k | endpoint change @{k}k | RSS @{k}k |",
        header.join(" | "),
        k = incremental_at / 1000
    );
    println!("|---|{}---|---|---|", "---|".repeat(sizes.len()));
    for (kind, row) in rows {
        let full: Vec<String> = row.full.iter().map(|(_, d)| fmt(d)).collect();
        let ms = |d: Option<Duration>| {
            d.map(|d| format!("{:.1} ms", d.as_secs_f64() * 1000.0))
                .unwrap_or_else(|| "-".into())
        };
        println!(
            "| {} | {} | {} | {} | {} |",
            kind.name(),
            full.join(" | "),
            ms(row.add_one),
            ms(row.endpoint_change),
            row.rss_mib
                .map(|r| format!("{r:.1} MiB"))
                .unwrap_or_else(|| "-".into())
        );
    }
}
