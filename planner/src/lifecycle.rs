//! NodeProxies that no policy governs any more: their policy was deleted (possibly mid-rollout) or
//! its `nodeSelector` no longer selects the node.
//!
//! # The outcome (documented behaviour)
//! Deleting a ProxyPolicy does **not** switch any node back or forward. Every NodeProxy the policy
//! governed is *released*:
//! - its spec no longer names the policy (`spec.policy` and the `switchyard.dev/policy` label go, so
//!   the POLICY column is empty) and gets the annotation [`RELEASED_ANNOTATION`] saying from which
//!   policy, why and which mode the node keeps;
//! - a node that is serving (phase `Active`) keeps the mode it runs now: `desiredMode` is pinned to
//!   its `activeMode`, so the agent starts nothing — also when the policy had just asked it to
//!   switch and the agent had not begun;
//! - a node in the middle of a switch keeps the spec of that switch (mode, rollout token, health
//!   gate), so the running switch finishes or rolls back under the gate it started with; once the
//!   node is serving again, its `desiredMode` is pinned to whatever it then runs;
//! - an Event `Released` on each NodeProxy says the same, and the operator's metric
//!   `switchyard_operator_ungoverned_nodes` counts the released nodes; `kubectl get nodeproxies`
//!   (DESIRED / ACTIVE) shows the mixed fleet.
//!
//! A later policy that selects the node governs it as any other node (the annotation then goes).

use std::collections::HashSet;

use switchyard_crds::v1alpha1::{NodeProxySpec, PolicyReference, ProxyMode, SwitchPhase};

use super::{NodeInput, NodeProxyInput, PolicyInput, selector::Selector};

/// Annotation on a released NodeProxy: `<policy> generation <g>: <why>; keeps <mode>`.
pub const RELEASED_ANNOTATION: &str = "switchyard.dev/released-from";

/// A NodeProxy to release (or, once released, to settle).
#[derive(Clone, Debug, PartialEq)]
pub struct Release {
    /// Node (and NodeProxy) name.
    pub node: String,
    /// Node UID, for the owner reference.
    pub node_uid: String,
    /// The policy its spec still names (`None`: released before, now settled).
    pub policy: Option<PolicyReference>,
    /// Whether that policy still exists (then its selector no longer selects the node).
    pub policy_exists: bool,
    /// The spec to apply.
    pub spec: NodeProxySpec,
    /// The mode the node runs now.
    pub keeps: Option<ProxyMode>,
    /// A switch is in flight; it finishes or rolls back on its own.
    pub switching: bool,
}

/// The spec of a released node: see the module documentation.
pub fn released_spec(np: &NodeProxyInput) -> NodeProxySpec {
    let status = np.status.as_ref();
    let serving = status.and_then(|s| s.phase) == Some(SwitchPhase::Active);
    let active = status.and_then(|s| s.active_mode);
    let desired_mode = match (serving, active) {
        (true, Some(a)) => Some(a),
        _ => np.spec.desired_mode,
    };
    NodeProxySpec {
        desired_mode,
        policy: None,
        ..np.spec.clone()
    }
}

/// Every NodeProxy that names a policy (or was released before) and that no policy in `policies`
/// selects, with the spec that releases it; only those whose spec changes.
pub fn releases(policies: &[PolicyInput], nodes: &[NodeInput], proxies: &[NodeProxyInput]) -> Vec<Release> {
    let selectors: Vec<Selector> = policies
        .iter()
        .map(|p| Selector::new(&p.spec.node_selector))
        .collect();
    let governed: HashSet<&str> = nodes
        .iter()
        .filter(|n| selectors.iter().any(|s| s.matches(&n.labels)))
        .map(|n| n.name.as_str())
        .collect();
    let uids: HashSet<&str> = policies.iter().map(|p| p.uid.as_str()).collect();
    let mut out: Vec<Release> = proxies
        .iter()
        .filter(|np| !governed.contains(np.name.as_str()))
        .filter(|np| np.spec.policy.is_some() || np.spec.rollout_token.is_some())
        .filter_map(|np| {
            let node = nodes.iter().find(|n| n.name == np.name)?;
            let spec = released_spec(np);
            if spec == np.spec {
                return None;
            }
            let status = np.status.as_ref();
            Some(Release {
                node: np.name.clone(),
                node_uid: node.uid.clone(),
                policy: np.spec.policy.clone(),
                policy_exists: np
                    .spec
                    .policy
                    .as_ref()
                    .and_then(|r| r.uid.as_deref())
                    .is_some_and(|u| uids.contains(u)),
                keeps: status.and_then(|s| s.active_mode),
                switching: status.and_then(|s| s.phase) != Some(SwitchPhase::Active),
                spec,
            })
        })
        .collect();
    out.sort_by(|a, b| a.node.cmp(&b.node));
    out
}

/// The annotation value and Event note of a release.
pub fn describe(r: &Release, why: &str) -> String {
    let keeps = r.keeps.map(|m| m.as_str()).unwrap_or("its current mode");
    let from = r
        .policy
        .as_ref()
        .map(|p| match p.generation {
            Some(g) => format!("proxypolicy {} (generation {g})", p.name),
            None => format!("proxypolicy {}", p.name),
        })
        .unwrap_or_else(|| "its former policy".into());
    let mut text = format!(
        "{from} {why}: no policy governs this node; it keeps running {keeps} and no switch is started"
    );
    if r.switching
        && let Some(to) = r.spec.desired_mode
    {
        text.push_str(&format!(
            "; the switch to {to} already in progress finishes or rolls back under its own health gate"
        ));
    }
    text
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::collections::BTreeMap;

    use switchyard_crds::v1alpha1::{NodeProxyStatus, ProxyPolicySpec};

    use super::*;

    fn node(name: &str, pool: &str) -> NodeInput {
        NodeInput {
            name: name.into(),
            uid: format!("uid-{name}"),
            labels: BTreeMap::from([("pool".to_string(), pool.to_string())]),
        }
    }

    fn governed_spec(desired: Option<ProxyMode>) -> NodeProxySpec {
        NodeProxySpec {
            desired_mode: desired,
            policy: Some(PolicyReference {
                name: "gone".into(),
                uid: Some("uid-gone".into()),
                generation: Some(2),
            }),
            rollout_token: desired.map(|m| format!("gone-g2-{m}")),
            health_gate: desired
                .map(|_| serde_json::from_value(serde_json::json!({"minHealthySeconds": 9})).unwrap()),
            ..Default::default()
        }
    }

    fn np(name: &str, spec: NodeProxySpec, active: ProxyMode, phase: SwitchPhase) -> NodeProxyInput {
        NodeProxyInput {
            name: name.into(),
            spec,
            status: Some(NodeProxyStatus {
                active_mode: Some(active),
                phase: Some(phase),
                ..Default::default()
            }),
        }
    }

    fn policy(pool: &str) -> PolicyInput {
        let spec: ProxyPolicySpec = serde_json::from_value(
            serde_json::json!({"nodeSelector": {"matchLabels": {"pool": pool}}, "mode": "nftables"}),
        )
        .unwrap();
        PolicyInput {
            name: "other".into(),
            uid: "uid-other".into(),
            generation: 1,
            spec,
            approvals: BTreeMap::new(),
            annotations: Vec::new(),
            rollback: None,
            status: None,
        }
    }

    const IPT: ProxyMode = ProxyMode::Iptables;
    const NFT: ProxyMode = ProxyMode::Nftables;

    #[test]
    fn a_deleted_policy_releases_its_nodes_in_their_current_mode() {
        let nodes = [
            node("done", "a"),
            node("busy", "a"),
            node("held", "a"),
            node("asked", "a"),
        ];
        let proxies = [
            np("done", governed_spec(Some(NFT)), NFT, SwitchPhase::Active),
            np("busy", governed_spec(Some(NFT)), IPT, SwitchPhase::Verifying),
            np("held", governed_spec(None), IPT, SwitchPhase::Active),
            // Asked to switch, the agent has not begun: no switch after the release.
            np("asked", governed_spec(Some(NFT)), IPT, SwitchPhase::Active),
        ];
        let r = releases(&[], &nodes, &proxies);
        let got: Vec<(&str, Option<ProxyMode>, bool)> = r
            .iter()
            .map(|r| (r.node.as_str(), r.spec.desired_mode, r.switching))
            .collect();
        assert_eq!(
            got,
            [
                ("asked", Some(IPT), false),
                ("busy", Some(NFT), true),
                ("done", Some(NFT), false),
                ("held", Some(IPT), false)
            ]
        );
        assert!(r.iter().all(|r| r.spec.policy.is_none() && !r.policy_exists));
        let busy = &r[1];
        assert_eq!(
            busy.spec.health_gate, proxies[1].spec.health_gate,
            "the running switch keeps its gate"
        );
        assert_eq!(busy.spec.rollout_token, proxies[1].spec.rollout_token);
        assert!(describe(busy, "was deleted").contains("finishes or rolls back"));
        assert!(describe(&r[0], "was deleted").contains("keeps running iptables"));
    }

    #[test]
    fn a_released_switch_that_rolled_back_is_settled_on_the_mode_it_runs() {
        let nodes = [node("busy", "a")];
        let released = released_spec(&np("busy", governed_spec(Some(NFT)), IPT, SwitchPhase::Verifying));
        let after = [np("busy", released.clone(), IPT, SwitchPhase::Active)];
        let r = releases(&[], &nodes, &after);
        assert_eq!(r.len(), 1);
        assert_eq!((r[0].spec.desired_mode, r[0].policy.clone()), (Some(IPT), None));
        let settled = [np("busy", r[0].spec.clone(), IPT, SwitchPhase::Active)];
        assert!(releases(&[], &nodes, &settled).is_empty(), "nothing more to do");
    }

    #[test]
    fn governed_and_never_governed_nodes_are_left_to_the_planner() {
        let nodes = [node("mine", "b"), node("free", "c")];
        let proxies = [
            np("mine", governed_spec(Some(NFT)), IPT, SwitchPhase::Active),
            np("free", NodeProxySpec::default(), IPT, SwitchPhase::Active),
        ];
        assert!(releases(&[policy("b")], &nodes, &proxies).is_empty());
        let moved = releases(&[policy("x")], &nodes, &proxies[..1]);
        assert_eq!(
            moved.len(),
            1,
            "a node its policy no longer selects is released too"
        );
    }
}
