//! Planning one policy, as a pipeline of stages, each a function with a named result that is
//! table-tested alone:
//!
//! 1. [`classify`] → [`View`]s: each governed node's state, target mode and availability;
//! 2. [`assign`] → [`Waves`]: the waves and their nodes (pinned by the previous status);
//! 3. [`budget`] → [`Budget`]: failures against `maxFailures`, the rollback they (or the
//!    annotation) trigger, and `maxUnavailable`;
//! 4. [`gates`] → [`Gates`]: the waves walked in order, the first open one, why it is held, which
//!    nodes it admits, soak;
//! 5. [`writes`] → the NodeProxy specs to apply;
//! 6. [`status`] → [`Summary`]: phase, headline message, counts and per-wave status;
//! 7. [`conditions`] → the policy's conditions;
//! 8. [`events`] → transition Events against the previous status.

mod assign;
mod budget;
mod classify;
mod conditions;
mod events;
#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod fixtures;
mod gates;
mod status;
mod writes;

use std::{collections::HashMap, fmt::Write as _, time::Duration};

use jiff::Timestamp;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use switchyard_crds::v1alpha1::{PolicyPhase, ProxyMode};

use self::{
    assign::Waves,
    budget::Budget,
    classify::View,
    gates::{Gates, Hold},
    status::Summary,
};
use super::{Lost, NodeInput, NodePlan, NodeProxyInput, NodeState, NodeWrite, PolicyInput, PolicyPlan};

/// Requeue while switches are in flight (agent reports also trigger reconciles).
const PROGRESS_REQUEUE: Duration = Duration::from_secs(30);
/// Requeue while waiting for a maintenance window.
const WINDOW_REQUEUE: Duration = Duration::from_secs(60);
/// Requeue when nothing is going on (keeps the reconcile loop, and /healthz, alive).
const IDLE_REQUEUE: Duration = Duration::from_secs(120);
/// Node names listed in one message before "and N more".
const MAX_NAMES: usize = 10;

/// The rollout token of a fresh switch attempt of `policy` at `generation` to `mode`.
pub fn switch_token(policy: &str, generation: i64, mode: ProxyMode) -> String {
    format!("{policy}-g{generation}-{mode}")
}

/// The rollout token of a policy rollback at `generation` to `mode`.
pub fn rollback_token(policy: &str, generation: i64, mode: ProxyMode) -> String {
    format!("{policy}-g{generation}-rollback-{mode}")
}

/// The rollout token of a settings switch of `policy` at `generation`: the node runs `mode`
/// already and takes the generation's `spec.proxy` behind the health gate. A distinct token, so
/// the planner knows to wait for the agent's answer although the mode does not change.
pub fn settings_token(policy: &str, generation: i64, mode: ProxyMode) -> String {
    format!("{policy}-g{generation}-settings-{mode}")
}

/// Splits a token of `policy` into (generation, is rollback); `None` if it is not this policy's.
fn parse_token(policy: &str, token: &str) -> Option<(i64, bool)> {
    let (generation, tail) = token_parts(policy, token)?;
    Some((generation, tail.starts_with("rollback-")))
}

/// Whether `token` is a settings switch of `policy` ([`settings_token`]).
fn is_settings_token(policy: &str, token: &str) -> bool {
    token_parts(policy, token).is_some_and(|(_, tail)| tail.starts_with("settings-"))
}

/// A token of `policy` as (generation, what follows it).
fn token_parts<'t>(policy: &str, token: &'t str) -> Option<(i64, &'t str)> {
    let rest = token.strip_prefix(policy)?.strip_prefix("-g")?;
    let (generation, tail) = rest.split_once('-')?;
    Some((generation.parse().ok()?, tail))
}

#[cfg(test)]
pub(super) fn parse_token_for_tests(policy: &str, token: &str) -> Option<(i64, bool)> {
    parse_token(policy, token)
}

/// At most [`MAX_NAMES`] names, then "and N more".
fn names(list: &[&str]) -> String {
    let mut out = list
        .iter()
        .take(MAX_NAMES)
        .copied()
        .collect::<Vec<_>>()
        .join(", ");
    if list.len() > MAX_NAMES {
        let _ = write!(out, " and {} more", list.len() - MAX_NAMES);
    }
    out
}

fn time(t: Timestamp) -> Time {
    Time(t)
}

/// Whether an annotation value names `generation` (approvals, rollback requests).
fn names_generation(value: &str, generation: i64) -> bool {
    value.trim().parse::<i64>().ok() == Some(generation)
}

/// Plans one policy over the nodes it governs: the stages above, in order.
pub(super) fn plan_policy(
    p: &PolicyInput,
    governed: &[&NodeInput],
    proxies: &HashMap<&str, &NodeProxyInput>,
    lost: &[Lost<'_>],
    now: Timestamp,
) -> PolicyPlan {
    let findings = super::validate::check(p);
    let views = classify::classify_nodes(p, governed, proxies);
    let waves = assign::assign_waves(p, &views);
    let budget = budget::budget(p, &views, &waves);
    let gates = gates::gates(p, &views, &waves, &budget, &findings, now);
    let writes = writes::writes(p, &views, &budget, &gates);
    let summary = status::summarize(p, &views, &waves, &budget, &gates);
    let mut conditions = conditions::conditions(p, &summary, &budget, &gates, lost, &findings, now);
    conditions.push(preflight_condition(p, &views, now));
    let status = summary.status(p.generation, conditions);
    let events = events::events(p, &status, &summary.message, &views, &budget);
    PolicyPlan {
        name: p.name.clone(),
        requeue_after: requeue_after(summary.phase, gates.soak_left),
        nodes: node_plans(&views, &waves, &budget, &gates),
        status,
        writes,
        events,
    }
}

/// `PreflightPassed` over the views' findings ([`crate::preflight`]).
fn preflight_condition(
    p: &PolicyInput,
    views: &[View<'_>],
    now: Timestamp,
) -> k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition {
    let previous = p
        .status
        .as_ref()
        .map(|s| s.conditions.as_slice())
        .unwrap_or_default();
    let nodes = views
        .iter()
        .map(|v| (v.node.name.as_str(), v.preflight.as_slice()));
    crate::preflight::condition(nodes, previous, p.generation, now)
}

/// When to look again even if nothing changes.
fn requeue_after(phase: PolicyPhase, soak_left: Option<Duration>) -> Duration {
    match (phase, soak_left) {
        (_, Some(left)) => left.min(IDLE_REQUEUE),
        (PolicyPhase::WaitingForWindow, _) => WINDOW_REQUEUE,
        (PolicyPhase::Progressing | PolicyPhase::RollingBack, _) => PROGRESS_REQUEUE,
        _ => IDLE_REQUEUE,
    }
}

/// Per-node decisions, sorted by name (as the views are).
fn node_plans(views: &[View<'_>], waves: &Waves<'_>, budget: &Budget, gates: &Gates) -> Vec<NodePlan> {
    let wave_of = waves.wave_of();
    views
        .iter()
        .enumerate()
        .map(|(i, v)| NodePlan {
            name: v.node.name.clone(),
            wave: wave_of.get(&i).map(|s| s.to_string()),
            state: if budget.roll_back[i] {
                NodeState::RollingBack
            } else if gates.admit[i] {
                NodeState::Switching
            } else {
                v.state
            },
            target: v.target,
            reason: v.reason.clone(),
            settings_generation: status::settings_generation(views, budget, gates, i),
            preflight: v.preflight.clone(),
        })
        .collect()
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn requeue_table() {
        let s = Duration::from_secs;
        let cases = [
            (PolicyPhase::Progressing, Some(s(5)), s(5)),
            (PolicyPhase::Ready, Some(s(500)), IDLE_REQUEUE),
            (PolicyPhase::WaitingForWindow, None, WINDOW_REQUEUE),
            (PolicyPhase::Progressing, None, PROGRESS_REQUEUE),
            (PolicyPhase::RollingBack, None, PROGRESS_REQUEUE),
            (PolicyPhase::Paused, None, IDLE_REQUEUE),
            (PolicyPhase::Ready, None, IDLE_REQUEUE),
        ];
        for (phase, soak, want) in cases {
            assert_eq!(requeue_after(phase, soak), want, "{phase:?} {soak:?}");
        }
    }

    #[test]
    fn names_table() {
        let many: Vec<String> = (1..=12).map(|i| format!("n{i}")).collect();
        let many: Vec<&str> = many.iter().map(String::as_str).collect();
        let cases: Vec<(&[&str], &str)> = vec![
            (&[], ""),
            (&["a"], "a"),
            (&["a", "b"], "a, b"),
            (&many, "n1, n2, n3, n4, n5, n6, n7, n8, n9, n10 and 2 more"),
        ];
        for (list, want) in cases {
            assert_eq!(names(list), want);
        }
    }

    #[test]
    fn generation_annotations_table() {
        let cases = [
            ("3", 3, true),
            (" 3 ", 3, true),
            ("2", 3, false),
            ("x", 3, false),
            ("", 0, false),
        ];
        for (value, g, want) in cases {
            assert_eq!(names_generation(value, g), want, "{value:?} {g}");
        }
    }
}
