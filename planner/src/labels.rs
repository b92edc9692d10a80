//! The Node label that steers another service proxy's DaemonSet ([`SERVICE_PROXY_LABEL`]): which
//! nodes should carry it. Pure.
//!
//! A node carries `switchyard.dev/service-proxy=external` while its NodeProxy asks for mode
//! `external` or its agent still reports `external` active. So the label appears with the request
//! (the other proxy starts before the agent bypasses its rules: make before break) and goes only
//! once the agent reports one of Switchyard's modes active again (the other proxy stops after
//! Switchyard serves).

use std::collections::HashMap;

use switchyard_crds::consts::{SERVICE_PROXY_EXTERNAL, SERVICE_PROXY_LABEL};

use crate::{NodeInput, NodeProxyInput};

/// One Node whose label must change.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LabelChange {
    /// Node name.
    pub node: String,
    /// `true`: set the label to `external`; `false`: remove it.
    pub external: bool,
}

/// Whether a node with this NodeProxy should carry the label.
pub fn wants_external_label(np: &NodeProxyInput) -> bool {
    let desired = np.spec.desired_mode.is_some_and(|m| m.is_external());
    let active = np
        .status
        .as_ref()
        .and_then(|s| s.active_mode)
        .is_some_and(|m| m.is_external());
    desired || active
}

/// The label changes that bring every Node in line with its NodeProxy, sorted by node name. A
/// Node without a NodeProxy keeps its label as it is (nobody asked anything of it). A label with
/// another value is never removed (someone else's), but a node handed to the other proxy gets
/// `external` over it: the other proxy's DaemonSet must select the node.
pub fn label_changes(nodes: &[NodeInput], proxies: &[NodeProxyInput]) -> Vec<LabelChange> {
    let by_name: HashMap<&str, &NodeProxyInput> = proxies.iter().map(|p| (p.name.as_str(), p)).collect();
    let mut changes: Vec<LabelChange> = nodes
        .iter()
        .filter_map(|node| {
            let np = by_name.get(node.name.as_str())?;
            let has = node.labels.get(SERVICE_PROXY_LABEL).map(String::as_str);
            let wants = wants_external_label(np);
            match (wants, has) {
                (true, Some(SERVICE_PROXY_EXTERNAL)) | (false, None) => None,
                (false, Some(other)) if other != SERVICE_PROXY_EXTERNAL => None,
                (external, _) => Some(LabelChange {
                    node: node.name.clone(),
                    external,
                }),
            }
        })
        .collect();
    changes.sort_by(|a, b| a.node.cmp(&b.node));
    changes
}

#[cfg(test)]
mod tests {
    use switchyard_crds::v1alpha1::{NodeProxySpec, NodeProxyStatus, ProxyMode};

    use super::*;

    fn node(name: &str, label: Option<&str>) -> NodeInput {
        NodeInput {
            name: name.into(),
            uid: format!("uid-{name}"),
            labels: label
                .map(|v| (SERVICE_PROXY_LABEL.to_owned(), v.to_owned()))
                .into_iter()
                .collect(),
        }
    }

    fn proxy(name: &str, desired: Option<ProxyMode>, active: Option<ProxyMode>) -> NodeProxyInput {
        NodeProxyInput {
            name: name.into(),
            spec: NodeProxySpec {
                desired_mode: desired,
                ..Default::default()
            },
            status: active.map(|a| NodeProxyStatus {
                active_mode: Some(a),
                ..Default::default()
            }),
        }
    }

    /// (what, label now, desired, active, change)
    type Case = (
        &'static str,
        Option<&'static str>,
        Option<ProxyMode>,
        Option<ProxyMode>,
        Option<bool>,
    );

    #[test]
    fn the_label_follows_the_request_and_leaves_after_the_agent() {
        use ProxyMode::{External as EXT, Iptables as IPT, Nftables as NFT};
        const EXTERNAL: Option<&str> = Some(SERVICE_PROXY_EXTERNAL);
        let cases: Vec<Case> = vec![
            ("ours, unlabelled", None, Some(NFT), Some(NFT), None),
            (
                "asked for external: labelled at once",
                None,
                Some(EXT),
                Some(NFT),
                Some(true),
            ),
            ("external, labelled", EXTERNAL, Some(EXT), Some(EXT), None),
            (
                "handed back to us, agent not there yet: kept",
                EXTERNAL,
                Some(NFT),
                Some(EXT),
                None,
            ),
            (
                "handed back and active: removed",
                EXTERNAL,
                Some(IPT),
                Some(IPT),
                Some(false),
            ),
            (
                "no agent report yet, asked for external",
                None,
                Some(EXT),
                None,
                Some(true),
            ),
            (
                "active external without a wish (spec cleared): labelled",
                None,
                None,
                Some(EXT),
                Some(true),
            ),
            (
                "someone else's value is left alone",
                Some("cilium"),
                Some(NFT),
                Some(NFT),
                None,
            ),
            (
                "someone else's value is overwritten when external is asked",
                Some("cilium"),
                Some(EXT),
                Some(NFT),
                Some(true),
            ),
        ];
        for (what, label, desired, active, change) in cases {
            let got = label_changes(&[node("n1", label)], &[proxy("n1", desired, active)]);
            let want: Vec<LabelChange> = change
                .map(|external| LabelChange {
                    node: "n1".into(),
                    external,
                })
                .into_iter()
                .collect();
            assert_eq!(got, want, "{what}");
        }
    }

    #[test]
    fn nodes_without_a_node_proxy_are_left_alone_and_changes_are_sorted() {
        let nodes = [
            node("c", None),
            node("a", None),
            node("b", Some(SERVICE_PROXY_EXTERNAL)),
        ];
        let proxies = [
            proxy("c", Some(ProxyMode::External), None),
            proxy("a", Some(ProxyMode::External), None),
        ];
        let got = label_changes(&nodes, &proxies);
        let names: Vec<&str> = got.iter().map(|c| c.node.as_str()).collect();
        assert_eq!(names, ["a", "c"], "b has no NodeProxy: its label stays");
    }
}
