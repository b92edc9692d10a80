//! Stage 7, conditions: Ready, Progressing, Degraded, Paused, Conflict, InvalidSpec,
//! UnknownAnnotations and IPVSDeprecated, each keeping its `lastTransitionTime` while its status
//! does not change.

use jiff::Timestamp;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use switchyard_crds::v1alpha1::{Fallback, PolicyPhase, ProxyMode};

use super::{
    super::{conditions as cond, validate::Findings},
    Budget, Gates, Hold, Lost, PolicyInput, Summary, names, time,
};

/// Builds conditions against the previous ones.
struct Make<'c> {
    prev: &'c [Condition],
    generation: i64,
    now: Timestamp,
}

impl Make<'_> {
    fn make(&self, type_: &str, status: bool, reason: &str, message: String) -> Condition {
        let status = if status { "True" } else { "False" }.to_owned();
        let last = self
            .prev
            .iter()
            .find(|c| c.type_ == type_ && c.status == status)
            .map(|c| c.last_transition_time.clone())
            .unwrap_or_else(|| time(self.now));
        Condition {
            type_: type_.into(),
            status,
            reason: reason.into(),
            message,
            observed_generation: Some(self.generation),
            last_transition_time: last,
        }
    }
}

/// The conditions of a policy's status.
pub(crate) fn conditions(
    p: &PolicyInput,
    summary: &Summary,
    budget: &Budget,
    gates: &Gates,
    lost: &[Lost<'_>],
    findings: &Findings,
    now: Timestamp,
) -> Vec<Condition> {
    let m = Make {
        prev: p
            .status
            .as_ref()
            .map(|s| s.conditions.as_slice())
            .unwrap_or_default(),
        generation: p.generation,
        now,
    };
    let (phase, message) = (summary.phase, &summary.message);
    let phase_reason = format!("{phase:?}");
    let ready_reason = if phase == PolicyPhase::Ready {
        "RolloutComplete"
    } else {
        &phase_reason
    };
    let progressing_reason = match phase {
        PolicyPhase::Progressing if gates.soak_left.is_some() => "Soaking",
        PolicyPhase::Progressing => "WaveProgressing",
        PolicyPhase::RollingBack => "RollingBack",
        _ => "Idle",
    };
    vec![
        m.make(
            cond::READY,
            phase == PolicyPhase::Ready,
            ready_reason,
            message.clone(),
        ),
        m.make(
            cond::PROGRESSING,
            matches!(phase, PolicyPhase::Progressing | PolicyPhase::RollingBack),
            progressing_reason,
            message.clone(),
        ),
        degraded(&m, phase, message, budget),
        paused(&m, p, phase, message, &gates.hold),
        conflict(&m, p, lost),
        invalid_spec(&m, findings),
        unknown_annotations(&m, findings),
        ipvs_deprecated(&m, p),
    ]
}

fn degraded(m: &Make<'_>, phase: PolicyPhase, message: &str, b: &Budget) -> Condition {
    if b.exceeded {
        m.make(cond::DEGRADED, true, "FailureBudgetSpent", message.to_owned())
    } else if !b.failed.is_empty() && phase == PolicyPhase::Degraded {
        m.make(cond::DEGRADED, true, "NodesFailed", message.to_owned())
    } else if !b.failed.is_empty() {
        m.make(
            cond::DEGRADED,
            false,
            "FailuresWithinBudget",
            format!(
                "{} node(s) failed, maxFailures={}: {}",
                b.failed.len(),
                b.max_failures,
                b.failed_names()
            ),
        )
    } else {
        m.make(
            cond::DEGRADED,
            false,
            "NoFailures",
            "no node failed its switch".into(),
        )
    }
}

fn paused(m: &Make<'_>, p: &PolicyInput, phase: PolicyPhase, message: &str, hold: &Hold) -> Condition {
    let spec_paused = p.spec.rollout.paused;
    let reason = match (hold, phase) {
        (_, PolicyPhase::Ready | PolicyPhase::Pending) if !spec_paused => None,
        (Hold::Rollback, _) => Some("RollbackRequested"),
        _ if spec_paused => Some("SpecPaused"),
        (Hold::Budget, _) => Some("FailureBudgetSpent"),
        (Hold::Approval { .. }, _) => Some("AwaitingApproval"),
        (Hold::Window(_), _) => Some("OutsideWindow"),
        (Hold::Invalid(_), _) => Some("InvalidSpec"),
        _ => None,
    };
    match reason {
        Some(reason) => m.make(cond::PAUSED, true, reason, message.to_owned()),
        None => m.make(
            cond::PAUSED,
            false,
            "NotPaused",
            "the rollout is not paused".into(),
        ),
    }
}

fn conflict(m: &Make<'_>, p: &PolicyInput, lost: &[Lost<'_>]) -> Condition {
    if lost.is_empty() {
        return m.make(
            cond::CONFLICT,
            false,
            "NoConflict",
            "no other policy with higher precedence selects these nodes".into(),
        );
    }
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
    m.make(
        cond::CONFLICT,
        true,
        "SelectorOverlap",
        format!(
            "{}; this policy leaves them alone. Make the nodeSelectors disjoint or change spec.priority",
            parts.join("; ")
        ),
    )
}

fn invalid_spec(m: &Make<'_>, findings: &Findings) -> Condition {
    if findings.invalid.is_empty() {
        m.make(
            cond::INVALID_SPEC,
            false,
            "SpecValid",
            "the operator can use every field of the spec".into(),
        )
    } else {
        m.make(
            cond::INVALID_SPEC,
            true,
            "InvalidSpec",
            format!(
                "fix the spec (nothing new switches until then): {}",
                findings.invalid.join("; ")
            ),
        )
    }
}

fn unknown_annotations(m: &Make<'_>, findings: &Findings) -> Condition {
    if findings.annotations.is_empty() {
        m.make(
            cond::UNKNOWN_ANNOTATIONS,
            false,
            "AllUnderstood",
            "every switchyard.dev annotation is understood".into(),
        )
    } else {
        m.make(
            cond::UNKNOWN_ANNOTATIONS,
            true,
            "UnknownAnnotations",
            format!("ignored: {}", findings.annotations.join("; ")),
        )
    }
}

fn ipvs_deprecated(m: &Make<'_>, p: &PolicyInput) -> Condition {
    if p.spec.mode == ProxyMode::Ipvs || p.spec.fallback == Some(Fallback::Ipvs) {
        m.make(cond::IPVS_DEPRECATED, true, "IPVSDeprecated", "IPVS mode is deprecated since Kubernetes v1.35 (off by default in v1.40, removed in v1.43); use it only to migrate off, and plan a move to nftables".into())
    } else {
        m.make(
            cond::IPVS_DEPRECATED,
            false,
            "NotIPVS",
            "this policy does not use IPVS".into(),
        )
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use jiff::SignedDuration;
    use switchyard_crds::v1alpha1::ProxyPolicyStatus;

    use super::{super::fixtures::*, *};

    fn summary(phase: PolicyPhase) -> Summary {
        Summary {
            phase,
            message: "headline".into(),
            waves: vec![],
            current_wave: None,
            target_nodes: 0,
            updated_nodes: 0,
            healthy_nodes: 0,
            failed_nodes: 0,
            incompatible_nodes: 0,
            settings_updated_nodes: 0,
        }
    }

    fn find<'c>(all: &'c [Condition], type_: &str) -> (&'c str, &'c str, &'c str) {
        let c = all.iter().find(|c| c.type_ == type_).unwrap();
        (c.status.as_str(), c.reason.as_str(), c.message.as_str())
    }

    #[test]
    fn paused_table() {
        use PolicyPhase::*;
        // (hold, phase, spec paused, expected status and reason)
        let cases = [
            (Hold::None, Ready, false, ("False", "NotPaused")),
            (Hold::SpecPaused, Paused, true, ("True", "SpecPaused")),
            (Hold::None, Ready, true, ("True", "SpecPaused")),
            (Hold::Rollback, Paused, false, ("True", "RollbackRequested")),
            (Hold::Rollback, Ready, false, ("False", "NotPaused")),
            (Hold::Budget, Degraded, false, ("True", "FailureBudgetSpent")),
            (
                Hold::Approval { stale: None },
                AwaitingApproval,
                false,
                ("True", "AwaitingApproval"),
            ),
            (
                Hold::Window("closed".into()),
                WaitingForWindow,
                false,
                ("True", "OutsideWindow"),
            ),
            (
                Hold::Invalid("bad".into()),
                Paused,
                false,
                ("True", "InvalidSpec"),
            ),
            (Hold::None, Progressing, false, ("False", "NotPaused")),
        ];
        for (hold, phase, spec_paused, want) in cases {
            let mut p = policy_input("pool", NFT, 1);
            p.spec.rollout.paused = spec_paused;
            let g = Gates {
                hold: hold.clone(),
                ..gates_none()
            };
            let all = conditions(
                &p,
                &summary(phase),
                &budget_none(),
                &g,
                &[],
                &Findings::default(),
                t0(),
            );
            let (status, reason, _) = find(&all, cond::PAUSED);
            assert_eq!((status, reason), want, "{hold:?} {phase:?} paused={spec_paused}");
        }
    }

    #[test]
    fn degraded_and_progressing_table() {
        use PolicyPhase::*;
        // (phase, failed, exceeded, soaking, expected Degraded reason, Progressing reason)
        let cases = [
            (Ready, 0, false, false, "NoFailures", "Idle"),
            (
                Progressing,
                1,
                false,
                false,
                "FailuresWithinBudget",
                "WaveProgressing",
            ),
            (Progressing, 0, false, true, "NoFailures", "Soaking"),
            (Degraded, 1, false, false, "NodesFailed", "Idle"),
            (RollingBack, 2, true, false, "FailureBudgetSpent", "RollingBack"),
        ];
        for (phase, failed, exceeded, soaking, degraded, progressing) in cases {
            let b = Budget {
                failed: (0..failed).collect(),
                failed_desc: (0..failed).map(|i| format!("n{i}: x")).collect(),
                exceeded,
                ..budget_none()
            };
            let g = Gates {
                soak_left: soaking.then(|| std::time::Duration::from_secs(5)),
                ..gates_none()
            };
            let p = policy_input("pool", NFT, 1);
            let all = conditions(&p, &summary(phase), &b, &g, &[], &Findings::default(), t0());
            assert_eq!(find(&all, cond::DEGRADED).1, degraded, "{phase:?}");
            assert_eq!(find(&all, cond::PROGRESSING).1, progressing, "{phase:?}");
            let ready = find(&all, cond::READY);
            assert_eq!(ready.0 == "True", phase == Ready, "{phase:?}");
            assert_eq!(ready.2, "headline");
        }
    }

    #[test]
    fn conflict_findings_and_ipvs() {
        let mut p = policy_input("pool", ProxyMode::Ipvs, 1);
        p.spec.priority = 1;
        let lost = [("n1", "big", 9), ("n2", "big", 9), ("n3", "other", 5)];
        let findings = Findings {
            invalid: vec!["bad field".into()],
            annotations: vec!["switchyard.dev/x".into()],
        };
        let all = conditions(
            &p,
            &summary(PolicyPhase::Paused),
            &budget_none(),
            &gates_none(),
            &lost,
            &findings,
            t0(),
        );
        assert_eq!(
            find(&all, cond::CONFLICT),
            (
                "True",
                "SelectorOverlap",
                "node(s) n1, n2 are governed by proxypolicy big (priority 9 vs 1); node(s) n3 are governed by proxypolicy other (priority 5 vs 1); this policy leaves them alone. Make the nodeSelectors disjoint or change spec.priority"
            )
        );
        assert_eq!(find(&all, cond::INVALID_SPEC).0, "True");
        assert_eq!(
            find(&all, cond::UNKNOWN_ANNOTATIONS).2,
            "ignored: switchyard.dev/x"
        );
        assert_eq!(find(&all, cond::IPVS_DEPRECATED).1, "IPVSDeprecated");
        assert_eq!(all.len(), 8);
    }

    #[test]
    fn transition_time_moves_only_with_the_status() {
        let earlier = t0() - SignedDuration::from_secs(3600);
        let mut p = policy_input("pool", NFT, 1);
        let before = conditions(
            &p,
            &summary(PolicyPhase::Ready),
            &budget_none(),
            &gates_none(),
            &[],
            &Findings::default(),
            earlier,
        );
        p.status = Some(ProxyPolicyStatus {
            conditions: before,
            ..Default::default()
        });
        let ready = conditions(
            &p,
            &summary(PolicyPhase::Ready),
            &budget_none(),
            &gates_none(),
            &[],
            &Findings::default(),
            t0(),
        );
        let progressing = conditions(
            &p,
            &summary(PolicyPhase::Progressing),
            &budget_none(),
            &gates_none(),
            &[],
            &Findings::default(),
            t0(),
        );
        let at = |all: &[Condition]| {
            all.iter()
                .find(|c| c.type_ == cond::READY)
                .unwrap()
                .last_transition_time
                .0
        };
        assert_eq!(at(&ready), earlier);
        assert_eq!(at(&progressing), t0());
    }
}
