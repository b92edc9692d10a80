//! The live mode switch: a pure state machine ([`decide`], [`recover`]) and its persisted state.
//!
//! ```text
//!  Active(old) ─► Preparing(new: programmed, bypassed) ─► CutOver(new takes new connections,
//!  old bypassed) ─► Verifying(health gate) ─► Cleaning(old removed) ─► Active(new)
//!        any failure, timeout or a changed wish ─► RollingBack ─► Active(old)
//! ```
//! Make-before-break works because NAT is decided once per connection: established connections
//! keep their conntrack binding whichever backend made it. Every backend has a bypass switch at
//! its entry points, so CutOver is "un-bypass new, then bypass old" and rollback the reverse,
//! whatever the pair of backends. The driver persists the phase *before* running its effect, so a
//! crash at any point is recovered by [`recover`] into exactly one serving backend.

use std::time::Duration;

use serde::{Deserialize, Serialize};
use switchyard_crds::v1alpha1::{ProxyMode, SwitchOutcome};

/// Phase of the switch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Phase {
    /// One backend serves.
    Active,
    /// The target backend is being programmed, bypassed.
    Preparing,
    /// Entry points are being swapped.
    CutOver,
    /// The health gate runs against the target.
    Verifying,
    /// The old backend's objects are being removed.
    Cleaning,
    /// Returning to the old backend.
    RollingBack,
}

/// What the agent persists (state file and NodeProxy status).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SwitchState {
    /// Current phase.
    pub phase: Phase,
    /// The serving backend (in Active), or the one being left (during a switch).
    pub active: ProxyMode,
    /// The backend being switched to.
    pub target: Option<ProxyMode>,
    /// Rollout token of the request being answered.
    pub token: Option<String>,
    /// Last token answered (switch finished, rolled back or refused).
    pub answered: Option<String>,
    /// How many agent restarts interrupted the current switch.
    pub restarts: u32,
}

impl SwitchState {
    /// Active in `mode`, nothing pending.
    pub fn active(mode: ProxyMode) -> Self {
        Self {
            phase: Phase::Active,
            active: mode,
            target: None,
            token: None,
            answered: None,
            restarts: 0,
        }
    }
}

/// What the operator asks for (NodeProxy spec).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Desired {
    /// Desired mode.
    pub mode: ProxyMode,
    /// Rollout token.
    pub token: Option<String>,
}

/// Health-gate observations during Verifying.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct GateProgress {
    /// Time since the cut-over.
    pub elapsed: Duration,
    /// How long the probes have been passing without interruption.
    pub healthy_for: Duration,
    /// Consecutive failed probe rounds.
    pub consecutive_failures: u32,
    /// In Preparing: the target still waits for something outside Switchyard (mode `external`:
    /// the other proxy's rules), see [`crate::backend::Backend::waiting_for`].
    pub target_waiting: bool,
    /// Time since Preparing started.
    pub preparing_for: Duration,
    /// The request brings other policy settings than the node ran before it: with the mode the
    /// node runs, a settings switch (the settings were taken, the gate decides whether they stay;
    /// see `runtime::settings_switch`).
    pub settings_changed: bool,
}

/// Health-gate parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Gate {
    /// Probes must pass this long.
    pub min_healthy: Duration,
    /// Overall deadline from the cut-over.
    pub timeout: Duration,
    /// Consecutive failures that fail the switch.
    pub failure_threshold: u32,
}

/// The next step for the driver.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// Nothing to do.
    Idle,
    /// Start a switch to `target` for `token`.
    Prepare {
        /// Target mode.
        target: ProxyMode,
        /// Token.
        token: Option<String>,
    },
    /// Refuse the request: the node cannot run the mode.
    Refuse {
        /// Why.
        reason: String,
    },
    /// Stay in Preparing: the target is not ready to take traffic yet.
    AwaitTarget,
    /// Swap the entry points.
    CutOver,
    /// Keep verifying.
    Verify,
    /// Gate passed: remove the old backend.
    Clean,
    /// Return to the old backend.
    RollBack {
        /// Why.
        reason: String,
    },
}

/// Decides the next step from the persisted state, the wish, what the kernel supports and the
/// gate's progress. Pure.
pub fn decide(
    state: &SwitchState,
    desired: Option<&Desired>,
    supported: &[ProxyMode],
    gate: Gate,
    progress: GateProgress,
) -> Step {
    match state.phase {
        Phase::Active => match desired {
            Some(d) if d.mode != state.active && (d.token.is_none() || d.token != state.answered) => {
                if supported.contains(&d.mode) {
                    Step::Prepare {
                        target: d.mode,
                        token: d.token.clone(),
                    }
                } else {
                    Step::Refuse {
                        reason: format!("this node cannot run {} (supported: {supported:?})", d.mode),
                    }
                }
            }
            // A settings switch: the backend that serves stays, the gate checks its new settings.
            Some(d) if progress.settings_changed && d.token.is_some() && d.token != state.answered => {
                Step::Prepare {
                    target: d.mode,
                    token: d.token.clone(),
                }
            }
            _ => Step::Idle,
        },
        _ if desired.is_some_and(|d| Some(d.mode) != state.target) && state.phase != Phase::RollingBack => {
            Step::RollBack {
                reason: "the desired mode changed during the switch".into(),
            }
        }
        Phase::Preparing => prepared(state, gate, progress),
        Phase::CutOver => Step::Verify,
        Phase::Verifying => {
            if progress.consecutive_failures >= gate.failure_threshold {
                Step::RollBack {
                    reason: format!(
                        "health gate failed {} consecutive probe rounds",
                        progress.consecutive_failures
                    ),
                }
            } else if progress.healthy_for >= gate.min_healthy && progress.consecutive_failures == 0 {
                Step::Clean
            } else if progress.elapsed >= gate.timeout {
                Step::RollBack {
                    reason: format!("health gate not passed within {}s", gate.timeout.as_secs()),
                }
            } else {
                Step::Verify
            }
        }
        Phase::Cleaning => Step::Clean,
        Phase::RollingBack => Step::RollBack {
            reason: "resuming rollback".into(),
        },
    }
}

/// In Preparing: cut over once the target is ready; a target that waits longer than the gate's
/// timeout (mode `external` without the other proxy's rules) rolls back before anything was
/// bypassed.
fn prepared(state: &SwitchState, gate: Gate, progress: GateProgress) -> Step {
    if !progress.target_waiting {
        return Step::CutOver;
    }
    if progress.preparing_for < gate.timeout {
        return Step::AwaitTarget;
    }
    let secs = gate.timeout.as_secs();
    let reason = match state.target {
        Some(ProxyMode::External) => format!(
            "no other service proxy appeared on the node within {secs}s (is its DaemonSet selecting switchyard.dev/service-proxy=external?); Switchyard's rules kept serving"
        ),
        target => format!(
            "{} was not ready to take traffic within {secs}s",
            target.map(|t| t.as_str()).unwrap_or("the target")
        ),
    };
    Step::RollBack { reason }
}

/// Restarts allowed to interrupt one switch before it is reported failed.
pub const MAX_RESTARTS: u32 = 3;

/// How to come back after a restart: which backend serves, which to remove, and the new state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Recovery {
    /// The backend to (re)program un-bypassed.
    pub serve: ProxyMode,
    /// Backends whose objects must be removed.
    pub remove: Vec<ProxyMode>,
    /// State after recovery (always Active).
    pub state: SwitchState,
    /// A result to report, if the interrupted switch is over.
    pub result: Option<(SwitchOutcome, String)>,
}

/// Recovers from a persisted state: Cleaning finishes forward (the gate had passed); any earlier
/// phase returns to the old backend and retries later (unless it was interrupted too often).
pub fn recover(persisted: &SwitchState) -> Recovery {
    let others = |keep: ProxyMode| {
        ProxyMode::ALL
            .iter()
            .copied()
            .filter(|m| *m != keep)
            .collect::<Vec<_>>()
    };
    match (persisted.phase, persisted.target) {
        (Phase::Active, _) | (_, None) => Recovery {
            serve: persisted.active,
            remove: others(persisted.active),
            state: SwitchState {
                phase: Phase::Active,
                target: None,
                ..persisted.clone()
            },
            result: None,
        },
        (Phase::Cleaning, Some(target)) => Recovery {
            serve: target,
            remove: others(target),
            state: SwitchState {
                phase: Phase::Active,
                active: target,
                target: None,
                answered: persisted.token.clone(),
                token: None,
                restarts: 0,
            },
            result: Some((
                SwitchOutcome::Succeeded,
                "switch completed after an agent restart during cleaning".into(),
            )),
        },
        (phase, Some(_)) => {
            let restarts = persisted.restarts + 1;
            let give_up = restarts >= MAX_RESTARTS;
            Recovery {
                serve: persisted.active,
                remove: others(persisted.active),
                state: SwitchState {
                    phase: Phase::Active,
                    active: persisted.active,
                    target: None,
                    answered: if give_up {
                        persisted.token.clone()
                    } else {
                        persisted.answered.clone()
                    },
                    token: None,
                    restarts: if give_up { 0 } else { restarts },
                },
                result: give_up.then(|| {
                    (
                        SwitchOutcome::Failed,
                        format!("the agent restarted {restarts} times during the switch (last in {phase:?})"),
                    )
                }),
            }
        }
    }
}

/// How the agent starts: the state to recover from, and why the persisted state was not used as
/// it was (reason, message) when it could not be trusted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Start {
    /// The state [`recover`] runs on.
    pub state: SwitchState,
    /// `(reason, message)` for status and an Event.
    pub problem: Option<(&'static str, String)>,
    /// A switch result to report: a switch the file missed the end of.
    pub result: Option<(SwitchOutcome, String)>,
}

fn modes_text(modes: &[ProxyMode]) -> String {
    if modes.is_empty() {
        return "none".into();
    }
    modes
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

/// Decides the start state from the persisted state and what the kernel holds. Pure.
///
/// The persisted state is used as it is when the kernel agrees with it (its serving backend
/// serves) or holds nothing of ours (a rebooted node). Otherwise — the file is missing,
/// unreadable, or stale — the kernel wins: the backend it serves keeps serving (by preference the
/// persisted target, then `--mode`), so nothing switches that the NodeProxy spec did not ask for.
pub fn start_state(
    loaded: &crate::state_store::Loaded,
    kernel: &[(ProxyMode, crate::backend::Presence)],
    initial: ProxyMode,
) -> Start {
    use crate::{backend::Presence, state_store::Loaded};
    let serving: Vec<ProxyMode> = kernel
        .iter()
        .filter(|(_, p)| *p == Presence::Serving)
        .map(|(m, _)| *m)
        .collect();
    match loaded {
        Loaded::Valid(state) => start_from(state, kernel, &serving, initial),
        Loaded::Absent => {
            let keep = pick(&serving, &[Some(initial)], initial);
            let problem = (keep != initial || serving.len() > 1).then(|| {
                (
                    "StateFileMissing",
                    format!(
                        "no state file; the kernel serves {}: keeping {keep} (the configured mode is {initial})",
                        modes_text(&serving)
                    ),
                )
            });
            Start {
                state: SwitchState::active(keep),
                problem,
                result: None,
            }
        }
        Loaded::Corrupt(why) => {
            let keep = pick(&serving, &[Some(initial)], initial);
            Start {
                state: SwitchState::active(keep),
                result: None,
                problem: Some((
                    "StateFileCorrupt",
                    format!(
                        "{why}; the kernel serves {}: keeping {keep}",
                        modes_text(&serving)
                    ),
                )),
            }
        }
    }
}

/// The serving mode to keep: the first of `preferred` that serves, else any that serves, else
/// `initial`.
fn pick(serving: &[ProxyMode], preferred: &[Option<ProxyMode>], initial: ProxyMode) -> ProxyMode {
    preferred
        .iter()
        .flatten()
        .find(|m| serving.contains(m))
        .or(serving.first())
        .copied()
        .unwrap_or(initial)
}

/// The start state from a valid persisted `state`: trusted when the kernel agrees with it,
/// otherwise the kernel's serving backend is kept (see [`start_state`]).
fn start_from(
    state: &SwitchState,
    kernel: &[(ProxyMode, crate::backend::Presence)],
    serving: &[ProxyMode],
    initial: ProxyMode,
) -> Start {
    use crate::backend::Presence;
    let present = |mode: ProxyMode| kernel.iter().any(|(m, p)| *m == mode && *p != Presence::Absent);
    let serve = recover(state).serve;
    // Mid-switch, either side may serve (the cut-over moves the entry points), as long as the
    // backend being left is still there (only Cleaning removes it).
    let mid_switch_agrees = state.phase != Phase::Active
        && (present(state.active) || state.phase == Phase::Cleaning)
        && serving
            .iter()
            .all(|m| *m == state.active || Some(*m) == state.target);
    if serving.is_empty() || serving.contains(&serve) || mid_switch_agrees {
        return Start {
            state: state.clone(),
            problem: None,
            result: None,
        };
    }
    let keep = pick(serving, &[state.target, Some(initial)], initial);
    // The switch the file missed the end of evidently finished: its token is answered.
    let finished = state.phase != Phase::Active && Some(keep) == state.target;
    let answered = if finished {
        state.token.clone().or_else(|| state.answered.clone())
    } else {
        state.answered.clone()
    };
    Start {
        result: finished.then(|| {
            (
                SwitchOutcome::Succeeded,
                "the switch had finished (the kernel serves only its target); the state file missed its end"
                    .to_owned(),
            )
        }),
        state: SwitchState {
            answered,
            ..SwitchState::active(keep)
        },
        problem: Some((
            "StateFileStale",
            format!(
                "the state file says {serve} serves ({:?}), but the kernel serves {}: keeping {keep}",
                state.phase,
                modes_text(serving)
            ),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ProxyMode::*;

    const GATE: Gate = Gate {
        min_healthy: Duration::from_secs(10),
        timeout: Duration::from_secs(60),
        failure_threshold: 3,
    };

    fn st(phase: Phase, active: ProxyMode, target: Option<ProxyMode>) -> SwitchState {
        SwitchState {
            phase,
            active,
            target,
            token: Some("t1".into()),
            answered: None,
            restarts: 0,
        }
    }
    fn want(mode: ProxyMode, token: &str) -> Desired {
        Desired {
            mode,
            token: Some(token.into()),
        }
    }
    fn secs(s: u64) -> Duration {
        Duration::from_secs(s)
    }

    #[test]
    fn decide_table() {
        let both = [Iptables, Nftables];
        let ok = |healthy: u64, elapsed: u64| GateProgress {
            elapsed: secs(elapsed),
            healthy_for: secs(healthy),
            ..GateProgress::default()
        };
        let new_settings = GateProgress {
            settings_changed: true,
            ..GateProgress::default()
        };
        let waiting = |preparing: u64| GateProgress {
            target_waiting: true,
            preparing_for: secs(preparing),
            ..GateProgress::default()
        };
        let cases: Vec<(&str, SwitchState, Option<Desired>, GateProgress, Step)> = vec![
            (
                "no wish",
                SwitchState::active(Iptables),
                None,
                ok(0, 0),
                Step::Idle,
            ),
            (
                "already there",
                SwitchState::active(Nftables),
                Some(want(Nftables, "t1")),
                ok(0, 0),
                Step::Idle,
            ),
            (
                "already there, new settings: a settings switch",
                SwitchState::active(Nftables),
                Some(want(Nftables, "t1")),
                new_settings,
                Step::Prepare {
                    target: Nftables,
                    token: Some("t1".into()),
                },
            ),
            (
                "a settings switch answered is not retried",
                SwitchState {
                    answered: Some("t1".into()),
                    ..SwitchState::active(Nftables)
                },
                Some(want(Nftables, "t1")),
                new_settings,
                Step::Idle,
            ),
            (
                "new wish",
                SwitchState::active(Iptables),
                Some(want(Nftables, "t1")),
                ok(0, 0),
                Step::Prepare {
                    target: Nftables,
                    token: Some("t1".into()),
                },
            ),
            (
                "answered token is not retried",
                SwitchState {
                    answered: Some("t1".into()),
                    ..SwitchState::active(Iptables)
                },
                Some(want(Nftables, "t1")),
                ok(0, 0),
                Step::Idle,
            ),
            (
                "a new token retries",
                SwitchState {
                    answered: Some("t1".into()),
                    ..SwitchState::active(Iptables)
                },
                Some(want(Nftables, "t2")),
                ok(0, 0),
                Step::Prepare {
                    target: Nftables,
                    token: Some("t2".into()),
                },
            ),
            (
                "unsupported",
                SwitchState::active(Iptables),
                Some(want(Ipvs, "t1")),
                ok(0, 0),
                Step::Refuse {
                    reason: "this node cannot run ipvs (supported: [Iptables, Nftables])".into(),
                },
            ),
            (
                "prepared",
                st(Phase::Preparing, Iptables, Some(Nftables)),
                Some(want(Nftables, "t1")),
                ok(0, 0),
                Step::CutOver,
            ),
            (
                "cut over",
                st(Phase::CutOver, Iptables, Some(Nftables)),
                Some(want(Nftables, "t1")),
                ok(0, 0),
                Step::Verify,
            ),
            (
                "verifying, not yet",
                st(Phase::Verifying, Iptables, Some(Nftables)),
                Some(want(Nftables, "t1")),
                ok(5, 5),
                Step::Verify,
            ),
            (
                "verified",
                st(Phase::Verifying, Iptables, Some(Nftables)),
                Some(want(Nftables, "t1")),
                ok(10, 12),
                Step::Clean,
            ),
            (
                "failures",
                st(Phase::Verifying, Iptables, Some(Nftables)),
                Some(want(Nftables, "t1")),
                GateProgress {
                    elapsed: secs(3),
                    consecutive_failures: 3,
                    ..GateProgress::default()
                },
                Step::RollBack {
                    reason: "health gate failed 3 consecutive probe rounds".into(),
                },
            ),
            (
                "two failures are tolerated",
                st(Phase::Verifying, Iptables, Some(Nftables)),
                Some(want(Nftables, "t1")),
                GateProgress {
                    elapsed: secs(3),
                    consecutive_failures: 2,
                    ..GateProgress::default()
                },
                Step::Verify,
            ),
            (
                "timeout",
                st(Phase::Verifying, Iptables, Some(Nftables)),
                Some(want(Nftables, "t1")),
                ok(2, 60),
                Step::RollBack {
                    reason: "health gate not passed within 60s".into(),
                },
            ),
            (
                "wish changed mid-switch",
                st(Phase::Verifying, Iptables, Some(Nftables)),
                Some(want(Iptables, "t2")),
                ok(10, 12),
                Step::RollBack {
                    reason: "the desired mode changed during the switch".into(),
                },
            ),
            (
                "cleaning continues",
                st(Phase::Cleaning, Iptables, Some(Nftables)),
                Some(want(Nftables, "t1")),
                ok(0, 0),
                Step::Clean,
            ),
            (
                "hand over: external is always possible",
                SwitchState::active(Nftables),
                Some(want(External, "t1")),
                ok(0, 0),
                Step::Prepare {
                    target: External,
                    token: Some("t1".into()),
                },
            ),
            (
                "hand over: waits for the other proxy before bypassing anything",
                st(Phase::Preparing, Nftables, Some(External)),
                Some(want(External, "t1")),
                waiting(59),
                Step::AwaitTarget,
            ),
            (
                "hand over: the other proxy is there, cut over",
                st(Phase::Preparing, Nftables, Some(External)),
                Some(want(External, "t1")),
                ok(0, 0),
                Step::CutOver,
            ),
            (
                "hand over: no other proxy within the gate's timeout",
                st(Phase::Preparing, Nftables, Some(External)),
                Some(want(External, "t1")),
                waiting(60),
                Step::RollBack {
                    reason: "no other service proxy appeared on the node within 60s (is its DaemonSet selecting switchyard.dev/service-proxy=external?); Switchyard's rules kept serving".into(),
                },
            ),
            (
                "hand over: probes failing through the other proxy roll back",
                st(Phase::Verifying, Nftables, Some(External)),
                Some(want(External, "t1")),
                GateProgress {
                    elapsed: secs(3),
                    consecutive_failures: 3,
                    ..GateProgress::default()
                },
                Step::RollBack {
                    reason: "health gate failed 3 consecutive probe rounds".into(),
                },
            ),
            (
                "take over: external to nftables is a switch like any",
                SwitchState::active(External),
                Some(want(Nftables, "t2")),
                ok(0, 0),
                Step::Prepare {
                    target: Nftables,
                    token: Some("t2".into()),
                },
            ),
            (
                "take over: verified, clean (removes nothing of the other proxy's)",
                st(Phase::Verifying, External, Some(Nftables)),
                Some(want(Nftables, "t2")),
                ok(10, 12),
                Step::Clean,
            ),
        ];
        let supported = [Iptables, Nftables, External];
        for (what, state, desired, progress, step) in cases {
            let supported: &[ProxyMode] = if what.starts_with("unsupported") {
                &both
            } else {
                &supported
            };
            assert_eq!(
                decide(&state, desired.as_ref(), supported, GATE, progress),
                step,
                "{what}"
            );
        }
    }

    #[test]
    fn recovery_leaves_exactly_one_backend() {
        for phase in [
            Phase::Preparing,
            Phase::CutOver,
            Phase::Verifying,
            Phase::RollingBack,
        ] {
            let r = recover(&st(phase, Iptables, Some(Nftables)));
            assert_eq!(r.serve, Iptables, "{phase:?}");
            assert_eq!(r.remove, vec![Ipvs, Nftables], "{phase:?}");
            assert_eq!(r.state.phase, Phase::Active);
            assert_eq!(r.state.restarts, 1);
            assert_eq!(r.result, None, "{phase:?}: retried, not reported");
        }
        let r = recover(&st(Phase::Cleaning, Iptables, Some(Nftables)));
        assert_eq!((r.serve, r.remove.clone()), (Nftables, vec![Iptables, Ipvs]));
        assert_eq!(r.state.answered.as_deref(), Some("t1"));
        assert_eq!(r.result.map(|x| x.0), Some(SwitchOutcome::Succeeded));
        let r = recover(&SwitchState {
            restarts: MAX_RESTARTS - 1,
            ..st(Phase::Verifying, Iptables, Some(Nftables))
        });
        assert_eq!(r.result.map(|x| x.0), Some(SwitchOutcome::Failed));
        assert_eq!(
            r.state.answered.as_deref(),
            Some("t1"),
            "given up: the token is answered"
        );
        let r = recover(&SwitchState::active(Nftables));
        assert_eq!((r.serve, r.remove), (Nftables, vec![Iptables, Ipvs]));
    }

    #[test]
    fn recovery_around_external_keeps_one_proxy_serving() {
        // Handed over: none of Switchyard's backends stays.
        let r = recover(&SwitchState::active(External));
        assert_eq!((r.serve, r.remove), (External, vec![Iptables, Ipvs, Nftables]));
        // Interrupted before the gate passed: Switchyard's rules serve again.
        let r = recover(&st(Phase::Verifying, Nftables, Some(External)));
        assert_eq!((r.serve, r.remove), (Nftables, vec![Iptables, Ipvs]));
        // Interrupted while cleaning: the hand-over finishes.
        let r = recover(&st(Phase::Cleaning, Nftables, Some(External)));
        assert_eq!((r.serve, r.remove), (External, vec![Iptables, Ipvs, Nftables]));
        // A takeover interrupted before the gate passed goes back to the other proxy.
        let r = recover(&st(Phase::Verifying, External, Some(Nftables)));
        assert_eq!((r.serve, r.remove), (External, vec![Iptables, Ipvs, Nftables]));
    }

    mod start {
        use super::*;
        use crate::{backend::Presence, state_store::Loaded};

        fn kernel(serving: &[ProxyMode], bypassed: &[ProxyMode]) -> Vec<(ProxyMode, Presence)> {
            ProxyMode::ALL
                .iter()
                .map(|m| {
                    let p = if serving.contains(m) {
                        Presence::Serving
                    } else if bypassed.contains(m) {
                        Presence::Bypassed
                    } else {
                        Presence::Absent
                    };
                    (*m, p)
                })
                .collect()
        }

        struct Case {
            name: &'static str,
            loaded: Loaded,
            kernel: Vec<(ProxyMode, Presence)>,
            initial: ProxyMode,
            active: ProxyMode,
            answered: Option<&'static str>,
            problem: Option<&'static str>,
        }

        #[test]
        fn the_kernel_wins_over_a_state_it_contradicts() {
            let active_ipt = SwitchState {
                answered: Some("t0".into()),
                ..SwitchState::active(Iptables)
            };
            let verifying = SwitchState {
                phase: Phase::Verifying,
                active: Iptables,
                target: Some(Nftables),
                token: Some("t1".into()),
                answered: Some("t0".into()),
                restarts: 0,
            };
            let cases = [
                Case {
                    name: "valid and agreeing",
                    loaded: Loaded::Valid(active_ipt.clone()),
                    kernel: kernel(&[Iptables], &[]),
                    initial: Nftables,
                    active: Iptables,
                    answered: Some("t0"),
                    problem: None,
                },
                Case {
                    name: "valid, rebooted kernel",
                    loaded: Loaded::Valid(active_ipt.clone()),
                    kernel: kernel(&[], &[]),
                    initial: Nftables,
                    active: Iptables,
                    answered: Some("t0"),
                    problem: None,
                },
                Case {
                    name: "stale: the kernel serves another mode",
                    loaded: Loaded::Valid(active_ipt.clone()),
                    kernel: kernel(&[Nftables], &[]),
                    initial: Iptables,
                    active: Nftables,
                    answered: Some("t0"),
                    problem: Some("StateFileStale"),
                },
                Case {
                    name: "stale mid-switch: the target finished",
                    loaded: Loaded::Valid(verifying.clone()),
                    kernel: kernel(&[Nftables], &[]),
                    initial: Iptables,
                    active: Nftables,
                    answered: Some("t1"),
                    problem: Some("StateFileStale"),
                },
                Case {
                    name: "mid-switch, the target serves and the old is bypassed: the state decides",
                    loaded: Loaded::Valid(verifying.clone()),
                    kernel: kernel(&[Nftables], &[Iptables]),
                    initial: Iptables,
                    active: Iptables,
                    answered: Some("t0"),
                    problem: None,
                },
                Case {
                    name: "mid-switch and both serve: the state decides (recovery returns to the old)",
                    loaded: Loaded::Valid(verifying),
                    kernel: kernel(&[Iptables, Nftables], &[]),
                    initial: Iptables,
                    active: Iptables,
                    answered: Some("t0"),
                    problem: None,
                },
                Case {
                    name: "corrupt: keep what serves, not the flag",
                    loaded: Loaded::Corrupt("empty".into()),
                    kernel: kernel(&[Nftables], &[]),
                    initial: Iptables,
                    active: Nftables,
                    answered: None,
                    problem: Some("StateFileCorrupt"),
                },
                Case {
                    name: "corrupt, bypassed leftovers do not serve",
                    loaded: Loaded::Corrupt("truncated".into()),
                    kernel: kernel(&[Iptables], &[Nftables]),
                    initial: Nftables,
                    active: Iptables,
                    answered: None,
                    problem: Some("StateFileCorrupt"),
                },
                Case {
                    name: "corrupt, empty kernel: the flag",
                    loaded: Loaded::Corrupt("garbage".into()),
                    kernel: kernel(&[], &[]),
                    initial: Iptables,
                    active: Iptables,
                    answered: None,
                    problem: Some("StateFileCorrupt"),
                },
                Case {
                    name: "absent, fresh node",
                    loaded: Loaded::Absent,
                    kernel: kernel(&[], &[]),
                    initial: Nftables,
                    active: Nftables,
                    answered: None,
                    problem: None,
                },
                Case {
                    name: "absent, the kernel serves the flag's mode",
                    loaded: Loaded::Absent,
                    kernel: kernel(&[Nftables], &[]),
                    initial: Nftables,
                    active: Nftables,
                    answered: None,
                    problem: None,
                },
                Case {
                    name: "absent, the kernel serves another mode",
                    loaded: Loaded::Absent,
                    kernel: kernel(&[Ipvs], &[]),
                    initial: Nftables,
                    active: Ipvs,
                    answered: None,
                    problem: Some("StateFileMissing"),
                },
            ];
            for c in cases {
                let start = start_state(&c.loaded, &c.kernel, c.initial);
                let r = recover(&start.state);
                assert_eq!(r.serve, c.active, "{}", c.name);
                assert_eq!(r.state.answered.as_deref(), c.answered, "{}", c.name);
                assert_eq!(start.problem.as_ref().map(|p| p.0), c.problem, "{}", c.name);
            }
        }
    }
}
