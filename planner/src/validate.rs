//! What the planner checks in a policy before it plans: a stored object the schema (or an older
//! schema) let through but the operator cannot use, and annotations it does not understand.
//!
//! An invalid policy is held (nothing new switches) with the `InvalidSpec` condition naming each
//! field and the fix; unknown annotations get the `UnknownAnnotations` condition. Both also raise a
//! Warning Event when they appear or change.

use k8s_openapi::apimachinery::pkg::{apis::meta::v1::LabelSelector, util::intstr::IntOrString};
use switchyard_crds::MAX_POLICY_NAME;

use super::{APPROVE_PREFIX, PolicyInput, ROLLBACK_ANNOTATION, waves::IMPLICIT_WAVE};

/// Largest count an int-or-string field accepts (as the CRD's CEL rules say).
pub const MAX_COUNT: i64 = 100_000;

/// What is wrong with a policy, in words naming the field and the fix.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Findings {
    /// Problems that make the spec unusable: the rollout is held.
    pub invalid: Vec<String>,
    /// Annotations under `switchyard.dev` the operator does not act on.
    pub annotations: Vec<String>,
}

/// Checks `p` (a pure function of the policy).
pub fn check(p: &PolicyInput) -> Findings {
    let mut invalid = Vec::new();
    if p.name.len() > MAX_POLICY_NAME {
        invalid.push(format!(
            "metadata.name is {} characters, but the operator labels NodeProxies with it and a label value holds at most {MAX_POLICY_NAME}: create the policy again with a shorter name",
            p.name.len()
        ));
    }
    let rollout = &p.spec.rollout;
    if let Some(why) = count_or_percent(&rollout.max_unavailable) {
        invalid.push(format!("spec.rollout.maxUnavailable {why}"));
    }
    for (i, w) in rollout.waves.iter().enumerate() {
        if let Some(why) = w.nodes.as_ref().and_then(count_or_percent) {
            invalid.push(format!("spec.rollout.waves[{i}].nodes {why}"));
        }
        if let Some(s) = &w.node_selector {
            selector(&format!("spec.rollout.waves[{i}].nodeSelector"), s, &mut invalid);
        }
    }
    selector("spec.nodeSelector", &p.spec.node_selector, &mut invalid);
    for (i, probe) in p.spec.health_gate.probes.iter().enumerate() {
        if let Some(s) = &probe.selector {
            selector(&format!("spec.healthGate.probes[{i}].selector"), s, &mut invalid);
        }
    }
    if let Some(w) = &rollout.window
        && jiff::tz::TimeZone::get(&w.time_zone).is_err()
    {
        invalid.push(format!(
            "spec.rollout.window.timeZone {:?} is not a known IANA time zone: use a name such as UTC or Europe/Berlin",
            w.time_zone
        ));
    }
    Findings {
        invalid,
        annotations: annotations(p),
    }
}

/// Why an int-or-string is not a count from 1 to [`MAX_COUNT`] or a whole percentage 1%–100%.
fn count_or_percent(v: &IntOrString) -> Option<String> {
    let fix = format!("set a count from 1 to {MAX_COUNT} or a whole percentage from 1% to 100% (e.g. 25%)");
    match v {
        IntOrString::Int(n) if (1..=MAX_COUNT).contains(&i64::from(*n)) => None,
        IntOrString::Int(n) => Some(format!("is {n}: {fix}")),
        IntOrString::String(s) => {
            let pct = s.strip_suffix('%').and_then(|d| d.parse::<u8>().ok());
            let plain = !s.starts_with('0') && s.strip_suffix('%').is_some_and(|d| !d.starts_with('0'));
            if pct.is_some_and(|p| (1..=100).contains(&p)) && plain {
                None
            } else {
                Some(format!("is {s:?}: {fix}"))
            }
        }
    }
}

fn selector(field: &str, s: &LabelSelector, out: &mut Vec<String>) {
    for (i, e) in s.match_expressions.iter().flatten().enumerate() {
        let values = e.values.as_ref().map_or(0, Vec::len);
        let at = format!("{field}.matchExpressions[{i}]");
        match e.operator.as_str() {
            "In" | "NotIn" if values == 0 => out.push(format!(
                "{at}: operator {} needs at least one value in values",
                e.operator
            )),
            "Exists" | "DoesNotExist" if values > 0 => out.push(format!(
                "{at}: operator {} must have no values: remove values",
                e.operator
            )),
            "In" | "NotIn" | "Exists" | "DoesNotExist" => {}
            other => out.push(format!(
                "{at}.operator {other:?} is not one of In, NotIn, Exists, DoesNotExist"
            )),
        }
    }
}

/// Annotations under `switchyard.dev` the operator does not act on, each with what to do.
fn annotations(p: &PolicyInput) -> Vec<String> {
    let waves: Vec<&str> = if p.spec.rollout.waves.is_empty() {
        vec![IMPLICIT_WAVE]
    } else {
        p.spec.rollout.waves.iter().map(|w| w.name.as_str()).collect()
    };
    let mut out = Vec::new();
    for (wave, value) in &p.approvals {
        if !waves.contains(&wave.as_str()) {
            out.push(format!(
                "{APPROVE_PREFIX}{wave} names no wave of this policy (waves: {}): annotate the wave to approve, e.g. {APPROVE_PREFIX}{}={}",
                waves.join(", "),
                waves[0],
                p.generation
            ));
        } else if value.trim().parse::<i64>().is_err() {
            out.push(format!(
                "{APPROVE_PREFIX}{wave}={value:?} is not a generation: set it to the generation to approve ({})",
                p.generation
            ));
        }
    }
    if let Some(v) = &p.rollback
        && v.trim().parse::<i64>().is_err()
    {
        out.push(format!(
            "{ROLLBACK_ANNOTATION}={v:?} is not a generation: set it to the generation to roll back ({}), e.g. kubectl switchyard rollback {}",
            p.generation, p.name
        ));
    }
    for key in &p.annotations {
        out.push(format!(
            "{key} is not an annotation Switchyard understands (known: {APPROVE_PREFIX}WAVE, {ROLLBACK_ANNOTATION}): remove it or fix its name"
        ));
    }
    out
}
