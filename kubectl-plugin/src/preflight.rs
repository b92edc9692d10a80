//! The migration preflight in `kubectl switchyard plan`: every node's findings (the planner's
//! [`switchyard_planner::preflight`]) with their severity — `blocking` holds the node before its
//! switch until the facts change or `spec.rollout.preflight.accept` lists it (`accepted`), a
//! `warning` never holds — and what to change.

use serde::Serialize;
use switchyard_planner::preflight::Finding;

use crate::{NodeRow, table};

/// One finding on one node, as the plan shows it.
#[derive(Clone, Debug, Serialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct FindingRow {
    /// The finding's name (as `spec.rollout.preflight.accept` lists it).
    pub name: String,
    /// `blocking`, `accepted` or `warning`.
    pub severity: String,
    /// What was measured and what to change.
    pub message: String,
}

impl From<&Finding> for FindingRow {
    fn from(f: &Finding) -> Self {
        Self {
            name: f.name.to_owned(),
            severity: f.severity().to_owned(),
            message: f.message.clone(),
        }
    }
}

/// The findings table of a plan's nodes; empty when no node has one.
pub fn render_findings(nodes: &[NodeRow]) -> String {
    let rows: Vec<Vec<String>> = nodes
        .iter()
        .flat_map(|n| {
            n.preflight.iter().map(|f| {
                vec![
                    n.name.clone(),
                    f.name.clone(),
                    f.severity.clone(),
                    f.message.clone(),
                ]
            })
        })
        .collect();
    if rows.is_empty() {
        return String::new();
    }
    let held = nodes
        .iter()
        .filter(|n| n.preflight.iter().any(|f| f.severity == "blocking"))
        .count();
    let mut out = format!(
        "\npreflight: {held} node(s) held by a blocking finding (fix it, or list it in spec.rollout.preflight.accept)\n"
    );
    out.push_str(&table(&["NODE", "FINDING", "SEVERITY", "MESSAGE"], &rows));
    out
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use k8s_openapi::api::core::v1::Node;
    use k8s_openapi::jiff::Timestamp;
    use serde_json::json;
    use switchyard_crds::v1alpha1::NodeProxy;

    use crate::{plan_for, policies_from_yaml, render_plan};

    #[test]
    fn the_plan_lists_each_nodes_findings_and_what_holds_it() {
        let policy = "apiVersion: switchyard.dev/v1alpha1\nkind: ProxyPolicy\nmetadata: {name: p}\nspec:\n  nodeSelector: {}\n  mode: nftables\n  rollout: {preflight: {accept: [ConntrackInvalidDrops]}}\n";
        let policy = policies_from_yaml("p.yaml", policy).unwrap().remove(0);
        let node = |name: &str| -> Node {
            serde_json::from_value(json!({"metadata": {"name": name, "uid": format!("uid-{name}")}})).unwrap()
        };
        let proxy = |name: &str, localhost: i64, invalid: i64| -> NodeProxy {
            serde_json::from_value(json!({
                "metadata": {"name": name},
                "spec": {},
                "status": {
                    "activeMode": "iptables", "phase": "Active",
                    "capabilities": {"kernelVersion": "6.18.0", "supportedModes": ["iptables", "nftables"],
                        "nftables": {"usable": true}, "iptablesLegacy": {"usable": true},
                        "iptablesNft": {"usable": true}, "ipvs": {"usable": false}, "ipset": {"usable": true}},
                    "preflightFacts": {"mode": "iptables", "kernelVersion": "6.18.0",
                        "localhostNodePortsAcceptedPackets": localhost, "ctStateInvalidDroppedPackets": invalid,
                        "tcpBeLiberal": false, "nodePortAddresses": ["all"], "localhostNodePorts": true},
                },
            }))
            .unwrap()
        };
        let nodes = [node("a"), node("b")];
        let proxies = [proxy("a", 40, 0), proxy("b", 0, 7)];
        let now: Timestamp = "2025-01-06T12:00:00Z".parse().unwrap();
        let r = plan_for(&policy, &[], &nodes, &proxies, now).unwrap();
        let text = render_plan(&r);
        assert!(text.contains("preflight: 1 node(s) held"), "{text}");
        let line = |node: &str, finding: &str| {
            text.lines()
                .find(|l| l.starts_with(node) && l.contains(finding))
                .unwrap_or_else(|| panic!("no {finding} line for {node}: {text}"))
                .to_owned()
        };
        assert!(line("a", "LocalhostNodePorts").contains("blocking"));
        assert!(line("a", "LocalhostNodePorts").contains("40 packets"));
        assert!(line("b", "ConntrackInvalidDrops").contains("accepted"));
        assert!(line("b", "NodePortFirewall").contains("warning"));
        let b = r.nodes.iter().find(|n| n.name == "b").unwrap();
        assert_eq!(b.state, "Switching", "only accepted findings: released");
    }
}
