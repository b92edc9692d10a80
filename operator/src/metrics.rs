//! Prometheus metrics of the operator (`switchyard_operator_*`), served on `/metrics`.

use prometheus_client::{
    encoding::{EncodeLabelSet, text::encode},
    metrics::{counter::Counter, family::Family, gauge::Gauge, histogram::Histogram},
    registry::Registry,
};

/// Label: error kind ([`crate::Error::metric_label`]).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ErrorLabel {
    /// Error kind.
    pub error: String,
}

/// Label: event reason.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabel {
    /// Event reason, e.g. `WaveStarted`.
    pub reason: String,
}

/// Labels: policy and node count kind (few policies per cluster, so per-policy labels are fine).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PolicyNodesLabel {
    /// Policy name.
    pub policy: String,
    /// `target`, `updated`, `healthy`, `failed` or `incompatible`.
    pub kind: String,
}

/// Label: object kind.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindLabel {
    /// Kind, e.g. `ProxyPolicy`.
    pub kind: String,
}

/// Node count kinds of `switchyard_operator_policy_nodes`.
pub const POLICY_NODE_KINDS: [&str; 5] = ["target", "updated", "healthy", "failed", "incompatible"];

/// Every metric the operator exports.
pub struct Metrics {
    registry: Registry,
    /// switchyard_operator_reconciles_total.
    pub reconciles: Counter,
    /// switchyard_operator_reconcile_errors_total{error}.
    pub reconcile_errors: Family<ErrorLabel, Counter>,
    /// switchyard_operator_reconcile_duration_seconds.
    pub reconcile_duration: Histogram,
    /// switchyard_operator_plan_duration_seconds: the pure planner alone.
    pub plan_duration: Histogram,
    /// switchyard_operator_nodeproxy_writes_total.
    pub node_writes: Counter,
    /// switchyard_operator_events_total{reason}.
    pub events: Family<ReasonLabel, Counter>,
    /// switchyard_operator_leader: 1 while this replica holds the Lease.
    pub leader: Gauge,
    /// switchyard_operator_policy_nodes{policy,kind}.
    pub policy_nodes: Family<PolicyNodesLabel, Gauge>,
    /// switchyard_operator_ungoverned_nodes: NodeProxies released from a policy that is gone.
    pub ungoverned_nodes: Gauge,
    /// switchyard_operator_api_reachable: 0 while the Kubernetes API fails.
    pub api_reachable: Gauge,
    /// switchyard_operator_api_unreachable_since_seconds: Unix time since which it fails, 0 when not.
    pub api_unreachable_since: Gauge,
    /// switchyard_operator_decode_failures_total{kind}: objects (per resourceVersion) the typed
    /// structs could not decode.
    pub decode_failures: Family<KindLabel, Counter>,
    /// switchyard_operator_undecodable_objects{kind}: objects left out of the caches now.
    pub undecodable_objects: Family<KindLabel, Gauge>,
    /// Policies with `policy_nodes` series (removed when the policy is gone).
    reported: std::sync::Mutex<std::collections::BTreeSet<String>>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Creates and registers every metric.
    pub fn new() -> Self {
        let buckets = || prometheus_client::metrics::histogram::exponential_buckets(0.0005, 2.0, 16);
        let mut registry = Registry::with_prefix("switchyard_operator");
        let m = Self {
            reconciles: Counter::default(),
            reconcile_errors: Family::default(),
            reconcile_duration: Histogram::new(buckets()),
            plan_duration: Histogram::new(buckets()),
            node_writes: Counter::default(),
            events: Family::default(),
            leader: Gauge::default(),
            policy_nodes: Family::default(),
            ungoverned_nodes: Gauge::default(),
            api_reachable: Gauge::default(),
            api_unreachable_since: Gauge::default(),
            decode_failures: Family::default(),
            undecodable_objects: Family::default(),
            reported: Default::default(),
            registry: Registry::default(),
        };
        registry.register("reconciles", "Reconciles of ProxyPolicies", m.reconciles.clone());
        registry.register(
            "reconcile_errors",
            "Failed reconciles by error kind",
            m.reconcile_errors.clone(),
        );
        registry.register(
            "reconcile_duration_seconds",
            "Duration of one reconcile",
            m.reconcile_duration.clone(),
        );
        registry.register(
            "plan_duration_seconds",
            "Duration of the pure planner",
            m.plan_duration.clone(),
        );
        registry.register(
            "nodeproxy_writes",
            "NodeProxy specs applied",
            m.node_writes.clone(),
        );
        registry.register("events", "Events published by reason", m.events.clone());
        registry.register("leader", "1 while this replica is the leader", m.leader.clone());
        registry.register("policy_nodes", "Nodes per policy by kind", m.policy_nodes.clone());
        registry.register(
            "ungoverned_nodes",
            "NodeProxies released from a deleted policy (or one that no longer selects them)",
            m.ungoverned_nodes.clone(),
        );
        registry.register(
            "api_reachable",
            "1 while the Kubernetes API answers, 0 while it fails",
            m.api_reachable.clone(),
        );
        registry.register(
            "api_unreachable_since_seconds",
            "Unix time since which the Kubernetes API fails, 0 while it answers",
            m.api_unreachable_since.clone(),
        );
        registry.register(
            "decode_failures",
            "Objects (per resourceVersion) that could not be decoded",
            m.decode_failures.clone(),
        );
        registry.register(
            "undecodable_objects",
            "Objects left out of the caches because they cannot be decoded",
            m.undecodable_objects.clone(),
        );
        Self { registry, ..m }
    }

    /// Sets the `policy_nodes` series of `policy` (`values` in [`POLICY_NODE_KINDS`] order).
    pub fn set_policy_nodes(&self, policy: &str, values: [i32; 5]) {
        for (kind, value) in POLICY_NODE_KINDS.iter().zip(values) {
            self.policy_nodes
                .get_or_create(&PolicyNodesLabel {
                    policy: policy.into(),
                    kind: (*kind).into(),
                })
                .set(i64::from(value));
        }
        self.reported
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert(policy.into());
    }

    /// Removes the `policy_nodes` series of policies not in `existing` (deleted policies report
    /// nothing rather than their last counts).
    pub fn retain_policies(&self, existing: &std::collections::BTreeSet<String>) {
        let mut reported = self
            .reported
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        for policy in reported.iter().filter(|p| !existing.contains(*p)) {
            for kind in POLICY_NODE_KINDS {
                self.policy_nodes.remove(&PolicyNodesLabel {
                    policy: policy.clone(),
                    kind: kind.into(),
                });
            }
        }
        reported.retain(|p| existing.contains(p));
    }

    /// The Prometheus text exposition.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        if encode(&mut out, &self.registry).is_err() {
            out.clear();
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_deleted_policy_loses_its_series() {
        let m = Metrics::new();
        m.set_policy_nodes("a", [3, 2, 2, 0, 1]);
        m.set_policy_nodes("b", [1, 1, 1, 0, 0]);
        assert!(
            m.encode()
                .contains(r#"switchyard_operator_policy_nodes{policy="a",kind="target"} 3"#)
        );
        m.retain_policies(&["b".to_string()].into());
        let text = m.encode();
        assert!(!text.contains(r#"policy="a""#), "{text}");
        assert!(text.contains(r#"policy="b""#), "{text}");
    }
}
