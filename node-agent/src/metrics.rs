//! Prometheus metrics with kube-proxy's names (`kubeproxy_*`) plus `switchyard_*`.

use prometheus_client::{
    encoding::{EncodeLabelSet, text::encode},
    metrics::{counter::Counter, family::Family, gauge::Gauge, histogram::Histogram},
    registry::Registry,
};
use std::sync::atomic::AtomicU64;

/// Label: traffic policy for the no-local-endpoints gauge.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TrafficPolicy {
    /// `internal` or `external`.
    pub traffic_policy: String,
}

/// Label: backend mode.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ModeLabel {
    /// `iptables`, `nftables`, `ipvs`.
    pub mode: String,
}

/// Label: what the idle check found.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CheckResult {
    /// `intact` (no sync needed), `changed` (a full resync followed) or `unchecked` (the backend
    /// has no cheap check, IPVS: a full resync followed).
    pub result: String,
}

/// Label: HTTP status code.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CodeLabel {
    /// Status code.
    pub code: String,
}

fn seconds_buckets() -> impl Iterator<Item = f64> {
    prometheus_client::metrics::histogram::exponential_buckets(0.001, 2.0, 15)
}

/// Every metric the agent exports.
pub struct Metrics {
    registry: Registry,
    /// kubeproxy_sync_proxy_rules_duration_seconds.
    pub sync_duration: Histogram,
    /// kubeproxy_sync_full_proxy_rules_duration_seconds.
    pub sync_full_duration: Histogram,
    /// kubeproxy_sync_partial_proxy_rules_duration_seconds.
    pub sync_partial_duration: Histogram,
    /// kubeproxy_sync_proxy_rules_last_timestamp_seconds.
    pub last_sync_timestamp: Gauge<f64, AtomicU64>,
    /// kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds.
    pub last_queued_timestamp: Gauge<f64, AtomicU64>,
    /// kubeproxy_sync_proxy_rules_service_changes_pending.
    pub service_changes_pending: Gauge,
    /// kubeproxy_sync_proxy_rules_service_changes_total.
    pub service_changes_total: Counter,
    /// kubeproxy_sync_proxy_rules_endpoint_changes_total.
    pub endpoint_changes_total: Counter,
    /// kubeproxy_sync_proxy_rules_no_local_endpoints_total{traffic_policy}.
    pub no_local_endpoints: Family<TrafficPolicy, Gauge>,
    /// kubeproxy_proxy_healthz_total{code}.
    pub healthz_total: Family<CodeLabel, Counter>,
    /// kubeproxy_proxy_livez_total{code}.
    pub livez_total: Family<CodeLabel, Counter>,
    /// switchyard_sync_failures_total{mode}.
    pub sync_failures: Family<ModeLabel, Counter>,
    /// switchyard_idle_checks_total{result}: checks of our rules in the kernel after an idle sync
    /// period, by what they found.
    pub idle_checks: Family<CheckResult, Counter>,
    /// switchyard_programmed_services{mode}.
    pub programmed_services: Family<ModeLabel, Gauge>,
    /// switchyard_sync_objects_written{mode}: kernel objects written by the last sync.
    pub objects_written: Family<ModeLabel, Gauge>,
    /// switchyard_apiserver_reachable: 1 while every watch is healthy, 0 while one is failing.
    pub apiserver_reachable: Gauge,
    /// switchyard_apiserver_unreachable_since_timestamp_seconds: when the current outage began
    /// (0 while the apiserver is reachable).
    pub apiserver_unreachable_since: Gauge<f64, AtomicU64>,
    /// switchyard_apiserver_errors_total: watch and request errors seen.
    pub apiserver_errors_total: Counter,
    /// switchyard_state_file_problem: 1 while the persisted switch state was unreadable, stale
    /// (disagreed with the kernel) or could not be written; 0 otherwise.
    pub state_file_problem: Gauge,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Creates and registers every metric.
    pub fn new() -> Self {
        let mut registry = Registry::default();
        let m = Self {
            sync_duration: Histogram::new(seconds_buckets()),
            sync_full_duration: Histogram::new(seconds_buckets()),
            sync_partial_duration: Histogram::new(seconds_buckets()),
            last_sync_timestamp: Gauge::default(),
            last_queued_timestamp: Gauge::default(),
            service_changes_pending: Gauge::default(),
            service_changes_total: Counter::default(),
            endpoint_changes_total: Counter::default(),
            no_local_endpoints: Family::default(),
            healthz_total: Family::default(),
            livez_total: Family::default(),
            sync_failures: Family::default(),
            idle_checks: Family::default(),
            programmed_services: Family::default(),
            objects_written: Family::default(),
            apiserver_reachable: Gauge::default(),
            apiserver_unreachable_since: Gauge::default(),
            apiserver_errors_total: Counter::default(),
            state_file_problem: Gauge::default(),
            registry: Registry::default(),
        };
        m.register_kube_proxy(&mut registry);
        m.register_switchyard(&mut registry);
        // kube-proxy's nfacct counters, read from the kernel at each scrape.
        registry.register_collector(Box::new(crate::preflight::NfacctCollector));
        m.apiserver_reachable.set(1);
        Self { registry, ..m }
    }

    /// Registers kube-proxy's metrics (`kubeproxy_*`).
    fn register_kube_proxy(&self, registry: &mut Registry) {
        let m = self;
        registry.register(
            "kubeproxy_sync_proxy_rules_duration_seconds",
            "SyncProxyRules latency in seconds",
            m.sync_duration.clone(),
        );
        registry.register(
            "kubeproxy_sync_full_proxy_rules_duration_seconds",
            "Full SyncProxyRules latency in seconds",
            m.sync_full_duration.clone(),
        );
        registry.register(
            "kubeproxy_sync_partial_proxy_rules_duration_seconds",
            "Partial SyncProxyRules latency in seconds",
            m.sync_partial_duration.clone(),
        );
        registry.register(
            "kubeproxy_sync_proxy_rules_last_timestamp_seconds",
            "The last time proxy rules were successfully synced",
            m.last_sync_timestamp.clone(),
        );
        registry.register(
            "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds",
            "The last time a sync of proxy rules was queued",
            m.last_queued_timestamp.clone(),
        );
        registry.register(
            "kubeproxy_sync_proxy_rules_service_changes_pending",
            "Pending proxy rules Service changes",
            m.service_changes_pending.clone(),
        );
        registry.register(
            "kubeproxy_sync_proxy_rules_service_changes",
            "Cumulative proxy rules Service changes",
            m.service_changes_total.clone(),
        );
        registry.register(
            "kubeproxy_sync_proxy_rules_endpoint_changes",
            "Cumulative proxy rules Endpoint changes",
            m.endpoint_changes_total.clone(),
        );
        registry.register(
            "kubeproxy_sync_proxy_rules_no_local_endpoints",
            "Number of services with a Local traffic policy and no endpoints",
            m.no_local_endpoints.clone(),
        );
        registry.register(
            "kubeproxy_proxy_healthz",
            "Cumulative proxy healthz HTTP status",
            m.healthz_total.clone(),
        );
        registry.register(
            "kubeproxy_proxy_livez",
            "Cumulative proxy livez HTTP status",
            m.livez_total.clone(),
        );
    }

    /// Registers Switchyard's own metrics (`switchyard_*`).
    fn register_switchyard(&self, registry: &mut Registry) {
        let m = self;
        registry.register(
            "switchyard_sync_failures",
            "Syncs that failed, by mode",
            m.sync_failures.clone(),
        );
        registry.register(
            "switchyard_idle_checks",
            "Checks of our rules in the kernel after an idle sync period (instead of a full resync), by result: intact, changed (a full resync followed) or unchecked (no cheap check for this backend: a full resync followed)",
            m.idle_checks.clone(),
        );
        registry.register(
            "switchyard_programmed_services",
            "Service ports programmed, by mode",
            m.programmed_services.clone(),
        );
        registry.register(
            "switchyard_sync_objects_written",
            "Kernel objects written by the last sync, by mode",
            m.objects_written.clone(),
        );
        registry.register(
            "switchyard_apiserver_reachable",
            "1 while every watch on the apiserver is healthy, 0 during an outage",
            m.apiserver_reachable.clone(),
        );
        registry.register(
            "switchyard_apiserver_unreachable_since_timestamp_seconds",
            "Start of the current apiserver outage (0 while reachable)",
            m.apiserver_unreachable_since.clone(),
        );
        registry.register(
            "switchyard_apiserver_errors",
            "Watch and request errors from the apiserver",
            m.apiserver_errors_total.clone(),
        );
        registry.register(
            "switchyard_state_file_problem",
            "1 while the persisted switch state is unreadable, stale or unwritable",
            m.state_file_problem.clone(),
        );
    }

    /// Prometheus text exposition.
    pub fn render(&self) -> String {
        let mut out = String::new();
        if encode(&mut out, &self.registry).is_err() {
            out.clear();
        }
        out
    }
}
