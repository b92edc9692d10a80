//! The scale benchmark through the real API (issue 16): N ClusterIP Services with their
//! EndpointSlices loaded into the test kube-apiserver in bulk, then one proxy at a time —
//! Switchyard's agent or the real kube-proxy, nftables or iptables mode — started in a fresh node
//! namespace and measured from the outside: start → every ClusterIP and endpoint in the kernel's
//! own listing, its sync-duration metric, RSS and CPU at that moment, and API write → kernel for a
//! new Service (its slice already there) and for one endpoint changed, the kernel polled every
//! 10 ms (or as set) with a query for the one object that must change ([`names`]): netlink
//! queries for one map element (ours) or one chain (kube-proxy's) in nftables mode, `iptables -S`
//! of the service chain in iptables mode.
//!
//! Beside each proxy a [`bare_watch::BareWatcher`] times when the apiserver delivers each timed
//! write's event to a client that does nothing else: the apiserver's share of the latency.
//!
//! [`create_cost`] times the apiserver's own Service create, with a ClusterIP and headless.
//!
//! [`fleet`] is the operator at fleet scale (thousands of Nodes and NodeProxies, played agents).
//! `src/bin/api-bench.rs` prints the tables; `tests/api_bench.rs` runs the 1k row as a smoke check.

pub mod bare_watch;
pub mod create_cost;
pub mod first_packet;
pub mod fleet;
pub mod lists;
pub mod names;
pub mod sys;

use std::{
    collections::HashSet,
    net::Ipv4Addr,
    time::{Duration, Instant},
};

use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::{core::v1::Service, discovery::v1::EndpointSlice};
use kube::{Api, Client, api::PostParams};
use serde_json::json;

use self::bare_watch::BareWatcher;
use crate::{
    Error, Result,
    agent::{self, Agent},
    controlplane::ControlPlane,
    kube_proxy::{KubeProxy, Mode},
    netns::{self, Cluster},
    objects,
};

/// The port of every benchmark Service, and its endpoints' port.
pub const PORT: u16 = 80;
/// The endpoints' (target) port.
pub const TARGET_PORT: u16 = 8080;
/// The pod CIDRs given to every proxy.
pub const CLUSTER_CIDRS: &str = "10.244.0.0/16,fd00:10:244::/56";
/// Where both proxies serve `/metrics` in the node namespace.
pub const METRICS_PORT: u16 = 10249;
/// The node name endpoints are on (no namespace node: every endpoint is remote).
const EP_NODE: &str = "remote";
/// The first ClusterIP of added Services (index into 10.96.0.0/16 past any row's N).
const ADDED_BASE: u32 = 60_000;

/// One benchmark Service: `default/<name>` port `http` 80/TCP → its endpoints' 8080.
#[derive(Debug, Clone)]
pub struct BenchSvc {
    /// Name in `default`.
    pub name: String,
    /// Its ClusterIP (set explicitly).
    pub cluster_ip: Ipv4Addr,
    /// Its endpoints (one IPv4 slice).
    pub eps: Vec<Ipv4Addr>,
}

/// What the API holds: the loaded Services and the ones added by the latency samples.
#[derive(Debug, Clone)]
pub struct Model {
    /// Loaded Services `b-0 … b-(N-1)`.
    pub services: Vec<BenchSvc>,
    /// Services added by the current run (deleted after it).
    pub added: Vec<BenchSvc>,
    next_ep: u32,
    next_added: u32,
}

fn cluster_ip(index: u32) -> Ipv4Addr {
    // 10.96.0.16 onwards: clear of 10.96.0.1 (`kubernetes`).
    Ipv4Addr::from(u32::from(Ipv4Addr::new(10, 96, 0, 16)) + index)
}

impl Model {
    /// `n` Services with `eps` endpoints each.
    pub fn new(n: usize, eps: usize) -> Self {
        Self::with_counts(n, eps, eps)
    }

    /// `n` Services, Service `i` with `lo + i mod (hi - lo + 1)` endpoints (every count in
    /// `lo..=hi` in use when `n` is large enough).
    pub fn with_counts(n: usize, lo: usize, hi: usize) -> Self {
        let span = hi.saturating_sub(lo) + 1;
        let mut m = Self {
            services: Vec::with_capacity(n),
            added: Vec::new(),
            next_ep: 0,
            next_added: 0,
        };
        for i in 0..n {
            let list = (0..lo + i % span).map(|_| m.alloc_ep()).collect();
            m.services.push(BenchSvc {
                name: format!("b-{i}"),
                cluster_ip: cluster_ip(i as u32),
                eps: list,
            });
        }
        m
    }

    /// A fresh endpoint address in 10.128.0.0/9.
    pub fn alloc_ep(&mut self) -> Ipv4Addr {
        self.next_ep += 1;
        Ipv4Addr::from(u32::from(Ipv4Addr::new(10, 128, 0, 0)) + self.next_ep)
    }

    /// A new Service `add-<k>` with 2 fresh endpoints, recorded in `added`.
    pub fn new_added(&mut self) -> BenchSvc {
        let k = self.next_added;
        self.next_added += 1;
        let eps = vec![self.alloc_ep(), self.alloc_ep()];
        let svc = BenchSvc {
            name: format!("add-{k}"),
            cluster_ip: cluster_ip(ADDED_BASE + k),
            eps,
        };
        self.added.push(svc.clone());
        svc
    }

    /// (ClusterIPs, endpoints) the kernel must hold.
    pub fn expected(&self) -> (usize, usize) {
        let all = self.services.iter().chain(&self.added);
        let (mut s, mut e) = (0, 0);
        for svc in all {
            s += 1;
            e += svc.eps.len();
        }
        (s, e)
    }
}

/// `svc`'s EndpointSlice as the endpointslice controller writes it.
fn slice_of(svc: &BenchSvc) -> Result<EndpointSlice> {
    let endpoints: Vec<_> = svc
        .eps
        .iter()
        .map(|ip| {
            json!({"addresses": [ip.to_string()], "nodeName": EP_NODE,
            "conditions": {"ready": true, "serving": true, "terminating": false}})
        })
        .collect();
    let body = json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": format!("{}-slice", svc.name), "namespace": "default",
            "labels": {"kubernetes.io/service-name": svc.name}},
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": TARGET_PORT, "protocol": "TCP"}],
        "endpoints": endpoints,
    });
    serde_json::from_value(body).map_err(|e| Error::Prerequisite(format!("slice of {}: {e}", svc.name)))
}

/// Creates `svc`'s EndpointSlice (POST, as the endpointslice controller creates one).
pub async fn put_slice(client: &Client, svc: &BenchSvc) -> Result<()> {
    let api: Api<EndpointSlice> = Api::namespaced(client.clone(), "default");
    api.create(&PostParams::default(), &slice_of(svc)?).await?;
    Ok(())
}

/// Replaces `svc`'s EndpointSlice with its endpoints now (PUT, as the endpointslice controller
/// updates one; no resourceVersion: EndpointSlices allow an unconditional update).
pub async fn update_slice(client: &Client, svc: &BenchSvc) -> Result<()> {
    let api: Api<EndpointSlice> = Api::namespaced(client.clone(), "default");
    let slice = slice_of(svc)?;
    api.replace(&format!("{}-slice", svc.name), &PostParams::default(), &slice)
        .await?;
    Ok(())
}

/// A benchmark Service `default/<name>` (port `http` 80/TCP → 8080, no selector) with
/// `cluster_ip` (an address, or `None` for a headless one).
fn bench_service(name: &str, cluster_ip: &str) -> Result<Service> {
    let body = json!({"apiVersion": "v1", "kind": "Service",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"clusterIP": cluster_ip, "ports": [
            {"name": "http", "port": PORT, "targetPort": TARGET_PORT, "protocol": "TCP"}]}});
    serde_json::from_value(body).map_err(|e| Error::Prerequisite(format!("Service {name}: {e}")))
}

/// Creates `svc`'s Service (POST; no selector: its slice is ours to write).
pub async fn put_service(client: &Client, svc: &BenchSvc) -> Result<()> {
    let service = bench_service(&svc.name, &svc.cluster_ip.to_string())?;
    let api: Api<Service> = Api::namespaced(client.clone(), "default");
    api.create(&PostParams::default(), &service).await?;
    Ok(())
}

/// Loads `services` (slice, then Service) with `concurrency` requests in flight.
pub async fn bulk_load(client: &Client, services: &[BenchSvc], concurrency: usize) -> Result<()> {
    futures::stream::iter(services)
        .map(|svc| async move {
            put_slice(client, svc).await?;
            put_service(client, svc).await
        })
        .buffer_unordered(concurrency)
        .try_collect::<Vec<()>>()
        .await?;
    Ok(())
}

/// Lists NodeProxies once, as a cluster's operator keeps doing: the apiserver builds a custom
/// resource's watch cache on the first request for it and answers 429 (`Retry-After: 1`) until
/// the cache is filled, so without this the first agent of a fresh apiserver waited a second for
/// its NodeProxy (the kube client retries after the server's delay) and every start-up row
/// carried that second. In a cluster the operator's watch has filled the cache long before.
pub async fn warm_nodeproxy_cache(client: &Client) -> Result<()> {
    let api: kube::Api<switchyard_crds::v1alpha1::NodeProxy> = kube::Api::all(client.clone());
    // resourceVersion 0: answered from the watch cache, so the answer waits until it is filled.
    api.list_metadata(&kube::api::ListParams::default().match_any())
        .await?;
    Ok(())
}

/// Deletes the Services a run added (and their slices).
pub async fn delete_added(client: &Client, model: &mut Model) -> Result<()> {
    let added = std::mem::take(&mut model.added);
    futures::stream::iter(&added)
        .map(|svc| objects::delete_service(client, &svc.name))
        .buffer_unordered(16)
        .try_collect::<Vec<()>>()
        .await?;
    Ok(())
}

/// One proxy under test.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Proxy {
    /// `switchyard-agent --mode …`.
    Switchyard(Mode),
    /// The real kube-proxy.
    KubeProxy(Mode),
}

impl Proxy {
    /// Its mode.
    pub fn mode(self) -> Mode {
        match self {
            Proxy::Switchyard(m) | Proxy::KubeProxy(m) => m,
        }
    }

    /// The mode's short name: `nft`, `ipt-nft`, `ipt-legacy`.
    pub fn mode_label(self) -> String {
        match self.mode() {
            Mode::Nftables => "nft".into(),
            Mode::Iptables(v) => format!("ipt-{v}"),
        }
    }

    /// `switchyard nft`, `kube-proxy ipt-nft`, ….
    pub fn label(self) -> String {
        let who = match self {
            Proxy::Switchyard(_) => "switchyard",
            Proxy::KubeProxy(_) => "kube-proxy",
        };
        format!("{who} {}", self.mode_label())
    }

    fn comm(self) -> &'static str {
        match self {
            // The kernel keeps 15 characters of a command name.
            Proxy::Switchyard(_) => "switchyard-agen",
            Proxy::KubeProxy(_) => "kube-proxy",
        }
    }

    fn nft_table(self) -> &'static str {
        match self {
            Proxy::Switchyard(_) => "switchyard",
            Proxy::KubeProxy(_) => "kube-proxy",
        }
    }

    fn ipt_prefix(self) -> &'static str {
        match self {
            Proxy::Switchyard(_) => "SWY",
            Proxy::KubeProxy(_) => "KUBE",
        }
    }

    /// Syncs its first full sync takes (kube-proxy syncs each IP family on its own).
    fn first_syncs(self) -> f64 {
        match self {
            Proxy::Switchyard(_) => 1.0,
            Proxy::KubeProxy(_) => 2.0,
        }
    }
}

/// A running proxy process (stopped on drop).
enum Running {
    Ours(Agent),
    Kp(KubeProxy),
}

impl Running {
    fn alive(&mut self) -> bool {
        match self {
            Running::Ours(a) => a.exit_status().is_none(),
            Running::Kp(k) => k.running(),
        }
    }

    fn log_text(&self) -> String {
        match self {
            Running::Ours(a) => a.log_text(),
            Running::Kp(k) => k.log_text(),
        }
    }

    fn log_tail(&self) -> String {
        let text = self.log_text();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(20)..].join("\n")
    }
}

/// The listing the start-up poll counts in: the proxy's IPv4 nft table, or the nat table of its
/// iptables variant (where every ClusterIP and endpoint DNAT lives).
pub fn rules_listing(proxy: Proxy, netns: &str) -> Result<String> {
    match proxy.mode() {
        Mode::Nftables => sys::in_netns(netns, &["nft", "list", "table", "ip", proxy.nft_table()]),
        Mode::Iptables(v) => sys::in_netns(netns, &[&format!("iptables-{v}-save"), "-t", "nat"]),
    }
}

/// Everything the proxy wrote for IPv4 (for the object counts): the nft table, or every table of
/// the variant's save.
pub fn full_listing(proxy: Proxy, netns: &str) -> Result<String> {
    match proxy.mode() {
        Mode::Nftables => rules_listing(proxy, netns),
        Mode::Iptables(v) => sys::in_netns(netns, &[&format!("iptables-{v}-save")]),
    }
}

/// Every IPv4 address written in `text` (`10.96.0.5`, `10.128.0.1/32`, `…__10.128.0.1/8080`).
fn ipv4_tokens(text: &str) -> HashSet<u32> {
    text.split(|c: char| !(c.is_ascii_digit() || c == '.'))
        .filter(|t| t.len() >= 7)
        .filter_map(|t| t.trim_matches('.').parse::<Ipv4Addr>().ok())
        .map(u32::from)
        .collect()
}

/// (ClusterIPs, endpoints) of `model` that `listing` names.
pub fn coverage(listing: &str, model: &Model) -> (usize, usize) {
    let seen = ipv4_tokens(listing);
    let (mut s, mut e) = (0, 0);
    for svc in model.services.iter().chain(&model.added) {
        s += usize::from(seen.contains(&u32::from(svc.cluster_ip)));
        e += svc
            .eps
            .iter()
            .filter(|ip| seen.contains(&u32::from(**ip)))
            .count();
    }
    (s, e)
}

/// Kernel objects in a listing.
#[derive(Debug, Clone, Copy, Default)]
pub struct Counts {
    /// Rules (`-A` lines; nft statements inside chains).
    pub rules: usize,
    /// Chains.
    pub chains: usize,
    /// Comments (`--comment`, nft `comment "…"`).
    pub comments: usize,
    /// nft set and map elements (0 for iptables).
    pub elements: usize,
}

/// Counts the objects of an `iptables-save` or `nft list` text.
pub fn count_objects(listing: &str, mode: Mode) -> Counts {
    let mut c = Counts::default();
    if let Mode::Iptables(_) = mode {
        for line in listing.lines() {
            c.rules += usize::from(line.starts_with("-A "));
            c.chains += usize::from(line.starts_with(':'));
            c.comments += line.matches("--comment").count();
        }
        return c;
    }
    let (mut in_chain, mut in_elements) = (false, false);
    for line in listing.lines().map(str::trim) {
        c.comments += line.matches("comment \"").count();
        if in_elements {
            c.elements += line.matches(',').count();
            if line.ends_with('}') {
                c.elements += 1;
                in_elements = false;
            }
        } else if line.starts_with("elements = {") {
            c.elements += line.matches(',').count();
            if line.ends_with('}') {
                c.elements += 1;
            } else {
                in_elements = true;
            }
        } else if line.starts_with("chain ") {
            c.chains += 1;
            in_chain = true;
        } else if line == "}" {
            in_chain = false;
        } else if in_chain
            && !line.is_empty()
            && !line.starts_with("type ")
            && !line.starts_with("comment ")
            && !line.starts_with("policy ")
        {
            c.rules += 1;
        }
    }
    c
}

/// Whether the kernel serves `svc` with each of `eps` (one cheap query, not a listing): our nft
/// endpoint-map elements of the ClusterIP; kube-proxy's nft service chain (its endpoint map); the
/// iptables service chain's jumps to the endpoints' `SEP` chains (one iptables-restore commits both).
pub fn programmed(proxy: Proxy, netns: &str, svc: &BenchSvc, eps: &[Ipv4Addr]) -> bool {
    let listing = match (proxy, proxy.mode()) {
        (Proxy::Switchyard(_), Mode::Nftables) => return switchyard_nft_programmed(netns, svc, eps),
        (Proxy::KubeProxy(_), Mode::Nftables) => return kube_proxy_nft_programmed(netns, svc, eps),
        (_, Mode::Iptables(v)) => {
            let chain = names::ipt_service_chain(proxy.ipt_prefix(), &svc.name);
            let tool = format!("iptables-{v}");
            sys::in_netns(netns, &[&tool, "-w", "5", "-t", "nat", "-S", &chain])
        }
    };
    let Ok(text) = listing else { return false };
    eps.iter().all(|ip| {
        text.contains(&names::ipt_endpoint_chain(
            proxy.ipt_prefix(),
            &svc.name,
            *ip,
            TARGET_PORT,
        ))
    })
}

/// Whether kube-proxy's nft service chain of `svc` DNATs to each of `eps`: v1.37 DNATs in the
/// service chain, inline for one endpoint (`dnat to ip:port`), else through an anonymous
/// `numgen random mod N map { 0 : ip . port, … }` replaced with the chain's rule in one
/// transaction. A rule dump of that chain and an element dump of its maps (netlink, no `nft`
/// command) find the targets. With a chain per endpoint (affinity, not benchmarked) this would
/// not find them.
fn kube_proxy_nft_programmed(netns: &str, svc: &BenchSvc, eps: &[Ipv4Addr]) -> bool {
    use switchyard_agent::sys::nft::{codec::dnat_value_bytes, other_chain_bytes};
    const NFPROTO_IPV4: u8 = 2;
    let chain = names::nft_service_chain(&svc.name);
    let found = sys::in_netns_thread(netns, || {
        other_chain_bytes(NFPROTO_IPV4, "kube-proxy", &chain)
            .map_err(|e| Error::Prerequisite(format!("dump {chain}: {e}")))
    });
    let Ok(Some(chain)) = found else { return false };
    let has = |bytes: &[u8], needle: &[u8]| bytes.windows(needle.len()).any(|w| w == needle);
    eps.iter().all(|ip| {
        let value = dnat_value_bytes(&(*ip).into(), TARGET_PORT);
        chain.elements.iter().any(|e| has(e, &value))
            || chain
                .rules
                .iter()
                .any(|r| has(r, &ip.octets()) && has(r, &TARGET_PORT.to_be_bytes()))
    })
}

/// Whether Switchyard's nft endpoint map holds every slot of `svc` with exactly the targets `eps`
/// (one netlink element query: as cheap at 44k Services as at 1k, unlike any `nft` command, which
/// reads the whole table first).
fn switchyard_nft_programmed(netns: &str, svc: &BenchSvc, eps: &[Ipv4Addr]) -> bool {
    use switchyard_agent::{
        model::Protocol,
        sys::nft::{
            codec::dnat_value_bytes,
            ir::{Key, Slot},
        },
    };
    let count = svc.eps.len() as u32;
    let keys: Vec<Key> = (0..count)
        .map(|index| {
            Key::AddrProtoPortSlot(svc.cluster_ip.into(), Protocol::Tcp, PORT, Slot { index, count })
        })
        .collect();
    let map = format!("ip-endpoints-{count}");
    let Ok(Some(answers)) = sys::nft_elements_in_netns(netns, &map, &keys) else {
        return false;
    };
    eps.iter().all(|ip| {
        let value = dnat_value_bytes(&(*ip).into(), TARGET_PORT);
        answers.iter().any(|a| a.windows(value.len()).any(|w| w == value))
    })
}

/// One successful poll.
#[derive(Debug, Clone, Copy)]
pub struct Polled {
    /// From `since` to the end of the check that succeeded.
    pub after: Duration,
    /// Checks made.
    pub checks: u32,
    /// Total time spent in checks.
    pub spent: Duration,
}

/// Runs `check` every `period` (back to back when a check takes longer) until it is true, for
/// at most `limit` after `since`. Blocking: call it through `block_in_place`.
pub fn poll_until(
    since: Instant,
    limit: Duration,
    period: Duration,
    mut check: impl FnMut() -> bool,
) -> Option<Polled> {
    let (mut checks, mut spent) = (0, Duration::ZERO);
    loop {
        let t = Instant::now();
        let ok = check();
        spent += t.elapsed();
        checks += 1;
        if ok {
            return Some(Polled {
                after: since.elapsed(),
                checks,
                spent,
            });
        }
        if since.elapsed() > limit {
            return None;
        }
        std::thread::sleep(period.saturating_sub(t.elapsed()));
    }
}

/// Options of one proxy run.
#[derive(Debug, Clone)]
pub struct RunOpts {
    /// Latency samples of each kind (≥ 20 for the benchmark).
    pub samples: usize,
    /// Pause before each timed write (past both proxies' 1 s minimum sync period).
    pub gap: Duration,
    /// Bound of the start-up (all rules in the kernel).
    pub limit: Duration,
    /// Kernel poll period of the latency samples.
    pub period: Duration,
    /// Seconds of idle CPU to measure after the samples (0: none).
    pub idle: Duration,
    /// Measure the first-packet cost (before the proxy starts and after all rules are in).
    pub first_packet: Option<first_packet::FlowOpts>,
}

/// The first-packet cost of new flows to the Services with one endpoint count.
#[derive(Debug, Clone, Copy)]
pub struct FirstPacketCell {
    /// The endpoint count of the Services targeted.
    pub endpoints: usize,
    /// µs of CPU per new flow in the node namespace before the proxy started (no rules).
    pub baseline_us: f64,
    /// µs of CPU per new flow with the proxy's rules.
    pub with_rules_us: f64,
}

/// What one run of one proxy measured.
#[derive(Debug, Clone)]
pub struct ProxyRun {
    /// The proxy.
    pub proxy: Proxy,
    /// Process start → every ClusterIP and endpoint in the kernel's listing.
    pub to_rules: Duration,
    /// The resolution of `to_rules` (see [`await_all_rules`]).
    pub listing_cost: Duration,
    /// Our agent's own start-up timeline ([`agent_timeline`]); None for kube-proxy.
    pub timeline: Option<(f64, f64, f64)>,
    /// The first full sync(s) by its own metric: (seconds, syncs counted).
    pub first_sync: Option<(f64, f64)>,
    /// Usage when every rule was seen.
    pub at_sync: sys::Usage,
    /// +1 Service (slice exists): API write → kernel, ms.
    pub add_ms: Vec<f64>,
    /// One endpoint changed: API write → kernel, ms.
    pub change_ms: Vec<f64>,
    /// CPU ms per endpoint change (the phase's CPU over its changes, gaps included).
    pub change_cpu_ms: f64,
    /// Mean of its own partial-sync metric over the endpoint-change phase, ms, and the syncs.
    pub partial_sync: Option<(f64, f64)>,
    /// Mean cost of one latency check, ms.
    pub check_ms: f64,
    /// The round trip of each timed API write (its part of the API write → kernel latency), ms.
    pub write_ms: Vec<f64>,
    /// Per timed write (as `write_ms`), ms from the write to its event at a bare watcher.
    pub event_ms: Vec<f64>,
    /// Objects in the kernel after the first sync.
    pub counts: Counts,
    /// (ClusterIPs, endpoints) found and expected at start-up.
    pub found: ((usize, usize), (usize, usize)),
    /// Usage at the end.
    pub at_end: sys::Usage,
    /// CPU seconds over the idle window, if measured.
    pub idle_cpu_s: Option<f64>,
    /// First-packet cost per endpoint count measured (fewest and most endpoints).
    pub first_packet: Vec<FirstPacketCell>,
}

impl ProxyRun {
    /// Per latency sample (new Services, then endpoint changes), the time from the API write's
    /// response to the kernel, ms (0 when the kernel had it first): the proxy's part and the
    /// check's, without the apiserver's own write latency, which both proxies pay alike.
    pub fn after_write_ms(&self) -> Vec<f64> {
        self.add_ms
            .iter()
            .chain(&self.change_ms)
            .zip(&self.write_ms)
            .map(|(total, write)| (total - write).max(0.0))
            .collect()
    }

    /// The bare watcher's event times of the new Services (`adds`) or the endpoint changes, ms.
    pub fn event_ms_of(&self, adds: bool) -> &[f64] {
        let n = self.add_ms.len().min(self.event_ms.len());
        if adds {
            &self.event_ms[..n]
        } else {
            &self.event_ms[n..]
        }
    }

    /// Per new Service (`adds`) or endpoint change, the kernel's time minus the bare watcher's
    /// event's, ms: the proxy's own share (negative when its watch was served first).
    pub fn after_event_ms(&self, adds: bool) -> Vec<f64> {
        let kernel = if adds { &self.add_ms } else { &self.change_ms };
        kernel
            .iter()
            .zip(self.event_ms_of(adds))
            .map(|(total, event)| total - event)
            .collect()
    }
}

/// Up to 256 Services with the fewest and with the most endpoints of the row: (count, ClusterIPs).
fn first_packet_targets(model: &Model) -> Vec<(usize, Vec<Ipv4Addr>)> {
    let counts = model.services.iter().map(|s| s.eps.len());
    let (Some(lo), Some(hi)) = (counts.clone().min(), counts.max()) else {
        return Vec::new();
    };
    let mut wanted = vec![lo];
    if hi != lo {
        wanted.push(hi);
    }
    wanted
        .into_iter()
        .map(|k| {
            let ips = model
                .services
                .iter()
                .filter(|s| s.eps.len() == k)
                .take(256)
                .map(|s| s.cluster_ip)
                .collect();
            (k, ips)
        })
        .collect()
}

/// Pairs the costs before and with the rules, checking that the benchmark's packets met no rules
/// before and were all DNATed with them (or the numbers would not be of the ruleset).
fn first_packet_cells(
    proxy: Proxy,
    baseline: &[(usize, first_packet::FlowCost)],
    with_rules: &[(usize, first_packet::FlowCost)],
    flows: usize,
) -> Result<Vec<FirstPacketCell>> {
    baseline
        .iter()
        .zip(with_rules)
        .map(|(&(endpoints, before), &(_, with))| {
            if before.dnated != 0 || with.dnated != flows {
                return Err(Error::Prerequisite(format!(
                    "{}: first-packet flows to {endpoints}-endpoint Services DNATed {} of {flows} \
                     without rules and {} with them",
                    proxy.label(),
                    before.dnated,
                    with.dnated
                )));
            }
            Ok(FirstPacketCell {
                endpoints,
                baseline_us: before.us_per_flow,
                with_rules_us: with.us_per_flow,
            })
        })
        .collect()
}

/// The first-packet cost to each target group in `netns` from `src`.
fn first_packet_costs(
    netns: &str,
    src: Ipv4Addr,
    targets: &[(usize, Vec<Ipv4Addr>)],
    opts: first_packet::FlowOpts,
) -> Result<Vec<(usize, first_packet::FlowCost)>> {
    targets
        .iter()
        .map(|(k, ips)| {
            let cost = first_packet::cost_per_flow(netns, src, ips, PORT, opts)?;
            Ok((*k, cost))
        })
        .collect()
}

/// Starts `proxy` on `node` (Node object and agent Pod created on the first run of a control
/// plane, reused after).
async fn start_proxy(cp: &ControlPlane, node: &netns::Node, proxy: Proxy) -> Result<Running> {
    match proxy {
        Proxy::Switchyard(mode) => {
            let token = match agent::agent_token(cp, &node.name).await {
                Ok(t) => t,
                Err(_) => agent::node_token(cp, &node.name).await?,
            };
            let _ = std::fs::remove_dir_all(cp.dir().join(format!("state-{}", node.name)));
            let args = ["--mode", mode.name(), "--cluster-cidr", CLUSTER_CIDRS];
            Ok(Running::Ours(Agent::start(cp, node, &token, &args)?))
        }
        Proxy::KubeProxy(mode) => Ok(Running::Kp(KubeProxy::start(cp, node, mode, CLUSTER_CIDRS)?)),
    }
}

/// kubelet's iptables chains in `variant` (both families), as on a real node: they steer
/// Switchyard's (iptables-wrapper's) choice of variant.
fn play_kubelet(netns: &str, variant: &str) -> Result<()> {
    for tool in ["iptables", "ip6tables"] {
        for (table, chain) in [
            ("mangle", "KUBE-IPTABLES-HINT"),
            ("mangle", "KUBE-KUBELET-CANARY"),
            ("filter", "KUBE-FIREWALL"),
        ] {
            sys::in_netns(
                netns,
                &[&format!("{tool}-{variant}"), "-w", "5", "-t", table, "-N", chain],
            )?;
        }
    }
    Ok(())
}

/// Start-up: polls the kernel until its listing names every ClusterIP and endpoint of `model`.
/// Returns (time from `t0`, the time's resolution, usage then, pid).
///
/// With nf_tables underneath (nftables mode, iptables-nft) a thread polls the ruleset generation
/// every 2 ms and the table is listed once per new generation: the time is when the generation
/// whose listing is complete was first seen (a listing across a commit is repeated), and its
/// resolution the poll's gap then, not a listing's cost (seconds at 250k endpoints). The kernel
/// bumps the generation when a commit starts applying what its messages staged (activating the
/// staged objects: the short last step of a transaction), so the time is that step's start. With
/// iptables-legacy there is no generation: the time is the end of the first complete listing and
/// its resolution that listing's cost.
fn await_all_rules(
    proxy: Proxy,
    netns: &str,
    running: &mut Running,
    model: &Model,
    t0: Instant,
    limit: Duration,
) -> Result<(Duration, Duration, sys::Usage, u32)> {
    if !matches!(proxy.mode(), Mode::Nftables | Mode::Iptables("nft")) {
        return await_listing(proxy, netns, running, model, t0, limit, |_| None);
    }
    let generations = sys::Generations::default();
    std::thread::scope(|s| {
        let poller =
            s.spawn(|| sys::poll_generations(netns, &generations, t0, Duration::from_millis(2), limit));
        let mut listed: Option<(u32, Instant)> = None;
        let found = await_listing(proxy, netns, running, model, t0, limit, |listing| {
            // Listed once per generation (again after 2 s: the kernel bumps the generation as a
            // commit starts applying, so a listing right then may miss what it is activating),
            // and counted only if no commit came during the listing.
            let Some((generation, at, poll_before)) = generations.latest() else {
                return Some(None);
            };
            if listed.is_some_and(|(g, when)| g == generation && when.elapsed() < Duration::from_secs(2)) {
                return Some(None);
            }
            let Some(text) = listing() else {
                // No table yet: it can only come with a new generation, so this one is not
                // listed again (a failed listing every 10 ms ran two processes each time, 0.4
                // of a core taken from the proxy being timed on 2 cores).
                listed = Some((generation, Instant::now()));
                return Some(None);
            };
            if generations.latest().map(|g| g.0) != Some(generation) {
                return Some(None);
            }
            listed = Some((generation, Instant::now()));
            Some(Some((text, at, at - poll_before)))
        });
        generations.stop();
        let polled = poller
            .join()
            .map_err(|_| Error::Prerequisite("generation poller panicked".into()))?;
        polled.and(found)
    })
}

/// A listing made through [`await_all_rules`]'s generation check: None to list the usual way,
/// Some(None) for nothing new to list, Some(Some((listing, at, resolution))) for a listing of one
/// generation first seen at `at`.
type Listed = Option<Option<(String, Duration, Duration)>>;

/// The start-up poll itself; `gate` may take over each listing (see [`Listed`]).
fn await_listing(
    proxy: Proxy,
    netns: &str,
    running: &mut Running,
    model: &Model,
    t0: Instant,
    limit: Duration,
    mut gate: impl FnMut(&dyn Fn() -> Option<String>) -> Listed,
) -> Result<(Duration, Duration, sys::Usage, u32)> {
    let want = model.expected();
    let mut pid = None;
    let mut last = (0, 0);
    loop {
        if pid.is_none() {
            pid = sys::pid_in_netns(netns, proxy.comm())?;
        }
        let t = Instant::now();
        let list = || rules_listing(proxy, netns).ok();
        // A whole listing per poll: every 100 ms at most, so that the poll does not crowd the
        // proxy it times; the generation check is cheap and polls every 10 ms.
        let (listed, period) = match gate(&list) {
            None => (list().map(|text| (text, None)), 100),
            Some(None) => (None, 10),
            Some(Some((text, at, resolution))) => (Some((text, Some((at, resolution)))), 10),
        };
        if let Some((text, timed)) = listed {
            last = coverage(&text, model);
            if last == want
                && let Some(pid) = pid
            {
                let (at, resolution) = timed.unwrap_or_else(|| (t0.elapsed(), t.elapsed()));
                return Ok((at, resolution, sys::usage(pid)?, pid));
            }
        }
        if !running.alive() {
            return Err(Error::Prerequisite(format!(
                "{} exited during start-up; log:\n{}",
                proxy.label(),
                running.log_tail()
            )));
        }
        if t0.elapsed() > limit {
            return Err(Error::Timeout(
                limit,
                format!("{}: all rules (found {last:?} of {want:?})", proxy.label()),
            ));
        }
        std::thread::sleep(Duration::from_millis(period).saturating_sub(t.elapsed()));
    }
}

/// Its own full-sync metric once the first full sync of each family is counted (kube-proxy's
/// second family may never come: 15 s after the first count, that count is taken).
async fn first_sync_metric(proxy: Proxy, netns: &str) -> Option<(f64, f64)> {
    let start = Instant::now();
    let mut first: Option<(Instant, (f64, f64))> = None;
    while start.elapsed() < Duration::from_secs(120) {
        let seen = sys::metrics_in_netns(netns, METRICS_PORT).ok().and_then(|text| {
            sys::histogram(&text, "kubeproxy_sync_full_proxy_rules_duration_seconds")
                .or_else(|| sys::histogram(&text, "kubeproxy_sync_proxy_rules_duration_seconds"))
        });
        if let Some(h) = seen.filter(|h| h.1 >= 1.0) {
            let since = first.get_or_insert((Instant::now(), h)).0;
            if h.1 >= proxy.first_syncs() || since.elapsed() > Duration::from_secs(15) {
                return Some(h);
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    first.map(|f| f.1)
}

/// Its partial-sync histogram now (sum s, count), or the whole sync histogram's.
fn partial_metric(netns: &str) -> Option<(f64, f64)> {
    let text = sys::metrics_in_netns(netns, METRICS_PORT).ok()?;
    sys::histogram(&text, "kubeproxy_sync_partial_proxy_rules_duration_seconds")
        .or_else(|| sys::histogram(&text, "kubeproxy_sync_proxy_rules_duration_seconds"))
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// What the latency samples spent outside the proxies: kernel checks and the API writes.
#[derive(Debug, Default)]
struct Spent {
    /// Kernel checks made.
    checks: u32,
    /// Time spent in them.
    checking: Duration,
    /// Each timed API write's own round trip, ms.
    writes_ms: Vec<f64>,
    /// Each timed write's event at the bare watcher, ms after the write began.
    events_ms: Vec<f64>,
}

/// The bare watcher's wait for one timed write's event (it is normally there already).
const EVENT_LIMIT: Duration = Duration::from_secs(60);

/// Waits until `programmed(svc, eps)`, polling every `period`; ms from `since`.
fn await_change(
    proxy: Proxy,
    netns: &str,
    svc: &BenchSvc,
    eps: &[Ipv4Addr],
    since: Instant,
    period: Duration,
    spent: &mut Spent,
) -> Result<f64> {
    let limit = Duration::from_secs(120);
    let polled = tokio::task::block_in_place(|| {
        poll_until(since, limit, period, || programmed(proxy, netns, svc, eps))
    })
    .ok_or_else(|| {
        Error::Timeout(
            limit,
            format!("{}: {} with {eps:?} in the kernel", proxy.label(), svc.name),
        )
    })?;
    spent.checks += polled.checks;
    spent.checking += polled.spent;
    Ok(ms(polled.after))
}

/// `samples` new Services (slice first, then after `gap` the Service: the timed write).
async fn sample_adds(
    client: &Client,
    proxy: Proxy,
    netns: &str,
    model: &mut Model,
    opts: &RunOpts,
    spent: &mut Spent,
    bare: &mut BareWatcher,
) -> Result<Vec<f64>> {
    let mut out = Vec::with_capacity(opts.samples);
    for _ in 0..opts.samples {
        let svc = model.new_added();
        put_slice(client, &svc).await?;
        tokio::time::sleep(opts.gap).await;
        let t = Instant::now();
        put_service(client, &svc).await?;
        spent.writes_ms.push(ms(t.elapsed()));
        out.push(await_change(proxy, netns, &svc, &svc.eps, t, opts.period, spent)?);
        let event = bare
            .await_event(t, EVENT_LIMIT, &svc.name, |s| {
                s.kind == "Service" && s.name == svc.name
            })
            .await?;
        spent.events_ms.push(event);
    }
    Ok(out)
}

/// `samples` endpoint changes: the last endpoint of a Service spread over the row is replaced.
async fn sample_changes(
    client: &Client,
    proxy: Proxy,
    netns: &str,
    model: &mut Model,
    opts: &RunOpts,
    spent: &mut Spent,
    bare: &mut BareWatcher,
) -> Result<Vec<f64>> {
    let mut out = Vec::with_capacity(opts.samples);
    let n = model.services.len();
    for k in 0..opts.samples {
        let j = (k * 7919 + 13) % n;
        let new = model.alloc_ep();
        if let Some(last) = model.services[j].eps.last_mut() {
            *last = new;
        }
        let svc = model.services[j].clone();
        tokio::time::sleep(opts.gap).await;
        let t = Instant::now();
        update_slice(client, &svc).await?;
        spent.writes_ms.push(ms(t.elapsed()));
        out.push(await_change(proxy, netns, &svc, &[new], t, opts.period, spent)?);
        let (slice, address) = (format!("{}-slice", svc.name), new.to_string());
        let event = bare
            .await_event(t, EVENT_LIMIT, &slice, |s| {
                s.kind == "EndpointSlice" && s.name == slice && s.addresses.contains(&address)
            })
            .await?;
        spent.events_ms.push(event);
    }
    Ok(out)
}

/// Runs `proxy` once in a fresh node namespace against the loaded API and measures it.
pub async fn run_proxy(
    cp: &ControlPlane,
    client: &Client,
    model: &mut Model,
    proxy: Proxy,
    opts: &RunOpts,
) -> Result<ProxyRun> {
    let cluster = Cluster::create(1, 0, cp.port)?;
    let node = cluster.nodes[0].clone();
    let _ = agent::create_node(cp, &node).await;
    if let Mode::Iptables(v) = proxy.mode() {
        play_kubelet(&node.netns, v)?;
    }
    let targets = first_packet_targets(model);
    let baseline = match opts.first_packet {
        Some(fp) => {
            first_packet::install_sink(&node.netns)?;
            tokio::task::block_in_place(|| first_packet_costs(&node.netns, node.ip, &targets, fp))?
        }
        None => Vec::new(),
    };
    let t0 = Instant::now();
    let mut running = start_proxy(cp, &node, proxy).await?;
    let (to_rules, listing_cost, at_sync, pid) = tokio::task::block_in_place(|| {
        await_all_rules(proxy, &node.netns, &mut running, model, t0, opts.limit)
    })?;
    let first_sync = first_sync_metric(proxy, &node.netns).await;
    let listing = full_listing(proxy, &node.netns)?;
    keep_ruleset(&listing, proxy, model.services.len());
    let counts = count_objects(&listing, proxy.mode());
    let found = (
        coverage(&rules_listing(proxy, &node.netns)?, model),
        model.expected(),
    );
    let probe = &model.services[0];
    // Polled, not asked once: a proxy may hold the xtables lock past the check's wait (kube-proxy
    // restoring 44k Services with iptables-legacy), which reads as not found.
    let probed = tokio::task::block_in_place(|| {
        poll_until(
            Instant::now(),
            Duration::from_secs(300),
            Duration::from_millis(200),
            || programmed(proxy, &node.netns, probe, &probe.eps),
        )
    });
    if probed.is_none() {
        // The lines naming it, each with the two lines after it (a chain's rules).
        let lines: Vec<&str> = listing.lines().collect();
        let named: Vec<String> = lines
            .iter()
            .enumerate()
            .filter(|(_, l)| {
                l.contains(&format!("/{}/", probe.name)) || l.contains(&format!("/{}:", probe.name))
            })
            .take(4)
            .flat_map(|(i, _)| lines[i..(i + 3).min(lines.len())].iter().map(|l| (*l).to_owned()))
            .collect();
        return Err(Error::Prerequisite(format!(
            "{}: the kernel query for {} ({:?}) does not find it although every rule is listed; the \
             listing names it in:\n{}",
            proxy.label(),
            probe.name,
            probe.eps,
            named.join("\n")
        )));
    }
    let first_packet = match opts.first_packet {
        Some(fp) => {
            let with_rules =
                tokio::task::block_in_place(|| first_packet_costs(&node.netns, node.ip, &targets, fp))?;
            first_packet_cells(proxy, &baseline, &with_rules, fp.flows)?
        }
        None => Vec::new(),
    };
    let mut spent = Spent::default();
    let mut bare = BareWatcher::start(client).await?;
    let add_ms = sample_adds(client, proxy, &node.netns, model, opts, &mut spent, &mut bare).await?;
    let (before, partial0) = (sys::usage(pid)?, partial_metric(&node.netns));
    let change_ms = sample_changes(client, proxy, &node.netns, model, opts, &mut spent, &mut bare).await?;
    drop(bare);
    let (after, partial1) = (sys::usage(pid)?, partial_metric(&node.netns));
    let idle_cpu_s = if opts.idle.is_zero() {
        None
    } else {
        tokio::time::sleep(opts.idle).await;
        Some(sys::usage(pid)?.cpu_s - after.cpu_s)
    };
    let at_end = sys::usage(pid)?;
    let partial_sync = match (partial0, partial1) {
        (Some((s0, c0)), Some((s1, c1))) if c1 > c0 => Some(((s1 - s0) / (c1 - c0) * 1000.0, c1 - c0)),
        _ => None,
    };
    let timeline = match &running {
        Running::Ours(agent) => agent_timeline(&agent.log_text()),
        Running::Kp(_) => None,
    };
    keep_log(&running, proxy);
    drop(running);
    drop(cluster);
    delete_added(client, model).await?;
    Ok(ProxyRun {
        proxy,
        to_rules,
        listing_cost,
        first_sync,
        at_sync,
        change_cpu_ms: (after.cpu_s - before.cpu_s) * 1000.0 / opts.samples.max(1) as f64,
        add_ms,
        change_ms,
        partial_sync,
        check_ms: ms(spent.checking) / f64::from(spent.checks.max(1)),
        write_ms: spent.writes_ms,
        event_ms: spent.events_ms,
        counts,
        found,
        at_end,
        idle_cpu_s,
        first_packet,
        timeline,
    })
}

/// Names the directory where each run's proxy log is copied (for reading a start-up's timeline
/// afterwards); unset, logs go with the control plane's directory.
pub const KEEP_LOGS_ENV: &str = "SWITCHYARD_BENCH_LOGS";

/// Copies the proxy's log to [`KEEP_LOGS_ENV`]'s directory, as `<label>-<unix ms>.log`; a
/// failure to copy is printed and the run goes on (the log is a by-product, not a measurement).
fn keep_log(running: &Running, proxy: Proxy) {
    let Some(dir) = std::env::var_os(KEEP_LOGS_ENV) else {
        return;
    };
    let text = running.log_text();
    let stamp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis());
    let path = std::path::Path::new(&dir).join(format!("{}-{stamp}.log", proxy.label().replace(' ', "-")));
    if let Err(e) = std::fs::create_dir_all(&dir).and_then(|()| std::fs::write(&path, text)) {
        eprintln!("keeping the proxy's log at {}: {e}", path.display());
    }
}

/// Names the directory where each run's ruleset is written once all its rules are in (for
/// `tests/bench/ruleset_ablation.py`): taken then, no listing competes with the start-up timed.
pub const KEEP_RULESETS_ENV: &str = "SWITCHYARD_BENCH_RULESETS";

/// Writes `listing` (the proxy's IPv4 table or save) to [`KEEP_RULESETS_ENV`]'s directory as
/// `<label>-<services>.nft` (`.save` for iptables); a failure is printed and the run goes on.
fn keep_ruleset(listing: &str, proxy: Proxy, services: usize) {
    let Some(dir) = std::env::var_os(KEEP_RULESETS_ENV) else {
        return;
    };
    let ext = match proxy.mode() {
        Mode::Nftables => "nft",
        Mode::Iptables(_) => "save",
    };
    let path =
        std::path::Path::new(&dir).join(format!("{}-{services}.{ext}", proxy.label().replace(' ', "-")));
    if let Err(e) = std::fs::create_dir_all(&dir).and_then(|()| std::fs::write(&path, listing)) {
        eprintln!("keeping the proxy's ruleset at {}: {e}", path.display());
    }
}

/// Our agent's start-up by its own log: (Services listed, EndpointSlices listed, first full sync),
/// milliseconds each (the two lists run side by side). A node's log is appended to by each agent
/// started there: only the last start's lines count (from its "agent starting" line on).
pub fn agent_timeline(log: &str) -> Option<(f64, f64, f64)> {
    let log = crate::logs::without_ansi(log);
    let log = match log.rfind(" agent starting") {
        Some(at) => &log[log[..at].rfind('\n').map_or(0, |n| n + 1)..],
        None => &log[..],
    };
    let millis = |pick: &dyn Fn(&str) -> bool| {
        log.lines().find(|l| pick(l)).and_then(|l| {
            let at = l.find(" millis=")? + " millis=".len();
            l[at..]
                .split(|c: char| !c.is_ascii_digit())
                .next()?
                .parse::<f64>()
                .ok()
        })
    };
    Some((
        millis(&|l| l.contains(" listed ") && l.contains("watch=\"service\""))?,
        millis(&|l| l.contains(" listed ") && l.contains("watch=\"endpointslice\""))?,
        millis(&|l| l.contains(" full sync "))?,
    ))
}

/// The `p`-quantile (0..=1, nearest rank) of `v`; NaN for none.
pub fn quantile(v: &[f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let rank = ((p * s.len() as f64).ceil() as usize).clamp(1, s.len());
    s[rank - 1]
}

/// The median of `v` (the middle one of 3); NaN for none.
pub fn median(v: &[f64]) -> f64 {
    let mut s: Vec<f64> = v.iter().copied().filter(|x| !x.is_nan()).collect();
    if s.is_empty() {
        return f64::NAN;
    }
    s.sort_by(f64::total_cmp);
    s[(s.len() - 1) / 2]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_agent_timeline_is_read_from_plain_and_coloured_logs() {
        let log = "2026-12-04T21:00:00.1Z  INFO switchyard_agent::runtime::intake: listed watch=\"endpointslice\" listed=5000 millis=2100\n\
                   2026-12-04T21:00:00.2Z  INFO switchyard_agent::runtime::intake: listed watch=\"service\" listed=5000 millis=900\n\
                   2026-12-04T21:00:01.0Z  INFO switchyard_agent::runtime::sync: full sync services=5000 objects=9 millis=350\n\
                   2026-12-04T21:00:09.0Z  INFO switchyard_agent::runtime::sync: full sync services=5000 objects=9 millis=999\n";
        assert_eq!(agent_timeline(log), Some((900.0, 2100.0, 350.0)));
        // A second agent on the same node appends to the log: its own start counts.
        let restarted = format!(
            "{log}2026-12-04T21:01:00.0Z  INFO switchyard_agent: agent starting node=\"node-1\"\n{}",
            log.replace("millis=2100", "millis=2200")
        );
        assert_eq!(agent_timeline(&restarted), Some((900.0, 2200.0, 350.0)));
        // Coloured (an agent writing to a terminal): field names wrapped in escapes.
        let field = |k: &str, v: &str| format!("\u{1b}[3m{k}\u{1b}[0m\u{1b}[2m=\u{1b}[0m{v}");
        let coloured = format!(
            "x: listed {} {}\nx: listed {} {}\nx: full sync {}\n",
            field("watch", "\"service\""),
            field("millis", "7"),
            field("watch", "\"endpointslice\""),
            field("millis", "8"),
            field("millis", "9")
        );
        assert_eq!(agent_timeline(&coloured), Some((7.0, 8.0, 9.0)));
        // A log without the lines (kube-proxy's, an agent that never synced): nothing.
        assert_eq!(agent_timeline(&log[..log.find("full sync").unwrap_or(0)]), None);
        assert_eq!(agent_timeline(""), None);
    }

    #[test]
    fn addresses_are_found_in_every_spelling() {
        let m = Model::new(2, 2);
        let (a, b) = (&m.services[0], &m.services[1]);
        let text = format!(
            "-A X -d {}/32 -j Y\n{} . tcp . 80 : goto c\n--to-destination {}:8080\nendpoint-AB-default/b-1/tcp/http__{}/8080 dnat to {} . 8080",
            a.cluster_ip, b.cluster_ip, a.eps[0], a.eps[1], b.eps[0]
        );
        assert_eq!(coverage(&text, &m), (2, 3));
    }

    #[test]
    fn objects_are_counted() {
        let nft = "table ip t {\n\tmap m {\n\t\ttype ipv4_addr : verdict\n\t\telements = { 1.2.3.4 : drop,\n\t\t\t     1.2.3.5 : drop }\n\t}\n\tchain c {\n\t\ttype nat hook prerouting priority 0; policy accept;\n\t\tip daddr 1.2.3.4 counter comment \"x\"\n\t\tjump d\n\t}\n}\n";
        let c = count_objects(nft, Mode::Nftables);
        assert_eq!((c.rules, c.chains, c.elements, c.comments), (2, 1, 2, 1));
        let ipt = "*nat\n:A - [0:0]\n-A A -m comment --comment \"x\" -j B\n-A A -j C\nCOMMIT\n";
        let c = count_objects(ipt, Mode::Iptables("nft"));
        assert_eq!((c.rules, c.chains, c.comments), (2, 1, 1));
    }

    #[test]
    fn quantiles_by_nearest_rank() {
        let v: Vec<f64> = (1..=20).map(f64::from).collect();
        assert_eq!(quantile(&v, 0.5), 10.0);
        assert_eq!(quantile(&v, 0.99), 20.0);
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
    }
}
