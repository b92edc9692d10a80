//! Stage 2, waves: the policy's waves over its compatible nodes ([`crate::waves`] does the
//! assignment), pinned to the previous status when it had the same waves.

use std::collections::HashMap;

use switchyard_crds::v1alpha1::WaveStatus;

use super::{
    super::waves::{self, PoolNode, WaveDef},
    NodeState, PolicyInput, View,
};

/// The waves of one plan.
#[derive(Clone, Debug)]
pub(crate) struct Waves<'p> {
    /// The waves, in rollout order.
    pub defs: Vec<WaveDef>,
    /// Indices into the views of the compatible nodes.
    pub eligible: Vec<usize>,
    /// Per wave, indices into the views, in rollout order.
    pub members: Vec<Vec<usize>>,
    /// Per wave, its previous status, when the previous status had the same waves.
    pub prev: Vec<Option<&'p WaveStatus>>,
}

impl Waves<'_> {
    /// View index → name of its wave.
    pub fn wave_of(&self) -> HashMap<usize, &str> {
        self.members
            .iter()
            .enumerate()
            .flat_map(|(w, m)| m.iter().map(move |&i| (i, self.defs[w].name.as_str())))
            .collect()
    }
}

/// Assigns the compatible nodes of `views` to the policy's waves.
pub(crate) fn assign_waves<'p>(p: &'p PolicyInput, views: &[View<'_>]) -> Waves<'p> {
    let eligible: Vec<usize> = (0..views.len())
        .filter(|&i| views[i].state != NodeState::Incompatible)
        .collect();
    let defs = waves::wave_defs(&p.spec.rollout, eligible.len());
    let prev_waves = p.status.as_ref().map(|s| s.waves.as_slice()).unwrap_or_default();
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
    let members: Vec<Vec<usize>> = waves::assign(&defs, &pool, &pins)
        .into_iter()
        .map(|w| w.into_iter().map(|k| eligible[k]).collect())
        .collect();
    let prev = defs
        .iter()
        .map(|d| {
            same_waves
                .then(|| prev_waves.iter().find(|w| w.name == d.name))
                .flatten()
        })
        .collect();
    Waves {
        defs,
        eligible,
        members,
        prev,
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use serde_json::json;
    use switchyard_crds::v1alpha1::{ProxyPolicyStatus, WaveState};

    use super::{
        super::{classify::classify, fixtures::*},
        *,
    };

    fn names(views: &[View<'_>], idx: &[usize]) -> Vec<String> {
        idx.iter().map(|&i| views[i].node.name.clone()).collect()
    }

    #[test]
    fn incompatible_nodes_get_no_wave() {
        let p = with_waves(
            policy_input("pool", NFT, 1),
            json!([{"name": "canary", "nodes": 1}, {"name": "rest"}]),
        );
        let nodes: Vec<_> = ["a", "b", "c"].into_iter().map(node_input).collect();
        let proxies = [np(IPT, BOTH), np(IPT, &[IPT]), np(IPT, BOTH)];
        let views: Vec<View<'_>> = nodes
            .iter()
            .zip(&proxies)
            .map(|(n, x)| classify(&p, n, Some(x)))
            .collect();
        let w = assign_waves(&p, &views);
        assert_eq!(w.eligible, [0, 2]);
        let sizes: Vec<usize> = w.members.iter().map(Vec::len).collect();
        assert_eq!(sizes, [1, 1]);
        assert!(w.members.iter().flatten().all(|&i| i != 1));
        assert_eq!(w.wave_of().get(&1), None);
        assert_eq!(w.prev, [None, None]);
    }

    #[test]
    fn previous_status_pins_nodes_only_for_the_same_waves() {
        let waves_json = json!([{"name": "canary", "nodes": 1}, {"name": "rest"}]);
        let nodes: Vec<_> = ["a", "b", "c"].into_iter().map(node_input).collect();
        // (previous wave names, expected canary member when the previous status pinned "c" there)
        let cases: Vec<(Vec<&str>, bool)> =
            vec![(vec!["canary", "rest"], true), (vec!["first", "rest"], false)];
        for (prev_names, pinned) in cases {
            let mut p = with_waves(policy_input("pool", NFT, 1), waves_json.clone());
            p.status = Some(ProxyPolicyStatus {
                waves: prev_names
                    .iter()
                    .map(|n| {
                        let pinned: &[&str] = if *n == prev_names[0] { &["a"] } else { &[] };
                        wave_status(n, WaveState::Completed, pinned)
                    })
                    .collect(),
                ..Default::default()
            });
            let views: Vec<View<'_>> = nodes.iter().map(|n| classify(&p, n, None)).collect();
            let w = assign_waves(&p, &views);
            assert_eq!(names(&views, &w.members[0]) == ["a"], pinned, "{prev_names:?}");
            assert_eq!(w.prev.iter().all(Option::is_some), pinned, "{prev_names:?}");
            assert_eq!(w.members.iter().map(Vec::len).sum::<usize>(), 3);
        }
    }
}
