//! The agent's service-proxy loop: intake (watchers on Services, EndpointSlices and the agent's
//! Node feeding the change tracker), a rate-limited sync loop driving the backend, health and
//! metrics, and NodeProxy status reports.

use std::{
    sync::{Arc, Mutex},
    time::{Duration, Instant, SystemTime},
};

use futures::StreamExt;
use k8s_openapi::api::{core::v1::Node, core::v1::Service, discovery::v1::EndpointSlice};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::{
    Api, Client,
    runtime::{WatchStreamExt, watcher},
};
use switchyard_crds::v1alpha1::{
    Capabilities, HealthGate, NodeProxy, NodeProxyStatus, ProbeTarget, ProxyMode, ProxySettings,
    SwitchResult, SyncStats as StatusSync,
};
use tokio::sync::Notify;

use crate::{
    Error, Result,
    backend::{self, Settings},
    driver::{Driver, Finished},
    health::{HealthCheckPorts, ProxyHealth, ServiceHealthServers},
    metrics::{Metrics, ModeLabel, TrafficPolicy},
    model::ServiceName,
    model::{DualSnapshot, IpNet, NodeInfo, categorize, tracker::Tracker},
    report,
    state_store::StateFile,
    switch::Desired,
};

/// Which node addresses accept NodePorts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NodePortAddresses {
    /// Every local address (iptables default).
    All,
    /// The node's primary addresses (nftables default).
    Primary,
    /// Node addresses inside these CIDRs.
    Cidrs(Vec<IpNet>),
}

/// Configuration of the proxy loop.
#[derive(Debug, Clone)]
pub struct Config {
    /// Node name.
    pub node_name: String,
    /// Mode to run.
    pub mode: ProxyMode,
    /// iptables variant (`legacy` / `nft`) for the iptables backend.
    pub iptables_variant: String,
    /// Pod CIDRs of the cluster, at most one per family.
    pub cluster_cidrs: Vec<IpNet>,
    /// Masquerade all service traffic.
    pub masquerade_all: bool,
    /// NodePort addresses.
    pub node_port_addresses: NodePortAddresses,
    /// Service proxy name to honour.
    pub proxy_name: Option<String>,
    /// Minimum time between syncs.
    pub min_sync_period: Duration,
    /// Full resync and retry period.
    pub sync_period: Duration,
    /// Capabilities, reported in status.
    pub capabilities: Capabilities,
    /// Directory of the persisted switch state.
    pub state_dir: std::path::PathBuf,
    /// Remove kube-proxy's leftovers once Switchyard serves the node.
    pub takeover_kube_proxy: bool,
    /// iptables mode: NodePorts on 127.0.0.1 (see [`Settings::localhost_node_ports`]).
    pub localhost_node_ports: bool,
    /// The cluster's Service CIDRs (see [`Settings::service_cidrs`]).
    pub service_cidrs: Vec<IpNet>,
}

/// Derives the node facts and the backend settings from the Node object.
pub fn node_settings(config: &Config, node: Option<&Node>) -> Settings {
    let addresses: Vec<std::net::IpAddr> = node
        .and_then(|n| n.status.as_ref())
        .and_then(|s| s.addresses.as_ref())
        .into_iter()
        .flatten()
        .filter(|a| a.type_ == "InternalIP")
        .filter_map(|a| a.address.parse().ok())
        .collect();
    let zone = node
        .and_then(|n| n.metadata.labels.as_ref())
        .and_then(|l| l.get("topology.kubernetes.io/zone"))
        .cloned();
    // Per family, as kube-proxy: `primary` restricts the families the Node has addresses of; CIDRs
    // restrict the families they are of (to the node addresses inside them, possibly none).
    let node_port_addresses = match &config.node_port_addresses {
        NodePortAddresses::All => backend::NodePortIps::default(),
        NodePortAddresses::Primary => backend::NodePortIps::of_addresses(&addresses),
        NodePortAddresses::Cidrs(cidrs) => {
            let mut ips = backend::NodePortIps::default();
            for family in crate::model::IpFamily::ALL {
                let of_family: Vec<&IpNet> = cidrs
                    .iter()
                    .filter(|c| crate::model::IpFamily::of_net(c) == family)
                    .collect();
                if !of_family.is_empty() {
                    ips.restrict(
                        family,
                        addresses
                            .iter()
                            .filter(|a| of_family.iter().any(|c| c.contains(*a)))
                            .copied()
                            .collect(),
                    );
                }
            }
            ips
        }
    };
    Settings {
        node: NodeInfo {
            name: config.node_name.clone(),
            addresses,
            zone,
        },
        cluster_cidrs: config.cluster_cidrs.clone(),
        masquerade_all: config.masquerade_all,
        node_port_addresses,
        masquerade_mark: 0x4000,
        ipvs: backend::ipvs::IpvsOptions::default(),
        localhost_node_ports: config.localhost_node_ports,
        service_cidrs: config.service_cidrs.clone(),
    }
}

fn node_eligible(node: Option<&Node>) -> bool {
    node.is_some_and(|n| {
        n.metadata.deletion_timestamp.is_none()
            && !n
                .spec
                .as_ref()
                .and_then(|s| s.taints.as_ref())
                .is_some_and(|t| t.iter().any(|t| t.key == "ToBeDeletedByClusterAutoscaler"))
    })
}

/// State shared between intake and the sync loop.
struct Shared {
    tracker: Mutex<Tracker>,
    node: Mutex<Option<Node>>,
    wish: Mutex<Wish>,
    proxy_settings: Mutex<Option<ProxySettings>>,
    /// Our NodeProxy is not known to exist (at start, or it was deleted): register it before the
    /// next report.
    needs_registration: std::sync::atomic::AtomicBool,
    wake: Notify,
    health: Arc<ProxyHealth>,
    metrics: Arc<Metrics>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn now_seconds() -> f64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs_f64()
}

/// Strips managed fields: they are large and never read.
fn trim<K: kube::Resource>(mut obj: K) -> K {
    obj.meta_mut().managed_fields = None;
    obj
}

/// How a watched kind feeds the tracker.
trait Tracked:
    kube::Resource<DynamicType = (), Scope = kube::core::NamespaceResourceScope>
    + Clone
    + std::fmt::Debug
    + serde::de::DeserializeOwned
    + Send
    + 'static
{
    /// Watch name for errors.
    const WHAT: &'static str;
    /// An add or update; returns whether anything programmed changed.
    fn apply(tracker: &mut Tracker, obj: &Self) -> bool;
    /// A delete.
    fn delete(tracker: &mut Tracker, namespace: &str, name: &str) -> bool;
    /// A relist.
    fn reset(tracker: &mut Tracker, all: &[Self]);
    /// The metric to count a change with.
    fn counter(metrics: &Metrics) -> &prometheus_client::metrics::counter::Counter;
}

impl Tracked for Service {
    const WHAT: &'static str = "service";
    fn apply(t: &mut Tracker, o: &Self) -> bool {
        t.apply_service(o)
    }
    fn delete(t: &mut Tracker, ns: &str, name: &str) -> bool {
        t.delete_service(ns, name)
    }
    fn reset(t: &mut Tracker, all: &[Self]) {
        t.reset_services(all)
    }
    fn counter(m: &Metrics) -> &prometheus_client::metrics::counter::Counter {
        &m.service_changes_total
    }
}

impl Tracked for EndpointSlice {
    const WHAT: &'static str = "endpointslice";
    fn apply(t: &mut Tracker, o: &Self) -> bool {
        t.apply_slice(o)
    }
    fn delete(t: &mut Tracker, ns: &str, name: &str) -> bool {
        t.delete_slice(ns, name)
    }
    fn reset(t: &mut Tracker, all: &[Self]) {
        t.reset_slices(all)
    }
    fn counter(m: &Metrics) -> &prometheus_client::metrics::counter::Counter {
        &m.endpoint_changes_total
    }
}

/// Backoff of the agent's watches after an error: 200 ms doubling to 800 ms, each delay scaled by
/// a random factor in [0.5, 1) so a fleet of agents does not retry in step. A returning apiserver
/// is therefore seen within 0.8 s — a faster reconnect than client-go's reflector (800 ms doubling
/// to 30 s), bought with at most ~10 cheap requests a second per agent during an outage, spread
/// by the jitter. Reset by every event.
#[derive(Debug, Clone)]
struct WatchBackoff {
    next: Duration,
}

impl WatchBackoff {
    const INITIAL: Duration = Duration::from_millis(200);
    const MAX: Duration = Duration::from_millis(800);

    fn new() -> Self {
        Self { next: Self::INITIAL }
    }
}

/// A random factor in [0.5, 1).
fn jitter() -> f64 {
    use std::hash::{BuildHasher, Hasher};
    let random = std::collections::hash_map::RandomState::new()
        .build_hasher()
        .finish();
    0.5 + (random >> 11) as f64 / (1u64 << 53) as f64 / 2.0
}

impl Iterator for WatchBackoff {
    type Item = Duration;
    fn next(&mut self) -> Option<Duration> {
        let now = self.next.mul_f64(jitter());
        self.next = (self.next * 2).min(Self::MAX);
        Some(now) // never gives up: the agent outlives any apiserver outage
    }
}

impl kube::runtime::utils::Backoff for WatchBackoff {
    fn reset(&mut self) {
        self.next = Self::INITIAL;
    }
}

/// Unwraps one watch item: an error is counted, logged (once per outage at warn level) and
/// reported in health and metrics, and the watch goes on (it re-lists or re-watches itself).
fn watch_item<T>(shared: &Shared, what: &'static str, item: Result<T, watcher::Error>) -> Option<T> {
    match item {
        Ok(event) => {
            if let Some(down) = shared.health.api_recovered(what) {
                tracing::info!(
                    watch = what,
                    outage_seconds = down.as_secs_f64(),
                    "watch recovered"
                );
                api_metrics(shared);
            }
            Some(event)
        }
        Err(e) => {
            shared.metrics.apiserver_errors_total.inc();
            if shared.health.api_failed(what, e.to_string()) {
                tracing::warn!(watch = what, error = %e, "watch failed; retrying until the apiserver answers (the kernel keeps serving the last programmed rules)");
                api_metrics(shared);
            } else {
                tracing::debug!(watch = what, error = %e, "watch still failing");
            }
            None
        }
    }
}

/// While a watch is failing, asks the apiserver for its version every second; once it answers,
/// watches that have been quiet for a few seconds (their backoff would have retried and failed
/// again by then) count as recovered.
async fn probe_api(client: Client, shared: Arc<Shared>) -> Result<()> {
    loop {
        tokio::time::sleep(Duration::from_secs(1)).await;
        if shared.health.api_view().reachable {
            continue;
        }
        if client.apiserver_version().await.is_ok() {
            let recovered = shared.health.api_answered(Duration::from_secs(3));
            for (watch, down) in &recovered {
                tracing::info!(
                    watch,
                    outage_seconds = down.as_secs_f64(),
                    "watch recovered (apiserver answers)"
                );
            }
            if !recovered.is_empty() {
                api_metrics(&shared);
            }
        }
    }
}

fn api_metrics(shared: &Shared) {
    let view = shared.health.api_view();
    shared.metrics.apiserver_reachable.set(i64::from(view.reachable));
    shared.metrics.apiserver_unreachable_since.set(
        view.unreachable_since
            .and_then(|t| t.duration_since(SystemTime::UNIX_EPOCH).ok())
            .map_or(0.0, |d| d.as_secs_f64()),
    );
}

/// Feeds one kind's watch events into the tracker; a relist replaces the kind's whole state.
/// Never ends: errors are retried with [`WatchBackoff`].
async fn watch_tracked<K: Tracked>(client: Client, shared: Arc<Shared>) -> Result<()> {
    let mut init: Vec<K> = Vec::new();
    let mut stream = watcher(Api::<K>::all(client), watcher::Config::default())
        .backoff(WatchBackoff::new())
        .boxed();
    while let Some(item) = stream.next().await {
        let Some(event) = watch_item(&shared, K::WHAT, item) else {
            continue;
        };
        let changed = {
            let mut t = lock(&shared.tracker);
            match event {
                watcher::Event::Apply(o) => K::apply(&mut t, &trim(o)),
                watcher::Event::Delete(o) => K::delete(
                    &mut t,
                    o.meta().namespace.as_deref().unwrap_or_default(),
                    o.meta().name.as_deref().unwrap_or_default(),
                ),
                watcher::Event::Init => {
                    init.clear();
                    false
                }
                watcher::Event::InitApply(o) => {
                    init.push(trim(o));
                    false
                }
                watcher::Event::InitDone => {
                    K::reset(&mut t, &std::mem::take(&mut init));
                    true
                }
            }
        };
        if changed {
            K::counter(&shared.metrics).inc();
            notify(&shared);
        }
    }
    Ok(())
}

async fn watch_node(client: Client, name: String, shared: Arc<Shared>) -> Result<()> {
    let config = watcher::Config::default().fields(&format!("metadata.name={name}"));
    let mut stream = watcher(Api::<Node>::all(client), config)
        .backoff(WatchBackoff::new())
        .boxed();
    while let Some(item) = stream.next().await {
        let node = match watch_item(&shared, "node", item) {
            Some(watcher::Event::Apply(node) | watcher::Event::InitApply(node)) => node,
            // Our Node is gone: not eligible (kube-proxy's /healthz fails while it is deleted).
            Some(watcher::Event::Delete(_)) => {
                shared.health.set_node_eligible(false);
                continue;
            }
            _ => continue,
        };
        shared.health.set_node_eligible(node_eligible(Some(&node)));
        *lock(&shared.node) = Some(trim(node));
        notify(&shared);
    }
    Ok(())
}

fn notify(shared: &Shared) {
    shared.health.queued();
    shared.metrics.last_queued_timestamp.set(now_seconds());
    shared.wake.notify_one();
}

/// Health-check node ports of ETP=Local Services with their local endpoint counts. A dual-stack
/// pod is one endpoint per family, so the count is the larger of the two families'.
fn health_check_ports(snapshot: &DualSnapshot, settings: &Settings) -> HealthCheckPorts {
    let mut ports = HealthCheckPorts::new();
    for family in snapshot.families() {
        for p in family.services.values().filter(|p| p.external_policy_local) {
            let Some(hc) = p.health_check_node_port else {
                continue;
            };
            let eps = family
                .endpoints
                .get(&p.name)
                .map(Vec::as_slice)
                .unwrap_or_default();
            let local = categorize(eps, &settings.node).local.len();
            let entry = ports.entry(hc).or_insert_with(|| (p.name.service.clone(), 0));
            entry.1 = entry.1.max(local);
        }
    }
    ports
}

fn no_local_endpoints(snapshot: &DualSnapshot, settings: &Settings, metrics: &Metrics) {
    let (mut internal, mut external) = (0i64, 0i64);
    for (snapshot, p) in snapshot
        .families()
        .into_iter()
        .flat_map(|s| s.services.values().map(move |p| (s, p)))
    {
        let eps = snapshot
            .endpoints
            .get(&p.name)
            .map(Vec::as_slice)
            .unwrap_or_default();
        let c = categorize(eps, &settings.node);
        if c.local.is_empty() && c.has_any {
            internal += i64::from(p.internal_policy_local);
            external += i64::from(p.external_policy_local && p.externally_accessible());
        }
    }
    metrics
        .no_local_endpoints
        .get_or_create(&TrafficPolicy {
            traffic_policy: "internal".into(),
        })
        .set(internal);
    metrics
        .no_local_endpoints
        .get_or_create(&TrafficPolicy {
            traffic_policy: "external".into(),
        })
        .set(external);
}

/// Runs the proxy until a watch fails for good or the process is asked to stop.
pub async fn run(
    client: Client,
    config: Config,
    health: Arc<ProxyHealth>,
    metrics: Arc<Metrics>,
) -> Result<()> {
    let shared = Arc::new(Shared {
        tracker: Mutex::new(Tracker::new(config.proxy_name.clone())),
        node: Mutex::new(None),
        wish: Mutex::new(Wish::default()),
        proxy_settings: Mutex::new(None),
        needs_registration: std::sync::atomic::AtomicBool::new(true),
        wake: Notify::new(),
        health,
        metrics,
    });
    let intake = {
        let (c1, c2, c3, c4, c5) = (
            client.clone(),
            client.clone(),
            client.clone(),
            client.clone(),
            client.clone(),
        );
        let (s1, s2, s3, s4, s5) = (
            shared.clone(),
            shared.clone(),
            shared.clone(),
            shared.clone(),
            shared.clone(),
        );
        let (name, name2) = (config.node_name.clone(), config.node_name.clone());
        async move {
            tokio::try_join!(
                watch_tracked::<Service>(c1, s1),
                watch_tracked::<EndpointSlice>(c2, s2),
                watch_node(c3, name, s3),
                watch_own_nodeproxy(c4, name2, s4),
                probe_api(c5, s5)
            )
            .map(|_| ())
        }
    };
    tokio::select! {
        r = intake => r,
        r = sync_loop(client, config, shared) => r,
    }
}

/// The agent's own NodeProxy spec, as last seen.
#[derive(Debug, Clone, Default)]
struct Wish {
    desired: Option<Desired>,
    gate: HealthGate,
    probes: Vec<ProbeTarget>,
    generation: Option<i64>,
}

async fn watch_own_nodeproxy(client: Client, name: String, shared: Arc<Shared>) -> Result<()> {
    let config = watcher::Config::default().fields(&format!("metadata.name={name}"));
    let mut stream = watcher(Api::<NodeProxy>::all(client), config)
        .backoff(WatchBackoff::new())
        .boxed();
    while let Some(item) = stream.next().await {
        let Some(event) = watch_item(&shared, "nodeproxy", item) else {
            continue;
        };
        match event {
            watcher::Event::Apply(np) | watcher::Event::InitApply(np) => {
                let mut wish = lock(&shared.wish);
                if np.spec.desired_mode.is_none() {
                    // A spec without a desired mode is what a re-created NodeProxy looks like until
                    // the operator writes it again: keep the health gate and settings of a switch
                    // under way instead of falling back to defaults.
                    if wish.desired.is_some() {
                        tracing::warn!(
                            "NodeProxy spec has no desired mode (re-created?); keeping the last health gate and settings until the operator writes it"
                        );
                    }
                    wish.desired = None;
                    wish.generation = np.metadata.generation;
                } else {
                    *wish = Wish {
                        desired: np.spec.desired_mode.map(|mode| Desired {
                            mode,
                            token: np.spec.rollout_token.clone(),
                        }),
                        gate: np.spec.health_gate.clone().unwrap_or_default(),
                        probes: np
                            .spec
                            .health_gate
                            .as_ref()
                            .map(|g| g.probes.clone())
                            .unwrap_or_default(),
                        generation: np.metadata.generation,
                    };
                    *lock(&shared.proxy_settings) = np.spec.proxy.clone();
                }
            }
            // Deleted under us: the sync loop registers it again and reports at once.
            watcher::Event::Delete(_) => shared
                .needs_registration
                .store(true, std::sync::atomic::Ordering::Relaxed),
            watcher::Event::Init | watcher::Event::InitDone => continue,
        }
        shared.wake.notify_one();
    }
    Ok(())
}

fn now_time() -> k8s_openapi::apimachinery::pkg::apis::meta::v1::Time {
    k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(k8s_openapi::jiff::Timestamp::now())
}

/// Resolves the gate's probe targets to Service names: `default/kubernetes` always, named ones,
/// and label-selected ones (listed from the API).
async fn probe_targets(client: &Client, probes: &[ProbeTarget]) -> Vec<ServiceName> {
    let mut out = vec![ServiceName {
        namespace: "default".into(),
        name: "kubernetes".into(),
    }];
    for p in probes {
        if let Some(name) = &p.name {
            out.push(ServiceName {
                namespace: p.namespace.clone(),
                name: name.clone(),
            });
        } else if let Some(sel) = &p.selector {
            let exprs = sel.match_expressions.iter().flatten().map(|e| {
                let values = e.values.as_deref().unwrap_or_default().join(",");
                match e.operator.as_str() {
                    "In" => format!("{} in ({values})", e.key),
                    "NotIn" => format!("{} notin ({values})", e.key),
                    "Exists" => e.key.clone(),
                    _ => format!("!{}", e.key), // DoesNotExist: the schema admits no other operator
                }
            });
            let labels = sel
                .match_labels
                .iter()
                .flatten()
                .map(|(k, v)| format!("{k}={v}"))
                .chain(exprs)
                .collect::<Vec<_>>()
                .join(",");
            let api: Api<Service> = Api::namespaced(client.clone(), &p.namespace);
            if let Ok(list) = api.list(&kube::api::ListParams::default().labels(&labels)).await {
                out.extend(list.items.into_iter().filter_map(|s| {
                    Some(ServiceName {
                        namespace: p.namespace.clone(),
                        name: s.metadata.name?,
                    })
                }));
            }
        }
    }
    out
}

fn status(
    config: &Config,
    driver: &Driver,
    stats: Option<(&backend::SyncStats, Duration, &DualSnapshot)>,
    wish: &Wish,
    previous: &[Condition],
) -> NodeProxyStatus {
    let last = driver.last.as_ref();
    let current = last
        .is_some_and(|l| l.token.is_some() && l.token == wish.desired.as_ref().and_then(|d| d.token.clone()));
    let at_desired = wish
        .desired
        .as_ref()
        .is_none_or(|d| d.mode == driver.state.active)
        && !driver.switching();
    let healthy = at_desired && (last.is_none_or(|l| !current || l.result == "Succeeded"));
    let condition = |ok: bool, reason: &str, message: String| Condition {
        type_: "Healthy".into(),
        status: if ok { "True".into() } else { "False".into() },
        reason: reason.into(),
        message,
        last_transition_time: now_time(),
        observed_generation: wish.generation,
    };
    let mut healthy_condition = match (healthy, last) {
        (true, Some(l)) if current => {
            condition(true, "GatePassed", format!("{} active; health gate passed", l.to))
        }
        (true, _) => condition(true, "Active", format!("{} active", driver.state.active)),
        (false, Some(l)) if current && l.result != "Succeeded" => {
            condition(false, l.result, l.reason.clone())
        }
        (false, _) => condition(false, "Switching", format!("switch phase {:?}", driver.phase())),
    };
    let mut state_condition = match &driver.state_problem {
        Some(p) => Condition {
            type_: "StateConsistent".into(),
            status: "False".into(),
            reason: p.reason.into(),
            message: p.message.clone(),
            last_transition_time: now_time(),
            observed_generation: wish.generation,
        },
        None => Condition {
            type_: "StateConsistent".into(),
            status: "True".into(),
            reason: "Consistent".into(),
            message: "the persisted switch state agrees with the kernel".into(),
            last_transition_time: now_time(),
            observed_generation: wish.generation,
        },
    };
    // The transition time moves only when the condition's status does.
    for c in [&mut healthy_condition, &mut state_condition] {
        if let Some(p) = previous
            .iter()
            .find(|p| p.type_ == c.type_ && p.status == c.status)
        {
            c.last_transition_time = p.last_transition_time.clone();
        }
    }
    NodeProxyStatus {
        observed_generation: wish.generation,
        agent_version: Some(env!("CARGO_PKG_VERSION").to_owned()),
        capabilities: Some(config.capabilities.clone()),
        active_mode: Some(driver.state.active),
        phase: Some(driver.phase()),
        last_switch: last.map(|l| SwitchResult {
            from: Some(l.from),
            to: l.to,
            result: l.result.into(),
            reason: Some(l.reason.clone()),
            rollout_token: l.token.clone(),
            started_at: l
                .started
                .map(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time),
            finished_at: Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(l.finished)),
        }),
        probes: driver.probes.clone(),
        sync: stats.map(|(stats, took, snapshot)| StatusSync {
            last_sync_time: Some(now_time()),
            last_sync_millis: took.as_millis() as i64,
            services: snapshot
                .families()
                .iter()
                .map(|s| s.services.len())
                .sum::<usize>() as i64,
            endpoints: snapshot
                .families()
                .iter()
                .flat_map(|s| s.endpoints.values())
                .map(Vec::len)
                .sum::<usize>() as i64,
            rules: stats.rules_total as i64,
        }),
        conditions: vec![healthy_condition, state_condition],
    }
}

async fn sync_loop(client: Client, config: Config, shared: Arc<Shared>) -> Result<()> {
    let mut driver: Option<Driver> = None;
    let mut need_full = true;
    // What the last successful sync programmed (stale UDP flows are found against it), and the
    // conntrack cleanups that could not run yet.
    let mut programmed: Option<DualSnapshot> = None;
    let mut unfinished_cleanups: std::collections::BTreeMap<
        crate::model::IpFamily,
        crate::conntrack::Cleanup,
    > = Default::default();
    let mut last_sync = Instant::now() - config.min_sync_period;
    let mut last_full = Instant::now();
    let mut last_report: Option<Instant> = None;
    let mut last_stats: Option<(backend::SyncStats, Duration)>;
    let mut health_servers = ServiceHealthServers::new(shared.health.clone());
    let mut took_over = !config.takeover_kube_proxy;
    let mut reported_conditions: Vec<Condition> = Vec::new();
    // The state problem an Event was published for.
    let mut announced: Option<crate::driver::StateProblem> = None;
    let mut prior_loaded = false;
    loop {
        let tick = if driver.as_ref().is_some_and(Driver::switching) {
            Duration::from_secs(1)
        } else {
            config.sync_period
        };
        tokio::select! {
            _ = shared.wake.notified() => {}
            _ = tokio::time::sleep(tick) => { need_full |= tick == config.sync_period; }
        }
        let since = last_sync.elapsed();
        if since < config.min_sync_period {
            tokio::time::sleep(config.min_sync_period - since).await;
        }
        let node = lock(&shared.node).clone();
        if !lock(&shared.tracker).synced() || node.is_none() {
            continue;
        }
        let wish = lock(&shared.wish).clone();
        let settings = node_settings(
            &with_policy_settings(&config, lock(&shared.proxy_settings).as_ref()),
            node.as_ref(),
        );
        if driver.is_none() {
            let d = Driver::new(
                Box::new(StateFile(config.state_dir.join("state.json"))),
                config.mode,
                settings.clone(),
                config.iptables_variant.clone(),
            );
            driver = Some(d);
        }
        let Some(d) = driver.as_mut() else { continue };
        if !d.switching() && d.state.active != ProxyMode::Ipvs {
            d.set_settings(settings.clone());
        }
        if last_full.elapsed() > Duration::from_secs(3600) {
            need_full = true;
        }
        let (snapshot, changes) = {
            let mut t = lock(&shared.tracker);
            (t.snapshot(), t.take_changes())
        };
        shared.metrics.service_changes_pending.set(0);
        last_sync = Instant::now();
        let full = need_full;
        let Some(mut owned) = driver.take() else { continue };
        let snap = snapshot.clone();
        // Decided before the sync, applied after it (so no entry is recreated by the old rules). A
        // full sync may follow a failed one whose changes are gone: compare every Service then.
        let compared = if full {
            crate::model::Changes {
                services: programmed
                    .iter()
                    .chain(std::iter::once(&snapshot))
                    .flat_map(|d| d.families())
                    .flat_map(|s| s.services.keys().map(|k| k.service.clone()))
                    .collect(),
            }
        } else {
            changes.clone()
        };
        let mut cleanups: Vec<(crate::model::IpFamily, crate::conntrack::Cleanup)> = Vec::new();
        for family in crate::model::IpFamily::ALL {
            let old = programmed.as_ref().map(|p| p.get(family));
            let node_ports = settings.node_port_addresses.of(family);
            let planned = crate::conntrack::cleanup_after(
                old,
                snapshot.get(family),
                &compared,
                &settings.node,
                node_ports,
            );
            let carried = unfinished_cleanups.remove(&family);
            match (planned, carried) {
                (planned, Some(carried)) => {
                    // Judged against what is programmed now, not when it was planned.
                    let mut c = planned.unwrap_or_else(|| crate::conntrack::Cleanup {
                        current: crate::conntrack::UdpDestinations::of(
                            snapshot.get(family),
                            &settings.node,
                            node_ports,
                        ),
                        ..Default::default()
                    });
                    c.merge(carried);
                    cleanups.push((family, c));
                }
                (Some(c), None) => cleanups.push((family, c)),
                (None, None) => {}
            }
        }
        let (result, owned, unfinished, snap) = tokio::task::spawn_blocking(move || {
            let started = Instant::now();
            let r = owned.sync(&snap, &changes, full);
            let took = started.elapsed();
            let mut unfinished = Vec::new();
            if r.is_ok() {
                for (family, cleanup) in cleanups {
                    match crate::sys::conntrack::delete_stale(family, &cleanup) {
                        Ok(0) => {}
                        Ok(deleted) => tracing::info!(%family, deleted, "deleted stale UDP conntrack entries"),
                        Err(e) => {
                            tracing::warn!(%family, error = %e, "deleting stale UDP conntrack entries failed; retrying after the next sync");
                            unfinished.push((family, cleanup));
                        }
                    }
                }
            } else {
                unfinished = cleanups;
            }
            (r.map(|s| (s, took)), owned, unfinished, snap)
        })
        .await
        .map_err(|e| Error::Config(format!("sync task: {e}")))?;
        driver = Some(owned);
        unfinished_cleanups.extend(unfinished);
        let mode_label = ModeLabel {
            mode: driver
                .as_ref()
                .map(|d| d.state.active.to_string())
                .unwrap_or_default(),
        };
        match result {
            Ok((stats, took)) => {
                need_full = false;
                // The task's copy comes back: no second clone of the whole state per sync.
                programmed = Some(snap);
                if stats.full {
                    last_full = Instant::now();
                    shared.metrics.sync_full_duration.observe(took.as_secs_f64());
                } else {
                    shared.metrics.sync_partial_duration.observe(took.as_secs_f64());
                }
                shared.metrics.sync_duration.observe(took.as_secs_f64());
                shared.metrics.last_sync_timestamp.set(now_seconds());
                shared
                    .metrics
                    .programmed_services
                    .get_or_create(&mode_label)
                    .set(stats.services as i64);
                shared
                    .metrics
                    .objects_written
                    .get_or_create(&mode_label)
                    .set(stats.objects_written as i64);
                shared.health.updated();
                tracing::debug!(
                    full = stats.full,
                    services = stats.services,
                    objects = stats.objects_written,
                    millis = took.as_millis() as u64,
                    "synced"
                );
                health_servers.sync(health_check_ports(&snapshot, &settings));
                no_local_endpoints(&snapshot, &settings, &shared.metrics);
                last_stats = Some((stats, took));
                if !took_over && driver.as_ref().is_some_and(|d| !d.switching()) {
                    // Our rules serve now: kube-proxy's leftovers can go.
                    let (removed, errors) = tokio::task::spawn_blocking(crate::takeover::takeover)
                        .await
                        .map_err(|e| Error::Config(format!("takeover task: {e}")))?;
                    tracing::info!(?removed, ?errors, "took over from kube-proxy");
                    took_over = errors.is_empty();
                }
            }
            Err(e) => {
                need_full = true;
                shared.metrics.sync_failures.get_or_create(&mode_label).inc();
                tracing::error!(error = %e, "sync failed; retrying with a full sync");
                shared.wake.notify_one();
                continue;
            }
        }
        // The switch: one step per iteration (a quick follow-up when the step asks for it).
        let targets = if driver.as_ref().is_some_and(Driver::switching) {
            probe_targets(&client, &wish.probes).await
        } else {
            Vec::new()
        };
        let Some(mut owned) = driver.take() else { continue };
        let (supported, desired, gate, snap) = (
            config.capabilities.supported_modes.clone(),
            wish.desired.clone(),
            wish.gate.clone(),
            snapshot.clone(),
        );
        let (again, owned) = tokio::task::spawn_blocking(move || {
            let again = owned.step(desired.as_ref(), &supported, &gate, &snap, &targets);
            (again, owned)
        })
        .await
        .map_err(|e| Error::Config(format!("switch task: {e}")))?;
        driver = Some(owned);
        if again {
            shared.wake.notify_one();
        }
        let Some(d) = driver.as_mut() else { continue };
        if shared
            .needs_registration
            .swap(false, std::sync::atomic::Ordering::Relaxed)
        {
            match report::ensure_registered(&client, &config.node_name).await {
                Ok(()) => d.dirty = true,
                Err(e) => {
                    tracing::warn!(error = %e, "registering the NodeProxy failed; retrying");
                    shared
                        .needs_registration
                        .store(true, std::sync::atomic::Ordering::Relaxed);
                }
            }
        }
        shared
            .metrics
            .state_file_problem
            .set(i64::from(d.state_problem.is_some()));
        if let Some(problem) = d
            .state_problem
            .as_ref()
            .filter(|p| announced.as_ref() != Some(*p))
        {
            match report::publish_warning(&client, &config.node_name, problem.reason, &problem.message).await
            {
                Ok(()) => announced = Some(problem.clone()),
                Err(e) => tracing::warn!(error = %e, "publishing the state-file Event failed; retrying"),
            }
        }
        if d.dirty || last_report.is_none_or(|t| t.elapsed() > Duration::from_secs(10)) {
            // Our status is applied whole (server-side apply): carry the last switch result over a
            // restart, or the restart would erase it. No report until it has been read.
            if !prior_loaded {
                match previous_switch(&client, &config.node_name).await {
                    Ok(prior) => {
                        if d.last.is_none() {
                            d.last = prior;
                        }
                        prior_loaded = true;
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "reading the last reported switch failed; status report postponed");
                        continue;
                    }
                }
            }
            let stats = last_stats.as_ref().map(|(s, t)| (s, *t, &snapshot));
            let report_status = status(&config, d, stats, &wish, &reported_conditions);
            match report::apply_status(&client, &config.node_name, &report_status).await {
                Ok(()) => {
                    reported_conditions = report_status.conditions;
                    last_report = Some(Instant::now());
                    d.dirty = false;
                }
                Err(Error::Kube {
                    source: kube::Error::Api(status),
                    ..
                }) if status.code == 404 => {
                    // Someone deleted our NodeProxy: register again, report on the next round.
                    tracing::warn!("NodeProxy {} is gone; registering again", config.node_name);
                    match report::ensure_registered(&client, &config.node_name).await {
                        Ok(()) => {
                            d.dirty = true;
                            shared.wake.notify_one();
                        }
                        Err(e) => tracing::warn!(error = %e, "re-registering failed"),
                    }
                }
                Err(e) => tracing::warn!(error = %e, "status report failed"),
            }
        }
    }
}

/// The last switch result this node reported before the agent (re)started.
async fn previous_switch(client: &Client, node: &str) -> Result<Option<Finished>> {
    let np = Api::<NodeProxy>::all(client.clone())
        .get_opt(node)
        .await
        .map_err(|source| Error::Kube {
            action: format!("get nodeproxy {node}"),
            source,
        })?;
    let Some(last) = np.and_then(|np| np.status).and_then(|s| s.last_switch) else {
        return Ok(None);
    };
    let result: &'static str = match last.result.as_str() {
        "Succeeded" => "Succeeded",
        "RolledBack" => "RolledBack",
        _ => "Failed",
    };
    Ok(Some(Finished {
        from: last.from.unwrap_or(last.to),
        to: last.to,
        result,
        reason: last.reason.unwrap_or_default(),
        token: last.rollout_token,
        started: last.started_at.map(|t| t.0),
        finished: last
            .finished_at
            .map(|t| t.0)
            .unwrap_or_else(k8s_openapi::jiff::Timestamp::now),
    }))
}

/// Parses a cluster CIDR list as kube-proxy's `--cluster-cidr` takes it: one CIDR, or one per
/// family separated by a comma.
pub fn parse_cluster_cidrs(value: &str) -> std::result::Result<Vec<IpNet>, String> {
    let cidrs: Vec<IpNet> = value
        .split(',')
        .map(|c| {
            c.trim()
                .parse::<IpNet>()
                .map(|n| n.trunc())
                .map_err(|e| format!("{c}: {e}"))
        })
        .collect::<std::result::Result<_, _>>()?;
    let families: std::collections::BTreeSet<_> = cidrs.iter().map(crate::model::IpFamily::of_net).collect();
    if families.len() != cidrs.len() {
        return Err(format!("{value}: at most one CIDR per IP family"));
    }
    Ok(cidrs)
}

/// The agent's configuration with the governing policy's proxy settings (from NodeProxy spec)
/// laid over its flags: clusterCIDR, masqueradeAll and nodePortAddresses. Invalid values keep the
/// flag's value (the CRD validates them, so this only guards against skew).
pub fn with_policy_settings(config: &Config, proxy: Option<&ProxySettings>) -> Config {
    let mut c = config.clone();
    let Some(p) = proxy else { return c };
    if let Some(Ok(cidrs)) = p.cluster_cidr.as_deref().map(parse_cluster_cidrs) {
        c.cluster_cidrs = cidrs;
    }
    if let Some(all) = p.masquerade_all {
        c.masquerade_all = all;
    }
    if !p.node_port_addresses.is_empty() {
        let cidrs: Vec<IpNet> = p
            .node_port_addresses
            .iter()
            .filter_map(|a| a.parse().ok())
            .collect();
        c.node_port_addresses = if p.node_port_addresses.iter().any(|a| a == "primary") {
            NodePortAddresses::Primary
        } else {
            NodePortAddresses::Cidrs(cidrs)
        };
    }
    c
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn watch_backoff_grows_to_its_cap_with_jitter_and_never_ends() {
        let delays: Vec<Duration> = WatchBackoff::new().take(50).collect();
        assert_eq!(delays.len(), 50);
        for d in &delays {
            assert!(*d >= WatchBackoff::INITIAL / 2 && *d < WatchBackoff::MAX, "{d:?}");
        }
        assert!(delays[10..].iter().all(|d| *d >= WatchBackoff::MAX / 2));
    }

    #[test]
    fn policy_settings_override_flags() {
        let config = Config {
            node_name: "n".into(),
            mode: ProxyMode::Iptables,
            iptables_variant: "legacy".into(),
            cluster_cidrs: Vec::new(),
            masquerade_all: false,
            node_port_addresses: NodePortAddresses::All,
            proxy_name: None,
            min_sync_period: Duration::from_secs(1),
            sync_period: Duration::from_secs(30),
            capabilities: Capabilities::default(),
            state_dir: "/tmp".into(),
            takeover_kube_proxy: false,
            localhost_node_ports: true,
            service_cidrs: Vec::new(),
        };
        let proxy = ProxySettings {
            cluster_cidr: Some("10.244.0.0/16,fd00:10:244::/56".into()),
            masquerade_all: Some(true),
            node_port_addresses: vec!["10.250.0.0/24".into()],
            ..Default::default()
        };
        let c = with_policy_settings(&config, Some(&proxy));
        assert_eq!(
            c.cluster_cidrs
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>(),
            ["10.244.0.0/16", "fd00:10:244::/56"]
        );
        assert!(c.masquerade_all);
        assert_eq!(
            c.node_port_addresses,
            NodePortAddresses::Cidrs(vec!["10.250.0.0/24".parse().expect("net")])
        );
        let primary = ProxySettings {
            node_port_addresses: vec!["primary".into()],
            ..Default::default()
        };
        assert_eq!(
            with_policy_settings(&config, Some(&primary)).node_port_addresses,
            NodePortAddresses::Primary
        );
        let unchanged = with_policy_settings(&config, None);
        assert_eq!(
            (unchanged.cluster_cidrs, unchanged.masquerade_all),
            (vec![], false)
        );
    }

    #[test]
    fn cluster_cidrs_take_one_per_family() {
        assert_eq!(
            parse_cluster_cidrs("10.244.1.0/16").map(|c| c[0].to_string()),
            Ok("10.244.0.0/16".into())
        );
        assert_eq!(
            parse_cluster_cidrs("10.244.0.0/16, fd00:10:244::/56").map(|c| c.len()),
            Ok(2)
        );
        assert!(
            parse_cluster_cidrs("10.244.0.0/16,10.245.0.0/16")
                .is_err_and(|e| e.contains("at most one CIDR per IP family"))
        );
        assert!(parse_cluster_cidrs("10.244.0.0/33").is_err());
    }
}
