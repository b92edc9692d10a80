//! Stage 3, budget: failed nodes against `maxFailures`, the rollback that spending it (with
//! `failurePolicy: rollback`) or the rollback annotation triggers, and `maxUnavailable`.

use switchyard_crds::v1alpha1::FailurePolicy;

use super::{MAX_NAMES, NodeState, PolicyInput, View, Waves, names_generation};

/// The failure and unavailability budgets of one plan.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Budget {
    /// Indices into the views of the failed nodes.
    pub failed: Vec<usize>,
    /// `node: reason` of each failed node, in `failed` order.
    pub failed_desc: Vec<String>,
    /// `spec.rollout.maxFailures`.
    pub max_failures: usize,
    /// More nodes failed than `maxFailures`.
    pub exceeded: bool,
    /// The rollback annotation names this generation.
    pub manual: bool,
    /// Nodes return to their previous mode: the budget is spent under `failurePolicy: rollback`,
    /// or a manual rollback was requested.
    pub rollback: bool,
    /// Per view: returned to its previous mode by this plan.
    pub roll_back: Vec<bool>,
    /// `maxUnavailable` resolved against the compatible nodes.
    pub max_unavailable: usize,
    /// Compatible nodes that count against `maxUnavailable`.
    pub unavailable: usize,
}

impl Budget {
    /// The first failed nodes with their reasons, for messages.
    pub fn failed_names(&self) -> String {
        self.failed_desc
            .iter()
            .take(MAX_NAMES)
            .cloned()
            .collect::<Vec<_>>()
            .join("; ")
    }

    /// View `i` is returned to its previous mode by this plan, or is being or was returned.
    pub fn returns(&self, views: &[View<'_>], i: usize) -> bool {
        self.roll_back[i] || matches!(views[i].state, NodeState::RollingBack | NodeState::RolledBack)
    }
}

/// Computes the budgets of a plan.
pub(crate) fn budget(p: &PolicyInput, views: &[View<'_>], waves: &Waves<'_>) -> Budget {
    let failed: Vec<usize> = (0..views.len())
        .filter(|&i| views[i].state == NodeState::Failed)
        .collect();
    let failed_desc = failed
        .iter()
        .map(|&i| {
            format!(
                "{}: {}",
                views[i].node.name,
                views[i].reason.clone().unwrap_or_default()
            )
        })
        .collect();
    let max_failures = p.spec.rollout.max_failures as usize;
    let exceeded = failed.len() > max_failures;
    let manual = p
        .rollback
        .as_deref()
        .is_some_and(|v| names_generation(v, p.generation));
    let rollback = (exceeded && p.spec.rollout.failure_policy == FailurePolicy::Rollback) || manual;
    let roll_back = views.iter().map(|v| rollback && rolls_back(v)).collect();
    let pool = waves.eligible.len();
    Budget {
        failed,
        failed_desc,
        max_failures,
        exceeded,
        manual,
        rollback,
        roll_back,
        max_unavailable: super::super::waves::resolve_max_unavailable(&p.spec.rollout.max_unavailable, pool),
        unavailable: waves.eligible.iter().filter(|&&i| !views[i].available).count(),
    }
}

/// Whether a rollback returns this node: it was switched by this rollout (or is switching) and
/// has a mode to return to.
fn rolls_back(v: &View<'_>) -> bool {
    let candidate = match v.state {
        NodeState::Healthy => v.switched_here,
        NodeState::Switching | NodeState::Unhealthy => true,
        _ => false,
    };
    candidate && v.rollback_to.is_some()
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use serde_json::json;

    use super::{
        super::{assign::assign_waves, classify::classify, fixtures::*},
        *,
    };

    /// (case, maxFailures, failurePolicy, rollback annotation, node proxies,
    ///  expected: failed, exceeded, rollback, roll_back per node)
    type Case = (
        &'static str,
        u32,
        &'static str,
        Option<&'static str>,
        Vec<NodeProxyInput>,
        (usize, bool, bool, Vec<bool>),
    );

    #[test]
    fn budget_table() {
        let tok = "pool-g2-nftables";
        let ok = || answered(NFT, tok, IPT, "Succeeded");
        let bad = || answered(IPT, tok, IPT, "RolledBack");
        let cases: Vec<Case> = vec![
            (
                "nothing failed",
                0,
                "pause",
                None,
                vec![ok(), np(IPT, BOTH)],
                (0, false, false, vec![false, false]),
            ),
            (
                "within budget",
                1,
                "rollback",
                None,
                vec![ok(), bad()],
                (1, false, false, vec![false, false]),
            ),
            (
                "spent, pause",
                0,
                "pause",
                None,
                vec![ok(), bad()],
                (1, true, false, vec![false, false]),
            ),
            (
                "spent, rollback",
                0,
                "rollback",
                None,
                vec![ok(), bad()],
                (1, true, true, vec![true, false]),
            ),
            (
                "manual rollback",
                5,
                "pause",
                Some("2"),
                vec![ok(), np(IPT, BOTH)],
                (0, false, true, vec![true, false]),
            ),
            (
                "stale manual rollback",
                5,
                "pause",
                Some("1"),
                vec![ok()],
                (0, false, false, vec![false]),
            ),
            (
                "never switched here: nothing to return",
                0,
                "rollback",
                Some("2"),
                vec![np(NFT, BOTH)],
                (0, false, true, vec![false]),
            ),
        ];
        for (name, max_failures, policy, annotation, proxies, want) in cases {
            let mut p = with_rollout(
                policy_input("pool", NFT, 2),
                json!({"maxFailures": max_failures, "failurePolicy": policy, "maxUnavailable": 1}),
            );
            p.rollback = annotation.map(str::to_owned);
            let nodes: Vec<_> = (0..proxies.len()).map(|i| node_input(&format!("n{i}"))).collect();
            let views: Vec<View<'_>> = nodes
                .iter()
                .zip(&proxies)
                .map(|(n, x)| classify(&p, n, Some(x)))
                .collect();
            let b = budget(&p, &views, &assign_waves(&p, &views));
            assert_eq!(
                (b.failed.len(), b.exceeded, b.rollback, b.roll_back.clone()),
                want,
                "{name}"
            );
            assert_eq!(b.manual, annotation == Some("2"), "{name}");
        }
    }

    #[test]
    fn unavailable_counts_only_compatible_nodes() {
        let p = with_rollout(policy_input("pool", NFT, 1), json!({"maxUnavailable": "50%"}));
        let nodes: Vec<_> = (0..4).map(|i| node_input(&format!("n{i}"))).collect();
        let proxies = [
            np(IPT, BOTH),
            unhealthy(np(NFT, BOTH)),
            np(IPT, &[IPT]),
            with_phase(
                np(IPT, &[IPT]),
                switchyard_crds::v1alpha1::SwitchPhase::Initializing,
            ),
        ];
        let views: Vec<View<'_>> = nodes
            .iter()
            .zip(&proxies)
            .map(|(n, x)| classify(&p, n, Some(x)))
            .collect();
        let b = budget(&p, &views, &assign_waves(&p, &views));
        // Two compatible nodes, one of them unhealthy; 50% of 2 is 1.
        assert_eq!((b.unavailable, b.max_unavailable), (1, 1));
    }

    #[test]
    fn failed_names_list_reasons() {
        let p = policy_input("pool", NFT, 2);
        let nodes = [node_input("a"), node_input("b")];
        let proxies = [
            answered(IPT, "pool-g2-nftables", IPT, "RolledBack"),
            answered(IPT, "pool-g2-nftables", IPT, "Failed"),
        ];
        let views: Vec<View<'_>> = nodes
            .iter()
            .zip(&proxies)
            .map(|(n, x)| classify(&p, n, Some(x)))
            .collect();
        let b = budget(&p, &views, &assign_waves(&p, &views));
        assert_eq!(
            b.failed_names(),
            "a: probe default/kubernetes: no endpoint answered; b: probe default/kubernetes: no endpoint answered"
        );
        assert!(b.returns(&views, 0) == b.roll_back[0]);
    }
}
