//! Stage 6, status: the policy's phase and headline message, its node counts and per-wave status
//! (the conditions, stage 7, are added by [`Summary::status`]).

use std::fmt::Write as _;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use switchyard_crds::v1alpha1::{PolicyPhase, ProxyPolicyStatus, WaveStatus};

use super::{
    super::{APPROVE_PREFIX, ROLLBACK_ANNOTATION},
    Budget, Gates, Hold, NodeState, PolicyInput, View, Waves, names,
};

/// The status of one policy, without its conditions.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Summary {
    /// Phase.
    pub phase: PolicyPhase,
    /// The headline: what happens and what to do (the Ready condition's message).
    pub message: String,
    /// Per-wave status.
    pub waves: Vec<WaveStatus>,
    /// The wave that is not complete (or soaks).
    pub current_wave: Option<String>,
    /// Governed nodes.
    pub target_nodes: i32,
    /// Nodes running the mode.
    pub updated_nodes: i32,
    /// Nodes healthy in the mode.
    pub healthy_nodes: i32,
    /// Nodes whose switch failed.
    pub failed_nodes: i32,
    /// Nodes that cannot run the mode.
    pub incompatible_nodes: i32,
    /// Nodes running this generation's settings.
    pub settings_updated_nodes: i32,
}

impl Summary {
    /// The ProxyPolicy status with `conditions`.
    pub fn status(&self, generation: i64, conditions: Vec<Condition>) -> ProxyPolicyStatus {
        ProxyPolicyStatus {
            observed_generation: Some(generation),
            phase: Some(self.phase),
            conditions,
            target_nodes: self.target_nodes,
            updated_nodes: self.updated_nodes,
            healthy_nodes: self.healthy_nodes,
            failed_nodes: self.failed_nodes,
            incompatible_nodes: self.incompatible_nodes,
            settings_updated_nodes: self.settings_updated_nodes,
            current_wave: self.current_wave.clone(),
            waves: self.waves.clone(),
            // Set by `plan` over the pool (the advisor is not a stage of the rollout).
            advice: None,
        }
    }
}

fn count<'v, 'a: 'v>(views: impl Iterator<Item = &'v View<'a>>, f: impl Fn(&View<'_>) -> bool) -> i32 {
    i32::try_from(views.filter(|v| f(v)).count()).unwrap_or(i32::MAX)
}

fn len(n: usize) -> i32 {
    i32::try_from(n).unwrap_or(i32::MAX)
}

/// The inputs of the headline.
struct Ctx<'c, 'a> {
    p: &'c PolicyInput,
    views: &'c [View<'a>],
    waves: &'c Waves<'c>,
    budget: &'c Budget,
    gates: &'c Gates,
}

/// Summarises a plan.
pub(crate) fn summarize(
    p: &PolicyInput,
    views: &[View<'_>],
    waves: &Waves<'_>,
    budget: &Budget,
    gates: &Gates,
) -> Summary {
    let ctx = Ctx {
        p,
        views,
        waves,
        budget,
        gates,
    };
    let (phase, message) = headline(&ctx);
    Summary {
        phase,
        message,
        waves: wave_status(views, waves, gates),
        current_wave: gates.current.map(|w| waves.defs[w].name.clone()),
        target_nodes: len(views.len()),
        updated_nodes: count(views.iter(), |v| v.updated),
        healthy_nodes: count(views.iter(), |v| v.state == NodeState::Healthy),
        failed_nodes: len(budget.failed.len()),
        incompatible_nodes: count(views.iter(), |v| v.state == NodeState::Incompatible),
        settings_updated_nodes: len((0..views.len())
            .filter(|&i| settings_generation(views, budget, gates, i) == Some(p.generation))
            .count()),
    }
}

/// The generation whose settings node `i` runs, `None` while it switches (also when this plan
/// admits it or rolls it back).
pub(crate) fn settings_generation(
    views: &[View<'_>],
    budget: &Budget,
    gates: &Gates,
    i: usize,
) -> Option<i64> {
    let moving =
        budget.roll_back.get(i).copied().unwrap_or(false) || gates.admit.get(i).copied().unwrap_or(false);
    views[i].settings_generation.filter(|_| !moving)
}

/// Per-wave status: state and times from the walk, counts from the views.
fn wave_status(views: &[View<'_>], waves: &Waves<'_>, gates: &Gates) -> Vec<WaveStatus> {
    waves
        .defs
        .iter()
        .zip(&gates.runs)
        .zip(&waves.members)
        .map(|((def, run), members)| {
            let of = || members.iter().map(|&i| &views[i]);
            let mut nodes: Vec<String> = of().map(|v| v.node.name.clone()).collect();
            nodes.sort();
            WaveStatus {
                name: def.name.clone(),
                state: run.state,
                nodes,
                updated: count(of(), |v| v.updated),
                healthy: count(of(), |v| v.state == NodeState::Healthy),
                failed: count(of(), |v| v.state == NodeState::Failed),
                started_at: run.started_at.clone(),
                completed_at: run.completed_at.clone(),
            }
        })
        .collect()
}

/// The phase and its message, in order of precedence.
fn headline(c: &Ctx<'_, '_>) -> (PolicyPhase, String) {
    let (b, g) = (c.budget, c.p.generation);
    let rolling_back = c
        .views
        .iter()
        .enumerate()
        .filter(|(i, v)| b.roll_back[*i] || v.state == NodeState::RollingBack)
        .count();
    let failed = b.failed.len();
    let (max, names) = (b.max_failures, b.failed_names());
    if c.views.is_empty() {
        (
            PolicyPhase::Pending,
            "spec.nodeSelector selects no node that this policy governs; nothing to roll out".to_owned(),
        )
    } else if b.rollback && rolling_back > 0 && b.manual && !b.exceeded {
        (
            PolicyPhase::RollingBack,
            format!(
                "rollback requested ({ROLLBACK_ANNOTATION}={g}): returning {rolling_back} node(s) this rollout switched to their previous mode"
            ),
        )
    } else if b.rollback && rolling_back > 0 {
        (
            PolicyPhase::RollingBack,
            format!(
                "{failed} node(s) failed, more than maxFailures={max} ({names}); failurePolicy rollback returns {rolling_back} node(s) to their previous mode"
            ),
        )
    } else if b.exceeded {
        let what = if b.rollback {
            "the switched nodes were returned to their previous mode"
        } else {
            "later waves will not start"
        };
        (
            PolicyPhase::Degraded,
            format!(
                "{failed} node(s) failed their switch, more than maxFailures={max} ({names}); the rollout stopped and {what}. Fix the cause, then change the policy spec (a new generation) to retry"
            ),
        )
    } else if c.gates.current.is_none() && failed > 0 {
        (
            PolicyPhase::Degraded,
            format!(
                "every wave ran, but {failed} node(s) failed their switch and still run their old mode (within maxFailures={max}): {names}. Fix the cause, then change the policy spec (a new generation) to retry them"
            ),
        )
    } else if c.gates.current.is_none() {
        (PolicyPhase::Ready, ready_message(c))
    } else {
        current_wave_headline(c)
    }
}

/// Every compatible node runs the mode.
fn ready_message(c: &Ctx<'_, '_>) -> String {
    let incompatible: Vec<&str> = c
        .views
        .iter()
        .filter(|v| v.state == NodeState::Incompatible)
        .map(|v| v.node.name.as_str())
        .collect();
    let mut m = format!(
        "all {} compatible node(s) run {} (or their fallback) and are healthy",
        c.waves.eligible.len(),
        c.p.spec.mode
    );
    if !incompatible.is_empty() {
        let _ = write!(
            m,
            "; {} incompatible node(s) left alone: {}",
            incompatible.len(),
            names(&incompatible)
        );
    }
    m
}

/// The current wave soaks, is held, or progresses.
fn current_wave_headline(c: &Ctx<'_, '_>) -> (PolicyPhase, String) {
    let (p, g) = (c.p, c.p.generation);
    let w = c.gates.current.unwrap_or(0);
    let name = &c.waves.defs[w].name;
    if let Some(left) = c.gates.soak_left {
        let next = c
            .waves
            .defs
            .get(w + 1)
            .map(|d| format!("wave {}", d.name))
            .unwrap_or_else(|| "the end of the rollout".into());
        let m = format!(
            "wave {name} is healthy and soaks for {}s more before {next}",
            left.as_secs()
        );
        return (PolicyPhase::Progressing, m);
    }
    match &c.gates.hold {
        Hold::SpecPaused => (
            PolicyPhase::Paused,
            format!(
                "spec.rollout.paused is true: nothing new switches and status.waves shows the plan (dry run); next is wave {name}. To start: kubectl patch proxypolicy {} --type merge -p '{{\"spec\":{{\"rollout\":{{\"paused\":false}}}}}}'",
                p.name
            ),
        ),
        Hold::Invalid(why) => (
            PolicyPhase::Paused,
            format!("the spec cannot be used, so nothing new switches (wave {name} waits): {why}"),
        ),
        Hold::Approval { stale } => {
            let mut m = format!(
                "wave {name} waits for approval: kubectl annotate --overwrite proxypolicy {} {APPROVE_PREFIX}{name}={g}",
                p.name
            );
            if c.waves.members[w].is_empty() {
                let _ = write!(
                    m,
                    " (the wave has no node: check its nodeSelector and nodes; approving it lets the rollout go on without it)"
                );
            }
            if let Some(s) = stale {
                let _ = write!(m, " (the present approval {s:?} is not for generation {g})");
            }
            (PolicyPhase::AwaitingApproval, m)
        }
        Hold::Window(why) => (
            PolicyPhase::WaitingForWindow,
            format!("wave {name} waits: {why}; switches start only inside the window"),
        ),
        Hold::Rollback => (
            PolicyPhase::Paused,
            format!(
                "rolled back on request ({ROLLBACK_ANNOTATION}={g}): the nodes this rollout switched run their previous mode again and nothing new switches; to roll out again, change the spec (a new generation), e.g. kubectl switchyard resume {}",
                p.name
            ),
        ),
        Hold::Budget | Hold::None => (PolicyPhase::Progressing, progress_message(c, w)),
    }
}

/// How the current wave `w` progresses: healthy nodes, switching ones, why nothing more starts.
fn progress_message(c: &Ctx<'_, '_>, w: usize) -> String {
    let (views, b) = (c.views, c.budget);
    let members = &c.waves.members[w];
    let healthy = members
        .iter()
        .filter(|&&i| views[i].state == NodeState::Healthy)
        .count();
    let switching: Vec<&str> = members
        .iter()
        .filter(|&&i| views[i].state == NodeState::Switching || c.gates.admit[i])
        .map(|&i| views[i].node.name.as_str())
        .collect();
    let mut m = format!(
        "wave {}: {healthy}/{} node(s) healthy",
        c.waves.defs[w].name,
        members.len()
    );
    if !switching.is_empty() {
        let _ = write!(m, ", switching: {}", names(&switching));
    }
    let waiting = members
        .iter()
        .any(|&i| views[i].state == NodeState::Pending && !c.gates.admit[i]);
    if switching.is_empty() && waiting && b.unavailable >= b.max_unavailable {
        let unavailable: Vec<&str> = c
            .waves
            .eligible
            .iter()
            .filter(|&&i| !views[i].available)
            .map(|&i| views[i].node.name.as_str())
            .collect();
        let _ = write!(
            m,
            "; waiting: {} node(s) unavailable ({}) with maxUnavailable={}",
            b.unavailable,
            names(&unavailable),
            b.max_unavailable
        );
    }
    if !b.failed.is_empty() {
        let _ = write!(
            m,
            "; failed within budget (maxFailures={}): {}",
            b.max_failures,
            b.failed_names()
        );
    }
    m
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use serde_json::json;

    use super::{
        super::{assign::assign_waves, budget::budget, classify::classify, fixtures::*, gates::gates},
        *,
    };
    use crate::validate;

    fn summary(p: &PolicyInput, proxies: &[NodeProxyInput]) -> Summary {
        let nodes: Vec<_> = (0..proxies.len()).map(|i| node_input(&format!("n{i}"))).collect();
        let views: Vec<View<'_>> = nodes
            .iter()
            .zip(proxies)
            .map(|(n, x)| classify(p, n, Some(x)))
            .collect();
        let waves = assign_waves(p, &views);
        let b = budget(p, &views, &waves);
        let g = gates(p, &views, &waves, &b, &validate::check(p), t0());
        summarize(p, &views, &waves, &b, &g)
    }

    /// (case, rollout fields, rollback annotation, proxies, expected phase, message contains)
    type Case = (
        &'static str,
        serde_json::Value,
        Option<&'static str>,
        Vec<NodeProxyInput>,
        PolicyPhase,
        &'static str,
    );

    #[test]
    fn phase_and_headline_table() {
        let bad = || answered(IPT, "pool-g1-nftables", IPT, "RolledBack");
        let ok = || answered(NFT, "pool-g1-nftables", IPT, "Succeeded");
        let cases: Vec<Case> = vec![
            (
                "no node",
                json!({}),
                None,
                vec![],
                PolicyPhase::Pending,
                "selects no node",
            ),
            (
                "all done",
                json!({}),
                None,
                vec![np(NFT, BOTH), np(IPT, &[IPT])],
                PolicyPhase::Ready,
                "all 1 compatible node(s) run nftables (or their fallback) and are healthy; 1 incompatible node(s) left alone: n1",
            ),
            (
                "progressing",
                json!({}),
                None,
                vec![np(IPT, BOTH), np(IPT, BOTH)],
                PolicyPhase::Progressing,
                "wave all: 0/2 node(s) healthy, switching: n",
            ),
            (
                "paused",
                json!({"paused": true}),
                None,
                vec![np(IPT, BOTH)],
                PolicyPhase::Paused,
                "spec.rollout.paused is true",
            ),
            (
                "approval",
                json!({"waves": [{"name": "w1", "requireApproval": true}]}),
                None,
                vec![np(IPT, BOTH)],
                PolicyPhase::AwaitingApproval,
                "approve.switchyard.dev/w1=1",
            ),
            (
                "budget spent",
                json!({"maxFailures": 0}),
                None,
                vec![bad(), np(IPT, BOTH)],
                PolicyPhase::Degraded,
                "1 node(s) failed their switch, more than maxFailures=0",
            ),
            (
                "budget spent, rollback",
                json!({"maxFailures": 0, "failurePolicy": "rollback"}),
                None,
                vec![bad(), ok()],
                PolicyPhase::RollingBack,
                "failurePolicy rollback returns 1 node(s)",
            ),
            (
                "manual rollback",
                json!({}),
                Some("1"),
                vec![ok()],
                PolicyPhase::RollingBack,
                "rollback requested (switchyard.dev/rollback=1): returning 1 node(s)",
            ),
            (
                "manual rollback done",
                json!({}),
                Some("1"),
                vec![np(NFT, BOTH)],
                PolicyPhase::Ready,
                "all 1 compatible",
            ),
            (
                "failed within budget, done",
                json!({"maxFailures": 1}),
                None,
                vec![bad(), np(NFT, BOTH)],
                PolicyPhase::Degraded,
                "every wave ran, but 1 node(s) failed",
            ),
            (
                "waiting for room",
                json!({}),
                None,
                vec![unhealthy(np(NFT, BOTH)), np(IPT, BOTH)],
                PolicyPhase::Progressing,
                "waiting: 1 node(s) unavailable (n0) with maxUnavailable=1",
            ),
        ];
        for (name, rollout, annotation, proxies, phase, message) in cases {
            let mut p = with_rollout(policy_input("pool", NFT, 1), rollout);
            p.rollback = annotation.map(str::to_owned);
            let s = summary(&p, &proxies);
            assert_eq!(s.phase, phase, "{name}: {}", s.message);
            assert!(s.message.contains(message), "{name}: {}", s.message);
        }
    }

    #[test]
    fn counts_and_wave_status() {
        let p = with_rollout(
            policy_input("pool", NFT, 1),
            json!({"maxFailures": 1, "waves": [{"name": "canary", "nodes": 1}, {"name": "rest"}]}),
        );
        let proxies = [
            np(NFT, BOTH),
            answered(IPT, "pool-g1-nftables", IPT, "RolledBack"),
            np(IPT, BOTH),
            np(IPT, &[IPT]),
        ];
        let s = summary(&p, &proxies);
        let counts = (
            s.target_nodes,
            s.updated_nodes,
            s.healthy_nodes,
            s.failed_nodes,
            s.incompatible_nodes,
        );
        assert_eq!(counts, (4, 1, 1, 1, 1));
        let waves: Vec<(&str, usize)> = s.waves.iter().map(|w| (w.name.as_str(), w.nodes.len())).collect();
        assert_eq!(waves, [("canary", 1), ("rest", 2)]);
        assert_eq!(s.waves.iter().map(|w| w.failed).sum::<i32>(), 1);
        let status = s.status(1, vec![]);
        assert_eq!(
            (status.observed_generation, status.phase),
            (Some(1), Some(s.phase))
        );
        assert_eq!(status.current_wave, s.current_wave);
    }
}
