//! `api-bench`: the scale benchmark through the real API (issue 16), printing markdown tables.
//!
//! ```text
//! api-bench [--rows 1k,10k,44k,5kx50] [--proxies sy-nft,sy-ipt,kp-nft,kp-ipt] [--variant nft|legacy]
//!           [--reps 3] [--samples 20] [--gap-ms 1100] [--idle-s 0] [--limit-s 3600] [--concurrency 32]
//!           [--period-ms 10] [--first-packet] [--flows 20000] [--batches 7]
//! api-bench --fleet [--nodes 5000] [--waves 10] [--concurrency 32] [--idle-s 0]
//! ```
//! Rows are `<N>[k]x<endpoints>` (endpoints default 2) or `<N>[k]x<lo>-<hi>` (Service `i` with
//! `lo + i mod (hi - lo + 1)` endpoints: every count in use); the default is the quick row `1k`.
//! `--first-packet` adds the CPU cost of a new connection's first packet to the Services with the
//! fewest and the most endpoints, before each proxy starts and with its rules
//! ([`scale::first_packet`]). Every
//! proxy runs in a fresh node namespace against one apiserver per row, the proxies interleaved
//! per repetition; cells are medians over the repetitions (each run's first-packet cells are also
//! printed, for pairing runs). After loading a row it prints the apiserver's own time to serve both
//! start-up lists ([`scale::lists`]). With `SWITCHYARD_BENCH_LOGS=<dir>` each run's proxy log is
//! copied there; with `SWITCHYARD_BENCH_RULESETS=<dir>` each run's ruleset, listed once all its
//! rules are in (for `tests/bench/ruleset_ablation.py`). Ctrl-C or SIGTERM stops it and removes what it started. Run
//! as root, with the workspace's
//! binaries built in the same profile (`cargo build --release --bins` for `--release`).

use std::{process::ExitCode, time::Duration};

use switchyard_e2e::{
    Result,
    agent::install_switchyard,
    controlplane::ControlPlane,
    kube_proxy::Mode,
    scale::{
        self, Model, Proxy, ProxyRun, RunOpts, fleet,
        lists::{self, Encoding},
    },
};

struct Args {
    rows: Vec<(usize, usize, usize)>,
    period_ms: u64,
    first_packet: Option<scale::first_packet::FlowOpts>,
    proxies: Vec<String>,
    variant: &'static str,
    reps: usize,
    samples: usize,
    gap_ms: u64,
    idle_s: u64,
    limit_s: u64,
    concurrency: usize,
    fleet: bool,
    nodes: usize,
    waves: usize,
}

fn parse_row(s: &str) -> Option<(usize, usize, usize)> {
    let (n, eps) = s.split_once('x').unwrap_or((s, "2"));
    let n = match n.strip_suffix('k') {
        Some(k) => k.parse::<usize>().ok()? * 1000,
        None => n.parse().ok()?,
    };
    let (lo, hi) = eps.split_once('-').unwrap_or((eps, eps));
    let (lo, hi) = (lo.parse().ok()?, hi.parse().ok()?);
    (n > 0 && lo > 0 && hi >= lo).then_some((n, lo, hi))
}

fn parse_args() -> std::result::Result<Args, String> {
    let mut a = Args {
        rows: vec![(1000, 2, 2)],
        period_ms: 10,
        first_packet: None,
        proxies: ["sy-nft", "sy-ipt", "kp-nft", "kp-ipt"]
            .map(String::from)
            .to_vec(),
        variant: "nft",
        reps: 1,
        samples: 20,
        gap_ms: 1100,
        idle_s: 0,
        limit_s: 3600,
        concurrency: 32,
        fleet: false,
        nodes: 5000,
        waves: 10,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        if flag == "--fleet" {
            a.fleet = true;
            continue;
        }
        if flag == "--first-packet" {
            a.first_packet.get_or_insert_with(Default::default);
            continue;
        }
        let value = it.next().ok_or(format!("{flag} needs a value"))?;
        let num = || {
            value
                .parse::<u64>()
                .map_err(|_| format!("{flag}: not a number: {value}"))
        };
        match flag.as_str() {
            "--rows" => {
                a.rows = value
                    .split(',')
                    .map(|r| parse_row(r).ok_or(format!("bad row {r}")))
                    .collect::<std::result::Result<_, _>>()?
            }
            "--proxies" => a.proxies = value.split(',').map(String::from).collect(),
            "--variant" if value == "nft" => a.variant = "nft",
            "--variant" if value == "legacy" => a.variant = "legacy",
            "--reps" => a.reps = num()? as usize,
            "--samples" => a.samples = num()? as usize,
            "--gap-ms" => a.gap_ms = num()?,
            "--idle-s" => a.idle_s = num()?,
            "--limit-s" => a.limit_s = num()?,
            "--concurrency" => a.concurrency = num()? as usize,
            "--nodes" => a.nodes = num()? as usize,
            "--waves" => a.waves = num()? as usize,
            "--period-ms" => a.period_ms = num()?.max(1),
            "--flows" => a.first_packet.get_or_insert_with(Default::default).flows = num()? as usize,
            "--batches" => a.first_packet.get_or_insert_with(Default::default).batches = num()? as usize,
            _ => return Err(format!("unknown flag {flag} {value}")),
        }
    }
    Ok(a)
}

fn proxy_of(name: &str, variant: &'static str) -> Option<Proxy> {
    Some(match name {
        "sy-nft" => Proxy::Switchyard(Mode::Nftables),
        "sy-ipt" => Proxy::Switchyard(Mode::Iptables(variant)),
        "kp-nft" => Proxy::KubeProxy(Mode::Nftables),
        "kp-ipt" => Proxy::KubeProxy(Mode::Iptables(variant)),
        _ => return None,
    })
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

/// One table line: a name and per proxy the medians of its extractors.
type Extract = fn(&ProxyRun) -> f64;

fn cell(runs: &[ProxyRun], fs: &[Extract], digits: usize) -> String {
    fs.iter()
        .map(|f| {
            let v = scale::median(&runs.iter().map(f).collect::<Vec<_>>());
            if v.is_nan() {
                "–".into()
            } else {
                format!("{v:.digits$}")
            }
        })
        .collect::<Vec<_>>()
        .join(" / ")
}

fn ratio(ours: &[ProxyRun], theirs: &[ProxyRun], fs: &[Extract]) -> String {
    fs.iter()
        .map(|f| {
            let a = scale::median(&ours.iter().map(f).collect::<Vec<_>>());
            let b = scale::median(&theirs.iter().map(f).collect::<Vec<_>>());
            if a.is_nan() || b.is_nan() || b == 0.0 {
                "–".into()
            } else {
                format!("{:.2}", a / b)
            }
        })
        .collect::<Vec<_>>()
        .join(" / ")
}

fn lines() -> Vec<(&'static str, Vec<Extract>, usize)> {
    vec![
        (
            "start → all rules in the kernel (s)",
            vec![(|r: &ProxyRun| r.to_rules.as_secs_f64()) as Extract],
            2,
        ),
        (
            "first full sync, own metric (s)",
            vec![(|r: &ProxyRun| r.first_sync.map_or(f64::NAN, |s| s.0)) as Extract],
            2,
        ),
        (
            "+1 Service (slice exists): API write → kernel p50 / p99 (ms)",
            vec![
                (|r: &ProxyRun| scale::quantile(&r.add_ms, 0.5)) as Extract,
                (|r: &ProxyRun| scale::quantile(&r.add_ms, 0.99)) as Extract,
            ],
            0,
        ),
        (
            "1 endpoint changed: API write → kernel p50 / p99 (ms)",
            vec![
                (|r: &ProxyRun| scale::quantile(&r.change_ms, 0.5)) as Extract,
                (|r: &ProxyRun| scale::quantile(&r.change_ms, 0.99)) as Extract,
            ],
            0,
        ),
        (
            "the API write's own round trip, both kinds, p50 / p99 (ms)",
            vec![
                (|r: &ProxyRun| scale::quantile(&r.write_ms, 0.5)) as Extract,
                (|r: &ProxyRun| scale::quantile(&r.write_ms, 0.99)) as Extract,
            ],
            0,
        ),
        (
            "both kinds from the write's response → kernel p50 / p99 (ms)",
            vec![
                (|r: &ProxyRun| scale::quantile(&r.after_write_ms(), 0.5)) as Extract,
                (|r: &ProxyRun| scale::quantile(&r.after_write_ms(), 0.99)) as Extract,
            ],
            0,
        ),
        (
            "+1 Service: API write → its event at a bare watcher p50 / p99 (ms)",
            vec![
                (|r: &ProxyRun| scale::quantile(r.event_ms_of(true), 0.5)) as Extract,
                (|r: &ProxyRun| scale::quantile(r.event_ms_of(true), 0.99)) as Extract,
            ],
            0,
        ),
        (
            "+1 Service: that event → kernel p50 / p99 (ms)",
            vec![
                (|r: &ProxyRun| scale::quantile(&r.after_event_ms(true), 0.5)) as Extract,
                (|r: &ProxyRun| scale::quantile(&r.after_event_ms(true), 0.99)) as Extract,
            ],
            0,
        ),
        (
            "1 endpoint changed: API write → its event at a bare watcher p50 / p99 (ms)",
            vec![
                (|r: &ProxyRun| scale::quantile(r.event_ms_of(false), 0.5)) as Extract,
                (|r: &ProxyRun| scale::quantile(r.event_ms_of(false), 0.99)) as Extract,
            ],
            0,
        ),
        (
            "1 endpoint changed: that event → kernel p50 / p99 (ms)",
            vec![
                (|r: &ProxyRun| scale::quantile(&r.after_event_ms(false), 0.5)) as Extract,
                (|r: &ProxyRun| scale::quantile(&r.after_event_ms(false), 0.99)) as Extract,
            ],
            0,
        ),
        (
            "own partial-sync metric per endpoint change (ms)",
            vec![(|r: &ProxyRun| r.partial_sync.map_or(f64::NAN, |p| p.0)) as Extract],
            1,
        ),
        (
            "CPU per endpoint change, gaps included (ms)",
            vec![(|r: &ProxyRun| r.change_cpu_ms) as Extract],
            0,
        ),
        (
            "RSS / CPU at first sync (MiB / s)",
            vec![
                (|r: &ProxyRun| r.at_sync.rss_mib) as Extract,
                (|r: &ProxyRun| r.at_sync.cpu_s) as Extract,
            ],
            1,
        ),
        (
            "of that RSS, file-backed (the executable's pages) (MiB)",
            vec![(|r: &ProxyRun| r.at_sync.rss_file_mib) as Extract],
            1,
        ),
        (
            "RSS / CPU at the end (MiB / s)",
            vec![
                (|r: &ProxyRun| r.at_end.rss_mib) as Extract,
                (|r: &ProxyRun| r.at_end.cpu_s) as Extract,
            ],
            1,
        ),
        (
            "idle CPU over the idle window (s)",
            vec![(|r: &ProxyRun| r.idle_cpu_s.unwrap_or(f64::NAN)) as Extract],
            2,
        ),
        (
            "IPv4 rules / chains / comments / set+map elements",
            vec![
                (|r: &ProxyRun| r.counts.rules as f64) as Extract,
                (|r: &ProxyRun| r.counts.chains as f64) as Extract,
                (|r: &ProxyRun| r.counts.comments as f64) as Extract,
                (|r: &ProxyRun| r.counts.elements as f64) as Extract,
            ],
            0,
        ),
        (
            "ClusterIPs / endpoints found in the kernel",
            vec![
                (|r: &ProxyRun| r.found.0.0 as f64) as Extract,
                (|r: &ProxyRun| r.found.0.1 as f64) as Extract,
            ],
            0,
        ),
        (
            "agent's log: Services listed / EndpointSlices listed / first full sync (ms)",
            vec![
                (|r: &ProxyRun| r.timeline.map_or(f64::NAN, |t| t.0)) as Extract,
                (|r: &ProxyRun| r.timeline.map_or(f64::NAN, |t| t.1)) as Extract,
                (|r: &ProxyRun| r.timeline.map_or(f64::NAN, |t| t.2)) as Extract,
            ],
            0,
        ),
        (
            "kernel check of a change / resolution of start → rules (ms)",
            vec![
                (|r: &ProxyRun| r.check_ms) as Extract,
                (|r: &ProxyRun| r.listing_cost.as_secs_f64() * 1000.0) as Extract,
            ],
            1,
        ),
    ]
}

fn eps_label(lo: usize, hi: usize) -> String {
    if lo == hi {
        lo.to_string()
    } else {
        format!("{lo}–{hi}")
    }
}

/// The first-packet table: per endpoint count, the baseline (no rules; median over every run's
/// namespace) and each proxy's cost.
fn print_first_packet(proxies: &[Proxy], runs: &[Vec<ProxyRun>]) {
    let Some(counts) = runs
        .first()
        .and_then(|r| r.first())
        .map(|r| r.first_packet.iter().map(|c| c.endpoints).collect::<Vec<_>>())
    else {
        return;
    };
    if counts.is_empty() {
        return;
    }
    let mut head = "| first packet of a new TCP flow, CPU µs per SYN | no rules |".to_owned();
    for p in proxies {
        head.push_str(&format!(" {} |", p.label()));
    }
    println!("\n{head}");
    println!("|{}", "---|".repeat(2 + proxies.len()));
    for (k, endpoints) in counts.iter().enumerate() {
        let of =
            |r: &ProxyRun, f: fn(&scale::FirstPacketCell) -> f64| r.first_packet.get(k).map_or(f64::NAN, f);
        let baseline: Vec<f64> = runs.iter().flatten().map(|r| of(r, |c| c.baseline_us)).collect();
        let mut line = format!(
            "| to a Service with {endpoints} endpoint(s) | {:.2} |",
            scale::median(&baseline)
        );
        for r in runs {
            let v: Vec<f64> = r.iter().map(|r| of(r, |c| c.with_rules_us)).collect();
            line.push_str(&format!(" {:.2} |", scale::median(&v)));
        }
        println!("{line}");
    }
    println!();
}

fn print_table(n: usize, eps: &str, proxies: &[Proxy], runs: &[Vec<ProxyRun>]) {
    let mut pairs = Vec::new();
    for (i, p) in proxies.iter().enumerate() {
        if let Proxy::Switchyard(m) = p
            && let Some(j) = proxies.iter().position(|q| *q == Proxy::KubeProxy(*m))
        {
            pairs.push((i, j, p.mode_label()));
        }
    }
    let mut head = format!("| {n} Services × {eps} endpoints |");
    for p in proxies {
        head.push_str(&format!(" {} |", p.label()));
    }
    for (_, _, m) in &pairs {
        head.push_str(&format!(" ours / kube-proxy {m} |"));
    }
    println!("\n{head}");
    println!("|{}", "---|".repeat(1 + proxies.len() + pairs.len()));
    for (name, fs, digits) in lines() {
        let mut line = format!("| {name} |");
        for r in runs {
            line.push_str(&format!(" {} |", cell(r, &fs, digits)));
        }
        for (i, j, _) in &pairs {
            line.push_str(&format!(" {} |", ratio(&runs[*i], &runs[*j], &fs)));
        }
        println!("{line}");
    }
    println!();
}

async fn bench_row(a: &Args, n: usize, (lo, hi): (usize, usize), proxies: &[Proxy]) -> Result<()> {
    let eps = eps_label(lo, hi);
    println!("## {n} Services × {eps} endpoints (load average {})", loadavg());
    let cp = ControlPlane::start().await?;
    install_switchyard(&cp)?;
    let client = cp.admin_client().await?;
    scale::warm_nodeproxy_cache(&client).await?;
    let mut model = Model::with_counts(n, lo, hi);
    let t = std::time::Instant::now();
    scale::bulk_load(&client, &model.services, a.concurrency).await?;
    println!(
        "loaded {n} Services and slices in {:.1} s",
        t.elapsed().as_secs_f64()
    );
    // What no proxy that lists before its first sync can start faster than.
    for encoding in [Encoding::Json, Encoding::Protobuf] {
        let fetches = lists::fetch_both(&client, encoding, 3).await?;
        println!(
            "the apiserver serving both lists, concurrently, bytes only, {}",
            lists::describe(encoding, &fetches)
        );
    }
    // What bounds "+1 Service" for every proxy: the create itself, at this size.
    let cost = scale::create_cost::measure(&client, a.samples).await?;
    println!("{}", cost.describe());
    let opts = RunOpts {
        samples: a.samples,
        gap: Duration::from_millis(a.gap_ms),
        limit: Duration::from_secs(a.limit_s),
        period: Duration::from_millis(a.period_ms),
        idle: Duration::from_secs(a.idle_s),
        first_packet: a.first_packet,
    };
    let mut runs: Vec<Vec<ProxyRun>> = vec![Vec::new(); proxies.len()];
    for rep in 0..a.reps {
        for (i, p) in proxies.iter().enumerate() {
            let r = match scale::run_proxy(&cp, &client, &mut model, *p, &opts).await {
                Ok(r) => r,
                Err(e) => {
                    // What the row measured so far is not lost with it.
                    println!("rep {rep} {}: failed: {e}", p.label());
                    print_table(n, &eps, proxies, &runs);
                    return Err(e);
                }
            };
            println!(
                "rep {rep} {}: rules {:.2} s, sync {:?}, add p50 {:.0} ms, change p50 {:.0} ms, RSS {:.0} MiB, CPU {:.2} s (load {})",
                p.label(),
                r.to_rules.as_secs_f64(),
                r.first_sync,
                scale::quantile(&r.add_ms, 0.5),
                scale::quantile(&r.change_ms, 0.5),
                r.at_sync.rss_mib,
                r.at_sync.cpu_s,
                loadavg()
            );
            // Each run's own first-packet cells, so runs can be paired (the table has medians).
            for c in &r.first_packet {
                println!(
                    "rep {rep} {}: first packet to {} endpoint(s): {:.3} µs with rules, {:.3} without",
                    p.label(),
                    c.endpoints,
                    c.with_rules_us,
                    c.baseline_us
                );
            }
            runs[i].push(r);
        }
    }
    print_table(n, &eps, proxies, &runs);
    print_first_packet(proxies, &runs);
    println!("(load average at the end {})", loadavg());
    Ok(())
}

fn print_fleet(r: &fleet::FleetRun) {
    println!(
        "\n| wave | nodes | wave time (s) | NodeProxy spec writes first→last (s) | operator requests | by verb and resource |"
    );
    println!("|---|---|---|---|---|---|");
    for w in &r.waves {
        let total: usize = w.requests.values().sum();
        let by: Vec<String> = w.requests.iter().map(|(k, v)| format!("{k} {v}")).collect();
        println!(
            "| {} | {} | {:.1} | {:.1} | {total} | {} |",
            w.name,
            w.nodes,
            w.duration.as_secs_f64(),
            w.writes_span.as_secs_f64(),
            by.join(", ")
        );
    }
    println!(
        "\nnodes {}: loaded in {:.1} s; rollout Ready {:.1} s after the policy's creation",
        r.nodes,
        r.load.as_secs_f64(),
        r.rollout.as_secs_f64()
    );
    println!(
        "operator before the policy: RSS {:.1} MiB, CPU {:.2} s; at Ready: RSS {:.1} MiB, CPU {:.2} s (rollout {:.2} CPU-s)",
        r.before.rss_mib,
        r.before.cpu_s,
        r.after.rss_mib,
        r.after.cpu_s,
        r.after.cpu_s - r.before.cpu_s
    );
    let total: usize = r.resync_requests.values().sum();
    let by: Vec<String> = r
        .resync_requests
        .iter()
        .map(|(k, v)| format!("{k} {v}"))
        .collect();
    println!(
        "resync (a new replica lists {} Nodes and NodeProxies and reconciles): {:.2} CPU-s, {:.1} s wall, RSS {:.1} MiB, {total} requests ({})",
        r.nodes,
        r.resync_cpu_s,
        r.resync_wall.as_secs_f64(),
        r.resync_rss_mib,
        by.join(", ")
    );
    if let Some(idle) = r.idle_cpu_s {
        println!("idle after the resync: {idle:.2} CPU-s over the idle window");
    }
}

async fn main_result(a: Args) -> Result<()> {
    println!("command: {}", std::env::args().collect::<Vec<_>>().join(" "));
    println!(
        "started {:?} (unix s); load average {} on {} CPUs",
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0),
        loadavg(),
        std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0)
    );
    if a.fleet {
        let opts = fleet::FleetOpts {
            nodes: a.nodes,
            waves: a.waves,
            concurrency: a.concurrency,
            idle: Duration::from_secs(a.idle_s),
        };
        let r = fleet::run_fleet(&opts).await?;
        print_fleet(&r);
        println!("(load average at the end {})", loadavg());
        return Ok(());
    }
    let proxies: Vec<Proxy> = a.proxies.iter().filter_map(|p| proxy_of(p, a.variant)).collect();
    for (n, lo, hi) in a.rows.clone() {
        bench_row(&a, n, (lo, hi), &proxies).await?;
    }
    Ok(())
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("api-bench: {e}");
            return ExitCode::from(2);
        }
    };
    // On Ctrl-C or SIGTERM the bench's future is dropped, and with it everything it started
    // (apiserver, etcd, proxies, node namespaces: their owners stop or remove them on drop).
    let code = tokio::select! {
        result = main_result(args) => match result {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("api-bench: {e}");
                ExitCode::FAILURE
            }
        },
        signal = stop_signal() => {
            eprintln!("api-bench: {signal}: stopping, removing what it started");
            ExitCode::from(130)
        }
    };
    switchyard_e2e::binaries::remove_pinned();
    code
}

/// Waits for Ctrl-C or SIGTERM and names it (a signal that cannot be watched never comes).
async fn stop_signal() -> &'static str {
    let interrupt = async {
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        () = interrupt => "interrupted",
        () = terminate => "terminated",
    }
}
