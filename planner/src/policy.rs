//! Planning one policy: classify its nodes, assign waves, open the gates, derive writes, status,
//! conditions and transition events.

use std::{collections::HashMap, fmt::Write as _, time::Duration};

use jiff::{SignedDuration, Timestamp};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use switchyard_crds::v1alpha1::{
    FailurePolicy, Fallback, NodeProxySpec, PolicyPhase, PolicyReference, ProxyMode, ProxyPolicyStatus,
    SwitchPhase, WaveState, WaveStatus,
};

use super::{
    EventReason, Lost, NodeInput, NodePlan, NodeProxyInput, NodeState, NodeWrite, PlanEvent, PolicyInput,
    PolicyPlan, conditions as cond,
    waves::{self, PoolNode},
    window,
};

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

/// Splits a token of `policy` into (generation, is rollback); `None` if it is not this policy's.
fn parse_token(policy: &str, token: &str) -> Option<(i64, bool)> {
    let rest = token.strip_prefix(policy)?.strip_prefix("-g")?;
    let (generation, tail) = rest.split_once('-')?;
    Some((generation.parse().ok()?, tail.starts_with("rollback-")))
}

#[cfg(test)]
pub(super) fn parse_token_for_tests(policy: &str, token: &str) -> Option<(i64, bool)> {
    parse_token(policy, token)
}

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

/// One governed node, classified.
struct View<'a> {
    node: &'a NodeInput,
    np: Option<&'a NodeProxyInput>,
    target: Option<ProxyMode>,
    state: NodeState,
    /// Counts against maxUnavailable when false.
    available: bool,
    /// The spec already releases it for `target` with this token (kept as long as it is valid).
    token: Option<String>,
    /// Switched to `target` by this policy (its last switch answered our token and succeeded).
    switched_here: bool,
    /// Mode to return to on a policy rollback.
    rollback_to: Option<ProxyMode>,
    reason: Option<String>,
    finished_at: Option<Timestamp>,
    /// Runs the target mode (phase Active).
    updated: bool,
    /// Admitted to switch by this plan.
    admit: bool,
    /// Rolled back by this plan.
    roll_back: bool,
}

fn target_mode(p: &PolicyInput, np: Option<&NodeProxyInput>) -> Result<ProxyMode, String> {
    let mode = p.spec.mode;
    let Some(caps) = np
        .and_then(|n| n.status.as_ref())
        .and_then(|s| s.capabilities.as_ref())
    else {
        // Not reported yet: assume the mode; the node stays Unknown until its agent reports.
        return Ok(mode);
    };
    if caps.supported_modes.contains(&mode) {
        return Ok(mode);
    }
    let supported = caps
        .supported_modes
        .iter()
        .map(|m| m.as_str())
        .collect::<Vec<_>>()
        .join(", ");
    let fallback = match p.spec.fallback.unwrap_or_default() {
        Fallback::Skip => None,
        Fallback::Iptables => Some(ProxyMode::Iptables),
        Fallback::Ipvs => Some(ProxyMode::Ipvs),
        Fallback::Nftables => Some(ProxyMode::Nftables),
    };
    match fallback {
        Some(f) if caps.supported_modes.contains(&f) => Ok(f),
        Some(f) => Err(format!(
            "cannot run {mode} or fallback {f} (supports: {supported})"
        )),
        None => Err(format!(
            "cannot run {mode} (supports: {supported}); fallback is skip"
        )),
    }
}

fn classify<'a>(p: &PolicyInput, node: &'a NodeInput, np: Option<&'a NodeProxyInput>) -> View<'a> {
    let mut v = View {
        node,
        np,
        target: None,
        state: NodeState::Pending,
        available: true,
        token: None,
        switched_here: false,
        rollback_to: None,
        reason: None,
        finished_at: None,
        updated: false,
        admit: false,
        roll_back: false,
    };
    let target = match target_mode(p, np) {
        Ok(t) => t,
        Err(reason) => {
            v.state = NodeState::Incompatible;
            v.reason = Some(reason);
            return v;
        }
    };
    v.target = Some(target);
    let spec = np.map(|n| &n.spec);
    let ours = spec
        .and_then(|s| s.policy.as_ref())
        .is_some_and(|r| r.name == p.name);
    let token = spec.and_then(|s| s.rollout_token.clone()).filter(|_| ours);
    let parsed = token.as_deref().and_then(|t| parse_token(&p.name, t));
    let desired = spec.and_then(|s| s.desired_mode);
    let Some(status) = np.and_then(|n| n.status.as_ref()) else {
        v.state = NodeState::Unknown;
        v.available = false;
        v.reason = Some("no report from its agent yet".into());
        if desired == Some(target) && parsed.is_some_and(|(_, rb)| !rb) {
            v.token = token;
        }
        return v;
    };
    let active = status.active_mode;
    let phase = status.phase;
    let serving = phase == Some(SwitchPhase::Active);
    let healthy_condition = !status
        .conditions
        .iter()
        .any(|c| c.type_ == "Healthy" && c.status == "False");
    let last = status.last_switch.as_ref();
    v.finished_at = last.and_then(|l| l.finished_at.as_ref()).map(|t| t.0);

    // A rollback of this generation: keep it until the agent is back.
    if parsed.is_some_and(|(g, rb)| rb && g == p.generation) {
        let back = desired.is_some() && active == desired && serving;
        v.state = if back {
            NodeState::RolledBack
        } else {
            NodeState::RollingBack
        };
        v.available = back;
        return v;
    }
    let released = desired == Some(target) && parsed.is_some_and(|(_, rb)| !rb);
    let answered = released && last.is_some_and(|l| l.rollout_token.is_some() && l.rollout_token == token);
    let result = last.map(|l| l.result.as_str()).unwrap_or_default();
    let mut released = released;
    if answered && matches!(result, "RolledBack" | "Failed") {
        if parsed.is_some_and(|(g, _)| g == p.generation) {
            v.state = NodeState::Failed;
            v.available = serving;
            v.token = token;
            v.reason = Some(
                last.and_then(|l| l.reason.clone())
                    .unwrap_or_else(|| format!("switch {result}")),
            );
            return v;
        }
        // Failed under an older generation: a new generation retries it.
        released = false;
    }
    v.updated = active == Some(target) && serving;
    if released {
        v.token = token;
    }
    if v.updated && healthy_condition {
        v.state = NodeState::Healthy;
        v.switched_here = answered && result == "Succeeded";
        v.rollback_to = last
            .filter(|l| l.to == target)
            .and_then(|l| l.from)
            .filter(|f| *f != target);
    } else if active == Some(target) && !released {
        // Runs the mode already (no switch needed) but is not serving healthily.
        v.state = NodeState::Unhealthy;
        v.available = false;
    } else if released {
        v.state = if v.updated {
            NodeState::Unhealthy
        } else {
            NodeState::Switching
        };
        v.available = false;
        v.rollback_to = active.filter(|a| *a != target);
    } else {
        v.state = NodeState::Pending;
        v.available = serving && healthy_condition;
        if !v.available {
            v.reason = Some(format!("agent phase {phase:?}, not serving"));
        }
    }
    v
}

/// Why the current wave does not release nodes.
#[derive(Clone, Debug, PartialEq)]
enum Hold {
    None,
    SpecPaused,
    Budget,
    Approval {
        stale: Option<String>,
    },
    Window(String),
    /// The spec cannot be used ([`super::validate`]): nothing new switches.
    Invalid(String),
    /// A manual rollback of this generation was requested.
    Rollback,
}

struct WaveRun {
    state: WaveState,
    started_at: Option<Time>,
    completed_at: Option<Time>,
}

fn time(t: Timestamp) -> Time {
    Time(t)
}

pub(super) fn plan_policy(
    p: &PolicyInput,
    governed: &[&NodeInput],
    proxies: &HashMap<&str, &NodeProxyInput>,
    lost: &[Lost<'_>],
    now: Timestamp,
) -> PolicyPlan {
    let g = p.generation;
    let prev = p.status.as_ref();
    let findings = super::validate::check(p);
    let mut views: Vec<View<'_>> = governed
        .iter()
        .map(|n| classify(p, n, proxies.get(n.name.as_str()).copied()))
        .collect();
    views.sort_by(|a, b| a.node.name.cmp(&b.node.name));

    // Waves over the eligible (compatible) nodes.
    let eligible: Vec<usize> = (0..views.len())
        .filter(|&i| views[i].state != NodeState::Incompatible)
        .collect();
    let defs = waves::wave_defs(&p.spec.rollout, eligible.len());
    let prev_waves = prev.map(|s| s.waves.as_slice()).unwrap_or_default();
    let same_waves =
        prev_waves.len() == defs.len() && prev_waves.iter().zip(&defs).all(|(a, b)| a.name == b.name);
    let pins: HashMap<&str, usize> = if same_waves {
        prev_waves
            .iter()
            .enumerate()
            .flat_map(|(w, ws)| ws.nodes.iter().map(move |n| (n.as_str(), w)))
            .collect()
    } else {
        HashMap::new()
    };
    let pool: Vec<PoolNode<'_>> = eligible
        .iter()
        .map(|&i| PoolNode {
            name: &views[i].node.name,
            key: waves::order_key(&views[i].node.uid, &p.uid),
            labels: &views[i].node.labels,
        })
        .collect();
    // Wave → indices into `views`, in rollout order.
    let assignment: Vec<Vec<usize>> = waves::assign(&defs, &pool, &pins)
        .into_iter()
        .map(|w| w.into_iter().map(|k| eligible[k]).collect())
        .collect();
    let prev_wave = |name: &str| {
        if same_waves {
            prev_waves.iter().find(|w| w.name == name)
        } else {
            None
        }
    };
    let prev_gen_same = prev.and_then(|s| s.observed_generation) == Some(g);

    // Failure budget.
    let failed: Vec<usize> = (0..views.len())
        .filter(|&i| views[i].state == NodeState::Failed)
        .collect();
    let max_failures = p.spec.rollout.max_failures as usize;
    let exceeded = failed.len() > max_failures;
    // A manual rollback: the annotation names this generation.
    let manual = p
        .rollback
        .as_deref()
        .is_some_and(|v| v.trim().parse::<i64>().ok() == Some(g));
    let rollback = (exceeded && p.spec.rollout.failure_policy == FailurePolicy::Rollback) || manual;
    if rollback {
        for v in views.iter_mut() {
            let candidate = match v.state {
                NodeState::Healthy => v.switched_here,
                NodeState::Switching | NodeState::Unhealthy => true,
                _ => false,
            };
            if candidate && v.rollback_to.is_some() {
                v.roll_back = true;
            }
        }
    }
    let max_unavailable = waves::resolve_max_unavailable(&p.spec.rollout.max_unavailable, eligible.len());
    let unavailable = eligible.iter().filter(|&&i| !views[i].available).count();

    // Walk the waves.
    let mut runs: Vec<WaveRun> = Vec::with_capacity(defs.len());
    let mut current: Option<usize> = None;
    let mut hold = Hold::None;
    let mut soak_left: Option<Duration> = None;
    let mut admitted: Vec<usize> = Vec::new();
    for (w, def) in defs.iter().enumerate() {
        let members = &assignment[w];
        let pw = prev_wave(&def.name);
        let prev_state = pw.map(|s| s.state);
        let prev_started = pw.and_then(|s| s.started_at.clone());
        let any = |f: &dyn Fn(&View<'_>) -> bool| members.iter().any(|&i| f(&views[i]));
        let rolled =
            any(&|v| v.roll_back || matches!(v.state, NodeState::RollingBack | NodeState::RolledBack));
        if current.is_some() {
            let state = if rolled {
                WaveState::RolledBack
            } else {
                WaveState::Pending
            };
            runs.push(WaveRun {
                state,
                started_at: None,
                completed_at: None,
            });
            continue;
        }
        // Failed nodes within the failure budget do not hold the wave.
        let all_healthy = members.iter().all(|&i| {
            views[i].state == NodeState::Healthy || (views[i].state == NodeState::Failed && !exceeded)
        });
        let needs_switch = any(&|v| matches!(v.state, NodeState::Pending | NodeState::Switching));
        let complete = all_healthy
            || (prev_gen_same && prev_state == Some(WaveState::Completed) && !needs_switch && !rolled);
        let approval = p.approvals.get(&def.name);
        let approved = approval.is_some_and(|v| v.trim().parse::<i64>().ok() == Some(g));
        // An empty wave does not pass its approval gate by being empty (a typo in a canary's
        // selector must not skip the approval): it waits like any other wave.
        let gate_closed = members.is_empty() && def.require_approval && !approved;
        let complete = complete && !gate_closed;
        let switched = any(&|v| v.switched_here);
        if complete && !rolled {
            let was_running = matches!(prev_state, Some(WaveState::Progressing | WaveState::Soaking));
            let healthy_since = pw
                .filter(|s| matches!(s.state, WaveState::Soaking | WaveState::Completed))
                .and_then(|s| s.completed_at.as_ref().map(|t| t.0))
                .or_else(|| members.iter().filter_map(|&i| views[i].finished_at).max())
                .unwrap_or(now);
            let soak_end = healthy_since
                .checked_add(SignedDuration::from_secs(i64::from(def.soak_seconds)))
                .unwrap_or(now);
            let soaking = def.soak_seconds > 0 && (switched || was_running) && now < soak_end;
            let started_at = prev_started.or_else(|| switched.then(|| time(healthy_since)));
            if soaking {
                current = Some(w);
                soak_left = Some(Duration::from_secs(
                    u64::try_from(now.duration_until(soak_end).as_secs()).unwrap_or(0) + 1,
                ));
                runs.push(WaveRun {
                    state: WaveState::Soaking,
                    started_at,
                    completed_at: Some(time(healthy_since)),
                });
            } else {
                runs.push(WaveRun {
                    state: WaveState::Completed,
                    started_at,
                    completed_at: Some(time(healthy_since)),
                });
            }
            continue;
        }
        current = Some(w);
        let started =
            matches!(
                prev_state,
                Some(WaveState::Progressing | WaveState::Soaking | WaveState::Failed)
            ) || any(&|v| v.switched_here || matches!(v.state, NodeState::Switching | NodeState::Failed));
        hold = if !findings.invalid.is_empty() {
            Hold::Invalid(findings.invalid.join("; "))
        } else if exceeded {
            Hold::Budget
        } else if manual {
            Hold::Rollback
        } else if p.spec.rollout.paused {
            Hold::SpecPaused
        } else if def.require_approval && !approved {
            Hold::Approval {
                stale: approval.cloned(),
            }
        } else {
            match p
                .spec
                .rollout
                .window
                .as_ref()
                .map(|win| window::is_open(win, now))
            {
                Some(Ok(false)) => Hold::Window(format!(
                    "outside the maintenance window ({})",
                    p.spec
                        .rollout
                        .window
                        .as_ref()
                        .map(window::describe)
                        .unwrap_or_default()
                )),
                Some(Err(e)) => Hold::Window(e),
                _ => Hold::None,
            }
        };
        if hold == Hold::None {
            let budget = max_unavailable.saturating_sub(unavailable);
            admitted = members
                .iter()
                .copied()
                .filter(|&i| views[i].state == NodeState::Pending && views[i].available)
                .take(budget)
                .collect();
            for &i in &admitted {
                views[i].admit = true;
            }
        }
        let state = match &hold {
            Hold::Budget if rollback => WaveState::RolledBack,
            Hold::Budget => WaveState::Failed,
            Hold::Rollback if rolled => WaveState::RolledBack,
            Hold::Rollback => WaveState::Pending,
            Hold::Approval { .. } => WaveState::AwaitingApproval,
            _ if started || !admitted.is_empty() => WaveState::Progressing,
            _ => WaveState::Pending,
        };
        let started_at = if matches!(
            state,
            WaveState::Progressing | WaveState::Failed | WaveState::RolledBack
        ) {
            prev_started.or(Some(time(now)))
        } else {
            prev_started
        };
        runs.push(WaveRun {
            state,
            started_at,
            completed_at: None,
        });
    }
    // Beyond the failure budget, waves with failed nodes are Failed (pause) or RolledBack (rollback),
    // and so are waves whose nodes the rollback returns.
    for (w, run) in runs.iter_mut().enumerate() {
        let members = &assignment[w];
        let has_failed = members.iter().any(|&i| views[i].state == NodeState::Failed);
        let returned = members.iter().any(|&i| {
            views[i].roll_back || matches!(views[i].state, NodeState::RollingBack | NodeState::RolledBack)
        });
        if rollback && (has_failed || returned) {
            run.state = WaveState::RolledBack;
        } else if exceeded && has_failed {
            run.state = WaveState::Failed;
        }
        if matches!(run.state, WaveState::Failed | WaveState::RolledBack) && run.started_at.is_none() {
            run.started_at = prev_wave(&defs[w].name)
                .and_then(|s| s.started_at.clone())
                .or(Some(time(now)));
        }
    }

    // Writes.
    let reference = PolicyReference {
        name: p.name.clone(),
        uid: Some(p.uid.clone()),
        generation: Some(g),
    };
    let mut writes = Vec::new();
    for v in &views {
        let held = NodeProxySpec {
            policy: Some(reference.clone()),
            ..Default::default()
        };
        let release = |mode: ProxyMode, token: String| NodeProxySpec {
            desired_mode: Some(mode),
            proxy: p.spec.proxy.clone(),
            health_gate: Some(p.spec.health_gate.clone()),
            policy: Some(reference.clone()),
            rollout_token: Some(token),
        };
        let spec = match (v.state, v.target) {
            (_, Some(_)) if v.roll_back => match v.rollback_to {
                Some(back) => release(back, rollback_token(&p.name, g, back)),
                None => continue,
            },
            (NodeState::RollingBack | NodeState::RolledBack, _) => match v.np {
                Some(np) => NodeProxySpec {
                    policy: Some(reference.clone()),
                    ..np.spec.clone()
                },
                None => continue,
            },
            (
                NodeState::Healthy | NodeState::Unhealthy | NodeState::Switching | NodeState::Failed,
                Some(t),
            ) => release(t, v.token.clone().unwrap_or_else(|| switch_token(&p.name, g, t))),
            (NodeState::Unknown, Some(t)) if v.token.is_some() => {
                release(t, v.token.clone().unwrap_or_default())
            }
            (NodeState::Pending, Some(t)) if v.admit => release(t, switch_token(&p.name, g, t)),
            _ => held,
        };
        if v.np.is_some_and(|np| np.spec == spec) {
            continue;
        }
        writes.push(NodeWrite {
            node: v.node.name.clone(),
            node_uid: v.node.uid.clone(),
            spec,
        });
    }

    // Counts and per-wave status.
    let count = |f: &dyn Fn(&View<'_>) -> bool, idx: &mut dyn Iterator<Item = &usize>| -> i32 {
        i32::try_from(idx.filter(|&&i| f(&views[i])).count()).unwrap_or(i32::MAX)
    };
    let wave_status: Vec<WaveStatus> = defs
        .iter()
        .zip(&runs)
        .zip(&assignment)
        .map(|((def, run), members)| {
            let mut nodes: Vec<String> = members.iter().map(|&i| views[i].node.name.clone()).collect();
            nodes.sort();
            WaveStatus {
                name: def.name.clone(),
                state: run.state,
                nodes,
                updated: count(&|v| v.updated, &mut members.iter()),
                healthy: count(&|v| v.state == NodeState::Healthy, &mut members.iter()),
                failed: count(&|v| v.state == NodeState::Failed, &mut members.iter()),
                started_at: run.started_at.clone(),
                completed_at: run.completed_at.clone(),
            }
        })
        .collect();
    let all: Vec<usize> = (0..views.len()).collect();
    let target_nodes = i32::try_from(views.len()).unwrap_or(i32::MAX);
    let healthy_nodes = count(&|v| v.state == NodeState::Healthy, &mut all.iter());
    let updated_nodes = count(&|v| v.updated, &mut all.iter());
    let incompatible: Vec<&str> = views
        .iter()
        .filter(|v| v.state == NodeState::Incompatible)
        .map(|v| v.node.name.as_str())
        .collect();
    let rolling_back = views
        .iter()
        .any(|v| v.roll_back || v.state == NodeState::RollingBack);

    // Phase and the headline message.
    let wave_name = |w: usize| defs[w].name.clone();
    let failed_desc: Vec<String> = failed
        .iter()
        .map(|&i| {
            format!(
                "{}: {}",
                views[i].node.name,
                views[i].reason.clone().unwrap_or_default()
            )
        })
        .collect();
    let failed_names = failed_desc
        .iter()
        .take(MAX_NAMES)
        .cloned()
        .collect::<Vec<_>>()
        .join("; ");
    let unavailable_names: Vec<&str> = eligible
        .iter()
        .filter(|&&i| !views[i].available)
        .map(|&i| views[i].node.name.as_str())
        .collect();
    let mode = p.spec.mode;
    let (phase, message) = if views.is_empty() {
        (
            PolicyPhase::Pending,
            "spec.nodeSelector selects no node that this policy governs; nothing to roll out".to_owned(),
        )
    } else if rollback && rolling_back && manual && !exceeded {
        let n = views
            .iter()
            .filter(|v| v.roll_back || v.state == NodeState::RollingBack)
            .count();
        (
            PolicyPhase::RollingBack,
            format!(
                "rollback requested ({}={g}): returning {n} node(s) this rollout switched to their previous mode",
                super::ROLLBACK_ANNOTATION
            ),
        )
    } else if rollback && rolling_back {
        let n = views
            .iter()
            .filter(|v| v.roll_back || v.state == NodeState::RollingBack)
            .count();
        (
            PolicyPhase::RollingBack,
            format!(
                "{} node(s) failed, more than maxFailures={max_failures} ({failed_names}); failurePolicy rollback returns {n} node(s) to their previous mode",
                failed.len()
            ),
        )
    } else if exceeded {
        let what = if rollback {
            "the switched nodes were returned to their previous mode"
        } else {
            "later waves will not start"
        };
        (
            PolicyPhase::Degraded,
            format!(
                "{} node(s) failed their switch, more than maxFailures={max_failures} ({failed_names}); the rollout stopped and {what}. Fix the cause, then change the policy spec (a new generation) to retry",
                failed.len()
            ),
        )
    } else if current.is_none() && !failed.is_empty() {
        (
            PolicyPhase::Degraded,
            format!(
                "every wave ran, but {} node(s) failed their switch and still run their old mode (within maxFailures={max_failures}): {failed_names}. Fix the cause, then change the policy spec (a new generation) to retry them",
                failed.len()
            ),
        )
    } else if current.is_none() {
        let mut m = format!(
            "all {} compatible node(s) run {mode} (or their fallback) and are healthy",
            eligible.len()
        );
        if !incompatible.is_empty() {
            let _ = write!(
                m,
                "; {} incompatible node(s) left alone: {}",
                incompatible.len(),
                names(&incompatible)
            );
        }
        (PolicyPhase::Ready, m)
    } else if let (Some(w), Some(left)) = (current, soak_left) {
        let next = defs
            .get(w + 1)
            .map(|d| format!("wave {}", d.name))
            .unwrap_or_else(|| "the end of the rollout".into());
        (
            PolicyPhase::Progressing,
            format!(
                "wave {} is healthy and soaks for {}s more before {next}",
                wave_name(w),
                left.as_secs()
            ),
        )
    } else {
        let w = current.unwrap_or(0);
        let name = wave_name(w);
        match &hold {
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
                    "wave {name} waits for approval: kubectl annotate --overwrite proxypolicy {} {}{name}={g}",
                    p.name,
                    super::APPROVE_PREFIX
                );
                if assignment[w].is_empty() {
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
                    "rolled back on request ({}={g}): the nodes this rollout switched run their previous mode again and nothing new switches; to roll out again, change the spec (a new generation), e.g. kubectl switchyard resume {}",
                    super::ROLLBACK_ANNOTATION,
                    p.name
                ),
            ),
            Hold::Budget | Hold::None => {
                let members = &assignment[w];
                let healthy = members
                    .iter()
                    .filter(|&&i| views[i].state == NodeState::Healthy)
                    .count();
                let switching: Vec<&str> = members
                    .iter()
                    .filter(|&&i| views[i].state == NodeState::Switching || views[i].admit)
                    .map(|&i| views[i].node.name.as_str())
                    .collect();
                let mut m = format!("wave {name}: {healthy}/{} node(s) healthy", members.len());
                if !switching.is_empty() {
                    let _ = write!(m, ", switching: {}", names(&switching));
                }
                let waiting = members
                    .iter()
                    .any(|&i| views[i].state == NodeState::Pending && !views[i].admit);
                if switching.is_empty() && waiting && unavailable >= max_unavailable {
                    let _ = write!(
                        m,
                        "; waiting: {unavailable} node(s) unavailable ({}) with maxUnavailable={max_unavailable}",
                        names(&unavailable_names)
                    );
                }
                if !failed.is_empty() {
                    let _ = write!(
                        m,
                        "; failed within budget (maxFailures={max_failures}): {failed_names}"
                    );
                }
                (PolicyPhase::Progressing, m)
            }
        }
    };

    // Conditions.
    let prev_conditions = prev.map(|s| s.conditions.as_slice()).unwrap_or_default();
    let condition = |type_: &str, status: bool, reason: &str, message: String| -> Condition {
        let status = if status { "True" } else { "False" }.to_owned();
        let last = prev_conditions
            .iter()
            .find(|c| c.type_ == type_ && c.status == status)
            .map(|c| c.last_transition_time.clone())
            .unwrap_or_else(|| time(now));
        Condition {
            type_: type_.into(),
            status,
            reason: reason.into(),
            message,
            observed_generation: Some(g),
            last_transition_time: last,
        }
    };
    let phase_reason = format!("{phase:?}");
    let mut conditions = vec![
        condition(
            cond::READY,
            phase == PolicyPhase::Ready,
            if phase == PolicyPhase::Ready {
                "RolloutComplete"
            } else {
                &phase_reason
            },
            message.clone(),
        ),
        condition(
            cond::PROGRESSING,
            matches!(phase, PolicyPhase::Progressing | PolicyPhase::RollingBack),
            match phase {
                PolicyPhase::Progressing if soak_left.is_some() => "Soaking",
                PolicyPhase::Progressing => "WaveProgressing",
                PolicyPhase::RollingBack => "RollingBack",
                _ => "Idle",
            },
            message.clone(),
        ),
        if exceeded {
            condition(cond::DEGRADED, true, "FailureBudgetSpent", message.clone())
        } else if !failed.is_empty() && phase == PolicyPhase::Degraded {
            condition(cond::DEGRADED, true, "NodesFailed", message.clone())
        } else if !failed.is_empty() {
            condition(
                cond::DEGRADED,
                false,
                "FailuresWithinBudget",
                format!(
                    "{} node(s) failed, maxFailures={max_failures}: {failed_names}",
                    failed.len()
                ),
            )
        } else {
            condition(
                cond::DEGRADED,
                false,
                "NoFailures",
                "no node failed its switch".into(),
            )
        },
        match (&hold, phase) {
            (_, PolicyPhase::Ready | PolicyPhase::Pending) if !p.spec.rollout.paused => condition(
                cond::PAUSED,
                false,
                "NotPaused",
                "the rollout is not paused".into(),
            ),
            (Hold::Rollback, _) => condition(cond::PAUSED, true, "RollbackRequested", message.clone()),
            _ if p.spec.rollout.paused => condition(cond::PAUSED, true, "SpecPaused", message.clone()),
            (Hold::Budget, _) => condition(cond::PAUSED, true, "FailureBudgetSpent", message.clone()),
            (Hold::Approval { .. }, _) => condition(cond::PAUSED, true, "AwaitingApproval", message.clone()),
            (Hold::Window(_), _) => condition(cond::PAUSED, true, "OutsideWindow", message.clone()),
            (Hold::Invalid(_), _) => condition(cond::PAUSED, true, "InvalidSpec", message.clone()),
            _ => condition(
                cond::PAUSED,
                false,
                "NotPaused",
                "the rollout is not paused".into(),
            ),
        },
    ];
    if lost.is_empty() {
        conditions.push(condition(
            cond::CONFLICT,
            false,
            "NoConflict",
            "no other policy with higher precedence selects these nodes".into(),
        ));
    } else {
        let mut by_winner: Vec<(&str, i32, Vec<&str>)> = Vec::new();
        for (node, winner, prio) in lost {
            match by_winner.iter_mut().find(|(w, _, _)| w == winner) {
                Some(entry) => entry.2.push(node),
                None => by_winner.push((winner, *prio, vec![node])),
            }
        }
        let parts: Vec<String> = by_winner
            .iter()
            .map(|(w, prio, nodes)| {
                format!(
                    "node(s) {} are governed by proxypolicy {w} (priority {prio} vs {})",
                    names(nodes),
                    p.spec.priority
                )
            })
            .collect();
        conditions.push(condition(
            cond::CONFLICT,
            true,
            "SelectorOverlap",
            format!(
                "{}; this policy leaves them alone. Make the nodeSelectors disjoint or change spec.priority",
                parts.join("; ")
            ),
        ));
    }
    conditions.push(if findings.invalid.is_empty() {
        condition(
            cond::INVALID_SPEC,
            false,
            "SpecValid",
            "the operator can use every field of the spec".into(),
        )
    } else {
        condition(
            cond::INVALID_SPEC,
            true,
            "InvalidSpec",
            format!(
                "fix the spec (nothing new switches until then): {}",
                findings.invalid.join("; ")
            ),
        )
    });
    conditions.push(if findings.annotations.is_empty() {
        condition(
            cond::UNKNOWN_ANNOTATIONS,
            false,
            "AllUnderstood",
            "every switchyard.dev annotation is understood".into(),
        )
    } else {
        condition(
            cond::UNKNOWN_ANNOTATIONS,
            true,
            "UnknownAnnotations",
            format!("ignored: {}", findings.annotations.join("; ")),
        )
    });
    let ipvs = mode == ProxyMode::Ipvs || p.spec.fallback == Some(Fallback::Ipvs);
    conditions.push(if ipvs {
        condition(cond::IPVS_DEPRECATED, true, "IPVSDeprecated", "IPVS mode is deprecated since Kubernetes v1.35 (off by default in v1.40, removed in v1.43); use it only to migrate off, and plan a move to nftables".into())
    } else {
        condition(cond::IPVS_DEPRECATED, false, "NotIPVS", "this policy does not use IPVS".into())
    });

    let status = ProxyPolicyStatus {
        observed_generation: Some(g),
        phase: Some(phase),
        conditions,
        target_nodes,
        updated_nodes,
        healthy_nodes,
        failed_nodes: i32::try_from(failed.len()).unwrap_or(i32::MAX),
        incompatible_nodes: i32::try_from(incompatible.len()).unwrap_or(i32::MAX),
        current_wave: current.map(wave_name),
        waves: wave_status,
    };

    // Events: transitions against the previous status.
    let mut events = Vec::new();
    for ws in &status.waves {
        let before = prev_waves.iter().find(|w| w.name == ws.name);
        let before_state = before.map(|w| w.state);
        if ws.state == WaveState::Progressing && before_state != Some(WaveState::Progressing) {
            events.push(PlanEvent {
                warning: false,
                reason: EventReason::WaveStarted,
                action: format!("StartWave/{}/g{g}", ws.name),
                note: format!(
                    "wave {} started: {} node(s): {}",
                    ws.name,
                    ws.nodes.len(),
                    names(&ws.nodes.iter().map(String::as_str).collect::<Vec<_>>())
                ),
            });
        }
        let done = |s: Option<WaveState>| matches!(s, Some(WaveState::Soaking | WaveState::Completed));
        if done(Some(ws.state)) && !done(before_state) && !ws.nodes.is_empty() {
            events.push(PlanEvent {
                warning: false,
                reason: EventReason::WaveCompleted,
                action: format!("CompleteWave/{}/g{g}", ws.name),
                note: format!(
                    "wave {}: all {} node(s) run the mode and are healthy",
                    ws.name,
                    ws.nodes.len()
                ),
            });
        }
        if ws.failed > before.map(|w| w.failed).unwrap_or(0) {
            let detail: Vec<String> = failed
                .iter()
                .filter(|&&i| ws.nodes.contains(&views[i].node.name))
                .map(|&i| failed_desc[failed.iter().position(|&f| f == i).unwrap_or(0)].clone())
                .collect();
            events.push(PlanEvent {
                warning: true,
                reason: EventReason::NodeSwitchFailed,
                action: format!("Switch/{}/g{g}/{}", ws.name, ws.failed),
                note: format!("wave {}: {}", ws.name, detail.join("; ")),
            });
        }
    }
    let prev_phase = prev.and_then(|s| s.phase);
    if phase == PolicyPhase::RollingBack && prev_phase != Some(PolicyPhase::RollingBack) {
        events.push(PlanEvent {
            warning: true,
            reason: EventReason::RolledBack,
            action: format!("Rollback/g{g}"),
            note: message.clone(),
        });
    }
    let pausing = |ph: Option<PolicyPhase>| {
        matches!(ph, Some(PolicyPhase::Paused | PolicyPhase::AwaitingApproval))
            || (ph == Some(PolicyPhase::Degraded) && exceeded)
    };
    if pausing(Some(phase))
        && prev_phase != Some(phase)
        && !(phase == PolicyPhase::Degraded && prev_phase == Some(PolicyPhase::RollingBack))
    {
        events.push(PlanEvent {
            warning: phase == PolicyPhase::Degraded,
            reason: EventReason::Paused,
            action: format!(
                "Pause/{phase:?}/{}/g{g}",
                status.current_wave.clone().unwrap_or_default()
            ),
            note: message.clone(),
        });
    }
    let conflict_now = status
        .conditions
        .iter()
        .find(|c| c.type_ == cond::CONFLICT && c.status == "True");
    let conflict_before = prev_conditions
        .iter()
        .find(|c| c.type_ == cond::CONFLICT && c.status == "True");
    if let Some(c) = conflict_now
        && conflict_before.map(|b| &b.message) != Some(&c.message)
    {
        events.push(PlanEvent {
            warning: true,
            reason: EventReason::Conflict,
            action: format!("ResolveConflict/g{g}"),
            note: c.message.clone(),
        });
    }

    for (type_, reason) in [
        (cond::INVALID_SPEC, EventReason::InvalidSpec),
        (cond::UNKNOWN_ANNOTATIONS, EventReason::UnknownAnnotations),
    ] {
        let now_true = status
            .conditions
            .iter()
            .find(|c| c.type_ == type_ && c.status == "True");
        let before = prev_conditions
            .iter()
            .find(|c| c.type_ == type_ && c.status == "True");
        if let Some(c) = now_true
            && before.map(|b| &b.message) != Some(&c.message)
        {
            events.push(PlanEvent {
                warning: true,
                reason,
                action: format!("{}/g{g}", reason.as_str()),
                note: c.message.clone(),
            });
        }
    }

    let requeue_after = match (phase, soak_left) {
        (_, Some(left)) => left.min(IDLE_REQUEUE),
        (PolicyPhase::WaitingForWindow, _) => WINDOW_REQUEUE,
        (PolicyPhase::Progressing | PolicyPhase::RollingBack, _) => PROGRESS_REQUEUE,
        _ => IDLE_REQUEUE,
    };
    let defs_ref = &defs;
    let wave_of: HashMap<usize, &str> = assignment
        .iter()
        .enumerate()
        .flat_map(|(w, m)| m.iter().map(move |&i| (i, defs_ref[w].name.as_str())))
        .collect();
    let nodes = views
        .iter()
        .enumerate()
        .map(|(i, v)| NodePlan {
            name: v.node.name.clone(),
            wave: wave_of.get(&i).map(|s| s.to_string()),
            state: if v.roll_back {
                NodeState::RollingBack
            } else if v.admit {
                NodeState::Switching
            } else {
                v.state
            },
            target: v.target,
            reason: v.reason.clone(),
        })
        .collect();
    PolicyPlan {
        name: p.name.clone(),
        status,
        writes,
        events,
        requeue_after,
        nodes,
    }
}
