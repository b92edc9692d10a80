//! Stage 5, writes: the NodeProxy spec of every governed node that differs from its current one.
//! A node keeps its release (and token) while it is valid, is released when admitted, sent back
//! with a rollback token when the rollback returns it, and otherwise is held: it names the policy
//! and keeps the settings it runs. The policy's `spec.proxy` reaches a node only with a token, in
//! its wave: with the mode switch, or as a settings switch of a node that runs the mode already.

use switchyard_crds::v1alpha1::{NodeProxySpec, PolicyReference, ProxyMode};

use super::{
    Budget, Gates, NodeState, NodeWrite, PolicyInput, View, rollback_token, settings_token, switch_token,
};

/// The NodeProxy specs to apply, in view order.
pub(crate) fn writes(p: &PolicyInput, views: &[View<'_>], budget: &Budget, gates: &Gates) -> Vec<NodeWrite> {
    let reference = PolicyReference {
        name: p.name.clone(),
        uid: Some(p.uid.clone()),
        generation: Some(p.generation),
    };
    views
        .iter()
        .enumerate()
        .filter_map(|(i, v)| {
            let spec = desired_spec(p, &reference, v, budget.roll_back[i], gates.admit[i])?;
            if v.np.is_some_and(|np| np.spec == spec) {
                return None;
            }
            Some(NodeWrite {
                node: v.node.name.clone(),
                node_uid: v.node.uid.clone(),
                spec,
            })
        })
        .collect()
}

/// The spec node `v` should have; `None`: leave its NodeProxy as it is.
fn desired_spec(
    p: &PolicyInput,
    reference: &PolicyReference,
    v: &View<'_>,
    roll_back: bool,
    admit: bool,
) -> Option<NodeProxySpec> {
    let g = p.generation;
    let release = |mode: ProxyMode, token: String| NodeProxySpec {
        desired_mode: Some(mode),
        proxy: p.spec.proxy.clone(),
        health_gate: Some(p.spec.health_gate.clone()),
        policy: Some(reference.clone()),
        rollout_token: Some(token),
    };
    Some(match (v.state, v.target) {
        (_, Some(_)) if roll_back => {
            let back = v.rollback_to?;
            release(back, rollback_token(&p.name, g, back))
        }
        (NodeState::RollingBack | NodeState::RolledBack, _) => NodeProxySpec {
            policy: Some(reference.clone()),
            ..v.np?.spec.clone()
        },
        // Failed under this generation: its release stays, the policy's budget counts it.
        (NodeState::Failed, Some(t)) => {
            release(t, v.token.clone().unwrap_or_else(|| switch_token(&p.name, g, t)))
        }
        // Other settings than the policy's reach a node only when it is admitted.
        _ if v.settings_pending && !admit => held(p, reference, v),
        (NodeState::Healthy | NodeState::Unhealthy | NodeState::Switching, Some(t)) => {
            release(t, v.token.clone().unwrap_or_else(|| switch_token(&p.name, g, t)))
        }
        (NodeState::Unknown, Some(t)) if v.token.is_some() => release(t, v.token.clone().unwrap_or_default()),
        // Runs the mode already: only the settings switch, behind the health gate.
        (NodeState::Pending, Some(t)) if admit && v.updated => release(t, settings_token(&p.name, g, t)),
        (NodeState::Pending, Some(t)) if admit => release(t, switch_token(&p.name, g, t)),
        _ => held(p, reference, v),
    })
}

/// The spec of a node that waits (for its wave, or for a mode it can run): it keeps what it runs.
/// A spec that asks for the mode it runs, or a release still valid (a switch under way finishes
/// with the settings it started with), stays as it is. Any other ask is withdrawn (without one
/// the agent reports healthy, so the node may be admitted again), its settings kept; a switch that
/// failed keeps its answered token, the mark that its agent put the settings from before back
/// (and keeps them). The reference names the generation whose settings the spec carries: this
/// one when they are the policy's, else the one it had.
fn held(p: &PolicyInput, reference: &PolicyReference, v: &View<'_>) -> NodeProxySpec {
    let Some(np) = v.np else {
        return NodeProxySpec {
            policy: Some(reference.clone()),
            ..Default::default()
        };
    };
    let current = &np.spec;
    let policy = if v.settings_pending {
        let ours = current.policy.clone().filter(|r| r.name == p.name);
        ours.unwrap_or_else(|| PolicyReference {
            generation: None,
            ..reference.clone()
        })
    } else {
        reference.clone()
    };
    let status = np.status.as_ref();
    let refused = current.rollout_token.is_some()
        && status
            .and_then(|s| s.last_switch.as_ref())
            .is_some_and(|l| l.rollout_token == current.rollout_token && l.outcome().is_failure());
    let runs_it =
        current.desired_mode.is_some() && current.desired_mode == status.and_then(|s| s.active_mode);
    if (runs_it && !refused) || v.token.is_some() {
        return NodeProxySpec {
            policy: Some(policy),
            ..current.clone()
        };
    }
    NodeProxySpec {
        policy: Some(policy),
        proxy: current.proxy.clone(),
        rollout_token: current.rollout_token.clone().filter(|_| refused),
        ..Default::default()
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::{
        super::{classify::classify, fixtures::*},
        *,
    };

    /// (case, NodeProxy, roll back, admit, expected: desired mode, token; None: no write)
    type Case = (
        &'static str,
        Option<NodeProxyInput>,
        bool,
        bool,
        Option<(Option<ProxyMode>, Option<&'static str>)>,
    );

    /// A node that runs the mode with other settings than the policy's keeps its spec until
    /// admitted, then gets the settings with a settings token; a held node keeps its settings.
    #[test]
    fn settings_writes_table() {
        let p = with_proxy(
            policy_input("pool", NFT, 2),
            serde_json::json!({"masqueradeAll": true}),
        );
        let old = Some(serde_json::from_value(serde_json::json!({"masqueradeAll": false})).unwrap());
        let on_old = |mut np: NodeProxyInput| {
            np.spec.proxy.clone_from(&old);
            np
        };
        let new_settings = |mut np: NodeProxyInput| {
            np.spec.proxy.clone_from(&p.spec.proxy);
            np
        };
        // (case, NodeProxy, admit, expected: None = no write, else (mode, token, settings are new))
        type SettingsCase = (
            &'static str,
            NodeProxyInput,
            bool,
            Option<(Option<ProxyMode>, Option<&'static str>, bool)>,
        );
        let cases: Vec<SettingsCase> = vec![
            (
                "waits for its wave: keeps its whole spec",
                on_old(answered(NFT, "pool-g1-nftables", IPT, "Succeeded")),
                false,
                None,
            ),
            (
                "admitted: the settings with a settings token, same mode",
                on_old(answered(NFT, "pool-g1-nftables", IPT, "Succeeded")),
                true,
                Some((Some(NFT), Some("pool-g2-settings-nftables"), true)),
            ),
            (
                "to switch its mode, held: keeps its settings",
                on_old(np(IPT, BOTH)),
                false,
                Some((None, None, false)),
            ),
            (
                "to switch its mode, admitted: mode and settings in one switch",
                on_old(np(IPT, BOTH)),
                true,
                Some((Some(NFT), Some("pool-g2-nftables"), true)),
            ),
            (
                "a settings switch failed under an older generation, held: the ask withdrawn, the mark kept",
                new_settings(answered(NFT, "pool-g1-settings-nftables", NFT, "RolledBack")),
                false,
                Some((None, Some("pool-g1-settings-nftables"), true)),
            ),
            (
                "and admitted: a new settings switch",
                new_settings(answered(NFT, "pool-g1-settings-nftables", NFT, "RolledBack")),
                true,
                Some((Some(NFT), Some("pool-g2-settings-nftables"), true)),
            ),
            (
                "a mode switch failed under an older generation, held: the ask withdrawn (its agent reports healthy again)",
                new_settings(answered(IPT, "pool-g1-nftables", IPT, "RolledBack")),
                false,
                Some((None, Some("pool-g1-nftables"), true)),
            ),
            (
                "switching its mode under older settings: keeps them until answered",
                on_old(NodeProxyInput {
                    spec: released(NFT, "pool-g1-nftables"),
                    ..np(IPT, BOTH)
                }),
                false,
                None,
            ),
        ];
        let node = node_input("n1");
        for (name, np, admit, want) in cases {
            let v = classify(&p, &node, Some(&np));
            let g = Gates {
                admit: vec![admit],
                ..gates_none()
            };
            let b = Budget {
                roll_back: vec![false],
                ..budget_none()
            };
            let written = writes(&p, &[v], &b, &g);
            let got = written.first().map(|w| {
                (
                    w.spec.desired_mode,
                    w.spec.rollout_token.as_deref(),
                    w.spec.proxy == p.spec.proxy,
                )
            });
            assert_eq!(got, want, "{name}");
            if let Some(w) = written.first().filter(|_| !admit) {
                assert_eq!(
                    w.spec.proxy, np.spec.proxy,
                    "{name}: a held node keeps its settings"
                );
            }
        }
    }

    #[test]
    fn writes_table() {
        let tok = "pool-g1-nftables";
        let p = policy_input("pool", NFT, 1);
        let cases: Vec<Case> = vec![
            (
                "pending, held: names the policy",
                Some(np(IPT, BOTH)),
                false,
                false,
                Some((None, None)),
            ),
            (
                "pending, admitted: released",
                Some(np(IPT, BOTH)),
                false,
                true,
                Some((Some(NFT), Some(tok))),
            ),
            (
                "no NodeProxy yet: created holding",
                None,
                false,
                false,
                Some((None, None)),
            ),
            (
                "released, no report: keeps its token",
                Some(np_spec(released(NFT, tok))),
                false,
                false,
                None,
            ),
            (
                "switched: spec unchanged, no write",
                Some(answered(NFT, tok, IPT, "Succeeded")),
                false,
                false,
                None,
            ),
            (
                "rolled back by the policy",
                Some(answered(NFT, tok, IPT, "Succeeded")),
                true,
                false,
                Some((Some(IPT), Some("pool-g1-rollback-iptables"))),
            ),
            (
                "already runs the mode: released with a fresh token",
                Some(np(NFT, BOTH)),
                false,
                false,
                Some((Some(NFT), Some(tok))),
            ),
            (
                "incompatible: names the policy",
                Some(np(IPT, &[IPT])),
                false,
                false,
                Some((None, None)),
            ),
        ];
        for (name, np, roll_back, admit, want) in cases {
            let node = node_input("n1");
            let v = classify(&p, &node, np.as_ref());
            let b = Budget {
                roll_back: vec![roll_back],
                ..budget_none()
            };
            let g = Gates {
                admit: vec![admit],
                ..gates_none()
            };
            let got = writes(&p, &[v], &b, &g);
            let got = got.first().map(|w| {
                assert_eq!(
                    w.spec.policy.as_ref().map(|r| r.name.as_str()),
                    Some("pool"),
                    "{name}"
                );
                (w.spec.desired_mode, w.spec.rollout_token.as_deref())
            });
            assert_eq!(got, want, "{name}");
        }
    }
}
