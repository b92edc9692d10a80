//! Stage 8, events: transitions of the new status against the previous one (a wave started or
//! completed, nodes failed, the rollout rolls back or pauses, a conflict or a finding appeared or
//! changed). The actions are distinct per wave and generation so the Event recorder keeps them apart.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use switchyard_crds::v1alpha1::{PolicyPhase, ProxyPolicyStatus, WaveState, WaveStatus};

use super::{
    super::{EventReason, PlanEvent, conditions as cond},
    Budget, PolicyInput, View, names,
};

/// The Events of a plan: `status` (new) against `p.status` (previous).
pub(crate) fn events(
    p: &PolicyInput,
    status: &ProxyPolicyStatus,
    message: &str,
    views: &[View<'_>],
    budget: &Budget,
) -> Vec<PlanEvent> {
    let prev = p.status.as_ref();
    let prev_waves = prev.map(|s| s.waves.as_slice()).unwrap_or_default();
    let prev_conditions = prev.map(|s| s.conditions.as_slice()).unwrap_or_default();
    let mut out = Vec::new();
    for ws in &status.waves {
        let before = prev_waves.iter().find(|w| w.name == ws.name);
        wave_events(p.generation, ws, before, views, budget, &mut out);
    }
    phase_events(
        p.generation,
        status,
        prev.and_then(|s| s.phase),
        message,
        budget,
        &mut out,
    );
    condition_events(p.generation, &status.conditions, prev_conditions, &mut out);
    out
}

/// WaveStarted, WaveCompleted and NodeSwitchFailed of one wave.
fn wave_events(
    g: i64,
    ws: &WaveStatus,
    before: Option<&WaveStatus>,
    views: &[View<'_>],
    budget: &Budget,
    out: &mut Vec<PlanEvent>,
) {
    let before_state = before.map(|w| w.state);
    if ws.state == WaveState::Progressing && before_state != Some(WaveState::Progressing) {
        out.push(PlanEvent {
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
        out.push(PlanEvent {
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
        let detail: Vec<&str> = budget
            .failed
            .iter()
            .zip(&budget.failed_desc)
            .filter(|(i, _)| ws.nodes.contains(&views[**i].node.name))
            .map(|(_, d)| d.as_str())
            .collect();
        out.push(PlanEvent {
            warning: true,
            reason: EventReason::NodeSwitchFailed,
            action: format!("Switch/{}/g{g}/{}", ws.name, ws.failed),
            note: format!("wave {}: {}", ws.name, detail.join("; ")),
        });
    }
}

/// RolledBack when the rollback starts; Paused when the rollout starts holding.
fn phase_events(
    g: i64,
    status: &ProxyPolicyStatus,
    prev_phase: Option<PolicyPhase>,
    message: &str,
    budget: &Budget,
    out: &mut Vec<PlanEvent>,
) {
    let Some(phase) = status.phase else { return };
    if phase == PolicyPhase::RollingBack && prev_phase != Some(PolicyPhase::RollingBack) {
        out.push(PlanEvent {
            warning: true,
            reason: EventReason::RolledBack,
            action: format!("Rollback/g{g}"),
            note: message.to_owned(),
        });
    }
    let pausing = matches!(phase, PolicyPhase::Paused | PolicyPhase::AwaitingApproval)
        || (phase == PolicyPhase::Degraded && budget.exceeded);
    if pausing
        && prev_phase != Some(phase)
        && !(phase == PolicyPhase::Degraded && prev_phase == Some(PolicyPhase::RollingBack))
    {
        out.push(PlanEvent {
            warning: phase == PolicyPhase::Degraded,
            reason: EventReason::Paused,
            action: format!(
                "Pause/{phase:?}/{}/g{g}",
                status.current_wave.clone().unwrap_or_default()
            ),
            note: message.to_owned(),
        });
    }
}

/// Conflict, InvalidSpec and UnknownAnnotations when their condition turns True or its message
/// changes.
fn condition_events(g: i64, now: &[Condition], before: &[Condition], out: &mut Vec<PlanEvent>) {
    let true_of = |all: &[Condition], type_: &str| -> Option<String> {
        all.iter()
            .find(|c| c.type_ == type_ && c.status == "True")
            .map(|c| c.message.clone())
    };
    for (type_, reason, action) in [
        (cond::CONFLICT, EventReason::Conflict, "ResolveConflict"),
        (
            cond::INVALID_SPEC,
            EventReason::InvalidSpec,
            EventReason::InvalidSpec.as_str(),
        ),
        (
            cond::UNKNOWN_ANNOTATIONS,
            EventReason::UnknownAnnotations,
            EventReason::UnknownAnnotations.as_str(),
        ),
    ] {
        if let Some(note) = true_of(now, type_)
            && true_of(before, type_).as_ref() != Some(&note)
        {
            out.push(PlanEvent {
                warning: true,
                reason,
                action: format!("{action}/g{g}"),
                note,
            });
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
    use switchyard_crds::v1alpha1::ProxyPolicyStatus;

    use super::{super::fixtures::*, *};

    fn status(phase: PolicyPhase, waves: Vec<WaveStatus>, conditions: Vec<Condition>) -> ProxyPolicyStatus {
        ProxyPolicyStatus {
            phase: Some(phase),
            waves,
            conditions,
            current_wave: Some("canary".into()),
            ..Default::default()
        }
    }

    fn condition(type_: &str, status: &str, message: &str) -> Condition {
        Condition {
            type_: type_.into(),
            status: status.into(),
            reason: "R".into(),
            message: message.into(),
            observed_generation: None,
            last_transition_time: Time(t0()),
        }
    }

    fn reasons(p: &PolicyInput, now: &ProxyPolicyStatus, budget: &Budget) -> Vec<(EventReason, String)> {
        events(p, now, "msg", &[], budget)
            .into_iter()
            .map(|e| (e.reason, e.action))
            .collect()
    }

    /// (case, previous status, new status, budget exceeded, expected (reason, action))
    type Case = (
        &'static str,
        Option<ProxyPolicyStatus>,
        ProxyPolicyStatus,
        bool,
        Vec<(EventReason, &'static str)>,
    );

    #[test]
    fn events_table() {
        use PolicyPhase as P;
        use WaveState as W;
        let wave = |state, failed: i32| WaveStatus {
            failed,
            ..wave_status("canary", state, &["n1"])
        };
        let conflict = |m: &str| vec![condition(cond::CONFLICT, "True", m)];
        let cases: Vec<Case> = vec![
            (
                "a wave starts",
                None,
                status(P::Progressing, vec![wave(W::Progressing, 0)], vec![]),
                false,
                vec![(EventReason::WaveStarted, "StartWave/canary/g3")],
            ),
            (
                "still progressing: nothing",
                Some(status(P::Progressing, vec![wave(W::Progressing, 0)], vec![])),
                status(P::Progressing, vec![wave(W::Progressing, 0)], vec![]),
                false,
                vec![],
            ),
            (
                "completes",
                Some(status(P::Progressing, vec![wave(W::Progressing, 0)], vec![])),
                status(P::Ready, vec![wave(W::Completed, 0)], vec![]),
                false,
                vec![(EventReason::WaveCompleted, "CompleteWave/canary/g3")],
            ),
            (
                "a node fails",
                Some(status(P::Progressing, vec![wave(W::Progressing, 0)], vec![])),
                status(P::Progressing, vec![wave(W::Progressing, 1)], vec![]),
                false,
                vec![(EventReason::NodeSwitchFailed, "Switch/canary/g3/1")],
            ),
            (
                "rollback starts",
                Some(status(P::Progressing, vec![], vec![])),
                status(P::RollingBack, vec![], vec![]),
                true,
                vec![(EventReason::RolledBack, "Rollback/g3")],
            ),
            (
                "budget spent pauses",
                Some(status(P::Progressing, vec![], vec![])),
                status(P::Degraded, vec![], vec![]),
                true,
                vec![(EventReason::Paused, "Pause/Degraded/canary/g3")],
            ),
            (
                "degraded after a rollback: no pause event",
                Some(status(P::RollingBack, vec![], vec![])),
                status(P::Degraded, vec![], vec![]),
                true,
                vec![],
            ),
            (
                "degraded within budget: no pause event",
                None,
                status(P::Degraded, vec![], vec![]),
                false,
                vec![],
            ),
            (
                "a conflict appears",
                None,
                status(P::Ready, vec![], conflict("a")),
                false,
                vec![(EventReason::Conflict, "ResolveConflict/g3")],
            ),
            (
                "the same conflict: nothing",
                Some(status(P::Ready, vec![], conflict("a"))),
                status(P::Ready, vec![], conflict("a")),
                false,
                vec![],
            ),
            (
                "the conflict changes",
                Some(status(P::Ready, vec![], conflict("a"))),
                status(P::Ready, vec![], conflict("b")),
                false,
                vec![(EventReason::Conflict, "ResolveConflict/g3")],
            ),
            (
                "an invalid spec",
                None,
                status(P::Ready, vec![], vec![condition(cond::INVALID_SPEC, "True", "x")]),
                false,
                vec![(EventReason::InvalidSpec, "InvalidSpec/g3")],
            ),
        ];
        for (name, prev, now, exceeded, want) in cases {
            let mut p = policy_input("pool", NFT, 3);
            p.status = prev;
            let b = Budget {
                exceeded,
                ..budget_none()
            };
            let got = reasons(&p, &now, &b);
            let want: Vec<(EventReason, String)> = want.into_iter().map(|(r, a)| (r, a.to_owned())).collect();
            assert_eq!(got, want, "{name}");
        }
    }

    #[test]
    fn failed_event_names_the_wave_nodes_and_reasons() {
        let p = policy_input("pool", NFT, 1);
        let nodes = [node_input("a"), node_input("b")];
        let views: Vec<View<'_>> = nodes
            .iter()
            .map(|n| super::super::classify::classify(&p, n, None))
            .collect();
        let b = Budget {
            failed: vec![0, 1],
            failed_desc: vec!["a: boom".into(), "b: bang".into()],
            ..budget_none()
        };
        let ws = WaveStatus {
            failed: 1,
            ..wave_status("w", WaveState::Progressing, &["b"])
        };
        let mut out = Vec::new();
        wave_events(1, &ws, Some(&ws.clone()), &views, &b, &mut out);
        assert!(out.is_empty(), "no new failure: {out:?}");
        wave_events(1, &ws, None, &views, &b, &mut out);
        let notes: Vec<&str> = out
            .iter()
            .filter(|e| e.reason == EventReason::NodeSwitchFailed)
            .map(|e| e.note.as_str())
            .collect();
        assert_eq!(notes, ["wave w: b: bang"]);
    }
}
