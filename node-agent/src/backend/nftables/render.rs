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
//! A single-endpoint destination is looked up in its map first; any other reaches the rule of
//! its count through a binary trie over the counts' bits ([`dispatch`]): it is also an element of
//! the plain set `ip-count-bit-K` for every bit K set in its count, and each trie chain tests one
//! bit in which the counts in use differ. A new connection makes one set lookup per such bit (at
//! most 9 for 256 counts) rather than one map lookup per count in use; the trie's chains change
//! only when the set of counts in use does.
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
    /// External and LB IP destinations served from endpoint maps: their traffic is masqueraded.
    pub const MASQUERADE_IPS: &str = "masquerade-ips";
    /// NodePorts served from endpoint maps: their traffic is masqueraded.
    pub const MASQUERADE_NODEPORTS: &str = "masquerade-nodeports";
    /// Endpoint maps of IP destinations, `ip-endpoints-N` for N endpoints.
    pub const IP_ENDPOINTS: &str = "ip-endpoints";
    /// Endpoint maps of NodePorts, `nodeport-endpoints-N` for N endpoints.
    pub const NODEPORT_ENDPOINTS: &str = "nodeport-endpoints";

    macro_rules! count_bits {
        ($kind:literal; $($bit:literal)*) => { [$(concat!($kind, "-count-bit-", $bit)),*] };
    }
    /// `ip-count-bit-K`: the IP destinations of endpoint maps whose endpoint count has bit K set
    /// (read by the dispatch trie, [`super::dispatch`]).
    pub const IP_COUNT_BITS: [&str; super::COUNT_BITS] =
        count_bits!("ip"; 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23);
    /// `nodeport-count-bit-K`: the same for NodePorts.
    pub const NODEPORT_COUNT_BITS: [&str; super::COUNT_BITS] =
        count_bits!("nodeport"; 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23);
}

/// Bits of an endpoint count the dispatch can tell apart: a service port may have up to 2^24 - 1
/// endpoints (16.7 million; a cluster holds far fewer), more are cut to that many.
pub const COUNT_BITS: usize = 24;

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
        set_def(
            MASQUERADE_IPS,
            KeyType::AddrProtoPort,
            false,
            "external and LoadBalancer IP traffic to masquerade",
        ),
        set_def(
            MASQUERADE_NODEPORTS,
            KeyType::ProtoPort,
            false,
            "NodePort traffic to masquerade",
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
/// masqueraded there (the endpoint cannot answer 127.0.0.1): Cluster ones through
/// `masquerade-nodeports`, Local ones because the source is a local address.
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
        chain("reject-chain", {
            let mut rules = fast_rejects(family, vec![]);
            rules.push(
                Rule::new(vec![Expr::Reject])
                    .comment("helper for @no-endpoint-services / @no-endpoint-nodeports"),
            );
            rules
        }),
    ]
}

/// `cluster-ips-check`: rejects traffic to ClusterIP ports that are no service, and drops
/// traffic to the Service CIDRs' other addresses.
fn cluster_ips_check(settings: &Settings, family: IpFamily) -> Vec<Rule> {
    let cluster_ips = || Expr::DaddrInSet(sets::CLUSTER_IPS.into());
    let mut rules = fast_rejects(family, vec![cluster_ips()]);
    rules.push(
        Rule::new(vec![cluster_ips(), Expr::Reject]).comment("Reject traffic to invalid ports of ClusterIPs"),
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
}

/// The nat chains that dispatch to the services (verdict maps first, then the endpoint maps'
/// DNAT chains) and masquerade what was marked.
fn dispatch_chains(settings: &Settings, family: IpFamily, nodeport_match: Vec<Expr>) -> Vec<Chain> {
    use sets::*;
    let mark = settings.masquerade_mark;
    vec![
        chain("services", services_rules(settings, family, nodeport_match)),
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
    ]
}

/// `services`: the ClusterIP masquerade mark, the verdict map, the endpoint maps of IP
/// destinations, and last the NodePorts.
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
    rules.push(Rule::new(vec![
        Expr::DaddrProtoPortInSet(MASQUERADE_IPS.into()),
        Expr::SetMarkOr(mark),
    ]));
    rules.push(Rule::new(vec![Expr::Verdict(Verdict::Jump(
        dnat_chains::IPS.into(),
    ))]));
    rules.push(Rule::new(then(
        nodeport_match,
        Expr::Verdict(Verdict::Jump("nodeports".into())),
    )));
    rules
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

/// Endpoint-map elements for `dest`: slot j of n DNATs to `eps[j]`; and the destination in the
/// count-bit set of each bit set in n (the dispatch trie's tests).
fn slots(
    set: &'static str,
    comment: &Arc<str>,
    eps: &[&Endpoint],
    dest: impl Fn(Slot) -> Key,
) -> Vec<(&'static str, Element)> {
    let eps = &eps[..eps.len().min((1 << COUNT_BITS) - 1)];
    let count = eps.len() as u32;
    let mut out: Vec<(&'static str, Element)> = (0..count)
        .zip(eps)
        .map(|(index, ep)| {
            let key = dest(Slot { index, count });
            (
                set,
                Element {
                    key,
                    verdict: None,
                    dnat: Some((ep.ip, ep.port)),
                    comment: Some(Arc::clone(comment)),
                },
            )
        })
        .collect();
    if let Some(key) = destination(&dest(Slot { index: 0, count })) {
        let bit_sets = count_bit_sets(set);
        out.extend((0..COUNT_BITS).filter(|b| count & (1 << b) != 0).map(|b| {
            let mut e = plain(key.clone());
            e.comment = Some(Arc::clone(comment));
            (bit_sets[b], e)
        }));
    }
    out
}

/// The destination of an endpoint-map key (the key without its slot).
fn destination(key: &Key) -> Option<Key> {
    match key {
        Key::AddrProtoPortSlot(ip, proto, port, _) => Some(Key::AddrProtoPort(*ip, *proto, *port)),
        Key::ProtoPortSlot(proto, port, _) => Some(Key::ProtoPort(*proto, *port)),
        _ => None,
    }
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

/// The external destinations of a port: its externalIPs and LB IPs with their map keys.
struct ExternalDestinations {
    ips: Vec<IpAddr>,
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
            frag.elements
                .extend(slots(sets::IP_ENDPOINTS, &self.comment, internal_eps, |s| {
                    Key::AddrProtoPortSlot(port.cluster_ip, proto, port.port, s)
                }));
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
        let ips: Vec<IpAddr> = port
            .external_ips
            .iter()
            .chain(port.load_balancer_ips.iter())
            .copied()
            .collect();
        let keys = ips
            .iter()
            .map(|ip| Key::AddrProtoPort(*ip, port.name.protocol, port.port))
            .collect();
        ExternalDestinations { ips, keys }
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
        let (proto, port) = (self.port.name.protocol, self.port.port);
        let eps = &self.cat.cluster;
        for (ip, key) in external.ips.iter().zip(&external.keys) {
            frag.elements.push((sets::MASQUERADE_IPS, plain(key.clone())));
            frag.elements
                .extend(slots(sets::IP_ENDPOINTS, &self.comment, eps, |s| {
                    Key::AddrProtoPortSlot(*ip, proto, port, s)
                }));
        }
        if let Some(np) = self.port.node_port {
            frag.elements
                .push((sets::MASQUERADE_NODEPORTS, plain(Key::ProtoPort(proto, np))));
            frag.elements
                .extend(slots(sets::NODEPORT_ENDPOINTS, &self.comment, eps, |s| {
                    Key::ProtoPortSlot(proto, np, s)
                }));
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

/// The chain reading a kind of endpoint maps.
pub fn dnat_chain(kind: &str) -> &'static str {
    if kind == sets::NODEPORT_ENDPOINTS {
        dnat_chains::NODEPORTS
    } else {
        dnat_chains::IPS
    }
}

/// The rule reading the endpoint map of `kind` with `n` endpoints per destination.
fn dnat_rule(kind: &'static str, n: u32) -> Rule {
    let map = endpoint_map_name(kind, n);
    Rule::new(vec![if kind == sets::NODEPORT_ENDPOINTS {
        Expr::DnatProtoPortSlot(n, map)
    } else {
        Expr::DnatDaddrProtoPortSlot(n, map)
    }])
}

/// The count-bit sets of a kind of endpoint maps.
fn count_bit_sets(kind: &str) -> &'static [&'static str; COUNT_BITS] {
    if kind == sets::NODEPORT_ENDPOINTS {
        &sets::NODEPORT_COUNT_BITS
    } else {
        &sets::IP_COUNT_BITS
    }
}

/// The definition of count-bit set `bit` of `kind`.
fn count_bit_set(kind: &str, bit: usize) -> SetDef {
    let (key, what) = if kind == sets::NODEPORT_ENDPOINTS {
        (KeyType::ProtoPort, "NodePorts")
    } else {
        (KeyType::AddrProtoPort, "IP destinations")
    };
    SetDef {
        name: count_bit_sets(kind)[bit].into(),
        key,
        verdict_map: false,
        timeout_seconds: None,
        comment: Some(format!("{what} whose endpoint count has bit {bit} set")),
    }
}

/// What dispatches the destinations of one kind of endpoint maps to the map of their endpoint
/// count: the sets it reads, the rules of its root chain ([`dnat_chain`]) and its other chains.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Dispatch {
    /// The endpoint maps in use and the count-bit sets of their counts' bits.
    pub sets: Vec<SetDef>,
    /// The root chain's rules.
    pub root: Vec<Rule>,
    /// The trie's other chains.
    pub chains: Vec<Chain>,
}

/// The dispatch of `kind` for the endpoint counts in use: the map of single-endpoint
/// destinations first, then a binary trie over the bits in which the other counts differ. A chain
/// tests one such bit (`… @<kind>-count-bit-K goto` the chain of the counts with the bit set) and
/// falls through to the counts without it; a leaf reads its map.
/// A new connection makes at most one set lookup per bit (9 for 256 counts) and one map lookup,
/// instead of one map lookup per count; services still come and go as elements only.
pub fn dispatch(kind: &'static str, counts: &BTreeSet<u32>) -> Dispatch {
    let mut d = Dispatch {
        sets: counts.iter().map(|n| endpoint_map(kind, *n)).collect(),
        ..Dispatch::default()
    };
    let bits = counts.iter().fold(0, |acc, n| acc | n);
    d.sets.extend(
        (0..COUNT_BITS)
            .filter(|b| bits & (1 << b) != 0)
            .map(|b| count_bit_set(kind, b)),
    );
    let counts: Vec<u32> = counts.iter().copied().collect();
    // Single-endpoint destinations (in most clusters the commonest count) are looked up in their
    // map before any trie test: one lookup for them (a count-1 destination is the trie's deepest
    // leaf: one test per bit), one failed lookup more for the others.
    let trie_counts = match counts.split_first() {
        Some((1, rest)) if !rest.is_empty() => {
            d.root.push(dnat_rule(kind, 1));
            rest
        }
        _ => &counts[..],
    };
    d.root.extend(trie_node(kind, trie_counts, "", &mut d.chains));
    d
}

/// The rules of the trie node over `counts` (reached by the decisions `path`), adding the chains
/// of its `1` branches to `chains`; its `0` branch follows inline.
fn trie_node(kind: &'static str, counts: &[u32], path: &str, chains: &mut Vec<Chain>) -> Vec<Rule> {
    let (any, all) = counts
        .iter()
        .fold((0, u32::MAX), |(any, all), n| (any | n, all & n));
    let differing = any & !all;
    if counts.len() <= 1 || differing == 0 {
        return counts.iter().map(|n| dnat_rule(kind, *n)).collect();
    }
    let bit = 31 - differing.leading_zeros();
    let (ones, zeros): (Vec<u32>, Vec<u32>) = counts.iter().partition(|n| *n & (1 << bit) != 0);
    let ones_name = format!("{}-{path}{bit}h", dnat_chain(kind));
    let ones_rules = trie_node(kind, &ones, &format!("{path}{bit}h"), chains);
    chains.push(chain(&ones_name, ones_rules));
    let set = count_bit_sets(kind)[bit as usize];
    let test = if kind == sets::NODEPORT_ENDPOINTS {
        Expr::ProtoPortInSet(set.into())
    } else {
        Expr::DaddrProtoPortInSet(set.into())
    };
    let mut rules = vec![Rule::new(vec![test, Expr::Verdict(Verdict::Goto(ones_name))])];
    rules.extend(trie_node(kind, &zeros, &format!("{path}{bit}l"), chains));
    rules
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
pub fn add_dispatch(ruleset: &mut Ruleset, maps: &EndpointMaps) {
    for kind in ENDPOINT_MAP_KINDS {
        let d = dispatch(kind, &counts_of(maps, kind));
        ruleset.sets.extend(d.sets);
        if let Some(chain) = ruleset.chains.iter_mut().find(|c| c.name == dnat_chain(kind)) {
            chain.rules = d.root;
        }
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
    add_dispatch(&mut ruleset, &maps);
    for frag in &fragments {
        merge(&mut ruleset, frag);
    }
    for list in ruleset.elements.values_mut() {
        list.sort();
    }
    ruleset
}
