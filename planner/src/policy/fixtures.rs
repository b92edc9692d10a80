//! Builders for the stage tests: a policy, nodes, NodeProxies in the states agents report, and
//! empty stage results to override field by field.

use jiff::Timestamp;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use switchyard_crds::v1alpha1::{
    Capabilities, NodeProxySpec, NodeProxyStatus, PolicyReference, ProxyMode, ProxyPolicySpec, SwitchPhase,
    SwitchResult, WaveState, WaveStatus,
};

pub(crate) use super::super::{NodeInput, NodeProxyInput, PolicyInput};
use super::{Budget, Gates, Hold};

pub(crate) const IPT: ProxyMode = ProxyMode::Iptables;
pub(crate) const NFT: ProxyMode = ProxyMode::Nftables;
pub(crate) const BOTH: &[ProxyMode] = &[IPT, NFT];

pub(crate) fn t0() -> Timestamp {
    "2025-01-06T12:00:00Z".parse().unwrap()
}

/// A policy over `pool=a` nodes running `mode`, at `generation`.
pub(crate) fn policy_input(name: &str, mode: ProxyMode, generation: i64) -> PolicyInput {
    let spec: ProxyPolicySpec = serde_json::from_value(serde_json::json!({
        "nodeSelector": {"matchLabels": {"pool": "a"}},
        "mode": mode.as_str(),
    }))
    .unwrap();
    PolicyInput {
        name: name.into(),
        uid: format!("uid-{name}"),
        generation,
        spec,
        approvals: Default::default(),
        rollback: None,
        annotations: Vec::new(),
        status: None,
    }
}

/// `p` with `fields` merged into `spec.rollout`.
pub(crate) fn with_rollout(mut p: PolicyInput, fields: serde_json::Value) -> PolicyInput {
    let mut spec = serde_json::to_value(&p.spec).unwrap();
    for (k, v) in fields.as_object().unwrap() {
        spec["rollout"][k] = v.clone();
    }
    p.spec = serde_json::from_value(spec).unwrap();
    p
}

/// `p` with this `spec.proxy`.
pub(crate) fn with_proxy(mut p: PolicyInput, proxy: serde_json::Value) -> PolicyInput {
    p.spec.proxy = Some(serde_json::from_value(proxy).unwrap());
    p
}

/// `p` with these waves.
pub(crate) fn with_waves(p: PolicyInput, waves: serde_json::Value) -> PolicyInput {
    with_rollout(p, serde_json::json!({ "waves": waves }))
}

pub(crate) fn node_input(name: &str) -> NodeInput {
    NodeInput {
        name: name.into(),
        uid: format!("uid-{name}"),
        labels: [("pool".to_owned(), "a".to_owned())].into(),
    }
}

/// A NodeProxy whose agent runs `active`, serving, and can run `supported`; empty spec.
pub(crate) fn np(active: ProxyMode, supported: &[ProxyMode]) -> NodeProxyInput {
    NodeProxyInput {
        name: String::new(),
        spec: NodeProxySpec::default(),
        status: Some(NodeProxyStatus {
            capabilities: Some(Capabilities {
                supported_modes: supported.to_vec(),
                ..Default::default()
            }),
            active_mode: Some(active),
            phase: Some(SwitchPhase::Active),
            ..Default::default()
        }),
    }
}

/// A NodeProxy with `spec` and no status yet.
pub(crate) fn np_spec(spec: NodeProxySpec) -> NodeProxyInput {
    NodeProxyInput {
        name: String::new(),
        spec,
        status: None,
    }
}

/// The spec `policy_input("pool", _, 1)` writes to release a node to `mode` with `token`.
pub(crate) fn released(mode: ProxyMode, token: &str) -> NodeProxySpec {
    let p = policy_input("pool", mode, 1);
    NodeProxySpec {
        desired_mode: Some(mode),
        proxy: p.spec.proxy.clone(),
        health_gate: Some(p.spec.health_gate.clone()),
        policy: Some(PolicyReference {
            name: p.name.clone(),
            uid: Some(p.uid.clone()),
            generation: Some(1),
        }),
        rollout_token: Some(token.into()),
    }
}

/// A node released to nftables with `token` whose agent answered it: runs `active` after a
/// switch from `from` that ended with `result` (the reason of a failure names a probe).
pub(crate) fn answered(active: ProxyMode, token: &str, from: ProxyMode, result: &str) -> NodeProxyInput {
    let mut out = np(active, BOTH);
    out.spec = released(NFT, token);
    if let Some(st) = out.status.as_mut() {
        st.last_switch = Some(SwitchResult {
            from: Some(from),
            to: NFT,
            result: result.into(),
            reason: (result != "Succeeded").then(|| "probe default/kubernetes: no endpoint answered".into()),
            rollout_token: Some(token.into()),
            started_at: Some(Time(t0())),
            finished_at: Some(Time(t0())),
        });
    }
    out
}

/// `np` in switch phase `phase`.
pub(crate) fn with_phase(mut np: NodeProxyInput, phase: SwitchPhase) -> NodeProxyInput {
    if let Some(st) = np.status.as_mut() {
        st.phase = Some(phase);
    }
    np
}

/// `np` with a `Healthy=False` condition.
pub(crate) fn unhealthy(mut np: NodeProxyInput) -> NodeProxyInput {
    if let Some(st) = np.status.as_mut() {
        st.conditions.push(Condition {
            type_: switchyard_crds::v1alpha1::HEALTHY_CONDITION.into(),
            status: "False".into(),
            reason: "Switching".into(),
            message: String::new(),
            observed_generation: None,
            last_transition_time: Time(t0()),
        });
    }
    np
}

pub(crate) fn wave_status(name: &str, state: WaveState, nodes: &[&str]) -> WaveStatus {
    WaveStatus {
        name: name.into(),
        state,
        nodes: nodes.iter().map(|n| (*n).to_owned()).collect(),
        updated: 0,
        healthy: 0,
        failed: 0,
        started_at: None,
        completed_at: None,
    }
}

/// No failure, no rollback, maxUnavailable 1.
pub(crate) fn budget_none() -> Budget {
    Budget {
        failed: vec![],
        failed_desc: vec![],
        max_failures: 0,
        exceeded: false,
        manual: false,
        rollback: false,
        roll_back: vec![],
        max_unavailable: 1,
        unavailable: 0,
    }
}

/// No wave walked, nothing held or admitted.
pub(crate) fn gates_none() -> Gates {
    Gates {
        runs: vec![],
        current: None,
        hold: Hold::None,
        soak_left: None,
        admit: vec![],
    }
}
