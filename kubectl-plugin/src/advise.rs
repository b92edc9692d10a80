//! `kubectl switchyard advise [POLICY]`: the mode advisor's recommendation for each node (as its
//! agent reported it in the NodeProxy status, with the figures it used) and the summary over
//! the nodes shown, made by the same function the operator writes into the ProxyPolicy status
//! ([`switchyard_planner::advisor::pool_advice`]).

use std::fmt::Write as _;

use serde::Serialize;
use switchyard_crds::{
    consts::POLICY_LABEL,
    v1alpha1::{AdviceAction, ModeAdvice, NodeProxy, PoolAdvice, ProxyPolicy, SyncMeasurements},
};
use switchyard_planner::advisor;

use crate::table;

/// One node's recommendation and figures.
#[derive(Clone, Debug, Serialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct AdviceRow {
    /// Node name.
    pub node: String,
    /// Mode its agent runs.
    pub active: Option<String>,
    /// Kernel release.
    pub kernel: Option<String>,
    /// The window of sync durations the agent measured.
    pub measurements: Option<SyncMeasurements>,
    /// The advisor's recommendation (none until the agent has synced).
    pub advice: Option<ModeAdvice>,
}

/// What `advise` shows.
#[derive(Clone, Debug, Serialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct AdviseReport {
    /// The policy whose nodes are shown (none: every node).
    pub policy: Option<String>,
    /// Its mode.
    pub policy_mode: Option<String>,
    /// The nodes, sorted by name.
    pub nodes: Vec<AdviceRow>,
    /// The summary over them.
    pub pool: PoolAdvice,
}

/// Whether `np` is one of `policy`'s nodes (the operator labels them and names the policy in
/// their spec).
fn governed_by(np: &NodeProxy, policy: &str) -> bool {
    np.spec.policy.as_ref().is_some_and(|p| p.name == policy)
        || np
            .metadata
            .labels
            .as_ref()
            .and_then(|l| l.get(POLICY_LABEL))
            .is_some_and(|v| v == policy)
}

/// The report over `policy`'s nodes (every NodeProxy when `None`).
pub fn advise_report(policy: Option<&ProxyPolicy>, proxies: &[NodeProxy]) -> AdviseReport {
    let name = policy.and_then(|p| p.metadata.name.clone());
    let mut nodes: Vec<AdviceRow> = proxies
        .iter()
        .filter(|np| name.as_deref().is_none_or(|n| governed_by(np, n)))
        .map(|np| {
            let status = np.status.as_ref();
            AdviceRow {
                node: np.metadata.name.clone().unwrap_or_default(),
                active: status.and_then(|s| s.active_mode).map(|m| m.to_string()),
                kernel: status
                    .and_then(|s| s.capabilities.as_ref())
                    .map(|c| c.kernel_version.clone()),
                measurements: status.and_then(|s| s.measurements.clone()),
                advice: status.and_then(|s| s.advice.clone()),
            }
        })
        .collect();
    nodes.sort_by(|a, b| a.node.cmp(&b.node));
    let pool = advisor::pool_advice(nodes.iter().map(|n| n.advice.as_ref()));
    AdviseReport {
        policy: name,
        policy_mode: policy.map(|p| p.spec.mode.to_string()),
        nodes,
        pool,
    }
}

/// The verdict in a few words: `switch → nftables`, `stay (iptables)`.
fn verdict(a: &ModeAdvice) -> String {
    match a.action {
        AdviceAction::Switch => format!("switch → {}", a.recommended_mode),
        AdviceAction::Stay => format!("stay ({})", a.recommended_mode),
    }
}

/// The table of nodes, each node's recommendation in words, and the pool's summary.
pub fn render_advice(r: &AdviseReport) -> String {
    let dash = || "-".to_owned();
    let rows: Vec<Vec<String>> = r
        .nodes
        .iter()
        .map(|n| {
            let m = n.measurements.as_ref();
            let num = |f: fn(&SyncMeasurements) -> i64| m.map(|m| f(m).to_string()).unwrap_or_else(dash);
            vec![
                n.node.clone(),
                n.active.clone().unwrap_or_else(dash),
                n.kernel.clone().unwrap_or_else(dash),
                num(|m| m.syncs),
                num(|m| m.average_millis),
                num(|m| m.p90_millis),
                num(|m| m.max_millis),
                num(|m| m.services),
                num(|m| m.endpoints),
                num(|m| m.rules),
                n.advice
                    .as_ref()
                    .map(verdict)
                    .unwrap_or_else(|| "no data yet".into()),
                n.advice.as_ref().map(|a| a.reasons.join(",")).unwrap_or_default(),
            ]
        })
        .collect();
    let mut out = match (&r.policy, &r.policy_mode) {
        (Some(p), Some(mode)) => format!("Policy {p} (mode {mode}): {} nodes\n", r.nodes.len()),
        _ => format!("All nodes: {}\n", r.nodes.len()),
    };
    out.push_str(&table(
        &[
            "NODE",
            "ACTIVE",
            "KERNEL",
            "SYNCS",
            "AVG-MS",
            "P90-MS",
            "MAX-MS",
            "SERVICES",
            "ENDPOINTS",
            "RULES",
            "ADVICE",
            "REASONS",
        ],
        &rows,
    ));
    for n in &r.nodes {
        if let Some(a) = &n.advice {
            let _ = writeln!(out, "{}: {}", n.node, a.message);
        }
    }
    let _ = writeln!(out, "Pool: {}", r.pool.message);
    out
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use serde_json::json;

    fn np(name: &str, policy: Option<&str>, status: serde_json::Value) -> NodeProxy {
        let mut v = json!({
            "apiVersion": "switchyard.dev/v1alpha1", "kind": "NodeProxy",
            "metadata": {"name": name}, "spec": {}, "status": status,
        });
        if let Some(p) = policy {
            v["spec"]["policy"] = json!({"name": p});
        }
        serde_json::from_value(v).unwrap()
    }

    fn measured(services: i64, avg: i64) -> serde_json::Value {
        let m = SyncMeasurements {
            mode: switchyard_crds::v1alpha1::ProxyMode::Iptables,
            measured_at: None,
            window_seconds: 30,
            syncs: 6,
            full_syncs: 1,
            average_millis: avg,
            p90_millis: avg + 10,
            max_millis: avg + 20,
            services,
            endpoints: services * 2,
            rules: services * 8,
        };
        let mut caps = switchyard_crds::v1alpha1::Capabilities {
            kernel_version: "6.18.0".into(),
            ..Default::default()
        };
        caps.nftables.usable = true;
        let advice = advisor::node_advice(&m, &caps);
        json!({"activeMode": "iptables", "capabilities": caps, "measurements": m, "advice": advice})
    }

    #[test]
    fn rows_per_node_then_messages_and_the_pool() {
        let proxies = [
            np("small", Some("pool"), measured(12, 40)),
            np("big", Some("pool"), measured(10_000, 800)),
            np("other", Some("elsewhere"), measured(10_000, 800)),
            np("fresh", Some("pool"), json!({})),
        ];
        let policy: ProxyPolicy = serde_json::from_value(json!({
            "apiVersion": "switchyard.dev/v1alpha1", "kind": "ProxyPolicy",
            "metadata": {"name": "pool"},
            "spec": {"nodeSelector": {}, "mode": "iptables"},
        }))
        .unwrap();
        let r = advise_report(Some(&policy), &proxies);
        let names: Vec<&str> = r.nodes.iter().map(|n| n.node.as_str()).collect();
        assert_eq!(names, ["big", "fresh", "small"]);
        assert_eq!((r.pool.advised_nodes, r.pool.unadvised_nodes), (2, 1));
        let text = render_advice(&r);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines[0], "Policy pool (mode iptables): 3 nodes");
        assert!(lines[1].starts_with("NODE"), "{text}");
        let big: Vec<&str> = lines[2].split_whitespace().collect();
        assert_eq!(
            big,
            [
                "big",
                "iptables",
                "6.18.0",
                "6",
                "800",
                "810",
                "820",
                "10000",
                "20000",
                "80000",
                "switch",
                "→",
                "nftables",
                "ManyServices"
            ]
        );
        assert!(
            lines[3].starts_with("fresh") && lines[3].contains("no data yet"),
            "{text}"
        );
        assert!(
            lines[4].contains("stay (iptables)") && lines[4].ends_with("WithinLimits"),
            "{text}"
        );
        assert!(
            lines[5].starts_with("big: switch to nftables: 10000 service ports"),
            "{text}"
        );
        assert!(lines[6].starts_with("small: stay on iptables"), "{text}");
        assert!(
            lines[7].starts_with("Pool: 1 switch to nftables (ManyServices), 1 stay on iptables (WithinLimits); 1 without advice"),
            "{text}"
        );
        assert_eq!(
            advise_report(None, &proxies).nodes.len(),
            4,
            "every node without a policy"
        );
    }
}
