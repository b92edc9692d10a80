//! Pure rendering of the service model into the nftables IR.
//!
//! Shape (chosen on measurements): most service ports are pure data. Their endpoints live in
//! endpoint maps, one map per endpoint count N, keyed by destination (`daddr . l4proto . dport`,
//! or `l4proto . dport` for NodePorts) and slot `0..N`, each slot one DNAT target. A destination
//! reaches its map as kube-proxy's reach their service chains: its element in the `service-ips`
//! (`service-nodeports`) verdict map `goto`s the chain of its endpoint count, shared by every
//! destination with that count, whose one rule `dnat ip to … . numgen random mod N map
//! @ip-endpoints-N` picks a slot uniformly (after marking external IPs' and NodePorts' traffic for
//! masquerade). A new connection so makes one verdict-map lookup and one map lookup, whatever the
//! counts in use; adding a service or changing its endpoints only adds and deletes elements. A
//! `goto` element makes the kernel validate the chains its verdict map reaches at commit: here a
//! count chain of one rule per element (kube-proxy's walk a chain per service and per endpoint).
//!
//! Service ports with ClientIP affinity or with `externalTrafficPolicy: Local` external
//! destinations keep per-service chains dispatched through the same verdict maps: a chain per
//! port cascading `numgen random mod (n-j) 0` rules that DNAT inline (exactly uniform), plus
//! per-endpoint chains and timeout sets for affinity. Hairpin traffic is masqueraded through one
//! `hairpin-connections` set.
//!
//! Each family has its own table with the same shape; a [`Snapshot`] holds one family.

use std::{
    borrow::Cow,
    collections::{BTreeMap, BTreeSet},
    sync::Arc,
};

use super::ir::{
    BaseChain, Chain, Element, Expr, Hook, Key, KeyType, Rule, Ruleset, SetDef, Slot, Verdict, loopback,
};
use crate::{
    backend::{Settings, names},
    model::{Categorized, Endpoint, IpFamily, ServicePort, ServicePortName, Snapshot, categorize},
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
    /// Endpoint maps of IP destinations, `ip-endpoints-N` for N endpoints.
    pub const IP_ENDPOINTS: &str = "ip-endpoints";
    /// Endpoint maps of NodePorts, `nodeport-endpoints-N` for N endpoints.
    pub const NODEPORT_ENDPOINTS: &str = "nodeport-endpoints";
}

/// The most endpoints one destination is balanced over (2^24 - 1, 16.7 million: a cluster holds
/// far fewer); more are cut to that many.
pub const MAX_SLOTS: u32 = (1 << 24) - 1;

/// The chains of the endpoint counts in use, each reading one endpoint map: `dnat-ips-N`
/// (ClusterIPs), `dnat-masquerade-ips-N` (external and LoadBalancer IPs, whose traffic is
/// masqueraded) and `dnat-nodeports-N` (NodePorts, masqueraded too).
pub mod dnat_chains {
    /// Prefix of the ClusterIPs' count chains.
    pub const IPS: &str = "dnat-ips";
    /// Prefix of the external and LoadBalancer IPs' count chains.
    pub const MASQUERADE_IPS: &str = "dnat-masquerade-ips";
    /// Prefix of the NodePorts' count chains.
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
    let mut sets = fixed_sets();
    let mut elements = BTreeMap::new();
    let nodeport_match = match settings.node_port_addresses(family) {
        // Restricted NodePorts: their addresses are a set, declared right after `cluster-ips`.
        Some(addrs) => {
            let def = set_def(
                sets::NODEPORT_IPS,
                KeyType::Addr,
                false,
                "IPs that accept NodePort traffic",
            );
            sets.insert(1, def);
            let addrs = addrs.into_iter().map(|a| plain(Key::Addr(a))).collect();
            elements.insert(sets::NODEPORT_IPS.to_owned(), addrs);
            vec![Expr::DaddrInSet(sets::NODEPORT_IPS.into())]
        }
        None => vec![Expr::FibDaddrLocal, Expr::DaddrIn(loopback(family), true)],
    };
    let mut chains = hook_chains(serves_localhost_node_ports(settings, family));
    chains.extend(check_chains(settings, family, &nodeport_match));
    chains.extend(dispatch_chains(settings, family, nodeport_match));
    Ruleset {
        family,
        sets,
        elements,
        chains,
    }
}

fn set_def(name: &str, key: KeyType, verdict_map: bool, comment: &str) -> SetDef {
    SetDef {
        name: name.into(),
        key,
        verdict_map,
        timeout_seconds: None,
        comment: Some(comment.to_owned()),
    }
}

/// An element without verdict, DNAT target or comment: a member of a plain set.
fn plain(key: Key) -> Element {
    Element {
        key,
        verdict: None,
        dnat: None,
        comment: None,
    }
}

/// `matches` followed by `last`.
fn then(mut matches: Vec<Expr>, last: Expr) -> Vec<Expr> {
    matches.push(last);
    matches
}

/// The sets and verdict maps every table has, in declaration order.
fn fixed_sets() -> Vec<SetDef> {
    use sets::*;
    vec![
        set_def(CLUSTER_IPS, KeyType::Addr, false, "Active ClusterIPs"),
        set_def(
            SERVICE_IPS,
            KeyType::AddrProtoPort,
            true,
            "ClusterIP, ExternalIP and LoadBalancer IP traffic",
        ),
        set_def(SERVICE_NODEPORTS, KeyType::ProtoPort, true, "NodePort traffic"),
        set_def(
            NO_ENDPOINT_SERVICES,
            KeyType::AddrProtoPort,
            true,
            "vmap to drop or reject packets to services with no endpoints",
        ),
        set_def(
            NO_ENDPOINT_NODEPORTS,
            KeyType::ProtoPort,
            true,
            "vmap to drop or reject packets to service nodeports with no endpoints",
        ),
        set_def(
            FIREWALL_IPS,
            KeyType::AddrProtoPort,
            true,
            "destinations that are subject to LoadBalancerSourceRanges",
        ),
        set_def(
            HAIRPIN,
            KeyType::AddrAddr,
            false,
            "local endpoints reaching themselves through a service",
        ),
    ]
}

/// Whether a render of `family` with `settings` serves NodePorts on `127.0.0.1` (and so needs
/// `net.ipv4.conf.all.route_localnet=1`): IPv4 with [`Settings::nftables_localhost_node_ports`],
/// on top of whatever `nodePortAddresses` says (as KEP-6032's `primary,localhost`). IPv6 never:
/// the kernel does not route `::1` off the node (kube-proxy serves none either).
pub fn serves_localhost_node_ports(settings: &Settings, family: IpFamily) -> bool {
    family == IpFamily::V4 && settings.nftables_localhost_node_ports
}

/// The rule of `nat-output` that sends node-local connections to `127.0.0.0/8` through the
/// NodePort dispatch. Only in the output path: a packet from elsewhere to 127.0.0.1 is never
/// DNATed (kube-proxy's iptables mode DNATs it in PREROUTING too). Every NodePort is
/// masqueraded there (the endpoint cannot answer 127.0.0.1): Cluster ones by their count's
/// `dnat-nodeports-N` chain, Local ones because the source is a local address.
fn localhost_node_ports_rule() -> Rule {
    Rule::new(vec![
        Expr::DaddrIn(loopback(IpFamily::V4), false),
        Expr::Verdict(Verdict::Jump("nodeports".into())),
    ])
    .comment("localhost NodePorts (route_localnet)")
}

/// The guard of localhost NodePorts, kube-proxy's `KUBE-FIREWALL` rule against CVE-2020-8558:
/// with `route_localnet=1` the kernel accepts packets to `127.0.0.0/8` from other hosts, so new
/// connections to loopback from a non-loopback source are dropped (replies to our masqueraded
/// NodePort connections are established, not new).
fn localnet_guard_rule() -> Rule {
    Rule::new(vec![
        Expr::CtStateNew,
        Expr::SaddrIn(loopback(IpFamily::V4), true),
        Expr::DaddrIn(loopback(IpFamily::V4), false),
        Expr::Verdict(Verdict::Drop),
    ])
    .comment("block incoming localnet connections")
}

/// The base chains on the netfilter hooks: the filter ones jump to the checks for new
/// connections, the nat ones to the dispatch and the masquerading; with `localhost` (IPv4
/// localhost NodePorts) the output path also dispatches `127.0.0.0/8` and the input path guards
/// it.
fn hook_chains(localhost: bool) -> Vec<Chain> {
    let jump = |target: &str| Rule::new(vec![Expr::Verdict(Verdict::Jump(target.into()))]);
    let only_localhost = |rule: fn() -> Rule| localhost.then(rule);
    let mut input = vec![
        jump_new("nodeport-endpoints-check"),
        jump_new("service-endpoints-check"),
    ];
    input.extend(only_localhost(localnet_guard_rule));
    let mut nat_output = vec![jump("services")];
    nat_output.extend(only_localhost(localhost_node_ports_rule));
    vec![
        base_chain(
            "filter-forward",
            false,
            Hook::Forward,
            0,
            vec![jump_new("service-endpoints-check"), jump_new("cluster-ips-check")],
        ),
        base_chain("filter-input", false, Hook::Input, 0, input),
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
            vec![jump("services")],
        ),
        base_chain("nat-output", true, Hook::Output, -100, nat_output),
        base_chain(
            "nat-postrouting",
            true,
            Hook::Postrouting,
            100,
            vec![jump("masquerading")],
        ),
    ]
}

/// The base chains that send new connections through `firewall-check` (loadBalancerSourceRanges),
/// before DNAT. The table has them only while `firewall-ips` has elements ([`firewalls`]): every
/// new connection on the node would otherwise pay a hook, a conntrack-state test and a map lookup
/// that cannot match (measured in the README, issue 16, 2026-12-07). kube-proxy keeps them
/// always; what they do is the same.
pub fn firewall_hooks() -> Vec<Chain> {
    vec![
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
    ]
}

/// Whether `fragment` puts destinations into `firewall-ips` (so the table needs
/// [`firewall_hooks`]).
pub fn firewalls(fragment: &Fragment) -> bool {
    fragment
        .elements
        .iter()
        .any(|(set, _)| *set == sets::FIREWALL_IPS)
}

/// Puts [`firewall_hooks`] first among `ruleset`'s chains (where the base chains are).
pub fn add_firewall_hooks(ruleset: &mut Ruleset) {
    ruleset.chains.splice(0..0, firewall_hooks());
}

/// The filter checks of new connections: source ranges, destinations without endpoints,
/// ClusterIP ports that are no service, and the shared reject.
fn check_chains(settings: &Settings, family: IpFamily, nodeport_match: &[Expr]) -> Vec<Chain> {
    use sets::*;
    vec![
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
            vec![Rule::new(then(
                nodeport_match.to_vec(),
                Expr::VmapProtoPort(NO_ENDPOINT_NODEPORTS.into()),
            ))],
        ),
        chain("cluster-ips-check", cluster_ips_check(settings, family)),
        chain(
            "reject-chain",
            vec![
                fast_reject(family),
                Rule::new(vec![Expr::Reject])
                    .comment("helper for @no-endpoint-services / @no-endpoint-nodeports"),
            ],
        ),
    ]
}

/// `cluster-ips-check`: rejects traffic to ClusterIP ports that are no service, and drops
/// traffic to the Service CIDRs' other addresses. Every new connection passes here after its
/// DNAT, so the reject is one set lookup that `goto`s `reject-chain` (which picks the reject by
/// protocol): no protocol test ahead of it for the connections that pass.
fn cluster_ips_check(settings: &Settings, family: IpFamily) -> Vec<Rule> {
    let mut rules = vec![
        Rule::new(vec![
            Expr::DaddrInSet(sets::CLUSTER_IPS.into()),
            Expr::Verdict(Verdict::Goto("reject-chain".into())),
        ])
        .comment("Reject traffic to invalid ports of ClusterIPs"),
    ];
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
}

/// The nat chains that dispatch to the services through the verdict maps (NodePorts after the
/// IP destinations) and masquerade what was marked. The endpoint counts' chains are added with
/// the counts in use ([`add_dispatch`]).
fn dispatch_chains(settings: &Settings, family: IpFamily, nodeport_match: Vec<Expr>) -> Vec<Chain> {
    use sets::*;
    let mark = settings.masquerade_mark;
    vec![
        chain("services", services_rules(settings, family, nodeport_match)),
        chain(
            "nodeports",
            vec![Rule::new(vec![Expr::VmapProtoPort(SERVICE_NODEPORTS.into())])],
        ),
        chain(
            "masquerading",
            // The marked connections first, as kube-proxy orders them: most connections a node
            // makes to a service are marked, and they skip the hairpin lookup.
            vec![
                Rule::new(vec![
                    Expr::MarkSet(mark),
                    Expr::SetMarkXor(mark),
                    Expr::Masquerade,
                ]),
                Rule::new(vec![
                    Expr::CtStatusDnat,
                    Expr::SaddrDaddrInSet(HAIRPIN.into()),
                    Expr::Masquerade,
                ]),
            ],
        ),
    ]
}

/// `services`: the ClusterIP masquerade mark, the verdict map of IP destinations, and last the
/// NodePorts.
fn services_rules(settings: &Settings, family: IpFamily, nodeport_match: Vec<Expr>) -> Vec<Rule> {
    use sets::*;
    let mark = settings.masquerade_mark;
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
    rules.push(Rule::new(then(
        nodeport_match,
        Expr::Verdict(Verdict::Jump("nodeports".into())),
    )));
    rules
}

/// The [`crate::backend::fast_reject`] rule of `family`.
fn fast_reject(family: IpFamily) -> Rule {
    let (protocol, reject) = crate::backend::fast_reject(family);
    let reject = match reject {
        crate::backend::FastReject::TcpReset => Expr::RejectTcpReset,
        crate::backend::FastReject::ProtocolUnreachable => Expr::RejectProtocolUnreachable,
    };
    Rule::new(vec![Expr::L4Proto(protocol), reject])
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

/// How a destination served from an endpoint map is dispatched: the verdict map holding its
/// element, the endpoint maps of its kind and the prefix of its count's chain.
#[derive(Debug, Clone, Copy)]
struct MapDispatch {
    verdict_map: &'static str,
    endpoint_maps: &'static str,
    chain: &'static str,
}

/// ClusterIPs.
const CLUSTER_IP_DISPATCH: MapDispatch = MapDispatch {
    verdict_map: sets::SERVICE_IPS,
    endpoint_maps: sets::IP_ENDPOINTS,
    chain: dnat_chains::IPS,
};
/// External and LoadBalancer IPs (externalTrafficPolicy Cluster): masqueraded.
const EXTERNAL_IP_DISPATCH: MapDispatch = MapDispatch {
    verdict_map: sets::SERVICE_IPS,
    endpoint_maps: sets::IP_ENDPOINTS,
    chain: dnat_chains::MASQUERADE_IPS,
};
/// NodePorts (externalTrafficPolicy Cluster): masqueraded.
const NODEPORT_DISPATCH: MapDispatch = MapDispatch {
    verdict_map: sets::SERVICE_NODEPORTS,
    endpoint_maps: sets::NODEPORT_ENDPOINTS,
    chain: dnat_chains::NODEPORTS,
};

/// The elements serving `dest` (an `AddrProtoPort` or `ProtoPort` key) from the endpoint map of
/// its count n: slot j of n DNATs to `eps[j]`, and `dest`'s verdict-map element goes to the
/// count's chain. Nothing without endpoints.
fn map_elements(
    how: MapDispatch,
    comment: &Arc<str>,
    eps: &[&Endpoint],
    dest: Key,
) -> Vec<(&'static str, Element)> {
    let eps = &eps[..eps.len().min(MAX_SLOTS as usize)];
    let count = eps.len() as u32;
    let slotted = |index| match &dest {
        Key::AddrProtoPort(ip, proto, port) => {
            Some(Key::AddrProtoPortSlot(*ip, *proto, *port, Slot { index, count }))
        }
        Key::ProtoPort(proto, port) => Some(Key::ProtoPortSlot(*proto, *port, Slot { index, count })),
        _ => None,
    };
    let mut out: Vec<(&'static str, Element)> = (0..count)
        .zip(eps)
        .filter_map(|(index, ep)| {
            let element = Element {
                key: slotted(index)?,
                verdict: None,
                dnat: Some((ep.ip, ep.port)),
                comment: Some(Arc::clone(comment)),
            };
            Some((how.endpoint_maps, element))
        })
        .collect();
    if !out.is_empty() {
        let element = Element {
            key: dest,
            verdict: Some(Verdict::Goto(count_chain(how.chain, count))),
            dnat: None,
            comment: Some(Arc::clone(comment)),
        };
        out.push((how.verdict_map, element));
    }
    out
}

/// The chain of the destinations of `prefix` ([`dnat_chains`]) with `count` endpoints.
pub fn count_chain(prefix: &str, count: u32) -> String {
    format!("{prefix}-{count}")
}

/// Everything one service port contributes, without spare capacity: the backend keeps every
/// fragment until its service port changes, and growth by push leaves room unused.
pub fn service(port: &ServicePort, endpoints: &[Endpoint], settings: &Settings) -> Fragment {
    let mut frag = service_grown(port, endpoints, settings);
    frag.chains.shrink_to_fit();
    frag.sets.shrink_to_fit();
    frag.elements.shrink_to_fit();
    frag
}

fn service_grown(port: &ServicePort, endpoints: &[Endpoint], settings: &Settings) -> Fragment {
    let render = PortRender::new(port, endpoints, settings);
    let mut frag = Fragment {
        endpoints: endpoints.len(),
        ..Default::default()
    };
    frag.elements
        .push((sets::CLUSTER_IPS, plain(Key::Addr(port.cluster_ip))));
    render.cascade_chains(&mut frag);
    if render.affinity {
        render.affinity_chains(&mut frag);
    }
    render.hairpin(&mut frag);
    render.cluster_ip(&mut frag);

    // External destinations: externalIPs, LB IPs, NodePort.
    if !port.externally_accessible() {
        return frag;
    }
    let external = render.external_destinations();
    if !render.external_ok() && !render.short_circuits() {
        render.blocked_external(&external, &mut frag);
        return frag;
    }
    if render.chained {
        render.external_chain(&external, &mut frag);
    } else {
        render.external_endpoint_maps(&external, &mut frag);
    }
    if port.has_source_ranges() && !port.load_balancer_ips.is_empty() {
        render.firewall(&mut frag);
    }
    frag
}

/// One service port being rendered: its inputs, its endpoints split by traffic policy and the
/// names of its chains, which every stage of [`service`] reads.
struct PortRender<'a> {
    port: &'a ServicePort,
    settings: &'a Settings,
    cat: Categorized<'a>,
    /// The port's name: the comment of its verdict and endpoint-map elements.
    comment: Arc<str>,
    svc_chain: String,
    local_chain: String,
    ext_chain: String,
    fw_chain: String,
    affinity: bool,
    /// Affinity and externalTrafficPolicy=Local need logic per service: chains. Everything
    /// else is served from endpoint maps.
    chained: bool,
    has_cluster: bool,
    has_local: bool,
}

/// The external destinations of a port: the map keys of its externalIPs and LB IPs.
struct ExternalDestinations {
    keys: Vec<Key>,
}

impl<'a> PortRender<'a> {
    fn new(port: &'a ServicePort, endpoints: &'a [Endpoint], settings: &'a Settings) -> Self {
        let name = &port.name;
        let affinity = port.affinity_timeout_seconds.is_some();
        let cat = categorize(endpoints, &settings.node);
        Self {
            port,
            settings,
            comment: name.to_string().into(),
            svc_chain: names::nft_service_chain("service-", name),
            local_chain: names::nft_service_chain("local-", name),
            ext_chain: names::nft_service_chain("external-", name),
            fw_chain: names::nft_service_chain("firewall-", name),
            affinity,
            chained: affinity || (port.external_policy_local && port.externally_accessible()),
            has_cluster: !cat.cluster.is_empty(),
            has_local: !cat.local.is_empty(),
            cat,
        }
    }

    /// An element of a verdict map, commented with the port's name.
    fn element(&self, key: Key, verdict: Verdict) -> Element {
        Element {
            key,
            verdict: Some(verdict),
            dnat: None,
            comment: Some(Arc::clone(&self.comment)),
        }
    }

    /// The verdict for a destination without usable endpoints: dropped when the port has
    /// endpoints elsewhere (a Local policy), rejected when it has none at all.
    fn blocked(&self) -> Verdict {
        if self.cat.has_any {
            Verdict::Drop
        } else {
            Verdict::Goto("reject-chain".into())
        }
    }

    /// The cascade chains of a chained port: all endpoints, and the local ones for Local
    /// policies.
    fn cascade_chains(&self, frag: &mut Fragment) {
        let port = self.port;
        if self.chained && self.has_cluster {
            frag.chains.push(chain(
                &self.svc_chain,
                cascade(&port.name, &self.cat.cluster, self.affinity),
            ));
        }
        if self.chained && (port.internal_policy_local || port.external_policy_local) && self.has_local {
            frag.chains.push(chain(
                &self.local_chain,
                cascade(&port.name, &self.cat.local, self.affinity),
            ));
        }
    }

    /// ClientIP affinity: per endpoint a timeout set of recent clients and a chain that
    /// records the client and DNATs to the endpoint.
    fn affinity_chains(&self, frag: &mut Fragment) {
        let name = &self.port.name;
        let timeout = self.port.affinity_timeout_seconds;
        let mut eps: Vec<&Endpoint> = self
            .cat
            .cluster
            .iter()
            .chain(self.cat.local.iter())
            .copied()
            .collect();
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
                    Expr::L4Proto(name.protocol),
                    Expr::Dnat(ep.ip, ep.port),
                ])],
            ));
        }
    }

    /// Hairpin: a local endpoint reaching itself through the service must be masqueraded.
    fn hairpin(&self, frag: &mut Fragment) {
        for ep in self.cat.cluster.iter().chain(self.cat.local.iter()) {
            if ep.node_name.as_deref() == Some(self.settings.node.name.as_str()) {
                frag.elements
                    .push((sets::HAIRPIN, plain(Key::AddrAddr(ep.ip, ep.ip))));
            }
        }
    }

    /// The ClusterIP: blocked without endpoints for its internal policy, else dispatched to
    /// its chain or its endpoint map.
    fn cluster_ip(&self, frag: &mut Fragment) {
        let port = self.port;
        let proto = port.name.protocol;
        let (internal_ok, internal_chain, internal_eps) = if port.internal_policy_local {
            (self.has_local, &self.local_chain, &self.cat.local)
        } else {
            (self.has_cluster, &self.svc_chain, &self.cat.cluster)
        };
        let cluster_key = Key::AddrProtoPort(port.cluster_ip, proto, port.port);
        if !internal_ok {
            frag.elements.push((
                sets::NO_ENDPOINT_SERVICES,
                self.element(cluster_key, self.blocked()),
            ));
        } else if self.chained {
            frag.elements.push((
                sets::SERVICE_IPS,
                self.element(cluster_key, Verdict::Goto(internal_chain.clone())),
            ));
        } else {
            frag.elements.extend(map_elements(
                CLUSTER_IP_DISPATCH,
                &self.comment,
                internal_eps,
                cluster_key,
            ));
        }
    }

    /// Whether the external destinations have endpoints for the external policy.
    fn external_ok(&self) -> bool {
        if self.port.external_policy_local {
            self.has_local
        } else {
            self.has_cluster
        }
    }

    /// Whether pod and node traffic to the external destinations still has endpoints: with a
    /// Local policy it short-circuits to all endpoints, so a node without a local endpoint still
    /// serves it (as kube-proxy does) and drops only the traffic from outside.
    fn short_circuits(&self) -> bool {
        self.port.external_policy_local && self.has_cluster
    }

    fn external_destinations(&self) -> ExternalDestinations {
        let port = self.port;
        let keys = port
            .external_ips
            .iter()
            .chain(port.load_balancer_ips.iter())
            .map(|ip| Key::AddrProtoPort(*ip, port.name.protocol, port.port))
            .collect();
        ExternalDestinations { keys }
    }

    /// External destinations without endpoints: blocked, NodePort included.
    fn blocked_external(&self, external: &ExternalDestinations, frag: &mut Fragment) {
        for key in &external.keys {
            frag.elements.push((
                sets::NO_ENDPOINT_SERVICES,
                self.element(key.clone(), self.blocked()),
            ));
        }
        if let Some(np) = self.port.node_port {
            frag.elements.push((
                sets::NO_ENDPOINT_NODEPORTS,
                self.element(Key::ProtoPort(self.port.name.protocol, np), self.blocked()),
            ));
        }
    }

    /// A chained port's external destinations: dispatched to its `external-` chain.
    fn external_chain(&self, external: &ExternalDestinations, frag: &mut Fragment) {
        frag.chains
            .push(chain(&self.ext_chain, self.external_chain_rules()));
        let to_ext = || Verdict::Goto(self.ext_chain.clone());
        for key in &external.keys {
            frag.elements
                .push((sets::SERVICE_IPS, self.element(key.clone(), to_ext())));
        }
        if let Some(np) = self.port.node_port {
            frag.elements.push((
                sets::SERVICE_NODEPORTS,
                self.element(Key::ProtoPort(self.port.name.protocol, np), to_ext()),
            ));
        }
    }

    /// The `external-` chain: with a Local policy, pod and node traffic short-circuits to all
    /// endpoints and the rest goes to the local ones; with a Cluster policy, masquerade and
    /// any endpoint.
    fn external_chain_rules(&self) -> Vec<Rule> {
        let mark = self.settings.masquerade_mark;
        let to_svc = || Expr::Verdict(Verdict::Goto(self.svc_chain.clone()));
        let mut rules = Vec::new();
        if !self.port.external_policy_local {
            rules.push(Rule::new(vec![Expr::SetMarkOr(mark)]));
            rules.push(Rule::new(vec![to_svc()]));
            return rules;
        }
        let cluster_cidr = self.settings.cluster_cidr(self.port.family());
        if let (Some(cidr), true) = (cluster_cidr, self.has_cluster) {
            rules.push(
                Rule::new(vec![Expr::SaddrIn(cidr, false), to_svc()]).comment("short-circuit pod traffic"),
            );
        }
        if self.has_cluster {
            rules.push(
                Rule::new(vec![Expr::FibSaddrLocal, Expr::SetMarkOr(mark)])
                    .comment("masquerade local traffic"),
            );
            rules.push(Rule::new(vec![Expr::FibSaddrLocal, to_svc()]).comment("short-circuit local traffic"));
        }
        if self.has_local {
            rules.push(Rule::new(vec![Expr::Verdict(Verdict::Goto(
                self.local_chain.clone(),
            ))]));
        } else {
            rules.push(
                Rule::new(vec![Expr::Verdict(Verdict::Drop)])
                    .comment("externalTrafficPolicy Local and no local endpoints"),
            );
        }
        rules
    }

    /// externalTrafficPolicy=Cluster: masquerade, then any endpoint from the endpoint maps.
    fn external_endpoint_maps(&self, external: &ExternalDestinations, frag: &mut Fragment) {
        let eps = &self.cat.cluster;
        for key in &external.keys {
            frag.elements.extend(map_elements(
                EXTERNAL_IP_DISPATCH,
                &self.comment,
                eps,
                key.clone(),
            ));
        }
        if let Some(np) = self.port.node_port {
            let key = Key::ProtoPort(self.port.name.protocol, np);
            frag.elements
                .extend(map_elements(NODEPORT_DISPATCH, &self.comment, eps, key));
        }
    }

    /// loadBalancerSourceRanges: a `firewall-` chain returning for allowed sources and
    /// dropping the rest, reached from the LB IPs through `firewall-ips`.
    fn firewall(&self, frag: &mut Fragment) {
        let port = self.port;
        let mut rules: Vec<Rule> = port
            .load_balancer_source_ranges
            .iter()
            .map(|r| Rule::new(vec![Expr::SaddrIn(*r, false), Expr::Verdict(Verdict::Return)]))
            .collect();
        rules.push(
            Rule::new(vec![Expr::Verdict(Verdict::Drop)]).comment("source not in loadBalancerSourceRanges"),
        );
        frag.chains.push(chain(&self.fw_chain, rules));
        for ip in &port.load_balancer_ips {
            let key = Key::AddrProtoPort(*ip, port.name.protocol, port.port);
            frag.elements.push((
                sets::FIREWALL_IPS,
                self.element(key, Verdict::Goto(self.fw_chain.clone())),
            ));
        }
    }
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

/// The rule reading the endpoint map of `kind` with `n` endpoints per destination, after marking
/// the connection for masquerade with `mark` if given.
fn dnat_rule(kind: &'static str, n: u32, mark: Option<u32>) -> Rule {
    let map = endpoint_map_name(kind, n);
    let mut exprs: Vec<Expr> = mark.map(Expr::SetMarkOr).into_iter().collect();
    exprs.push(if kind == sets::NODEPORT_ENDPOINTS {
        Expr::DnatProtoPortSlot(n, map)
    } else {
        Expr::DnatDaddrProtoPortSlot(n, map)
    });
    Rule::new(exprs)
}

/// What serves the destinations of one kind of endpoint maps for the endpoint counts in use: the
/// maps, and the chains of each count that the destinations' verdict-map elements go to.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Dispatch {
    /// The endpoint maps in use.
    pub sets: Vec<SetDef>,
    /// The counts' chains.
    pub chains: Vec<Chain>,
}

/// The dispatch of `kind` for the endpoint `counts` in use, masquerading with `mark`: per count N
/// the map and, for IP destinations, `dnat-ips-N` (ClusterIPs) and `dnat-masquerade-ips-N`
/// (external and LoadBalancer IPs), for NodePorts `dnat-nodeports-N`. A new connection makes one
/// verdict-map lookup (its destination's element) and one map lookup, whatever the counts in use.
pub fn dispatch(kind: &'static str, counts: &BTreeSet<u32>, mark: u32) -> Dispatch {
    let prefixes: &[(&str, Option<u32>)] = if kind == sets::NODEPORT_ENDPOINTS {
        &[(dnat_chains::NODEPORTS, Some(mark))]
    } else {
        &[
            (dnat_chains::IPS, None),
            (dnat_chains::MASQUERADE_IPS, Some(mark)),
        ]
    };
    Dispatch {
        sets: counts.iter().map(|n| endpoint_map(kind, *n)).collect(),
        chains: counts
            .iter()
            .flat_map(|n| {
                prefixes.iter().map(move |(prefix, mark)| {
                    chain(&count_chain(prefix, *n), vec![dnat_rule(kind, *n, *mark)])
                })
            })
            .collect(),
    }
}

/// Endpoint maps in use, and by how many fragments.
pub type EndpointMaps = BTreeMap<(&'static str, u32), usize>;

/// The kinds of endpoint maps, each with its own dispatch.
pub const ENDPOINT_MAP_KINDS: [&str; 2] = [sets::IP_ENDPOINTS, sets::NODEPORT_ENDPOINTS];

/// The endpoint counts of `kind` in use.
pub fn counts_of(maps: &EndpointMaps, kind: &str) -> BTreeSet<u32> {
    maps.keys().filter(|(k, _)| *k == kind).map(|(_, n)| *n).collect()
}

/// Adds the endpoint maps in use and their dispatch to a ruleset built on [`base`].
pub fn add_dispatch(ruleset: &mut Ruleset, maps: &EndpointMaps, settings: &Settings) {
    for kind in ENDPOINT_MAP_KINDS {
        let d = dispatch(kind, &counts_of(maps, kind), settings.masquerade_mark);
        ruleset.sets.extend(d.sets);
        ruleset.chains.extend(d.chains);
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
    add_dispatch(&mut ruleset, &maps, settings);
    if fragments.iter().any(firewalls) {
        add_firewall_hooks(&mut ruleset);
    }
    for frag in &fragments {
        merge(&mut ruleset, frag);
    }
    for list in ruleset.elements.values_mut() {
        list.sort();
    }
    ruleset
}
