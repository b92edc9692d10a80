//! Migration preflight, judged per node before its switch: the differences kube-proxy documents
//! between iptables and nftables mode (NodePorts on `127.0.0.1`, the conntrack-invalid drop vs
//! `tcpBeLiberal`, NodePort addresses defaulting to `primary`, no NodePort firewall accept rules),
//! kernel 5.13 for nftables, and IPVS deprecation — decided from the facts the node's agent
//! measured (`status.preflightFacts`) against the mode and `spec.proxy` the policy asks for.
//!
//! A **blocking** finding holds the node before its switch (it is not admitted to its wave) until
//! the facts or the policy no longer produce it, or `spec.rollout.preflight.accept` names it; a
//! **warning** never holds. The policy's `PreflightPassed` condition names the held nodes and
//! what to change; `kubectl switchyard plan` lists every node's findings. Pure: table-tested.

use jiff::Timestamp;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use switchyard_crds::v1alpha1::{PreflightFacts, ProxyMode, ProxySettings, preflight_findings as names};

/// Condition type on the ProxyPolicy: False while a blocking finding holds a node.
pub const PREFLIGHT_PASSED: &str = "PreflightPassed";
/// nftables mode's minimum kernel release.
pub const NFTABLES_MIN_KERNEL: (u32, u32) = (5, 13);
/// Held nodes named in the condition before "and N more".
const MAX_HELD: usize = 10;

/// One finding of the preflight on one node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Finding {
    /// Its name ([`names`]), as `spec.rollout.preflight.accept` lists it.
    pub name: &'static str,
    /// Holds the node unless accepted.
    pub blocking: bool,
    /// Named in `spec.rollout.preflight.accept`.
    pub accepted: bool,
    /// What was measured and what to change.
    pub message: String,
}

impl Finding {
    /// Holds the node's switch: blocking and not accepted.
    pub fn holds(&self) -> bool {
        self.blocking && !self.accepted
    }

    /// `blocking`, `accepted` or `warning`.
    pub fn severity(&self) -> &'static str {
        match (self.blocking, self.accepted) {
            (true, false) => "blocking",
            (true, true) => "accepted",
            (false, _) => "warning",
        }
    }
}

/// Parses the `major.minor` of a kernel release such as `6.18.44-fc-v973`.
pub fn kernel_version(release: &str) -> Option<(u32, u32)> {
    let mut parts = release.split(|c: char| !c.is_ascii_digit());
    let major = parts.next()?.parse().ok()?;
    let minor = parts.next()?.parse().ok()?;
    Some((major, minor))
}

/// The findings for a node that runs `active` (its agent measured `facts`) and is to run `target`
/// with `settings`; `accept` lists the policy's accepted names. No switch (`active == target`),
/// or no facts: none.
pub fn judge(
    active: Option<ProxyMode>,
    target: ProxyMode,
    settings: Option<&ProxySettings>,
    facts: Option<&PreflightFacts>,
    accept: &[String],
) -> Vec<Finding> {
    let (Some(active), Some(facts)) = (active, facts) else {
        return Vec::new();
    };
    if active == target {
        return Vec::new();
    }
    let mut out = match target {
        ProxyMode::Nftables => to_nftables(active, settings, facts),
        ProxyMode::Ipvs => vec![(
            names::IPVS_DEPRECATED,
            false,
            "IPVS mode is deprecated upstream since Kubernetes v1.35 (off by default from v1.40, removed in \
             v1.43): prefer nftables, or iptables on kernels older than 5.13"
                .to_owned(),
        )],
        ProxyMode::Iptables | ProxyMode::External => Vec::new(),
    };
    out.sort_by_key(|(name, ..)| names::ALL.iter().position(|n| n == name));
    out.into_iter()
        .map(|(name, blocking, message)| Finding {
            name,
            blocking,
            accepted: accept.iter().any(|a| a == name),
            message,
        })
        .collect()
}

/// The differences of nftables mode, from the facts measured in `active`.
fn to_nftables(
    active: ProxyMode,
    settings: Option<&ProxySettings>,
    facts: &PreflightFacts,
) -> Vec<(&'static str, bool, String)> {
    let mut out = Vec::new();
    let localhost_on = settings.and_then(|s| s.localhost_node_ports) == Some(true);
    if let Some(n) = facts.localhost_node_ports_accepted_packets.filter(|n| *n > 0)
        && !localhost_on
    {
        out.push((
            names::LOCALHOST_NODE_PORTS,
            true,
            format!(
                "{n} packets reached NodePorts on 127.0.0.1 in {active} mode \
                 (kubeproxy_iptables_localhost_nodeports_accepted_packets_total); nftables mode does not serve \
                 127.0.0.1:<NodePort>: point those clients at the node's address, or set \
                 spec.proxy.localhostNodePorts: true"
            ),
        ));
    }
    let liberal_wanted = settings
        .and_then(|s| s.conntrack.as_ref())
        .and_then(|c| c.tcp_be_liberal)
        == Some(true);
    if let Some(n) = facts.ct_state_invalid_dropped_packets.filter(|n| *n > 0)
        && !liberal_wanted
        && facts.tcp_be_liberal != Some(true)
    {
        out.push((
            names::CONNTRACK_INVALID_DROPS,
            true,
            format!(
                "{n} conntrack-invalid packets dropped in {active} mode \
                 (kubeproxy_iptables_ct_state_invalid_dropped_packets_total) and nf_conntrack_tcp_be_liberal is 0; \
                 nftables mode does not drop them (out-of-window packets then reset connections): set \
                 spec.proxy.conntrack.tcpBeLiberal: true, or net.netfilter.nf_conntrack_tcp_be_liberal=1 on the node"
            ),
        ));
    }
    if let Some(version) = kernel_version(&facts.kernel_version).filter(|v| *v < NFTABLES_MIN_KERNEL) {
        out.push((
            names::KERNEL_TOO_OLD,
            true,
            format!(
                "kernel {} ({}.{}) is older than 5.13, which nftables mode needs: upgrade the kernel, or keep \
                 the node on iptables (spec.fallback: iptables), not IPVS",
                facts.kernel_version, version.0, version.1
            ),
        ));
    }
    let addresses_set = settings.is_some_and(|s| !s.node_port_addresses.is_empty());
    if !addresses_set
        && facts.node_port_addresses.iter().any(|a| a == "all")
        && !facts.other_addresses.is_empty()
    {
        out.push((
            names::NODE_PORT_ADDRESSES,
            false,
            format!(
                "NodePorts answer on every local address now; nftables mode serves them on the primary \
                 addresses ({}) only, so they stop answering on {}: set spec.proxy.nodePortAddresses (e.g. \
                 [\"0.0.0.0/0\"]) to keep them",
                facts.primary_addresses.join(", "),
                facts.other_addresses.join(", ")
            ),
        ));
    }
    out.push((
        names::NODE_PORT_FIREWALL,
        false,
        "nftables mode adds no firewall accept rules for NodePorts: a host firewall on the node must accept \
         the NodePort range (30000-32767) itself"
            .to_owned(),
    ));
    out
}

/// The policy's `PreflightPassed` condition over `(node, findings)` of its pending nodes; its
/// transition time stays while its status does (from `previous`).
pub fn condition<'a>(
    nodes: impl Iterator<Item = (&'a str, &'a [Finding])>,
    previous: &[Condition],
    generation: i64,
    now: Timestamp,
) -> Condition {
    let held: Vec<String> = nodes
        .filter_map(|(node, findings)| {
            let why: Vec<String> = findings
                .iter()
                .filter(|f| f.holds())
                .map(|f| format!("{}: {}", f.name, f.message))
                .collect();
            (!why.is_empty()).then(|| format!("{node}: {}", why.join("; ")))
        })
        .collect();
    let (status, reason, message) = if held.is_empty() {
        (
            "True",
            "NoBlockingFindings",
            "no node is held by a preflight finding".to_owned(),
        )
    } else {
        let mut message = format!(
            "{} node(s) held before their switch (fix, or list the finding in spec.rollout.preflight.accept): {}",
            held.len(),
            held.iter()
                .take(MAX_HELD)
                .cloned()
                .collect::<Vec<_>>()
                .join(" | ")
        );
        if held.len() > MAX_HELD {
            message.push_str(&format!(" | and {} more", held.len() - MAX_HELD));
        }
        ("False", "BlockingFindings", message)
    };
    let last = previous
        .iter()
        .find(|c| c.type_ == PREFLIGHT_PASSED && c.status == status)
        .map(|c| c.last_transition_time.clone())
        .unwrap_or(Time(now));
    Condition {
        type_: PREFLIGHT_PASSED.into(),
        status: status.into(),
        reason: reason.into(),
        message,
        observed_generation: Some(generation),
        last_transition_time: last,
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    const IPT: ProxyMode = ProxyMode::Iptables;
    const NFT: ProxyMode = ProxyMode::Nftables;

    fn facts(localhost: i64, invalid: i64, liberal: bool) -> PreflightFacts {
        PreflightFacts {
            mode: Some(IPT),
            kernel_version: "6.18.44".into(),
            localhost_node_ports_accepted_packets: Some(localhost),
            ct_state_invalid_dropped_packets: Some(invalid),
            tcp_be_liberal: Some(liberal),
            node_port_addresses: vec!["all".into()],
            localhost_node_ports: true,
            primary_addresses: vec!["10.0.0.1".into()],
            other_addresses: Vec::new(),
            measured_at: None,
        }
    }

    fn settings(v: serde_json::Value) -> ProxySettings {
        serde_json::from_value(v).unwrap()
    }

    /// (case, active, target, settings, facts, accept, expected "name:severity" list)
    type Case = (
        &'static str,
        ProxyMode,
        ProxyMode,
        serde_json::Value,
        PreflightFacts,
        &'static [&'static str],
        &'static [&'static str],
    );

    #[test]
    fn judge_table() {
        let none = serde_json::json!({});
        let cases: Vec<Case> = vec![
            (
                "clean iptables node",
                IPT,
                NFT,
                none.clone(),
                facts(0, 0, false),
                &[],
                &["NodePortFirewall:warning"],
            ),
            (
                "localhost clients",
                IPT,
                NFT,
                none.clone(),
                facts(12, 0, false),
                &[],
                &["LocalhostNodePorts:blocking", "NodePortFirewall:warning"],
            ),
            (
                "localhost clients, accepted",
                IPT,
                NFT,
                none.clone(),
                facts(12, 0, false),
                &["LocalhostNodePorts"],
                &["LocalhostNodePorts:accepted", "NodePortFirewall:warning"],
            ),
            (
                "localhost clients, nftables serves them",
                IPT,
                NFT,
                serde_json::json!({"localhostNodePorts": true}),
                facts(12, 0, false),
                &[],
                &["NodePortFirewall:warning"],
            ),
            (
                "invalid drops",
                IPT,
                NFT,
                none.clone(),
                facts(0, 3, false),
                &[],
                &["ConntrackInvalidDrops:blocking", "NodePortFirewall:warning"],
            ),
            (
                "invalid drops, node already liberal",
                IPT,
                NFT,
                none.clone(),
                facts(0, 3, true),
                &[],
                &["NodePortFirewall:warning"],
            ),
            (
                "invalid drops, policy sets tcpBeLiberal",
                IPT,
                NFT,
                serde_json::json!({"conntrack": {"tcpBeLiberal": true}}),
                facts(0, 3, false),
                &[],
                &["NodePortFirewall:warning"],
            ),
            (
                "old kernel",
                IPT,
                NFT,
                none.clone(),
                PreflightFacts {
                    kernel_version: "5.10.0-21-amd64".into(),
                    ..facts(0, 0, false)
                },
                &[],
                &["KernelTooOld:blocking", "NodePortFirewall:warning"],
            ),
            (
                "more addresses than the primary one",
                IPT,
                NFT,
                none.clone(),
                PreflightFacts {
                    other_addresses: vec!["192.168.7.2".into()],
                    ..facts(0, 0, false)
                },
                &[],
                &["NodePortAddresses:warning", "NodePortFirewall:warning"],
            ),
            (
                "more addresses, policy lists nodePortAddresses",
                IPT,
                NFT,
                serde_json::json!({"nodePortAddresses": ["0.0.0.0/0"]}),
                PreflightFacts {
                    other_addresses: vec!["192.168.7.2".into()],
                    ..facts(0, 0, false)
                },
                &[],
                &["NodePortFirewall:warning"],
            ),
            (
                "everything at once, sorted by name order",
                IPT,
                NFT,
                none.clone(),
                PreflightFacts {
                    kernel_version: "4.19".into(),
                    ..facts(1, 1, false)
                },
                &["ConntrackInvalidDrops"],
                &[
                    "LocalhostNodePorts:blocking",
                    "ConntrackInvalidDrops:accepted",
                    "KernelTooOld:blocking",
                    "NodePortFirewall:warning",
                ],
            ),
            (
                "already on the target: nothing",
                NFT,
                NFT,
                none.clone(),
                facts(5, 5, false),
                &[],
                &[],
            ),
            (
                "to IPVS: deprecated",
                IPT,
                ProxyMode::Ipvs,
                none.clone(),
                facts(5, 5, false),
                &[],
                &["IPVSDeprecated:warning"],
            ),
            (
                "to iptables: nothing",
                NFT,
                IPT,
                none.clone(),
                facts(0, 0, false),
                &[],
                &[],
            ),
        ];
        for (name, active, target, s, f, accept, want) in cases {
            let s = settings(s);
            let accept: Vec<String> = accept.iter().map(|a| (*a).to_owned()).collect();
            let got: Vec<String> = judge(Some(active), target, Some(&s), Some(&f), &accept)
                .iter()
                .map(|f| format!("{}:{}", f.name, f.severity()))
                .collect();
            assert_eq!(got, want, "{name}");
        }
    }

    #[test]
    fn no_facts_no_findings() {
        assert!(judge(Some(IPT), NFT, None, None, &[]).is_empty());
        assert!(judge(None, NFT, None, Some(&facts(1, 1, false)), &[]).is_empty());
    }

    #[test]
    fn messages_say_what_to_change() {
        let f = judge(Some(IPT), NFT, None, Some(&facts(7, 9, false)), &[]);
        assert!(f[0].message.contains("7 packets") && f[0].message.contains("localhostNodePorts: true"));
        assert!(f[1].message.contains("9 conntrack-invalid") && f[1].message.contains("tcpBeLiberal: true"));
    }

    /// The whole planner: two pending nodes, one with localhost clients, one with invalid drops,
    /// one clean; the held ones are not released and the condition names them, until the
    /// finding is accepted (a) or the node's facts change (b).
    #[test]
    fn blocking_findings_hold_nodes_until_accepted_or_fixed() {
        use switchyard_crds::v1alpha1::{Capabilities, NodeProxyStatus, ProxyPolicySpec, SwitchPhase};

        use crate::{NodeInput, NodeProxyInput, PolicyInput, plan};
        let t0: Timestamp = "2025-01-06T12:00:00Z".parse().unwrap();
        let policy = |accept: &[&str]| {
            let spec: ProxyPolicySpec = serde_json::from_value(serde_json::json!({
                "nodeSelector": {}, "mode": "nftables",
                "rollout": {"maxUnavailable": 3, "preflight": {"accept": accept}},
            }))
            .unwrap();
            PolicyInput {
                name: "pool".into(),
                uid: "uid-pool".into(),
                generation: 1,
                spec,
                approvals: Default::default(),
                rollback: None,
                annotations: Vec::new(),
                status: None,
            }
        };
        let nodes: Vec<NodeInput> = ["a", "b", "c"]
            .iter()
            .map(|n| NodeInput {
                name: (*n).into(),
                uid: format!("uid-{n}"),
                labels: Default::default(),
            })
            .collect();
        let proxy = |name: &str, f: PreflightFacts| NodeProxyInput {
            name: name.into(),
            spec: Default::default(),
            status: Some(NodeProxyStatus {
                capabilities: Some(Capabilities {
                    supported_modes: vec![IPT, NFT],
                    ..Default::default()
                }),
                active_mode: Some(IPT),
                phase: Some(SwitchPhase::Active),
                preflight_facts: Some(f),
                ..Default::default()
            }),
        };
        let released = |p: &crate::Plan| -> Vec<String> {
            let mut n: Vec<String> = p.policies[0]
                .writes
                .iter()
                .filter(|w| w.spec.desired_mode == Some(NFT))
                .map(|w| w.node.clone())
                .collect();
            n.sort();
            n
        };
        let held_facts = [facts(4, 0, false), facts(0, 2, false), facts(0, 0, false)];
        let proxies: Vec<NodeProxyInput> = ["a", "b", "c"]
            .iter()
            .zip(held_facts.clone())
            .map(|(n, f)| proxy(n, f))
            .collect();

        let held = plan(&[policy(&[])], &nodes, &proxies, t0);
        assert_eq!(released(&held), ["c"]);
        let pp = &held.policies[0];
        let c = pp
            .status
            .conditions
            .iter()
            .find(|c| c.type_ == PREFLIGHT_PASSED)
            .unwrap();
        assert_eq!(c.status, "False");
        assert!(c.message.contains("2 node(s) held"), "{}", c.message);
        assert!(
            c.message.contains("a: LocalhostNodePorts") && c.message.contains("b: ConntrackInvalidDrops")
        );
        let a = pp.nodes.iter().find(|n| n.name == "a").unwrap();
        assert!(a.preflight.iter().any(Finding::holds));

        // Accepting a's finding releases a; b stays held.
        let accepted = plan(&[policy(&["LocalhostNodePorts"])], &nodes, &proxies, t0);
        assert_eq!(released(&accepted), ["a", "c"]);
        // b's facts change (the node now runs tcp_be_liberal=1): released too.
        let mut fixed = proxies.clone();
        fixed[1] = proxy("b", facts(0, 2, true));
        let all = plan(&[policy(&["LocalhostNodePorts"])], &nodes, &fixed, t0);
        assert_eq!(released(&all), ["a", "b", "c"]);
        let c = all.policies[0]
            .status
            .conditions
            .iter()
            .find(|c| c.type_ == PREFLIGHT_PASSED)
            .unwrap();
        assert_eq!(c.status, "True");
    }

    #[test]
    fn kernel_versions_parse() {
        let cases = [
            ("6.18.44-fc-v973", Some((6, 18))),
            ("5.13.0", Some((5, 13))),
            ("5.4", Some((5, 4))),
            ("garbage", None),
            ("", None),
        ];
        for (release, want) in cases {
            assert_eq!(kernel_version(release), want, "{release}");
        }
        // An inverted comparison once shipped in kube-proxy: 5.4 is older than 5.13.
        assert!(kernel_version("5.4").unwrap() < NFTABLES_MIN_KERNEL);
        assert!(kernel_version("5.13").unwrap() >= NFTABLES_MIN_KERNEL);
    }

    #[test]
    fn condition_names_held_nodes_and_keeps_its_transition_time() {
        let t0: Timestamp = "2025-01-06T12:00:00Z".parse().unwrap();
        let t1: Timestamp = "2025-01-06T12:05:00Z".parse().unwrap();
        let held = judge(Some(IPT), NFT, None, Some(&facts(3, 0, false)), &[]);
        let clean = judge(Some(IPT), NFT, None, Some(&facts(0, 0, false)), &[]);
        let nodes = [("a", held.as_slice()), ("b", clean.as_slice())];
        let c = condition(nodes.iter().copied(), &[], 2, t0);
        assert_eq!(
            (c.status.as_str(), c.reason.as_str()),
            ("False", "BlockingFindings")
        );
        assert!(
            c.message.contains("1 node(s) held") && c.message.contains("a: LocalhostNodePorts: 3 packets")
        );
        assert!(!c.message.contains("b:"));
        let again = condition(nodes.iter().copied(), std::slice::from_ref(&c), 2, t1);
        assert_eq!(again.last_transition_time, Time(t0));
        let passed = condition([("b", clean.as_slice())].into_iter(), &[c], 3, t1);
        assert_eq!(
            (passed.status.as_str(), passed.last_transition_time),
            ("True", Time(t1))
        );
    }
}
