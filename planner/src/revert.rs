//! `spec.onRelease: Revert`: the nodes a policy stops governing return to `spec.revertMode`
//! through a rollout before they are released (the default, Keep, is [`crate::lifecycle`]).
//!
//! # The outcome (documented behaviour)
//! - **Deletion.** The operator keeps the finalizer [`REVERT_FINALIZER`] on every policy that asks
//!   for Revert (and on no other). When such a policy is deleted, the nodes whose NodeProxy names
//!   it and that no other policy governs are planned as a rollout to `revertMode` ([`plan_revert`]):
//!   the policy's own waves (membership pinned by its status), `maxUnavailable`, `maxFailures` and
//!   `failurePolicy`, pause, approvals (of the generation the deletion made), window and health
//!   gate, with the agent's own settings (`spec.proxy` is not sent). The policy's status says
//!   so: phase and counts as for any rollout, and the condition `Reverting`. When every node is
//!   back on `revertMode` (or cannot run it, or failed its switch within the failure budget and
//!   runs what it ran), the finalizer goes; the nodes are then released in the mode they run, as
//!   with Keep. When `revertTimeoutSeconds` pass first, the finalizer goes all the same, with a
//!   `RevertTimedOut` Warning Event naming the nodes left as they are: a deletion is never stuck.
//! - **A node leaving the pool** (its labels no longer match, the policy stays): the departing
//!   nodes are planned the same way ([`plan_departing`]) as a rollout of their own (waves and
//!   budgets of the policy's spec, counted over the departing nodes), and each is released once
//!   it runs `revertMode` (or cannot, or its switch failed: it keeps what it runs). No timeout:
//!   nothing holds a departing node but the policy's own gates (pause, approval, window).
//! - A node in the middle of a switch when its policy lets it go finishes (or rolls back) that
//!   switch under its own spec first; its revert starts once it serves again.
//!
//! Pure: the operator (`operator::revert`) applies the writes, the status and the finalizer.

use std::{collections::HashMap, time::Duration};

use jiff::{SignedDuration, Timestamp};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
pub use switchyard_crds::v1alpha1::REVERT_FINALIZER;
use switchyard_crds::v1alpha1::{
    DEFAULT_REVERT_TIMEOUT_SECONDS, OnRelease, ProxyMode, ProxyPolicySpec, SwitchPhase,
};

use super::{NodeInput, NodeProxyInput, NodeState, PolicyInput, PolicyPlan, policy, selector::Selector};

/// Condition type on a policy whose deletion waits for its nodes to revert.
pub const REVERTING: &str = "Reverting";

/// The mode a policy's released nodes return to: `Some` only with `onRelease: Revert`.
pub fn revert_mode(spec: &ProxyPolicySpec) -> Option<ProxyMode> {
    if spec.on_release != Some(OnRelease::Revert) {
        return None;
    }
    spec.revert_mode.map(ProxyMode::from)
}

/// How long a deletion waits for the revert.
pub fn revert_timeout(spec: &ProxyPolicySpec) -> Duration {
    Duration::from_secs(u64::from(
        spec.revert_timeout_seconds
            .unwrap_or(DEFAULT_REVERT_TIMEOUT_SECONDS),
    ))
}

/// A revert rollout: the plan of the policy turned towards `revertMode` over its released nodes.
#[derive(Clone, Debug)]
pub struct RevertPlan {
    /// The mode the nodes return to.
    pub mode: ProxyMode,
    /// Writes, status (with the `Reverting` condition for a deletion), events and node plans.
    pub plan: PolicyPlan,
    /// Nodes still on their way to `mode`, sorted.
    pub remaining: Vec<String>,
    /// Nodes done: on `mode`, or left as they are (cannot run it, or their switch failed), sorted.
    pub settled: Vec<String>,
    /// Nothing remains.
    pub done: bool,
    /// A deletion's `revertTimeoutSeconds` have passed.
    pub timed_out: bool,
    /// When a deletion stops waiting.
    pub deadline: Option<Timestamp>,
}

/// The policy as the revert plans it: `revertMode` with the agent's own settings, no fallback.
fn revert_input(p: &PolicyInput, mode: ProxyMode) -> PolicyInput {
    let mut input = p.clone();
    input.spec.mode = mode;
    input.spec.fallback = None;
    input.spec.proxy = None;
    input.spec.on_release = None;
    input.spec.revert_mode = None;
    input.spec.revert_timeout_seconds = None;
    input
}

/// Nodes whose NodeProxy names `p` and that none of `live` (the policies that are not being
/// deleted, `p` included when it is one) selects.
pub fn members<'n>(
    p: &PolicyInput,
    live: &[PolicyInput],
    nodes: &'n [NodeInput],
    proxies: &[NodeProxyInput],
) -> Vec<&'n NodeInput> {
    let selectors: Vec<Selector> = live
        .iter()
        .filter(|l| l.name.len() <= switchyard_crds::MAX_POLICY_NAME)
        .map(|l| Selector::new(&l.spec.node_selector))
        .collect();
    let by_name: HashMap<&str, &NodeProxyInput> = proxies.iter().map(|np| (np.name.as_str(), np)).collect();
    nodes
        .iter()
        .filter(|n| {
            by_name
                .get(n.name.as_str())
                .and_then(|np| np.spec.policy.as_ref())
                .is_some_and(|r| r.name == p.name && r.uid.as_deref().is_none_or(|u| u == p.uid))
        })
        .filter(|n| !selectors.iter().any(|s| s.matches(&n.labels)))
        .collect()
}

/// The revert of a deleted policy (`deleted_at`: its deletion timestamp); `None` when it does
/// not ask for Revert.
pub fn plan_revert(
    p: &PolicyInput,
    live: &[PolicyInput],
    nodes: &[NodeInput],
    proxies: &[NodeProxyInput],
    deleted_at: Timestamp,
    now: Timestamp,
) -> Option<RevertPlan> {
    let mode = revert_mode(&p.spec)?;
    let timeout = SignedDuration::try_from(revert_timeout(&p.spec)).unwrap_or(SignedDuration::MAX);
    let deadline = deleted_at.checked_add(timeout).unwrap_or(Timestamp::MAX);
    let mut r = plan_members(&revert_input(p, mode), mode, live, nodes, proxies, now);
    r.timed_out = !r.done && now >= deadline;
    r.deadline = Some(deadline);
    let condition = reverting_condition(p, &r, now);
    r.plan.status.conditions.retain(|c| c.type_ != REVERTING);
    r.plan.status.conditions.push(condition);
    if !r.done && !r.timed_out {
        let left = deadline.duration_since(now).unsigned_abs();
        r.plan.requeue_after = r.plan.requeue_after.min(left.max(Duration::from_secs(1)));
    }
    Some(r)
}

/// The revert of the nodes that left a live policy's pool; `None` when it does not ask for
/// Revert or no node left.
pub fn plan_departing(
    p: &PolicyInput,
    live: &[PolicyInput],
    nodes: &[NodeInput],
    proxies: &[NodeProxyInput],
    now: Timestamp,
) -> Option<RevertPlan> {
    let mode = revert_mode(&p.spec)?;
    let mut input = revert_input(p, mode);
    // The policy's status describes its pool, not the departing nodes.
    input.status = None;
    let r = plan_members(&input, mode, live, nodes, proxies, now);
    (!r.remaining.is_empty() || !r.settled.is_empty()).then_some(r)
}

/// Plans `input` (already turned towards `mode`) over its members.
fn plan_members(
    input: &PolicyInput,
    mode: ProxyMode,
    live: &[PolicyInput],
    nodes: &[NodeInput],
    proxies: &[NodeProxyInput],
    now: Timestamp,
) -> RevertPlan {
    let governed = members(input, live, nodes, proxies);
    let by_name: HashMap<&str, &NodeProxyInput> = proxies.iter().map(|np| (np.name.as_str(), np)).collect();
    let mut plan = policy::plan_policy(input, &governed, &by_name, &[], now);
    // A switch in flight finishes under the spec it started with.
    plan.writes.retain(|w| {
        by_name
            .get(w.node.as_str())
            .is_none_or(|np| !in_flight(np) || np.spec.desired_mode == w.spec.desired_mode)
    });
    let (settled, remaining): (Vec<_>, Vec<_>) = plan.nodes.iter().partition(|n| settles(n.state));
    let name = |n: &&crate::NodePlan| n.name.clone();
    let remaining: Vec<String> = remaining.iter().map(name).collect();
    RevertPlan {
        mode,
        done: remaining.is_empty(),
        settled: settled.iter().map(name).collect(),
        remaining,
        plan,
        timed_out: false,
        deadline: None,
    }
}

/// The agent is in the middle of a switch.
fn in_flight(np: &NodeProxyInput) -> bool {
    matches!(
        np.status.as_ref().and_then(|s| s.phase),
        Some(
            SwitchPhase::Preparing
                | SwitchPhase::CutOver
                | SwitchPhase::Verifying
                | SwitchPhase::Cleaning
                | SwitchPhase::RollingBack
        )
    )
}

/// At most ten names, then "and N more".
fn names(list: &[String]) -> String {
    let mut out = list.iter().take(10).cloned().collect::<Vec<_>>().join(", ");
    if list.len() > 10 {
        out.push_str(&format!(" and {} more", list.len() - 10));
    }
    out
}

/// A node in this state needs nothing more from the revert: it runs the revert mode and is
/// healthy, or is left as it is (cannot run it; its switch failed, or was rolled back by
/// `failurePolicy: rollback`, and its agent serves what it ran).
fn settles(state: NodeState) -> bool {
    matches!(
        state,
        NodeState::Healthy | NodeState::Incompatible | NodeState::Failed | NodeState::RolledBack
    )
}

/// The `Reverting` condition of a deleted policy's status.
fn reverting_condition(p: &PolicyInput, r: &RevertPlan, now: Timestamp) -> Condition {
    let total = r.remaining.len() + r.settled.len();
    let deadline = r.deadline.map(|d| d.to_string()).unwrap_or_default();
    let (status, reason, message) = if r.timed_out {
        (
            "False",
            "TimedOut",
            format!(
                "proxypolicy deleted with onRelease Revert: revertTimeoutSeconds passed at {deadline}; {} of {total} nodes not back on {} ({}) keep the mode they run",
                r.remaining.len(),
                r.mode,
                names(&r.remaining),
            ),
        )
    } else if r.done {
        (
            "False",
            "Reverted",
            format!(
                "proxypolicy deleted with onRelease Revert: all {total} nodes are back on {} or left as they are; the finalizer goes",
                r.mode
            ),
        )
    } else {
        (
            "True",
            "PolicyDeleted",
            format!(
                "proxypolicy deleted with onRelease Revert: returning its nodes to {} through the rollout before the policy goes; {} of {total} done, waiting for {}; gives up at {deadline}",
                r.mode,
                r.settled.len(),
                names(&r.remaining),
            ),
        )
    };
    let prev = p.status.as_ref().and_then(|s| {
        s.conditions
            .iter()
            .find(|c| c.type_ == REVERTING && c.status == status)
    });
    Condition {
        type_: REVERTING.into(),
        status: status.into(),
        reason: reason.into(),
        message,
        observed_generation: Some(p.generation),
        last_transition_time: prev.map(|c| c.last_transition_time.clone()).unwrap_or(Time(now)),
    }
}

#[cfg(test)]
#[path = "revert_tests.rs"]
#[allow(clippy::unwrap_used)]
mod tests;
