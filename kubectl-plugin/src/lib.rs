//! `kubectl switchyard`: the kubectl experience of Switchyard.
//!
//! - `plan` runs the operator's own wave planner ([`switchyard_planner::plan`]) over the
//!   cluster's Nodes, NodeProxies and ProxyPolicies (optionally with a policy from a file in place of
//!   the cluster's copy) and shows the waves and nodes the operator will use;
//! - `status` shows a policy's status: phase, counters, waves and conditions;
//! - `advise` shows the mode advisor's recommendation per node with its figures, and the pool's
//!   summary ([`advise`]);
//! - `approve`, `pause`, `resume` and `rollback` write the annotations and patches the operator
//!   honours (approval `approve.switchyard.dev/<wave>: "<generation>"`, `spec.rollout.paused`, and
//!   [`ROLLBACK_ANNOTATION`]).
//!
//! This library holds the pure parts (planning, rendering, patch bodies) so they are unit-tested;
//! `main.rs` talks to the API server.
#![cfg_attr(not(test), warn(clippy::too_many_lines))]

use std::fmt::Write as _;

use k8s_openapi::{api::core::v1::Node, jiff::Timestamp};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use switchyard_crds::{
    consts::{SERVICE_PROXY_EXTERNAL, SERVICE_PROXY_LABEL},
    v1alpha1::{NodeProxy, ProxyMode, ProxyPolicy, ProxyPolicyStatus, WaveState},
};
use switchyard_planner::{self as planner, APPROVE_PREFIX, NodeInput, NodeProxyInput, PolicyInput};

pub use switchyard_planner::ROLLBACK_ANNOTATION;

pub mod advise;
pub mod preflight;

/// Errors of the plugin.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The request cannot be carried out as asked; the message says why and what to do.
    #[error("{0}")]
    Usage(String),
    /// A policy file could not be read or parsed.
    #[error("{path}: {detail}")]
    File {
        /// The file.
        path: String,
        /// What went wrong.
        detail: String,
    },
    /// The API server refused or failed a request.
    #[error("{action}: {source}")]
    Kube {
        /// What was being done.
        action: String,
        /// The error.
        #[source]
        source: kube::Error,
    },
}

/// Result alias of the plugin.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Every ProxyPolicy in a (multi-document) YAML text; other kinds are skipped.
pub fn policies_from_yaml(path: &str, text: &str) -> Result<Vec<ProxyPolicy>> {
    let mut out = Vec::new();
    for doc in serde_yaml::Deserializer::from_str(text) {
        let value = Value::deserialize(doc).map_err(|e| Error::File {
            path: path.into(),
            detail: e.to_string(),
        })?;
        if value.is_null() || value.get("kind").and_then(Value::as_str) != Some("ProxyPolicy") {
            continue;
        }
        let policy: ProxyPolicy = serde_json::from_value(value).map_err(|e| Error::File {
            path: path.into(),
            detail: format!("not a valid ProxyPolicy: {e}"),
        })?;
        out.push(policy);
    }
    Ok(out)
}

/// One node of a plan.
#[derive(Clone, Debug, Serialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct NodeRow {
    /// Node name.
    pub name: String,
    /// Wave it is in (none when incompatible).
    pub wave: Option<String>,
    /// The planner's state of the node (Pending, Switching, Healthy, ...).
    pub state: String,
    /// Mode its agent runs now.
    pub active: Option<String>,
    /// Mode it will run (its fallback on nodes that cannot run the policy's mode).
    pub target: Option<String>,
    /// Why it is incompatible or failed.
    pub reason: Option<String>,
    /// The policy generation whose `spec.proxy` it runs (none while it switches, or not this
    /// policy's): settings changes roll out in waves, so nodes waiting for theirs show an older one.
    pub settings_generation: Option<i64>,
    /// Its migration preflight findings ([`preflight`]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub preflight: Vec<preflight::FindingRow>,
}

/// One wave of a plan.
#[derive(Clone, Debug, Serialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct WaveRow {
    /// Wave name.
    pub name: String,
    /// State the operator would report.
    pub state: String,
    /// Nodes in the wave, sorted.
    pub nodes: Vec<String>,
    /// Seconds the wave soaks once healthy.
    pub soak_seconds: u32,
    /// Whether the wave waits for approval.
    pub require_approval: bool,
}

/// The plan of one policy, as `kubectl switchyard plan` shows it.
#[derive(Clone, Debug, Serialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct PlanReport {
    /// Policy name.
    pub policy: String,
    /// Proxy mode of the policy.
    pub mode: String,
    /// Generation the plan is for (the cluster's, plus one when a file changes the spec).
    pub generation: i64,
    /// False when the policy is not in the cluster yet: the order of nodes inside the waves is
    /// seeded by the UID the API server will assign, so only sizes and selector-chosen nodes are
    /// exact until it is applied.
    pub exact_order: bool,
    /// Phase the operator would report.
    pub phase: String,
    /// The operator's headline message.
    pub message: String,
    /// Waves in order.
    pub waves: Vec<WaveRow>,
    /// Every governed node, sorted by name.
    pub nodes: Vec<NodeRow>,
    /// Nodes selected but governed by another policy (Conflict condition), if any.
    pub conflict: Option<String>,
}

/// Plans `target` the way the operator does: with every other policy of the cluster (for
/// precedence), the cluster's Nodes and NodeProxies, at `now`. When `target` comes from a file and
/// the cluster has a policy of the same name, its UID, annotations and status are used, and the
/// generation is the next one if the spec differs.
pub fn plan_for(
    target: &ProxyPolicy,
    cluster: &[ProxyPolicy],
    nodes: &[Node],
    proxies: &[NodeProxy],
    now: Timestamp,
) -> Result<PlanReport> {
    let name = target
        .metadata
        .name
        .clone()
        .ok_or_else(|| Error::Usage("the policy has no metadata.name".into()))?;
    let existing = cluster
        .iter()
        .find(|p| p.metadata.name.as_deref() == Some(name.as_str()));
    let mut merged = merged_policy(target, existing);
    let exact_order = merged.metadata.uid.is_some();
    merged.metadata.uid.get_or_insert_with(String::new);
    let mut inputs: Vec<PolicyInput> = cluster
        .iter()
        .filter(|p| p.metadata.name.as_deref() != Some(name.as_str()))
        .map(PolicyInput::from_policy)
        .collect();
    inputs.push(PolicyInput::from_policy(&merged));
    let node_inputs: Vec<NodeInput> = nodes
        .iter()
        .map(|n| NodeInput {
            name: n.metadata.name.clone().unwrap_or_default(),
            uid: n.metadata.uid.clone().unwrap_or_default(),
            labels: n.metadata.labels.clone().unwrap_or_default(),
        })
        .collect();
    let proxy_inputs: Vec<NodeProxyInput> = proxies.iter().map(NodeProxyInput::from_node_proxy).collect();
    let plan = planner::plan(&inputs, &node_inputs, &proxy_inputs, now);
    let pp = plan
        .policy(&name)
        .ok_or_else(|| Error::Usage(format!("the planner returned no plan for {name}")))?;
    Ok(report(name, &merged, exact_order, pp, proxies))
}

/// The policy to plan: `target` over the cluster's copy (`existing`), its generation bumped when
/// the spec changes, and at least 1.
fn merged_policy(target: &ProxyPolicy, existing: Option<&ProxyPolicy>) -> ProxyPolicy {
    let mut merged = match existing {
        Some(live) => {
            let mut m = live.clone();
            if live.spec != target.spec {
                m.spec = target.spec.clone();
                m.metadata.generation = Some(live.metadata.generation.unwrap_or(0) + 1);
            }
            m
        }
        None => {
            let mut m = target.clone();
            m.metadata.generation = Some(m.metadata.generation.unwrap_or(1).max(1));
            m
        }
    };
    if merged.metadata.generation.is_none() {
        merged.metadata.generation = Some(1);
    }
    merged
}

/// The report of the planner's plan `pp` of `merged`.
fn report(
    name: String,
    merged: &ProxyPolicy,
    exact_order: bool,
    pp: &planner::PolicyPlan,
    proxies: &[NodeProxy],
) -> PlanReport {
    let active = |node: &str| {
        proxies
            .iter()
            .find(|np| np.metadata.name.as_deref() == Some(node))
            .and_then(|np| np.status.as_ref())
            .and_then(|s| s.active_mode)
            .map(|m| m.to_string())
    };
    let waves = pp
        .status
        .waves
        .iter()
        .map(|w| {
            let spec = merged.spec.rollout.waves.iter().find(|s| s.name == w.name);
            WaveRow {
                name: w.name.clone(),
                state: format!("{:?}", w.state),
                nodes: w.nodes.clone(),
                soak_seconds: spec.map(|s| s.soak_seconds).unwrap_or(0),
                require_approval: spec.is_some_and(|s| s.require_approval),
            }
        })
        .collect();
    let nodes = pp
        .nodes
        .iter()
        .map(|n| NodeRow {
            name: n.name.clone(),
            wave: n.wave.clone(),
            state: format!("{:?}", n.state),
            active: active(&n.name),
            target: n.target.map(|m| m.to_string()),
            reason: n.reason.clone(),
            settings_generation: n.settings_generation,
            preflight: n.preflight.iter().map(preflight::FindingRow::from).collect(),
        })
        .collect();
    let condition = |t: &str| pp.status.conditions.iter().find(|c| c.type_ == t);
    PlanReport {
        policy: name,
        mode: merged.spec.mode.to_string(),
        generation: merged.metadata.generation.unwrap_or(1),
        exact_order,
        phase: pp.status.phase.map(|p| format!("{p:?}")).unwrap_or_default(),
        message: condition(planner::conditions::READY)
            .map(|c| c.message.clone())
            .unwrap_or_default(),
        waves,
        nodes,
        conflict: condition(planner::conditions::CONFLICT)
            .filter(|c| c.status == "True")
            .map(|c| c.message.clone()),
    }
}

/// Lays out rows as a left-aligned table with two spaces between columns.
pub fn table(header: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for row in rows {
        for (i, cell) in row.iter().enumerate() {
            if let Some(w) = widths.get_mut(i) {
                *w = (*w).max(cell.chars().count());
            }
        }
    }
    let mut out = String::new();
    let mut line = |cells: &mut dyn Iterator<Item = &str>| {
        let mut l = String::new();
        for (i, cell) in cells.enumerate() {
            let w = widths.get(i).copied().unwrap_or(0);
            let _ = write!(l, "{cell:<w$}  ");
        }
        out.push_str(l.trim_end());
        out.push('\n');
    };
    line(&mut header.iter().copied());
    for row in rows {
        line(&mut row.iter().map(String::as_str));
    }
    out
}

fn dash(v: Option<&str>) -> String {
    v.filter(|s| !s.is_empty()).unwrap_or("-").to_owned()
}

/// What mode `external` does, for the plan and status of a policy that hands nodes over.
fn external_note() -> String {
    format!(
        "note: mode external hands the nodes to another service proxy: each is labelled {SERVICE_PROXY_LABEL}={SERVICE_PROXY_EXTERNAL} (that proxy's DaemonSet must select it), and its agent removes Switchyard's rules once Services answer through the other proxy\n"
    )
}

/// The plan as people read it: a header, the waves with their nodes, every node.
pub fn render_plan(r: &PlanReport) -> String {
    let mut out = format!(
        "ProxyPolicy {} → {} (generation {}): {} — {}\n",
        r.policy, r.mode, r.generation, r.phase, r.message
    );
    if r.mode == ProxyMode::External.as_str() {
        out.push_str(&external_note());
    }
    if !r.exact_order {
        out.push_str("note: the policy is not in the cluster yet; the order of nodes inside waves is seeded by the UID it gets when applied, so only wave sizes and nodes chosen by wave selectors are exact until then\n");
    }
    if let Some(c) = &r.conflict {
        let _ = writeln!(out, "conflict: {c}");
    }
    out.push('\n');
    let waves: Vec<Vec<String>> = r
        .waves
        .iter()
        .enumerate()
        .map(|(i, w)| {
            vec![
                (i + 1).to_string(),
                w.name.clone(),
                w.state.clone(),
                w.nodes.len().to_string(),
                if w.require_approval {
                    "yes".into()
                } else {
                    "-".into()
                },
                if w.soak_seconds > 0 {
                    format!("{}s", w.soak_seconds)
                } else {
                    "-".into()
                },
                if w.nodes.is_empty() {
                    "-".into()
                } else {
                    w.nodes.join(",")
                },
            ]
        })
        .collect();
    out.push_str(&table(
        &["#", "WAVE", "STATE", "NODES", "APPROVAL", "SOAK", "MEMBERS"],
        &waves,
    ));
    out.push('\n');
    let nodes: Vec<Vec<String>> = r
        .nodes
        .iter()
        .map(|n| {
            vec![
                n.name.clone(),
                dash(n.wave.as_deref()),
                n.state.clone(),
                dash(n.active.as_deref()),
                dash(n.target.as_deref()),
                n.settings_generation
                    .map(|g| format!("g{g}"))
                    .unwrap_or_else(|| "-".into()),
                dash(n.reason.as_deref()),
            ]
        })
        .collect();
    out.push_str(&table(
        &["NODE", "WAVE", "STATE", "ACTIVE", "TARGET", "SETTINGS", "REASON"],
        &nodes,
    ));
    out.push_str(&preflight::render_findings(&r.nodes));
    out
}

/// A policy's status as people read it.
pub fn render_status(p: &ProxyPolicy) -> String {
    let name = p.metadata.name.clone().unwrap_or_default();
    let generation = p.metadata.generation.unwrap_or(0);
    let Some(s) = p.status.as_ref() else {
        return format!(
            "ProxyPolicy {name} (generation {generation}): no status yet — is the operator running?\n"
        );
    };
    let mut out = format!(
        "ProxyPolicy {name} → {} (generation {generation}, status for {}): {}\n",
        p.spec.mode,
        s.observed_generation
            .map(|g| g.to_string())
            .unwrap_or_else(|| "-".into()),
        s.phase.map(|p| format!("{p:?}")).unwrap_or_else(|| "-".into())
    );
    if s.observed_generation != Some(generation) {
        out.push_str("note: the operator has not observed the latest spec yet\n");
    }
    if p.spec.mode.is_external() {
        out.push_str(&external_note());
    }
    let _ = writeln!(
        out,
        "nodes: {} governed, {} updated, {} healthy, {} failed, {} incompatible, {} on this generation's settings; current wave: {}\n",
        s.target_nodes,
        s.updated_nodes,
        s.healthy_nodes,
        s.failed_nodes,
        s.incompatible_nodes,
        s.settings_updated_nodes,
        dash(s.current_wave.as_deref())
    );
    out.push_str(&render_waves(s));
    out.push('\n');
    let conditions: Vec<Vec<String>> = s
        .conditions
        .iter()
        .map(|c| {
            vec![
                c.type_.clone(),
                c.status.clone(),
                c.reason.clone(),
                c.message.clone(),
            ]
        })
        .collect();
    out.push_str(&table(&["CONDITION", "STATUS", "REASON", "MESSAGE"], &conditions));
    out
}

fn render_waves(s: &ProxyPolicyStatus) -> String {
    let rows: Vec<Vec<String>> = s
        .waves
        .iter()
        .enumerate()
        .map(|(i, w)| {
            vec![
                (i + 1).to_string(),
                w.name.clone(),
                format!("{:?}", w.state),
                format!("{}/{}", w.healthy, w.nodes.len()),
                w.failed.to_string(),
                if w.nodes.is_empty() {
                    "-".into()
                } else {
                    w.nodes.join(",")
                },
            ]
        })
        .collect();
    table(&["#", "WAVE", "STATE", "HEALTHY", "FAILED", "MEMBERS"], &rows)
}

/// Which wave `approve` approves: `wave` if given (it must exist), else the wave the status says
/// waits for approval (the status must be for the current generation).
pub fn wave_to_approve(p: &ProxyPolicy, wave: Option<&str>) -> Result<String> {
    let name = p.metadata.name.clone().unwrap_or_default();
    if let Some(w) = wave {
        if !p.spec.rollout.waves.iter().any(|x| x.name == w) {
            let known: Vec<&str> = p.spec.rollout.waves.iter().map(|x| x.name.as_str()).collect();
            return Err(Error::Usage(format!(
                "proxypolicy {name} has no wave {w:?} (waves: {})",
                known.join(", ")
            )));
        }
        return Ok(w.to_owned());
    }
    let generation = p.metadata.generation.unwrap_or(0);
    let status = p.status.as_ref();
    if status.and_then(|s| s.observed_generation) != Some(generation) {
        return Err(Error::Usage(format!(
            "the status of proxypolicy {name} is not for generation {generation} yet; wait for the operator or name the wave with --wave"
        )));
    }
    status
        .and_then(|s| s.waves.iter().find(|w| w.state == WaveState::AwaitingApproval))
        .map(|w| w.name.clone())
        .ok_or_else(|| {
            Error::Usage(format!(
                "no wave of proxypolicy {name} awaits approval now; name one with --wave to approve it ahead"
            ))
        })
}

/// Merge patch approving `wave` for the policy's current generation, conditional on the object
/// not having changed since it was read (so an approval never lands on a newer spec).
pub fn approve_patch(p: &ProxyPolicy, wave: &str) -> Value {
    json!({"metadata": {
        "resourceVersion": p.metadata.resource_version,
        "annotations": {format!("{APPROVE_PREFIX}{wave}"): p.metadata.generation.unwrap_or(0).to_string()},
    }})
}

/// Merge patch setting `spec.rollout.paused`; resuming also drops a rollback annotation.
pub fn pause_patch(paused: bool) -> Value {
    if paused {
        json!({"spec": {"rollout": {"paused": true}}})
    } else {
        json!({"metadata": {"annotations": {ROLLBACK_ANNOTATION: null}}, "spec": {"rollout": {"paused": false}}})
    }
}

/// Merge patch requesting a manual rollback: pauses the rollout and sets [`ROLLBACK_ANNOTATION`]
/// to the generation the object will have after the patch (pausing changes the spec, which
/// increments the generation by one), conditional on the object being unchanged since it was read.
pub fn rollback_patch(p: &ProxyPolicy) -> (i64, Value) {
    let g = p.metadata.generation.unwrap_or(0);
    let target = if p.spec.rollout.paused { g } else { g + 1 };
    (
        target,
        json!({
            "metadata": {"resourceVersion": p.metadata.resource_version, "annotations": {ROLLBACK_ANNOTATION: target.to_string()}},
            "spec": {"rollout": {"paused": true}},
        }),
    )
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    const POLICY: &str = r#"
apiVersion: v1
kind: ConfigMap
metadata: {name: ignored}
---
apiVersion: switchyard.dev/v1alpha1
kind: ProxyPolicy
metadata: {name: p}
spec:
  nodeSelector: {matchLabels: {pool: a}}
  mode: nftables
  rollout:
    waves:
    - {name: canary, nodes: 1, requireApproval: true, soakSeconds: 60}
    - {name: rest, nodes: 100%}
"#;

    fn node(name: &str) -> Node {
        serde_json::from_value(
            json!({"metadata": {"name": name, "uid": format!("uid-{name}"), "labels": {"pool": "a"}}}),
        )
        .unwrap()
    }

    #[test]
    fn plans_a_file_policy_with_the_operator_planner() {
        let policies = policies_from_yaml("x.yaml", POLICY).unwrap();
        assert_eq!(policies.len(), 1);
        let nodes: Vec<Node> = ["n1", "n2", "n3"].into_iter().map(node).collect();
        let now: Timestamp = "2025-01-06T12:00:00Z".parse().unwrap();
        let r = plan_for(&policies[0], &[], &nodes, &[], now).unwrap();
        assert!(!r.exact_order);
        assert_eq!(r.waves.len(), 2);
        assert_eq!((r.waves[0].nodes.len(), r.waves[1].nodes.len()), (1, 2));
        assert_eq!(r.waves[0].state, "AwaitingApproval");
        assert!(r.waves[0].require_approval);
        assert_eq!(r.nodes.len(), 3);
        assert!(
            r.nodes.iter().all(|n| n.state == "Unknown"),
            "no agent reports: {:?}",
            r.nodes
        );
        let text = render_plan(&r);
        assert!(
            text.contains("WAVE") && text.contains("canary") && text.contains("n1"),
            "{text}"
        );
        assert!(text.contains("not in the cluster yet"), "{text}");
    }

    #[test]
    fn a_changed_spec_plans_the_next_generation() {
        let mut live = policies_from_yaml("x.yaml", POLICY).unwrap().remove(0);
        live.metadata.uid = Some("uid-p".into());
        live.metadata.generation = Some(4);
        let mut edited = live.clone();
        edited.spec.rollout.paused = true;
        let nodes = vec![node("n1")];
        let now: Timestamp = "2025-01-06T12:00:00Z".parse().unwrap();
        let same = plan_for(&live, std::slice::from_ref(&live), &nodes, &[], now).unwrap();
        assert_eq!((same.generation, same.exact_order), (4, true));
        let next = plan_for(&edited, &[live], &nodes, &[], now).unwrap();
        assert_eq!(next.generation, 5);
        assert_eq!(next.phase, "Paused");
    }

    #[test]
    fn patches_name_the_generation() {
        let mut p = policies_from_yaml("x.yaml", POLICY).unwrap().remove(0);
        p.metadata.generation = Some(3);
        p.metadata.resource_version = Some("77".into());
        assert_eq!(
            approve_patch(&p, "canary"),
            json!({"metadata": {"resourceVersion": "77", "annotations": {"approve.switchyard.dev/canary": "3"}}})
        );
        let (g, patch) = rollback_patch(&p);
        assert_eq!(g, 4, "pausing bumps the generation");
        assert_eq!(patch["metadata"]["annotations"][ROLLBACK_ANNOTATION], "4");
        p.spec.rollout.paused = true;
        assert_eq!(rollback_patch(&p).0, 3, "already paused: same generation");
        assert!(pause_patch(false)["metadata"]["annotations"][ROLLBACK_ANNOTATION].is_null());
        assert!(wave_to_approve(&p, Some("nope")).is_err());
        assert_eq!(wave_to_approve(&p, Some("canary")).unwrap(), "canary");
        assert!(wave_to_approve(&p, None).is_err(), "no status yet");
    }

    #[test]
    fn plans_a_hand_over_to_another_proxy() {
        let text = POLICY.replace("mode: nftables", "mode: external");
        let policies = policies_from_yaml("x.yaml", &text).unwrap();
        let nodes: Vec<Node> = ["n1", "n2"].into_iter().map(node).collect();
        let now: Timestamp = "2025-01-06T12:00:00Z".parse().unwrap();
        let r = plan_for(&policies[0], &[], &nodes, &[], now).unwrap();
        assert_eq!(r.mode, "external");
        assert_eq!(r.nodes.len(), 2);
        let plan = render_plan(&r);
        assert!(
            plan.contains("→ external") && plan.contains("switchyard.dev/service-proxy=external"),
            "{plan}"
        );
        let mut p = policies.into_iter().next().unwrap();
        p.status = Some(ProxyPolicyStatus::default());
        assert!(render_status(&p).contains("another service proxy"));
    }

    /// A settings change planned against the live policy: the waiting nodes show the generation
    /// whose settings they still run, the admitted one none (it switches).
    #[test]
    fn a_settings_change_shows_which_nodes_run_which_settings() {
        let text = POLICY.replace("requireApproval: true, soakSeconds: 60", "soakSeconds: 60");
        let mut live = policies_from_yaml("x.yaml", &text).unwrap().remove(0);
        live.metadata.uid = Some("uid-p".into());
        live.metadata.generation = Some(4);
        let mut edited = live.clone();
        edited.spec.proxy = Some(serde_json::from_value(json!({"masqueradeAll": true})).unwrap());
        let nodes: Vec<Node> = ["n1", "n2", "n3"].into_iter().map(node).collect();
        let proxies: Vec<NodeProxy> = ["n1", "n2", "n3"]
            .into_iter()
            .map(|n| {
                serde_json::from_value(json!({
                    "metadata": {"name": n},
                    "spec": {"desiredMode": "nftables", "rolloutToken": "p-g4-nftables",
                             "policy": {"name": "p", "uid": "uid-p", "generation": 4}},
                    "status": {"activeMode": "nftables", "phase": "Active",
                               "lastSwitch": {"from": "iptables", "to": "nftables", "result": "Succeeded", "rolloutToken": "p-g4-nftables"}},
                }))
                .unwrap()
            })
            .collect();
        let now: Timestamp = "2025-01-06T12:00:00Z".parse().unwrap();
        let r = plan_for(&edited, &[live], &nodes, &proxies, now).unwrap();
        assert_eq!(r.generation, 5);
        let settings: Vec<Option<i64>> = r.nodes.iter().map(|n| n.settings_generation).collect();
        assert_eq!(
            settings.iter().filter(|g| g.is_none()).count(),
            1,
            "{:?}",
            r.nodes
        );
        assert_eq!(
            settings.iter().filter(|g| **g == Some(4)).count(),
            2,
            "{:?}",
            r.nodes
        );
        let plan = render_plan(&r);
        assert!(plan.contains("SETTINGS") && plan.contains("g4"), "{plan}");
    }

    #[test]
    fn tables_align() {
        let t = table(&["A", "LONG"], &[vec!["xyz".into(), "1".into()]]);
        assert_eq!(t, "A    LONG\nxyz  1\n");
    }
}
