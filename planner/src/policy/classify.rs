//! Stage 1, classify: each governed node's [`NodeState`], target mode, availability and what its
//! NodeProxy says about this policy's release of it.

use std::collections::HashMap;

use jiff::Timestamp;
use switchyard_crds::v1alpha1::{
    Fallback, NodeProxyStatus, ProxyMode, SwitchOutcome, SwitchPhase, SwitchResult,
};

use super::{super::NodeInput, NodeProxyInput, NodeState, PolicyInput, is_settings_token, parse_token};

/// One governed node, classified.
#[derive(Clone, Debug)]
pub(crate) struct View<'a> {
    /// The node.
    pub node: &'a NodeInput,
    /// Its NodeProxy, if any.
    pub np: Option<&'a NodeProxyInput>,
    /// Mode it should run (`None`: incompatible).
    pub target: Option<ProxyMode>,
    /// Its state.
    pub state: NodeState,
    /// Counts against maxUnavailable when false.
    pub available: bool,
    /// The spec already releases it for `target` with this token (kept as long as it is valid).
    pub token: Option<String>,
    /// Switched to `target` by this policy (its last switch answered our token and succeeded).
    pub switched_here: bool,
    /// Mode to return to on a policy rollback.
    pub rollback_to: Option<ProxyMode>,
    /// Why it failed, is incompatible or unavailable, for people.
    pub reason: Option<String>,
    /// When its last switch ended.
    pub finished_at: Option<Timestamp>,
    /// Runs the target mode (phase Active).
    pub updated: bool,
    /// Its NodeProxy's `spec.proxy` is not the policy's: a settings switch is pending (it waits
    /// for its wave like a mode switch, keeping the settings it runs).
    pub settings_pending: bool,
    /// The policy generation whose `spec.proxy` it runs (see [`crate::NodePlan`]).
    pub settings_generation: Option<i64>,
    /// Migration preflight findings, for a pending node that changes mode ([`crate::preflight`]).
    pub preflight: Vec<crate::preflight::Finding>,
}

impl<'a> View<'a> {
    fn new(node: &'a NodeInput, np: Option<&'a NodeProxyInput>) -> Self {
        Self {
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
            settings_pending: false,
            settings_generation: None,
            preflight: Vec::new(),
        }
    }
}

/// Classifies every governed node; the views are sorted by node name.
pub(crate) fn classify_nodes<'a>(
    p: &PolicyInput,
    governed: &[&'a NodeInput],
    proxies: &HashMap<&str, &'a NodeProxyInput>,
) -> Vec<View<'a>> {
    let mut views: Vec<View<'a>> = governed
        .iter()
        .map(|n| classify(p, n, proxies.get(n.name.as_str()).copied()))
        .collect();
    views.sort_by(|a, b| a.node.name.cmp(&b.node.name));
    views
}

/// The mode a node should run: the policy's, else its fallback; `Err` says why neither fits.
fn target_mode(p: &PolicyInput, np: Option<&NodeProxyInput>) -> Result<ProxyMode, String> {
    let mode = p.spec.mode;
    // Every node can hand over to another proxy, whatever its agent reports (older agents do not
    // list `external`).
    if mode.is_external() {
        return Ok(mode);
    }
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
        Fallback::External => Some(ProxyMode::External),
    };
    match fallback {
        Some(f) if f.is_external() || caps.supported_modes.contains(&f) => Ok(f),
        Some(f) => Err(format!(
            "cannot run {mode} or fallback {f} (supports: {supported})"
        )),
        None => Err(format!(
            "cannot run {mode} (supports: {supported}); fallback is skip"
        )),
    }
}

/// What the NodeProxy spec says about this policy's release of the node.
struct Release {
    /// The spec's rollout token, when the spec names this policy.
    token: Option<String>,
    /// The token split into (generation, is rollback), when it is this policy's.
    parsed: Option<(i64, bool)>,
    /// The spec's desired mode.
    desired: Option<ProxyMode>,
    /// The token is a settings switch ([`super::settings_token`]).
    settings: bool,
}

impl Release {
    fn read(p: &PolicyInput, np: Option<&NodeProxyInput>) -> Self {
        let spec = np.map(|n| &n.spec);
        let ours = spec
            .and_then(|s| s.policy.as_ref())
            .is_some_and(|r| r.name == p.name);
        let token = spec.and_then(|s| s.rollout_token.clone()).filter(|_| ours);
        let parsed = token.as_deref().and_then(|t| parse_token(&p.name, t));
        Self {
            settings: token.as_deref().is_some_and(|t| is_settings_token(&p.name, t)),
            token,
            parsed,
            desired: spec.and_then(|s| s.desired_mode),
        }
    }

    /// The spec asks for `target` with a switch (not rollback) token of this policy.
    fn releases(&self, target: ProxyMode) -> bool {
        self.desired == Some(target) && self.parsed.is_some_and(|(_, rb)| !rb)
    }

    /// The token is a rollback of `generation`.
    fn rollback_of(&self, generation: i64) -> bool {
        self.parsed.is_some_and(|(g, rb)| rb && g == generation)
    }

    /// The token was issued for `generation`.
    fn of_generation(&self, generation: i64) -> bool {
        self.parsed.is_some_and(|(g, _)| g == generation)
    }
}

/// Classifies one node.
pub(crate) fn classify<'a>(p: &PolicyInput, node: &'a NodeInput, np: Option<&'a NodeProxyInput>) -> View<'a> {
    let mut v = classify_mode(p, node, np);
    v.settings_generation = settings_generation(p, &v);
    v.preflight = preflight(p, &v);
    v
}

/// The preflight findings of a node still to switch: judged only while it is Pending (a released
/// node is never held back), against the mode it runs.
fn preflight(p: &PolicyInput, v: &View<'_>) -> Vec<crate::preflight::Finding> {
    let (Some(target), NodeState::Pending) = (v.target, v.state) else {
        return Vec::new();
    };
    let status = v.np.and_then(|n| n.status.as_ref());
    let accept = p
        .spec
        .rollout
        .preflight
        .as_ref()
        .map(|pf| pf.accept.as_slice())
        .unwrap_or_default();
    crate::preflight::judge(
        status.and_then(|s| s.active_mode),
        target,
        p.spec.proxy.as_ref(),
        status.and_then(|s| s.preflight_facts.as_ref()),
        accept,
    )
}

/// The generation whose settings the node runs: this one when its spec has the policy's, else
/// its spec's (the planner keeps the reference of a node waiting for a settings switch); `None`
/// while its agent has not answered the spec, or for a spec of another policy.
fn settings_generation(p: &PolicyInput, v: &View<'_>) -> Option<i64> {
    let settled = matches!(
        v.state,
        NodeState::Healthy | NodeState::Pending | NodeState::Unhealthy | NodeState::Incompatible
    );
    if !settled {
        return None;
    }
    if !v.settings_pending {
        return Some(p.generation);
    }
    let reference = v.np?.spec.policy.as_ref().filter(|r| r.name == p.name)?;
    reference.generation
}

/// Classifies one node's mode switch (and a pending settings switch).
fn classify_mode<'a>(p: &PolicyInput, node: &'a NodeInput, np: Option<&'a NodeProxyInput>) -> View<'a> {
    let mut v = View::new(node, np);
    v.settings_pending = np.is_some_and(|n| n.spec.proxy != p.spec.proxy);
    let target = match target_mode(p, np) {
        Ok(t) => t,
        Err(reason) => {
            v.state = NodeState::Incompatible;
            v.reason = Some(reason);
            return v;
        }
    };
    v.target = Some(target);
    let release = Release::read(p, np);
    match np.and_then(|n| n.status.as_ref()) {
        Some(status) => reported(p, v, target, release, status),
        None => {
            v.state = NodeState::Unknown;
            v.available = false;
            v.reason = Some("no report from its agent yet".into());
            if release.releases(target) {
                v.token = release.token;
            }
            v
        }
    }
}

/// What the agent reported, as classification reads it.
struct Report<'s> {
    active: Option<ProxyMode>,
    phase: Option<SwitchPhase>,
    /// Phase Active.
    serving: bool,
    /// No `Healthy=False` condition.
    healthy: bool,
    last: Option<&'s SwitchResult>,
}

/// Classifies a node whose agent has reported.
fn reported<'a>(
    p: &PolicyInput,
    mut v: View<'a>,
    target: ProxyMode,
    release: Release,
    status: &NodeProxyStatus,
) -> View<'a> {
    let r = Report {
        active: status.active_mode,
        phase: status.phase,
        serving: status.phase == Some(SwitchPhase::Active),
        healthy: !status.reports_unhealthy(),
        last: status.last_switch.as_ref(),
    };
    v.finished_at = r.last.and_then(|l| l.finished_at.as_ref()).map(|t| t.0);
    // A rollback of this generation: keep it until the agent is back.
    if release.rollback_of(p.generation) {
        let back = release.desired.is_some() && r.active == release.desired && r.serving;
        v.state = if back {
            NodeState::RolledBack
        } else {
            NodeState::RollingBack
        };
        v.available = back;
        return v;
    }
    let mut released = release.releases(target);
    let answers_spec = r
        .last
        .is_some_and(|l| l.rollout_token.is_some() && l.rollout_token == release.token);
    let answered = released && answers_spec;
    let outcome = r.last.map(SwitchResult::outcome);
    if answers_spec && outcome.as_ref().is_some_and(SwitchOutcome::is_failure) {
        // The agent put back the settings it ran before (and keeps them while the spec carries
        // that token, also once its ask is withdrawn): the spec's are not in force.
        v.settings_pending = true;
    }
    if answered && let Some(o) = outcome.as_ref().filter(|o| o.is_failure()) {
        if release.of_generation(p.generation) {
            v.state = NodeState::Failed;
            v.available = r.serving;
            v.token = release.token;
            v.reason = Some(
                r.last
                    .and_then(|l| l.reason.clone())
                    .unwrap_or_else(|| format!("switch {o}")),
            );
            return v;
        }
        // Failed under an older generation: a new generation retries it.
        released = false;
    }
    if released {
        v.token = release.token;
    }
    let succeeded = answered && outcome == Some(SwitchOutcome::Succeeded);
    // A settings switch leaves the mode as it is: the node switches until its agent answers.
    let settings_switch = released && release.settings && !answered;
    settle(v, target, &r, released, succeeded, settings_switch)
}

/// The state of a reported node that is neither rolling back nor failed for this generation.
fn settle<'a>(
    mut v: View<'a>,
    target: ProxyMode,
    r: &Report<'_>,
    released: bool,
    succeeded: bool,
    settings_switch: bool,
) -> View<'a> {
    v.updated = r.active == Some(target) && r.serving;
    if settings_switch {
        v.state = NodeState::Switching;
        v.available = false;
    } else if v.updated && r.healthy {
        // Runs the mode with other settings: waits for its wave like a node to switch.
        v.state = if v.settings_pending {
            NodeState::Pending
        } else {
            NodeState::Healthy
        };
        v.switched_here = succeeded;
        v.rollback_to = r
            .last
            .filter(|l| l.to == target)
            .and_then(|l| l.from)
            .filter(|f| *f != target);
    } else if r.active == Some(target) && !released {
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
        v.rollback_to = r.active.filter(|a| *a != target);
    } else {
        v.state = NodeState::Pending;
        v.available = r.serving && r.healthy;
        if !v.available {
            v.reason = Some(format!("agent phase {:?}, not serving", r.phase));
        }
    }
    v
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::{super::fixtures::*, *};

    /// (name, policy mode, NodeProxy, expected state, available, target, token kept, reason contains)
    type Case = (
        &'static str,
        Option<NodeProxyInput>,
        NodeState,
        bool,
        Option<ProxyMode>,
        Option<&'static str>,
        &'static str,
    );

    #[test]
    fn classify_table() {
        let tok = "pool-g1-nftables";
        let cases: Vec<Case> = vec![
            (
                "no NodeProxy",
                None,
                NodeState::Unknown,
                false,
                Some(NFT),
                None,
                "no report",
            ),
            (
                "released, no status yet",
                Some(np_spec(released(NFT, tok))),
                NodeState::Unknown,
                false,
                Some(NFT),
                Some(tok),
                "no report",
            ),
            (
                "runs iptables, serving",
                Some(np(IPT, BOTH)),
                NodeState::Pending,
                true,
                Some(NFT),
                None,
                "",
            ),
            (
                "not serving",
                Some(with_phase(np(IPT, BOTH), SwitchPhase::Initializing)),
                NodeState::Pending,
                false,
                Some(NFT),
                None,
                "not serving",
            ),
            (
                "no nftables, fallback skip",
                Some(np(IPT, &[IPT])),
                NodeState::Incompatible,
                true,
                None,
                None,
                "fallback is skip",
            ),
            (
                "already runs the mode",
                Some(np(NFT, BOTH)),
                NodeState::Healthy,
                true,
                Some(NFT),
                None,
                "",
            ),
            (
                "runs the mode, Healthy=False",
                Some(unhealthy(np(NFT, BOTH))),
                NodeState::Unhealthy,
                false,
                Some(NFT),
                None,
                "",
            ),
            (
                "released, switching",
                Some(NodeProxyInput {
                    spec: released(NFT, tok),
                    ..np(IPT, BOTH)
                }),
                NodeState::Switching,
                false,
                Some(NFT),
                Some(tok),
                "",
            ),
            (
                "switched here",
                Some(answered(NFT, tok, IPT, "Succeeded")),
                NodeState::Healthy,
                true,
                Some(NFT),
                Some(tok),
                "",
            ),
            (
                "rolled back this generation",
                Some(answered(IPT, tok, IPT, "RolledBack")),
                NodeState::Failed,
                true,
                Some(NFT),
                Some(tok),
                "no endpoint",
            ),
            (
                "failed under an older generation: retried",
                Some(answered(IPT, "pool-g0-nftables", IPT, "Failed")),
                NodeState::Pending,
                true,
                Some(NFT),
                None,
                "",
            ),
            (
                "an unknown outcome is not a failure",
                Some(answered(IPT, tok, IPT, "Exploded")),
                NodeState::Switching,
                false,
                Some(NFT),
                Some(tok),
                "",
            ),
            (
                "policy rollback under way",
                Some(NodeProxyInput {
                    spec: released(IPT, "pool-g1-rollback-iptables"),
                    ..np(NFT, BOTH)
                }),
                NodeState::RollingBack,
                false,
                Some(NFT),
                None,
                "",
            ),
            (
                "policy rollback done",
                Some(NodeProxyInput {
                    spec: released(IPT, "pool-g1-rollback-iptables"),
                    ..np(IPT, BOTH)
                }),
                NodeState::RolledBack,
                true,
                Some(NFT),
                None,
                "",
            ),
        ];
        let p = policy_input("pool", NFT, 1);
        let node = node_input("n1");
        for (name, np, state, available, target, token, reason) in cases {
            let v = classify(&p, &node, np.as_ref());
            assert_eq!(
                (v.state, v.available, v.target, v.token.as_deref()),
                (state, available, target, token),
                "{name}"
            );
            let why = v.reason.clone().unwrap_or_default();
            assert!(why.contains(reason), "{name}: reason {why:?}");
        }
    }

    #[test]
    fn settings_switch_table() {
        let p = with_proxy(
            policy_input("pool", NFT, 2),
            serde_json::json!({"masqueradeAll": true}),
        );
        let node = node_input("n1");
        let new_settings = |mut np: NodeProxyInput| {
            np.spec.proxy = p.spec.proxy.clone();
            np
        };
        let settings_tok = "pool-g2-settings-nftables";
        // (case, NodeProxy, state, available, settings generation)
        let cases: Vec<(&str, NodeProxyInput, NodeState, bool, Option<i64>)> = vec![
            (
                "runs the mode with other settings: pending",
                answered(NFT, "pool-g1-nftables", IPT, "Succeeded"),
                NodeState::Pending,
                true,
                Some(1),
            ),
            (
                "runs the mode and the settings",
                new_settings(answered(NFT, "pool-g1-nftables", IPT, "Succeeded")),
                NodeState::Healthy,
                true,
                Some(2),
            ),
            (
                "settings switch not answered yet",
                new_settings(NodeProxyInput {
                    spec: released(NFT, settings_tok),
                    ..np(NFT, BOTH)
                }),
                NodeState::Switching,
                false,
                None,
            ),
            (
                "settings switch answered",
                new_settings(answered(NFT, settings_tok, NFT, "Succeeded")),
                NodeState::Healthy,
                true,
                Some(2),
            ),
            (
                "settings switch rolled back",
                new_settings(answered(NFT, settings_tok, NFT, "RolledBack")),
                NodeState::Failed,
                true,
                None,
            ),
            (
                "its ask withdrawn after that: still pending (the agent kept the old settings)",
                {
                    let mut np = new_settings(answered(NFT, "pool-g1-settings-nftables", NFT, "RolledBack"));
                    np.spec.desired_mode = None;
                    np
                },
                NodeState::Pending,
                true,
                Some(1),
            ),
            (
                "settings switch rolled back under an older generation: pending again",
                new_settings(answered(NFT, "pool-g1-settings-nftables", NFT, "RolledBack")),
                NodeState::Pending,
                true,
                Some(1),
            ),
        ];
        for (name, np, state, available, generation) in cases {
            let v = classify(&p, &node, Some(&np));
            assert_eq!(
                (v.state, v.available, v.settings_generation),
                (state, available, generation),
                "{name}"
            );
        }
    }

    #[test]
    fn switched_here_and_rollback_target() {
        let p = policy_input("pool", NFT, 1);
        let node = node_input("n1");
        let np = answered(NFT, "pool-g1-nftables", IPT, "Succeeded");
        let v = classify(&p, &node, Some(&np));
        assert!(v.switched_here);
        assert_eq!(v.rollback_to, Some(IPT));
        // A token of another policy is not ours: the node is merely healthy.
        let other = answered(NFT, "other-g1-nftables", IPT, "Succeeded");
        let v = classify(&p, &node, Some(&other));
        assert_eq!(
            (v.state, v.switched_here, v.token),
            (NodeState::Healthy, false, None)
        );
    }

    #[test]
    fn views_are_sorted_by_name() {
        let p = policy_input("pool", NFT, 1);
        let (b, a) = (node_input("b"), node_input("a"));
        let views = classify_nodes(&p, &[&b, &a], &HashMap::new());
        let names: Vec<&str> = views.iter().map(|v| v.node.name.as_str()).collect();
        assert_eq!(names, ["a", "b"]);
    }
}
