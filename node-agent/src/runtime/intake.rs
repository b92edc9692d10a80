//! Intake: watchers on Services, EndpointSlices, the agent's Node and its own NodeProxy feed the
//! change tracker and the state the sync loop reads ([`Shared`]), wake it, and keep the
//! apiserver's reachability in health and metrics.

use std::{
    sync::{Arc, Mutex, atomic::AtomicBool, atomic::Ordering},
    time::{Duration, SystemTime},
};

use futures::StreamExt;
use k8s_openapi::api::{core::v1::Node, core::v1::Service, discovery::v1::EndpointSlice};
use kube::{
    Api, Client,
    runtime::{WatchStreamExt, watcher},
};
use switchyard_crds::v1alpha1::{HealthGate, NodeProxy, ProbeTarget, ProxySettings};
use tokio::sync::Notify;

use super::reflector;

use crate::{
    Error, Result,
    health::ProxyHealth,
    metrics::Metrics,
    model::{
        tracker::{ServiceEntry, SliceEntry, Tracker},
        wire::WireKind,
    },
    switch::Desired,
};

/// The agent's own NodeProxy spec, as last seen.
#[derive(Debug, Clone, Default)]
pub(super) struct Wish {
    /// The mode (and rollout token) the operator asks for.
    pub desired: Option<Desired>,
    /// The health gate of a switch.
    pub gate: HealthGate,
    /// The gate's probe targets.
    pub probes: Vec<ProbeTarget>,
    /// The spec's generation.
    pub generation: Option<i64>,
}

/// State shared between intake and the sync loop.
pub(super) struct Shared {
    /// Services and EndpointSlices, with their pending changes.
    pub tracker: Mutex<Tracker>,
    /// Our Node, once seen.
    pub node: Mutex<Option<Node>>,
    /// Our NodeProxy spec.
    pub wish: Mutex<Wish>,
    /// The governing policy's proxy settings (from our NodeProxy spec).
    pub proxy_settings: Mutex<Option<ProxySettings>>,
    /// Our NodeProxy has been listed once: the policy's settings are known (until then the flags'
    /// stand, and nothing the policy owns is changed or put back).
    pub spec_listed: AtomicBool,
    /// Our NodeProxy is not known to exist (at start, or it was deleted): register it before the
    /// next report.
    pub needs_registration: AtomicBool,
    /// Wakes the sync loop.
    pub wake: Notify,
    /// Health (`/healthz`, `/livez`).
    pub health: Arc<ProxyHealth>,
    /// Metrics.
    pub metrics: Arc<Metrics>,
}

impl Shared {
    /// Empty state: nothing seen yet, registration pending.
    pub fn new(proxy_name: Option<String>, health: Arc<ProxyHealth>, metrics: Arc<Metrics>) -> Self {
        Self {
            tracker: Mutex::new(Tracker::new(proxy_name)),
            node: Mutex::new(None),
            wish: Mutex::new(Wish::default()),
            proxy_settings: Mutex::new(None),
            spec_listed: AtomicBool::new(false),
            needs_registration: AtomicBool::new(true),
            wake: Notify::new(),
            health,
            metrics,
        }
    }

    /// Takes the pending registration request (true once per request).
    pub fn take_registration(&self) -> bool {
        self.needs_registration.swap(false, Ordering::Relaxed)
    }

    /// Asks for a registration before the next report.
    pub fn request_registration(&self) {
        self.needs_registration.store(true, Ordering::Relaxed);
    }

    /// A change to program: counts it as queued and wakes the sync loop.
    fn notify(&self) {
        self.health.queued();
        self.metrics.last_queued_timestamp.set(now_seconds());
        self.wake.notify_one();
    }
}

/// Locks `m`, also when a panicking holder poisoned it (the data stays usable).
pub(super) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Seconds since the epoch, for timestamp gauges.
pub(super) fn now_seconds() -> f64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs_f64()
}

/// Runs every watch (and the apiserver probe during outages); never ends unless one fails for
/// good.
pub(super) async fn run(client: Client, intake: super::Intake, shared: Arc<Shared>) -> Result<()> {
    let node_name = intake.node_name;
    tokio::try_join!(
        watch_tracked::<Service>(client.clone(), shared.clone(), intake.list_page),
        watch_tracked::<EndpointSlice>(client.clone(), shared.clone(), intake.list_page),
        watch_node(client.clone(), node_name.clone(), shared.clone()),
        watch_own_nodeproxy(client.clone(), node_name, shared.clone()),
        probe_api(client, shared)
    )
    .map(|_| ())
}

/// Strips managed fields: they are large and never read.
fn trim<K: kube::Resource>(mut obj: K) -> K {
    obj.meta_mut().managed_fields = None;
    obj
}

/// How a watched kind feeds the tracker.
trait Tracked: kube::Resource + WireKind + Send + 'static {
    /// What the tracker keeps of one object: a relist collects these, not the API objects (at
    /// 250k endpoints the objects cost several times the model).
    type Entry: Send;
    /// An add or update; returns whether anything programmed changed.
    fn apply(tracker: &mut Tracker, obj: &Self) -> bool;
    /// A delete.
    fn delete(tracker: &mut Tracker, namespace: &str, name: &str) -> bool;
    /// The entry of one relisted object (None: not tracked).
    fn entry(obj: &Self) -> Option<Self::Entry>;
    /// A relist.
    fn reset(tracker: &mut Tracker, all: Vec<Self::Entry>);
    /// Whether this kind has been listed whole once (until then a list goes straight into the
    /// tracker as it arrives: nothing reads the kind before).
    fn listed(tracker: &Tracker) -> bool;
    /// The first list starts (again).
    fn restart_first(tracker: &mut Tracker);
    /// The first list is whole.
    fn first_done(tracker: &mut Tracker);
    /// The metric to count a change with.
    fn counter(metrics: &Metrics) -> &prometheus_client::metrics::counter::Counter;
}

impl Tracked for Service {
    type Entry = ServiceEntry;
    fn apply(t: &mut Tracker, o: &Self) -> bool {
        t.apply_service(o)
    }
    fn delete(t: &mut Tracker, ns: &str, name: &str) -> bool {
        t.delete_service(ns, name)
    }
    fn entry(o: &Self) -> Option<ServiceEntry> {
        ServiceEntry::of(o)
    }
    fn reset(t: &mut Tracker, all: Vec<ServiceEntry>) {
        t.reset_service_entries(all)
    }
    fn listed(t: &Tracker) -> bool {
        t.services_listed()
    }
    fn restart_first(t: &mut Tracker) {
        t.restart_first_service_list()
    }
    fn first_done(t: &mut Tracker) {
        t.first_service_list_done()
    }
    fn counter(m: &Metrics) -> &prometheus_client::metrics::counter::Counter {
        &m.service_changes_total
    }
}

impl Tracked for EndpointSlice {
    type Entry = SliceEntry;
    fn apply(t: &mut Tracker, o: &Self) -> bool {
        t.apply_slice(o)
    }
    fn delete(t: &mut Tracker, ns: &str, name: &str) -> bool {
        t.delete_slice(ns, name)
    }
    fn entry(o: &Self) -> Option<SliceEntry> {
        SliceEntry::of(o)
    }
    fn reset(t: &mut Tracker, all: Vec<SliceEntry>) {
        t.reset_slice_entries(all)
    }
    fn listed(t: &Tracker) -> bool {
        t.slices_listed()
    }
    fn restart_first(t: &mut Tracker) {
        t.restart_first_slice_list()
    }
    fn first_done(t: &mut Tracker) {
        t.first_slice_list_done()
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
fn watch_item<T, E: std::fmt::Display>(shared: &Shared, what: &'static str, item: Result<T, E>) -> Option<T> {
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

/// Applies one watch event of a tracked kind; returns whether anything programmed changed.
/// `init` collects a relist (converted as it arrives) until it is done, which then replaces the
/// kind's whole state; the kind's first list, which nothing reads before it is whole, goes into
/// the tracker as it arrives (at 10k Services putting it in after the list kept 44–54 ms between
/// the last list page and the first sync, 26–33 ms since).
fn track_event<K: Tracked>(t: &mut Tracker, init: &mut Vec<K::Entry>, event: watcher::Event<K>) -> bool {
    if !K::listed(t) {
        match event {
            watcher::Event::Init => {
                K::restart_first(t);
                return false;
            }
            watcher::Event::InitApply(o) => {
                // As a watch's add: nothing reads the kind yet, so nothing is woken.
                K::apply(t, &o);
                return false;
            }
            watcher::Event::InitDone => {
                K::first_done(t);
                return true;
            }
            // (A watch follows only a whole list: these come after it.)
            watcher::Event::Apply(_) | watcher::Event::Delete(_) => {}
        }
    }
    match event {
        watcher::Event::Apply(o) => K::apply(t, &o),
        watcher::Event::Delete(o) => K::delete(
            t,
            o.meta().namespace.as_deref().unwrap_or_default(),
            o.meta().name.as_deref().unwrap_or_default(),
        ),
        watcher::Event::Init => {
            init.clear();
            false
        }
        watcher::Event::InitApply(o) => {
            init.extend(K::entry(&o));
            false
        }
        watcher::Event::InitDone => {
            K::reset(t, std::mem::take(init));
            true
        }
    }
}

/// Feeds one kind's list and watch events into the tracker; a relist replaces the kind's whole
/// state. Never ends: errors are retried with [`WatchBackoff`], from where the watch left off.
async fn watch_tracked<K: Tracked>(client: Client, shared: Arc<Shared>, list_page: u32) -> Result<()> {
    let mut init: Vec<K::Entry> = Vec::new();
    let mut listing_since = std::time::Instant::now();
    // Objects of the list under way (the first list goes into the tracker, not into `init`).
    let mut listed_objects = 0usize;
    let mut position = reflector::Position::Unlisted;
    let mut backoff = WatchBackoff::new();
    loop {
        let started = std::time::Instant::now();
        let watching = position != reflector::Position::Unlisted;
        let mut heard = false;
        let mut emit = |event: watcher::Event<K>| {
            // An event: the apiserver answers (ends an outage in health and metrics).
            heard = true;
            kube::runtime::utils::Backoff::reset(&mut backoff);
            watch_item::<_, Error>(&shared, K::WHAT, Ok(()));
            match &event {
                watcher::Event::Init => {
                    listing_since = std::time::Instant::now();
                    listed_objects = 0;
                }
                watcher::Event::InitApply(_) => listed_objects += 1,
                watcher::Event::InitDone => tracing::info!(
                    watch = K::WHAT,
                    listed = listed_objects,
                    millis = listing_since.elapsed().as_millis() as u64,
                    "listed"
                ),
                _ => {}
            }
            let changed = track_event(&mut lock(&shared.tracker), &mut init, event);
            if changed {
                K::counter(&shared.metrics).inc();
                shared.notify();
            }
        };
        let outcome = reflector::step::<K>(&client, &mut position, list_page, &mut emit).await;
        match outcome {
            Ok(()) if ended_at_once(heard, started.elapsed()) => {
                // Not an error, but a server or proxy that closes every watch at once would
                // otherwise make this a tight request loop.
                tracing::debug!(watch = K::WHAT, "watch ended at once without events; backing off");
                tokio::time::sleep(backoff.next().unwrap_or(WatchBackoff::MAX)).await;
            }
            Ok(()) => kube::runtime::utils::Backoff::reset(&mut backoff),
            Err(e) if watching && position == reflector::Position::Unlisted => {
                // A 410: the apiserver answers, it just no longer has this watch's version (its
                // watch cache restarted or moved on). Not an outage; the backoff only guards
                // against a server that answers every watch so.
                tracing::info!(watch = K::WHAT, error = %e, "relisting: the apiserver no longer has the version this watch was at");
                tokio::time::sleep(backoff.next().unwrap_or(WatchBackoff::MAX)).await;
            }
            Err(e) => {
                watch_item::<(), _>(&shared, K::WHAT, Err(e));
                tokio::time::sleep(backoff.next().unwrap_or(WatchBackoff::MAX)).await;
            }
        }
    }
}

/// Whether a step that succeeded was a watch that ended within a second without a single event
/// (a list always emits): the next one waits out the backoff instead of starting at once.
fn ended_at_once(heard: bool, took: Duration) -> bool {
    !heard && took < Duration::from_secs(1)
}

/// Whether the node may receive load-balancer traffic (kube-proxy's /healthz node check).
pub(super) fn node_eligible(node: Option<&Node>) -> bool {
    node.is_some_and(|n| {
        n.metadata.deletion_timestamp.is_none()
            && !n
                .spec
                .as_ref()
                .and_then(|s| s.taints.as_ref())
                .is_some_and(|t| t.iter().any(|t| t.key == "ToBeDeletedByClusterAutoscaler"))
    })
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
        shared.notify();
    }
    Ok(())
}

/// Takes our NodeProxy's spec as the wish (and the policy's proxy settings).
fn apply_spec(shared: &Shared, np: &NodeProxy) {
    let mut wish = lock(&shared.wish);
    if np.spec.desired_mode.is_none() {
        // A spec without a desired mode is what a re-created NodeProxy looks like until the
        // operator writes it again: keep the health gate and settings of a switch under way
        // instead of falling back to defaults.
        if wish.desired.is_some() {
            tracing::warn!(
                "NodeProxy spec has no desired mode (re-created?); keeping the last health gate and settings until the operator writes it"
            );
        }
        wish.desired = None;
        wish.generation = np.metadata.generation;
        return;
    }
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
            watcher::Event::Apply(np) | watcher::Event::InitApply(np) => apply_spec(&shared, &np),
            // Deleted under us: the sync loop registers it again and reports at once.
            watcher::Event::Delete(_) => shared.request_registration(),
            watcher::Event::InitDone => shared.spec_listed.store(true, Ordering::Relaxed),
            watcher::Event::Init => continue,
        }
        shared.wake.notify_one();
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_quick_silent_watch_end_backs_off() {
        let ms = Duration::from_millis;
        assert!(ended_at_once(false, ms(0)), "closed at once");
        assert!(ended_at_once(false, ms(999)));
        assert!(
            !ended_at_once(false, ms(1000)),
            "a watch that lasted ran its course"
        );
        assert!(
            !ended_at_once(true, ms(5)),
            "events were heard (a list always emits)"
        );
    }

    #[test]
    fn watch_backoff_grows_to_its_cap_with_jitter_and_never_ends() {
        let delays: Vec<Duration> = WatchBackoff::new().take(50).collect();
        assert_eq!(delays.len(), 50);
        for d in &delays {
            assert!(*d >= WatchBackoff::INITIAL / 2 && *d < WatchBackoff::MAX, "{d:?}");
        }
        assert!(delays[10..].iter().all(|d| *d >= WatchBackoff::MAX / 2));
    }

    fn service(name: &str) -> Service {
        serde_json::from_value(serde_json::json!({
            "metadata": {"namespace": "ns", "name": name, "managedFields": [{"manager": "m"}]},
            "spec": {"clusterIP": "10.96.0.10", "ports": [{"port": 80, "protocol": "TCP"}]},
        }))
        .expect("service")
    }

    fn names(t: &mut Tracker) -> Vec<String> {
        t.snapshot()
            .families()
            .iter()
            .flat_map(|s| s.services.keys().map(|k| k.service.name.to_string()))
            .collect()
    }

    /// Feeds a whole list of Services named `names`.
    fn list(t: &mut Tracker, init: &mut Vec<ServiceEntry>, names: &[&str]) -> bool {
        let mut changed = track_event(t, init, watcher::Event::<Service>::Init);
        for name in names {
            changed |= track_event(t, init, watcher::Event::InitApply(service(name)));
        }
        changed
    }

    #[test]
    fn a_relist_replaces_the_kind_only_once_done() {
        let mut t = Tracker::new(None);
        let mut init = Vec::new();
        list(&mut t, &mut init, &["a"]);
        assert!(track_event(
            &mut t,
            &mut init,
            watcher::Event::<Service>::InitDone
        ));
        assert!(
            !list(&mut t, &mut init, &["b"]),
            "a relist changes nothing until done"
        );
        assert_eq!(init.len(), 1);
        // Kept as the tracker's entry, not as the API object.
        assert_eq!(Some(&init[0]), ServiceEntry::of(&service("b")).as_ref());
        assert_eq!(
            names(&mut t),
            ["a"],
            "the old state stands while the relist loads"
        );
        assert!(track_event(
            &mut t,
            &mut init,
            watcher::Event::<Service>::InitDone
        ));
        assert!(init.is_empty());
        assert_eq!(
            names(&mut t),
            ["b"],
            "the relist dropped a, which it did not list"
        );
    }

    #[test]
    fn the_first_list_goes_in_as_it_arrives_and_a_restarted_one_drops_its_part() {
        let mut t = Tracker::new(None);
        let mut init = Vec::new();
        assert!(!list(&mut t, &mut init, &["a", "b"]));
        assert!(init.is_empty(), "not buffered: straight into the tracker");
        assert!(!t.services_listed(), "not listed until the list is whole");
        // The list failed part-way; the next one starts over.
        assert!(!list(&mut t, &mut init, &["c"]));
        assert!(track_event(
            &mut t,
            &mut init,
            watcher::Event::<Service>::InitDone
        ));
        assert!(t.services_listed());
        assert_eq!(names(&mut t), ["c"], "a and b came only in the failed list");
        // A watch event after it applies as usual.
        assert!(track_event(
            &mut t,
            &mut init,
            watcher::Event::Apply(service("d"))
        ));
        assert_eq!(names(&mut t), ["c", "d"]);
    }

    #[test]
    fn nodes_being_deleted_or_drained_are_not_eligible() {
        let node = |json| serde_json::from_value::<Node>(json).expect("node");
        assert!(!node_eligible(None));
        assert!(node_eligible(Some(&node(
            serde_json::json!({"metadata": {"name": "n"}})
        ))));
        let deleting =
            node(serde_json::json!({"metadata": {"name": "n", "deletionTimestamp": "2026-01-01T00:00:00Z"}}));
        assert!(!node_eligible(Some(&deleting)));
        let drained = node(
            serde_json::json!({"metadata": {"name": "n"}, "spec": {"taints": [{"key": "ToBeDeletedByClusterAutoscaler", "effect": "NoSchedule"}]}}),
        );
        assert!(!node_eligible(Some(&drained)));
    }
}
