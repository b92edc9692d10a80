//! Stage 5, writes: the NodeProxy spec of every governed node that differs from its current one.
//! A node keeps its release (and token) while it is valid, is released when admitted, sent back
//! with a rollback token when the rollback returns it, and otherwise only names the policy.

use switchyard_crds::v1alpha1::{NodeProxySpec, PolicyReference, ProxyMode};

use super::{Budget, Gates, NodeState, NodeWrite, PolicyInput, View, rollback_token, switch_token};

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
        (NodeState::Healthy | NodeState::Unhealthy | NodeState::Switching | NodeState::Failed, Some(t)) => {
            release(t, v.token.clone().unwrap_or_else(|| switch_token(&p.name, g, t)))
        }
        (NodeState::Unknown, Some(t)) if v.token.is_some() => release(t, v.token.clone().unwrap_or_default()),
        (NodeState::Pending, Some(t)) if admit => release(t, switch_token(&p.name, g, t)),
        _ => NodeProxySpec {
            policy: Some(reference.clone()),
            ..Default::default()
        },
    })
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
