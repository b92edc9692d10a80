//! Stage 4, gates: walks the waves in order. Complete waves (all nodes healthy, or recorded
//! complete for this generation) pass, possibly soaking; the first other wave is the current one:
//! its gates (invalid spec, failure budget, manual rollback, pause, approval, maintenance window)
//! either hold it or it admits pending nodes up to `maxUnavailable`. Later waves wait.

use std::time::Duration;

use jiff::{SignedDuration, Timestamp};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use switchyard_crds::v1alpha1::{WaveState, WaveStatus};

use super::{
    super::{validate::Findings, waves::WaveDef, window},
    Budget, NodeState, PolicyInput, View, Waves, names_generation, time,
};

/// Why the current wave does not release nodes.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Hold {
    /// Nothing holds it.
    None,
    /// `spec.rollout.paused`.
    SpecPaused,
    /// The failure budget is spent.
    Budget,
    /// The wave needs an approval for this generation; `stale`: the approval present, if any.
    Approval {
        /// The value of the present approval annotation (for another generation).
        stale: Option<String>,
    },
    /// Outside the maintenance window (or the window cannot be evaluated): why.
    Window(String),
    /// The spec cannot be used ([`crate::validate`]): nothing new switches.
    Invalid(String),
    /// A manual rollback of this generation was requested.
    Rollback,
}

/// The state and timestamps of one wave in this plan.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct WaveRun {
    /// Its state.
    pub state: WaveState,
    /// When it started.
    pub started_at: Option<Time>,
    /// When it became healthy.
    pub completed_at: Option<Time>,
}

/// The walk over the waves.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Gates {
    /// One run per wave.
    pub runs: Vec<WaveRun>,
    /// The first wave that is not complete, or that soaks.
    pub current: Option<usize>,
    /// Why the current wave does not release nodes.
    pub hold: Hold,
    /// Soak time left of the current wave.
    pub soak_left: Option<Duration>,
    /// Per view: admitted to switch by this plan.
    pub admit: Vec<bool>,
}

/// The inputs every step of the walk reads.
struct Walk<'c, 'a> {
    p: &'c PolicyInput,
    views: &'c [View<'a>],
    waves: &'c Waves<'c>,
    budget: &'c Budget,
    findings: &'c Findings,
    now: Timestamp,
}

impl Walk<'_, '_> {
    fn any(&self, w: usize, f: impl Fn(&View<'_>) -> bool) -> bool {
        self.waves.members[w].iter().any(|&i| f(&self.views[i]))
    }

    /// Some node of wave `w` is (being) returned to its previous mode.
    fn rolled(&self, w: usize) -> bool {
        self.waves.members[w]
            .iter()
            .any(|&i| self.budget.returns(self.views, i))
    }

    /// The approval annotation of wave `w`, and whether it names this generation.
    fn approval(&self, def: &WaveDef) -> (Option<&String>, bool) {
        let approval = self.p.approvals.get(&def.name);
        let approved = approval.is_some_and(|v| names_generation(v, self.p.generation));
        (approval, approved)
    }

    fn prev(&self, w: usize) -> Option<&WaveStatus> {
        self.waves.prev[w]
    }
}

/// Walks the waves: see the module documentation.
pub(crate) fn gates(
    p: &PolicyInput,
    views: &[View<'_>],
    waves: &Waves<'_>,
    budget: &Budget,
    findings: &Findings,
    now: Timestamp,
) -> Gates {
    let walk = Walk {
        p,
        views,
        waves,
        budget,
        findings,
        now,
    };
    let mut g = Gates {
        runs: Vec::with_capacity(waves.defs.len()),
        current: None,
        hold: Hold::None,
        soak_left: None,
        admit: vec![false; views.len()],
    };
    for w in 0..waves.defs.len() {
        let run = if g.current.is_some() {
            WaveRun {
                state: if walk.rolled(w) {
                    WaveState::RolledBack
                } else {
                    WaveState::Pending
                },
                started_at: None,
                completed_at: None,
            }
        } else if is_complete(&walk, w) && !walk.rolled(w) {
            let (run, soak_left) = completed_run(&walk, w);
            if soak_left.is_some() {
                g.current = Some(w);
                g.soak_left = soak_left;
            }
            run
        } else {
            g.current = Some(w);
            open_run(&walk, w, &mut g)
        };
        g.runs.push(run);
    }
    mark_budget_waves(&walk, &mut g.runs);
    g
}

/// Wave `w` needs nothing more: all its nodes are healthy (failed ones within the budget do not
/// hold it), or the previous status recorded it complete for this generation and none of its nodes
/// needs a switch. An empty wave that requires approval is not complete until approved.
fn is_complete(walk: &Walk<'_, '_>, w: usize) -> bool {
    let views = walk.views;
    let members = &walk.waves.members[w];
    let exceeded = walk.budget.exceeded;
    // Failed nodes within the failure budget do not hold the wave.
    let all_healthy = members
        .iter()
        .all(|&i| views[i].state == NodeState::Healthy || (views[i].state == NodeState::Failed && !exceeded));
    let needs_switch = walk.any(w, |v| {
        matches!(v.state, NodeState::Pending | NodeState::Switching)
    });
    let prev_gen_same = walk.p.status.as_ref().and_then(|s| s.observed_generation) == Some(walk.p.generation);
    let recorded = prev_gen_same
        && walk.prev(w).map(|s| s.state) == Some(WaveState::Completed)
        && !needs_switch
        && !walk.rolled(w);
    let (_, approved) = walk.approval(&walk.waves.defs[w]);
    // An empty wave does not pass its approval gate by being empty (a typo in a canary's
    // selector must not skip the approval): it waits like any other wave.
    let gate_closed = members.is_empty() && walk.waves.defs[w].require_approval && !approved;
    (all_healthy || recorded) && !gate_closed
}

/// The run of a complete wave: Soaking (with the time left) or Completed.
fn completed_run(walk: &Walk<'_, '_>, w: usize) -> (WaveRun, Option<Duration>) {
    let (def, pw, now) = (&walk.waves.defs[w], walk.prev(w), walk.now);
    let switched = walk.any(w, |v| v.switched_here);
    let was_running = matches!(
        pw.map(|s| s.state),
        Some(WaveState::Progressing | WaveState::Soaking)
    );
    let healthy_since = pw
        .filter(|s| matches!(s.state, WaveState::Soaking | WaveState::Completed))
        .and_then(|s| s.completed_at.as_ref().map(|t| t.0))
        .or_else(|| {
            walk.waves.members[w]
                .iter()
                .filter_map(|&i| walk.views[i].finished_at)
                .max()
        })
        .unwrap_or(now);
    let soak_end = healthy_since
        .checked_add(SignedDuration::from_secs(i64::from(def.soak_seconds)))
        .unwrap_or(now);
    let soaking = def.soak_seconds > 0 && (switched || was_running) && now < soak_end;
    let started_at = pw
        .and_then(|s| s.started_at.clone())
        .or_else(|| switched.then(|| time(healthy_since)));
    let soak_left = soaking
        .then(|| Duration::from_secs(u64::try_from(now.duration_until(soak_end).as_secs()).unwrap_or(0) + 1));
    let run = WaveRun {
        state: if soaking {
            WaveState::Soaking
        } else {
            WaveState::Completed
        },
        started_at,
        completed_at: Some(time(healthy_since)),
    };
    (run, soak_left)
}

/// What holds the current wave `def`, if anything (in order of precedence).
fn hold_for(walk: &Walk<'_, '_>, def: &WaveDef) -> Hold {
    let p = walk.p;
    let (approval, approved) = walk.approval(def);
    if !walk.findings.invalid.is_empty() {
        Hold::Invalid(walk.findings.invalid.join("; "))
    } else if walk.budget.exceeded {
        Hold::Budget
    } else if walk.budget.manual {
        Hold::Rollback
    } else if p.spec.rollout.paused {
        Hold::SpecPaused
    } else if def.require_approval && !approved {
        Hold::Approval {
            stale: approval.cloned(),
        }
    } else {
        match p.spec.rollout.window.as_ref() {
            Some(win) => match window::is_open(win, walk.now) {
                Ok(true) => Hold::None,
                Ok(false) => Hold::Window(format!(
                    "outside the maintenance window ({})",
                    window::describe(win)
                )),
                Err(e) => Hold::Window(e.to_string()),
            },
            None => Hold::None,
        }
    }
}

/// The run of the current wave `w`: decides its hold and admits pending, available nodes up to
/// the unavailability budget when nothing holds it.
fn open_run(walk: &Walk<'_, '_>, w: usize, g: &mut Gates) -> WaveRun {
    let (views, budget) = (walk.views, walk.budget);
    let prev_state = walk.prev(w).map(|s| s.state);
    let prev_started = walk.prev(w).and_then(|s| s.started_at.clone());
    let started = matches!(
        prev_state,
        Some(WaveState::Progressing | WaveState::Soaking | WaveState::Failed)
    ) || walk.any(w, |v| {
        v.switched_here || matches!(v.state, NodeState::Switching | NodeState::Failed)
    });
    g.hold = hold_for(walk, &walk.waves.defs[w]);
    let mut admitted = false;
    if g.hold == Hold::None {
        let room = budget.max_unavailable.saturating_sub(budget.unavailable);
        for &i in walk.waves.members[w]
            .iter()
            .filter(|&&i| views[i].state == NodeState::Pending && views[i].available)
            // A blocking preflight finding holds the node (PreflightPassed says why).
            .filter(|&&i| !views[i].preflight.iter().any(crate::preflight::Finding::holds))
            .take(room)
        {
            g.admit[i] = true;
            admitted = true;
        }
    }
    let state = match &g.hold {
        Hold::Budget if budget.rollback => WaveState::RolledBack,
        Hold::Budget => WaveState::Failed,
        Hold::Rollback if walk.rolled(w) => WaveState::RolledBack,
        Hold::Rollback => WaveState::Pending,
        Hold::Approval { .. } => WaveState::AwaitingApproval,
        _ if started || admitted => WaveState::Progressing,
        _ => WaveState::Pending,
    };
    let started_at = if matches!(
        state,
        WaveState::Progressing | WaveState::Failed | WaveState::RolledBack
    ) {
        prev_started.or(Some(time(walk.now)))
    } else {
        prev_started
    };
    WaveRun {
        state,
        started_at,
        completed_at: None,
    }
}

/// Beyond the failure budget, waves with failed nodes are Failed (pause) or RolledBack (rollback),
/// and so are waves whose nodes the rollback returns.
fn mark_budget_waves(walk: &Walk<'_, '_>, runs: &mut [WaveRun]) {
    let budget = walk.budget;
    for (w, run) in runs.iter_mut().enumerate() {
        let has_failed = walk.any(w, |v| v.state == NodeState::Failed);
        if budget.rollback && (has_failed || walk.rolled(w)) {
            run.state = WaveState::RolledBack;
        } else if budget.exceeded && has_failed {
            run.state = WaveState::Failed;
        }
        if matches!(run.state, WaveState::Failed | WaveState::RolledBack) && run.started_at.is_none() {
            run.started_at = walk
                .prev(w)
                .and_then(|s| s.started_at.clone())
                .or(Some(time(walk.now)));
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use serde_json::json;

    use super::{
        super::{assign::assign_waves, budget::budget, classify::classify, fixtures::*},
        *,
    };
    use crate::validate;

    /// Runs classify → waves → budget → gates over `proxies` (nodes n0, n1, ...).
    fn walk(p: &PolicyInput, proxies: &[NodeProxyInput], now: Timestamp) -> Gates {
        let nodes: Vec<_> = (0..proxies.len()).map(|i| node_input(&format!("n{i}"))).collect();
        let views: Vec<View<'_>> = nodes
            .iter()
            .zip(proxies)
            .map(|(n, x)| classify(p, n, Some(x)))
            .collect();
        let waves = assign_waves(p, &views);
        let b = budget(p, &views, &waves);
        gates(p, &views, &waves, &b, &validate::check(p), now)
    }

    fn states(g: &Gates) -> Vec<WaveState> {
        g.runs.iter().map(|r| r.state).collect()
    }

    /// (case, rollout fields, approvals, node proxies, expected: wave states, current, hold, admitted)
    type Case = (
        &'static str,
        serde_json::Value,
        Vec<(&'static str, &'static str)>,
        Vec<NodeProxyInput>,
        (Vec<WaveState>, Option<usize>, Hold, usize),
    );

    #[test]
    fn gates_table() {
        use WaveState::*;
        let two = json!([{"name": "canary", "nodes": 1}, {"name": "rest"}]);
        let gated = json!([{"name": "canary", "nodes": 1, "requireApproval": true}, {"name": "rest"}]);
        let idle = || vec![np(IPT, BOTH), np(IPT, BOTH), np(IPT, BOTH)];
        let done = || vec![np(NFT, BOTH), np(NFT, BOTH)];
        let cases: Vec<Case> = vec![
            (
                "starts the first wave",
                json!({"waves": two}),
                vec![],
                idle(),
                (vec![Progressing, Pending], Some(0), Hold::None, 1),
            ),
            (
                "maxUnavailable 2 admits two in the big wave",
                json!({"maxUnavailable": 2}),
                vec![],
                idle(),
                (vec![Progressing], Some(0), Hold::None, 2),
            ),
            (
                "spec paused",
                json!({"waves": two, "paused": true}),
                vec![],
                idle(),
                (vec![Pending, Pending], Some(0), Hold::SpecPaused, 0),
            ),
            (
                "awaits approval",
                json!({"waves": gated}),
                vec![],
                idle(),
                (
                    vec![AwaitingApproval, Pending],
                    Some(0),
                    Hold::Approval { stale: None },
                    0,
                ),
            ),
            (
                "stale approval",
                json!({"waves": gated}),
                vec![("canary", "0")],
                idle(),
                (
                    vec![AwaitingApproval, Pending],
                    Some(0),
                    Hold::Approval {
                        stale: Some("0".into()),
                    },
                    0,
                ),
            ),
            (
                "approved",
                json!({"waves": gated}),
                vec![("canary", "1")],
                idle(),
                (vec![Progressing, Pending], Some(0), Hold::None, 1),
            ),
            (
                "all done",
                json!({"waves": two}),
                vec![],
                done(),
                (vec![Completed, Completed], None, Hold::None, 0),
            ),
            (
                "no room: one node unavailable",
                json!({"waves": two}),
                vec![],
                vec![np(IPT, BOTH), unhealthy(np(NFT, BOTH)), np(IPT, BOTH)],
                (vec![Pending, Pending], Some(0), Hold::None, 0),
            ),
            (
                "budget spent, pause",
                json!({"maxFailures": 0}),
                vec![],
                vec![
                    answered(IPT, "pool-g1-nftables", IPT, "RolledBack"),
                    np(IPT, BOTH),
                ],
                (vec![Failed], Some(0), Hold::Budget, 0),
            ),
            (
                "invalid spec holds first",
                json!({"waves": two, "maxUnavailable": "lots"}),
                vec![],
                idle(),
                (vec![Pending, Pending], Some(0), Hold::Invalid(String::new()), 0),
            ),
        ];
        for (name, rollout, approvals, proxies, (want_states, current, hold, admitted)) in cases {
            let mut p = with_rollout(policy_input("pool", NFT, 1), rollout);
            p.approvals = approvals
                .iter()
                .map(|(k, v)| ((*k).into(), (*v).into()))
                .collect();
            let g = walk(&p, &proxies, t0());
            assert_eq!(states(&g), want_states, "{name}");
            assert_eq!(g.current, current, "{name}");
            match (&hold, &g.hold) {
                (Hold::Invalid(_), Hold::Invalid(why)) => {
                    assert!(why.contains("maxUnavailable"), "{name}: {why}")
                }
                _ => assert_eq!(g.hold, hold, "{name}"),
            }
            assert_eq!(g.admit.iter().filter(|a| **a).count(), admitted, "{name}");
        }
    }

    #[test]
    fn a_healthy_wave_soaks_then_completes() {
        let p = with_rollout(
            policy_input("pool", NFT, 1),
            json!({"waves": [{"name": "canary", "nodes": 1, "soakSeconds": 60}, {"name": "rest"}]}),
        );
        // Both nodes switched here and finished at t0, so each wave is healthy since t0.
        let proxies = [
            answered(NFT, "pool-g1-nftables", IPT, "Succeeded"),
            answered(NFT, "pool-g1-nftables", IPT, "Succeeded"),
        ];
        let g = walk(&p, &proxies, t0() + SignedDuration::from_secs(20));
        assert_eq!(states(&g), [WaveState::Soaking, WaveState::Pending]);
        assert_eq!((g.current, g.soak_left), (Some(0), Some(Duration::from_secs(41))));
        let g = walk(&p, &proxies, t0() + SignedDuration::from_secs(61));
        assert_eq!(states(&g), [WaveState::Completed, WaveState::Completed]);
        assert_eq!((g.current, g.soak_left), (None, None));
        assert_eq!(g.runs[0].completed_at, Some(time(t0())));
    }

    #[test]
    fn outside_the_window_holds() {
        let p = with_rollout(
            policy_input("pool", NFT, 1),
            json!({"window": {"start": "22:00", "end": "23:00", "timeZone": "UTC"}}),
        );
        let g = walk(&p, &[np(IPT, BOTH)], t0());
        assert_eq!(
            g.hold,
            Hold::Window("outside the maintenance window (daily 22:00-23:00 UTC)".into())
        );
        assert_eq!(states(&g), [WaveState::Pending]);
    }
}
