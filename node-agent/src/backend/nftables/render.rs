//! Pure rendering of the service model into the nftables IR.
//!
//! Shape (chosen on measurements): most service ports are pure data. Their destinations
//! (`daddr . l4proto . dport`, or `l4proto . dport` for NodePorts) are keys of endpoint maps,
//! one map per endpoint count N, whose slot `0..N` holds one DNAT target; one static rule per N,
//! `dnat ip to … . numgen random mod N map @ip-endpoints-N`, picks a slot uniformly. Adding a
//! service or changing its endpoints then only adds and deletes map elements, which the kernel
//! commits without re-validating the chain graph (a rule or a `goto` element makes it walk every
//! chain reachable from every base chain: 15–20 ms at 10k service chains).
//!
//! Service ports with ClientIP affinity or with `externalTrafficPolicy: Local` external
//! destinations keep per-service chains dispatched through the `service-ips` and
//! `service-nodeports` verdict maps: a chain per port cascading `numgen random mod (n-j) 0` rules
//! that DNAT inline (exactly uniform), plus per-endpoint chains and timeout sets for affinity.
//! Hairpin traffic is masqueraded through one `hairpin-connections` set.
//!
//! Each family has its own table with the same shape; a [`Snapshot`] holds one family.

use std::{
    borrow::Cow,
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
};

use super::ir::{
    BaseChain, Chain, Element, Expr, Hook, Key, KeyType, Rule, Ruleset, SetDef, Slot, Verdict, loopback,
};
use crate::{
    backend::{Settings, names},
    model::{Endpoint, IpFamily, ServicePort, ServicePortName, Snapshot, categorize},
};

/// Set and map names.
pub mod sets {
    /// Every ClusterIP (reject traffic to undefined ports).
    pub const CLUSTER_IPS: &str = "cluster-ips";
    /// Node addresses that accept NodePorts (when restricted).
    pub const NODEPORT_IPS: &str = "nodeport-ips";
    /// `ip . proto . port : verdict` for ClusterIPs, external and LB IPs.
    pub const SERVICE_IPS: &str = "service-ips";
    /// `proto . port : verdict` for NodePorts.
    pub const SERVICE_NODEPORTS: &str = "service-nodeports";
    /// Destinations without usable endpoints: reject or drop.
    pub const NO_ENDPOINT_SERVICES: &str = "no-endpoint-services";
    /// NodePorts without usable endpoints.
    pub const NO_ENDPOINT_NODEPORTS: &str = "no-endpoint-nodeports";
    /// LB IPs with source ranges.
    pub const FIREWALL_IPS: &str = "firewall-ips";
    /// `endpoint . endpoint` for local endpoints: hairpin traffic to masquerade.
    pub const HAIRPIN: &str = "hairpin-connections";
    /// External and LB IP destinations served from endpoint maps: their traffic is masqueraded.
    pub const MASQUERADE_IPS: &str = "masquerade-ips";
    /// NodePorts served from endpoint maps: their traffic is masqueraded.
    pub const MASQUERADE_NODEPORTS: &str = "masquerade-nodeports";
    /// Endpoint maps of IP destinations, `ip-endpoints-N` for N endpoints.
    pub const IP_ENDPOINTS: &str = "ip-endpoints";
    /// Endpoint maps of NodePorts, `nodeport-endpoints-N` for N endpoints.
    pub const NODEPORT_ENDPOINTS: &str = "nodeport-endpoints";
}

/// Chains holding one DNAT rule per endpoint map in use.
pub mod dnat_chains {
    /// Reads the `ip-endpoints-N` maps.
    pub const IPS: &str = "dnat-ips";
    /// Reads the `nodeport-endpoints-N` maps.
    pub const NODEPORTS: &str = "dnat-nodeports";
}

/// What one service port contributes: its chains, affinity sets and map elements.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Fragment {
    /// Chains owned by the service port.
    pub chains: Vec<Chain>,
    /// Affinity sets owned by the service port.
    pub sets: Vec<SetDef>,
    /// Elements it adds to shared sets and maps: `(set, element)`.
    pub elements: Vec<(&'static str, Element)>,
    /// Endpoints it programs.
    pub endpoints: usize,
}

fn base_chain(name: &str, nat: bool, hook: Hook, priority: i32, rules: Vec<Rule>) -> Chain {
    Chain {
        name: name.into(),
        base: Some(BaseChain { nat, hook, priority }),
        rules,
    }
}

fn chain(name: &str, rules: Vec<Rule>) -> Chain {
    Chain {
        name: name.into(),
        base: None,
        rules,
    }
}

fn jump_new(target: &str) -> Rule {
    Rule::new(vec![
        Expr::CtStateNew,
        Expr::Verdict(Verdict::Jump(target.into())),
    ])
}

/// The fixed part of `family`'s table: sets, maps, base chains and dispatch chains.
pub fn base(settings: &Settings, family: IpFamily) -> Ruleset {
    use sets::*;
    let set = |name: &str, key: KeyType, verdict_map: bool, comment: Option<&str>| SetDef {
        name: name.into(),
        key,
        verdict_map,
        timeout_seconds: None,
        comment: comment.map(str::to_owned),
    };
    let mut sets_defs = vec![
        set(CLUSTER_IPS, KeyType::Addr, false, Some("Active ClusterIPs")),
        set(
            SERVICE_IPS,
            KeyType::AddrProtoPort,
            true,
            Some("ClusterIP, ExternalIP and LoadBalancer IP traffic"),
        ),
        set(
            SERVICE_NODEPORTS,
            KeyType::ProtoPort,
            true,
            Some("NodePort traffic"),
        ),
        set(
            NO_ENDPOINT_SERVICES,
            KeyType::AddrProtoPort,
            true,
            Some("vmap to drop or reject packets to services with no endpoints"),
        ),
        set(
            NO_ENDPOINT_NODEPORTS,
            KeyType::ProtoPort,
            true,
            Some("vmap to drop or reject packets to service nodeports with no endpoints"),
        ),
        set(
            FIREWALL_IPS,
            KeyType::AddrProtoPort,
            true,
            Some("destinations that are subject to LoadBalancerSourceRanges"),
        ),
        set(
            HAIRPIN,
            KeyType::AddrAddr,
            false,
            Some("local endpoints reaching themselves through a service"),
        ),
        set(
            MASQUERADE_IPS,
            KeyType::AddrProtoPort,
            false,
            Some("external and LoadBalancer IP traffic to masquerade"),
        ),
        set(
            MASQUERADE_NODEPORTS,
            KeyType::ProtoPort,
            false,
            Some("NodePort traffic to masquerade"),
        ),
    ];
    let mut elements = std::collections::BTreeMap::new();
    let nodeport_match: Vec<Expr> = match settings.node_port_addresses(family) {
        Some(addrs) => {
            sets_defs.insert(
                1,
                set(
                    NODEPORT_IPS,
                    KeyType::Addr,
                    false,
                    Some("IPs that accept NodePort traffic"),
                ),
            );
            elements.insert(
                NODEPORT_IPS.to_owned(),
                addrs
                    .into_iter()
                    .map(|a| Element {
                        key: Key::Addr(a),
                        verdict: None,
                        dnat: None,
                        comment: None,
                    })
                    .collect(),
            );
            vec![Expr::DaddrInSet(NODEPORT_IPS.into())]
        }
        None => vec![Expr::FibDaddrLocal, Expr::DaddrIn(loopback(family), true)],
    };
    let with = |mut m: Vec<Expr>, e: Expr| {
        m.push(e);
        m
    };
    let mark = settings.masquerade_mark;
    let chains = vec![
        base_chain(
            "filter-prerouting-pre-dnat",
            false,
            Hook::Prerouting,
            -110,
            vec![jump_new("firewall-check")],
        ),
        base_chain(
            "filter-output-pre-dnat",
            false,
            Hook::Output,
            -110,
            vec![jump_new("firewall-check")],
        ),
        base_chain(
            "filter-forward",
            false,
            Hook::Forward,
            0,
            vec![jump_new("service-endpoints-check"), jump_new("cluster-ips-check")],
        ),
        base_chain(
            "filter-input",
            false,
            Hook::Input,
            0,
            vec![
                jump_new("nodeport-endpoints-check"),
                jump_new("service-endpoints-check"),
            ],
        ),
        base_chain(
            "filter-output",
            false,
            Hook::Output,
            0,
            vec![jump_new("service-endpoints-check"), jump_new("cluster-ips-check")],
        ),
        base_chain(
            "nat-prerouting",
            true,
            Hook::Prerouting,
            -100,
            vec![Rule::new(vec![Expr::Verdict(Verdict::Jump("services".into()))])],
        ),
        base_chain(
            "nat-output",
            true,
            Hook::Output,
            -100,
            vec![Rule::new(vec![Expr::Verdict(Verdict::Jump("services".into()))])],
        ),
        base_chain(
            "nat-postrouting",
            true,
            Hook::Postrouting,
            100,
            vec![Rule::new(vec![Expr::Verdict(Verdict::Jump(
                "masquerading".into(),
            ))])],
        ),
        chain(
            "firewall-check",
            vec![Rule::new(vec![Expr::VmapDaddrProtoPort(FIREWALL_IPS.into())])],
        ),
        chain(
            "service-endpoints-check",
            vec![Rule::new(vec![Expr::VmapDaddrProtoPort(
                NO_ENDPOINT_SERVICES.into(),
            )])],
        ),
        chain(
            "nodeport-endpoints-check",
            vec![Rule::new(with(
                nodeport_match.clone(),
                Expr::VmapProtoPort(NO_ENDPOINT_NODEPORTS.into()),
            ))],
        ),
        chain("cluster-ips-check", {
            let mut rules = fast_rejects(family, vec![Expr::DaddrInSet(CLUSTER_IPS.into())]);
            rules.push(
                Rule::new(vec![Expr::DaddrInSet(CLUSTER_IPS.into()), Expr::Reject])
                    .comment("Reject traffic to invalid ports of ClusterIPs"),
            );
            // The rest of the Service CIDRs: unallocated addresses, or Services another proxy
            // handles. Dropped here instead of routed out of the node (kube-proxy's rule; handled
            // ClusterIPs are DNATed before this filter priority, so only those reach it).
            for cidr in settings
                .service_cidrs
                .iter()
                .filter(|c| IpFamily::of_net(c) == family)
            {
                rules.push(
                    Rule::new(vec![
                        Expr::DaddrIn(cidr.trunc(), false),
                        Expr::Verdict(Verdict::Drop),
                    ])
                    .comment("Drop traffic to unallocated ClusterIPs"),
                );
            }
            rules
        }),
        chain("reject-chain", {
            let mut rules = fast_rejects(family, vec![]);
            rules.push(
                Rule::new(vec![Expr::Reject])
                    .comment("helper for @no-endpoint-services / @no-endpoint-nodeports"),
            );
            rules
        }),
        chain("services", {
            // One masquerade rule for every ClusterIP (as kube-proxy 1.36 does) instead of one per
            // service chain: a third fewer rules for the kernel to load and validate.
            let mut rules = Vec::new();
            if settings.masquerade_all {
                rules.push(
                    Rule::new(vec![Expr::DaddrInSet(CLUSTER_IPS.into()), Expr::SetMarkOr(mark)])
                        .comment("masquerade all ClusterIP traffic"),
                );
            } else if let Some(cidr) = settings.cluster_cidr(family) {
                rules.push(
                    Rule::new(vec![
                        Expr::DaddrInSet(CLUSTER_IPS.into()),
                        Expr::SaddrIn(cidr, true),
                        Expr::SetMarkOr(mark),
                    ])
                    .comment("masquerade ClusterIP traffic from outside the cluster"),
                );
            }
            rules.push(Rule::new(vec![Expr::VmapDaddrProtoPort(SERVICE_IPS.into())]));
            rules.push(Rule::new(vec![
                Expr::DaddrProtoPortInSet(MASQUERADE_IPS.into()),
                Expr::SetMarkOr(mark),
            ]));
            rules.push(Rule::new(vec![Expr::Verdict(Verdict::Jump(
                dnat_chains::IPS.into(),
            ))]));
            rules.push(Rule::new(with(
                nodeport_match,
                Expr::Verdict(Verdict::Jump("nodeports".into())),
            )));
            rules
        }),
        chain(
            "nodeports",
            vec![
                Rule::new(vec![Expr::VmapProtoPort(SERVICE_NODEPORTS.into())]),
                Rule::new(vec![
                    Expr::ProtoPortInSet(MASQUERADE_NODEPORTS.into()),
                    Expr::SetMarkOr(mark),
                ]),
                Rule::new(vec![Expr::Verdict(Verdict::Goto(dnat_chains::NODEPORTS.into()))]),
            ],
        ),
        // Filled by `add_dispatch` for the endpoint maps in use.
        chain(dnat_chains::IPS, Vec::new()),
        chain(dnat_chains::NODEPORTS, Vec::new()),
        chain(
            "masquerading",
            vec![
                Rule::new(vec![
                    Expr::CtStatusDnat,
                    Expr::SaddrDaddrInSet(HAIRPIN.into()),
                    Expr::Masquerade,
                ]),
                Rule::new(vec![Expr::MarkUnset(mark), Expr::Verdict(Verdict::Return)]),
                Rule::new(vec![Expr::SetMarkXor(mark)]),
                Rule::new(vec![Expr::Masquerade]),
            ],
        ),
    ];
    Ruleset {
        family,
        sets: sets_defs,
        elements,
        chains,
    }
}

/// The [`crate::backend::fast_reject`] rule of `family`, after `matches`.
fn fast_rejects(family: IpFamily, matches: Vec<Expr>) -> Vec<Rule> {
    let (protocol, reject) = crate::backend::fast_reject(family);
    let reject = match reject {
        crate::backend::FastReject::TcpReset => Expr::RejectTcpReset,
        crate::backend::FastReject::ProtocolUnreachable => Expr::RejectProtocolUnreachable,
    };
    let mut exprs = matches;
    exprs.extend([Expr::L4Proto(protocol), reject]);
    vec![Rule::new(exprs)]
}

/// DNAT cascade over `eps`: endpoint j of n is taken with probability 1/(n-j) given the earlier
/// ones were not, which is exactly uniform.
fn cascade(name: &ServicePortName, eps: &[&Endpoint], affinity: bool) -> Vec<Rule> {
    let n = eps.len();
    let mut rules = Vec::with_capacity(n * 2);
    if affinity {
        for ep in eps {
            rules.push(Rule::new(vec![
                Expr::SaddrInSet(names::nft_endpoint_name("affinity-", name, ep)),
                Expr::Verdict(Verdict::Goto(names::nft_endpoint_name("endpoint-", name, ep))),
            ]));
        }
    }
    for (j, ep) in eps.iter().enumerate() {
        let mut exprs = Vec::with_capacity(4);
        if j + 1 < n {
            exprs.push(Expr::NumgenZero((n - j) as u32));
        }
        if affinity {
            exprs.push(Expr::Verdict(Verdict::Goto(names::nft_endpoint_name(
                "endpoint-",
                name,
                ep,
            ))));
        } else {
            exprs.push(Expr::L4Proto(name.protocol));
            exprs.push(Expr::Dnat(ep.ip, ep.port));
        }
        rules.push(Rule::new(exprs));
    }
    rules
}

/// Endpoint-map elements for `dest`: slot j of n DNATs to `eps[j]`.
fn slots(
    set: &'static str,
    comment: &str,
    eps: &[&Endpoint],
    dest: impl Fn(Slot) -> Key,
) -> Vec<(&'static str, Element)> {
    let count = eps.len() as u32;
    (0..count)
        .zip(eps)
        .map(|(index, ep)| {
            let key = dest(Slot { index, count });
            (
                set,
                Element {
                    key,
                    verdict: None,
                    dnat: Some((ep.ip, ep.port)),
                    comment: Some(comment.to_owned()),
                },
            )
        })
        .collect()
}

/// Everything one service port contributes.
pub fn service(port: &ServicePort, endpoints: &[Endpoint], settings: &Settings) -> Fragment {
    use sets::*;
    let name = &port.name;
    let comment = name.to_string();
    let cat = categorize(endpoints, &settings.node);
    let mut frag = Fragment {
        endpoints: endpoints.len(),
        ..Default::default()
    };
    let element = |key: Key, verdict: Option<Verdict>| Element {
        key,
        verdict,
        dnat: None,
        comment: Some(comment.clone()),
    };
    let plain = |key: Key| Element {
        key,
        verdict: None,
        dnat: None,
        comment: None,
    };
    let proto = name.protocol;
    let svc_chain = names::nft_service_chain("service-", name);
    let local_chain = names::nft_service_chain("local-", name);
    let ext_chain = names::nft_service_chain("external-", name);
    let fw_chain = names::nft_service_chain("firewall-", name);
    let affinity = port.affinity_timeout_seconds.is_some();
    let mark = settings.masquerade_mark;
    // Affinity and externalTrafficPolicy=Local need logic per service: chains. Everything else is
    // served from endpoint maps.
    let chained = affinity || (port.external_policy_local && port.externally_accessible());

    frag.elements
        .push((CLUSTER_IPS, plain(Key::Addr(port.cluster_ip))));

    let has_cluster = !cat.cluster.is_empty();
    let has_local = !cat.local.is_empty();
    let blocked = |usable_somewhere: bool| {
        if usable_somewhere {
            Verdict::Drop
        } else {
            Verdict::Goto("reject-chain".into())
        }
    };

    // Chains.
    if chained && has_cluster {
        frag.chains
            .push(chain(&svc_chain, cascade(name, &cat.cluster, affinity)));
    }
    if chained && (port.internal_policy_local || port.external_policy_local) && has_local {
        frag.chains
            .push(chain(&local_chain, cascade(name, &cat.local, affinity)));
    }
    if affinity {
        let timeout = port.affinity_timeout_seconds;
        let mut eps: Vec<&Endpoint> = cat.cluster.iter().chain(cat.local.iter()).copied().collect();
        eps.sort();
        eps.dedup();
        for ep in eps {
            let set_name = names::nft_endpoint_name("affinity-", name, ep);
            frag.sets.push(SetDef {
                name: set_name.clone(),
                key: KeyType::Addr,
                verdict_map: false,
                timeout_seconds: timeout,
                comment: None,
            });
            frag.chains.push(chain(
                &names::nft_endpoint_name("endpoint-", name, ep),
                vec![Rule::new(vec![
                    Expr::UpdateSaddr(set_name),
                    Expr::L4Proto(proto),
                    Expr::Dnat(ep.ip, ep.port),
                ])],
            ));
        }
    }

    // Hairpin: a local endpoint reaching itself through the service must be masqueraded.
    for ep in cat.cluster.iter().chain(cat.local.iter()) {
        if ep.node_name.as_deref() == Some(settings.node.name.as_str()) {
            frag.elements.push((HAIRPIN, plain(Key::AddrAddr(ep.ip, ep.ip))));
        }
    }

    // ClusterIP.
    let (internal_ok, internal_chain, internal_eps) = if port.internal_policy_local {
        (has_local, &local_chain, &cat.local)
    } else {
        (has_cluster, &svc_chain, &cat.cluster)
    };
    let cluster_key = Key::AddrProtoPort(port.cluster_ip, proto, port.port);
    if !internal_ok {
        frag.elements.push((
            NO_ENDPOINT_SERVICES,
            element(cluster_key, Some(blocked(cat.has_any))),
        ));
    } else if chained {
        frag.elements.push((
            SERVICE_IPS,
            element(cluster_key, Some(Verdict::Goto(internal_chain.clone()))),
        ));
    } else {
        frag.elements
            .extend(slots(IP_ENDPOINTS, &comment, internal_eps, |s| {
                Key::AddrProtoPortSlot(port.cluster_ip, proto, port.port, s)
            }));
    }

    // External destinations: externalIPs, LB IPs, NodePort.
    if !port.externally_accessible() {
        return frag;
    }
    let external_ok = if port.external_policy_local {
        has_local
    } else {
        has_cluster
    };
    let external_ips: Vec<IpAddr> = port
        .external_ips
        .iter()
        .chain(port.load_balancer_ips.iter())
        .copied()
        .collect();
    let external_keys: Vec<Key> = external_ips
        .iter()
        .map(|ip| Key::AddrProtoPort(*ip, proto, port.port))
        .collect();
    if !external_ok {
        for key in external_keys {
            frag.elements
                .push((NO_ENDPOINT_SERVICES, element(key, Some(blocked(cat.has_any)))));
        }
        if let Some(np) = port.node_port {
            frag.elements.push((
                NO_ENDPOINT_NODEPORTS,
                element(Key::ProtoPort(proto, np), Some(blocked(cat.has_any))),
            ));
        }
        return frag;
    }
    if chained {
        let mut ext_rules = Vec::new();
        if port.external_policy_local {
            if let (Some(cidr), true) = (settings.cluster_cidr(port.family()), has_cluster) {
                ext_rules.push(
                    Rule::new(vec![
                        Expr::SaddrIn(cidr, false),
                        Expr::Verdict(Verdict::Goto(svc_chain.clone())),
                    ])
                    .comment("short-circuit pod traffic"),
                );
            }
            if has_cluster {
                ext_rules.push(
                    Rule::new(vec![Expr::FibSaddrLocal, Expr::SetMarkOr(mark)])
                        .comment("masquerade local traffic"),
                );
                ext_rules.push(
                    Rule::new(vec![
                        Expr::FibSaddrLocal,
                        Expr::Verdict(Verdict::Goto(svc_chain.clone())),
                    ])
                    .comment("short-circuit local traffic"),
                );
            }
            ext_rules.push(Rule::new(vec![Expr::Verdict(Verdict::Goto(local_chain.clone()))]));
        } else {
            ext_rules.push(Rule::new(vec![Expr::SetMarkOr(mark)]));
            ext_rules.push(Rule::new(vec![Expr::Verdict(Verdict::Goto(svc_chain.clone()))]));
        }
        frag.chains.push(chain(&ext_chain, ext_rules));
        for key in external_keys {
            frag.elements
                .push((SERVICE_IPS, element(key, Some(Verdict::Goto(ext_chain.clone())))));
        }
        if let Some(np) = port.node_port {
            frag.elements.push((
                SERVICE_NODEPORTS,
                element(Key::ProtoPort(proto, np), Some(Verdict::Goto(ext_chain.clone()))),
            ));
        }
    } else {
        // externalTrafficPolicy=Cluster: masquerade, then any endpoint.
        for (ip, key) in external_ips.iter().zip(external_keys) {
            frag.elements.push((MASQUERADE_IPS, plain(key)));
            frag.elements
                .extend(slots(IP_ENDPOINTS, &comment, &cat.cluster, |s| {
                    Key::AddrProtoPortSlot(*ip, proto, port.port, s)
                }));
        }
        if let Some(np) = port.node_port {
            frag.elements
                .push((MASQUERADE_NODEPORTS, plain(Key::ProtoPort(proto, np))));
            frag.elements
                .extend(slots(NODEPORT_ENDPOINTS, &comment, &cat.cluster, |s| {
                    Key::ProtoPortSlot(proto, np, s)
                }));
        }
    }
    if port.has_source_ranges() && !port.load_balancer_ips.is_empty() {
        let mut rules: Vec<Rule> = port
            .load_balancer_source_ranges
            .iter()
            .map(|r| Rule::new(vec![Expr::SaddrIn(*r, false), Expr::Verdict(Verdict::Return)]))
            .collect();
        rules.push(
            Rule::new(vec![Expr::Verdict(Verdict::Drop)]).comment("source not in loadBalancerSourceRanges"),
        );
        frag.chains.push(chain(&fw_chain, rules));
        for ip in &port.load_balancer_ips {
            let key = Key::AddrProtoPort(*ip, proto, port.port);
            frag.elements
                .push((FIREWALL_IPS, element(key, Some(Verdict::Goto(fw_chain.clone())))));
        }
    }
    frag
}

/// The set an element of `set` lives in: endpoint-map elements go to the map of their count.
pub fn element_set(set: &'static str, key: &Key) -> Cow<'static, str> {
    match key.slot() {
        Some(slot) => Cow::Owned(endpoint_map_name(set, slot.count)),
        None => Cow::Borrowed(set),
    }
}

/// `ip-endpoints-N` / `nodeport-endpoints-N`.
pub fn endpoint_map_name(kind: &str, count: u32) -> String {
    format!("{kind}-{count}")
}

/// The endpoint maps (kind, endpoint count) a fragment fills.
pub fn endpoint_maps(frag: &Fragment) -> BTreeSet<(&'static str, u32)> {
    frag.elements
        .iter()
        .filter_map(|(set, e)| e.key.slot().map(|s| (*set, s.count)))
        .collect()
}

/// The definition of an endpoint map.
pub fn endpoint_map(kind: &'static str, count: u32) -> SetDef {
    let (key, what) = if kind == sets::NODEPORT_ENDPOINTS {
        (KeyType::ProtoPortSlot(count), "NodePort")
    } else {
        (
            KeyType::AddrProtoPortSlot(count),
            "ClusterIP, external and LoadBalancer IP",
        )
    };
    SetDef {
        name: endpoint_map_name(kind, count),
        key,
        verdict_map: false,
        timeout_seconds: None,
        comment: Some(format!("{what} endpoints, {count} per destination")),
    }
}

/// The chain reading a kind of endpoint maps.
pub fn dnat_chain(kind: &str) -> &'static str {
    if kind == sets::NODEPORT_ENDPOINTS {
        dnat_chains::NODEPORTS
    } else {
        dnat_chains::IPS
    }
}

/// The rules of a DNAT chain: one per endpoint map in use, fewest endpoints first.
pub fn dnat_rules(kind: &'static str, counts: impl Iterator<Item = u32>) -> Vec<Rule> {
    counts
        .map(|n| {
            let map = endpoint_map_name(kind, n);
            Rule::new(vec![if kind == sets::NODEPORT_ENDPOINTS {
                Expr::DnatProtoPortSlot(n, map)
            } else {
                Expr::DnatDaddrProtoPortSlot(n, map)
            }])
        })
        .collect()
}

/// Endpoint maps in use, and by how many fragments.
pub type EndpointMaps = BTreeMap<(&'static str, u32), usize>;

/// Adds the endpoint maps in use and the DNAT rules reading them to a ruleset built on [`base`].
pub fn add_dispatch(ruleset: &mut Ruleset, maps: &EndpointMaps) {
    for kind in [sets::IP_ENDPOINTS, sets::NODEPORT_ENDPOINTS] {
        let counts: Vec<u32> = maps.keys().filter(|(k, _)| *k == kind).map(|(_, n)| *n).collect();
        ruleset.sets.extend(counts.iter().map(|n| endpoint_map(kind, *n)));
        if let Some(chain) = ruleset.chains.iter_mut().find(|c| c.name == dnat_chain(kind)) {
            chain.rules = dnat_rules(kind, counts.into_iter());
        }
    }
}

/// Adds a fragment to a ruleset (for whole-ruleset rendering).
pub fn merge(ruleset: &mut Ruleset, frag: &Fragment) {
    ruleset.chains.extend(frag.chains.iter().cloned());
    ruleset.sets.extend(frag.sets.iter().cloned());
    for (set, e) in &frag.elements {
        let list = ruleset
            .elements
            .entry(element_set(set, &e.key).into_owned())
            .or_default();
        if !list.iter().any(|x| x.key == e.key) {
            list.push(e.clone());
        }
    }
}

/// The whole ruleset of a snapshot's family.
pub fn full(snapshot: &Snapshot, settings: &Settings) -> Ruleset {
    let mut ruleset = base(settings, snapshot.family);
    let fragments: Vec<Fragment> = snapshot
        .services
        .iter()
        .map(|(name, port)| {
            service(
                port,
                snapshot
                    .endpoints
                    .get(name)
                    .map(Vec::as_slice)
                    .unwrap_or_default(),
                settings,
            )
        })
        .collect();
    let mut maps = EndpointMaps::new();
    for m in fragments.iter().flat_map(endpoint_maps) {
        *maps.entry(m).or_default() += 1;
    }
    add_dispatch(&mut ruleset, &maps);
    for frag in &fragments {
        merge(&mut ruleset, frag);
    }
    for list in ruleset.elements.values_mut() {
        list.sort();
    }
    ruleset
}
