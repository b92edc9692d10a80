//! The pure render of a [`Snapshot`] into `iptables-restore` input (tables `filter` and `nat`), or
//! `ip6tables-restore` input for an IPv6 snapshot (same layout; `/128`, ICMPv6 rejects, IPv6
//! masks and bracketed DNAT targets).
//!
//! Every rule is written exactly as `iptables-save` prints it back (argument order, `/32` suffixes,
//! quoting of comments, `MARK --set-xmark`, `REJECT --reject-with ...`, `recent --mask ...
//! --rsource`), and chains and rules come out in `iptables-save`'s order (chains sorted by name,
//! rules grouped by chain), so the text of a full render equals the kernel's listing of our chains.
//! The one exception is `-m statistic --probability`: we write kube-proxy's `%0.10f`, the kernel
//! stores a 31-bit fraction and prints it back with 11 decimals (see [`kernel_probability`]).
//!
//! Layout (kube-proxy's iptables mode with `SWY-` prefixes):
//! - nat `SWY-SERVICES`: per service port its cluster IP (-> `SWY-SVC`/`SWY-SVL`), external IPs
//!   (-> `SWY-EXT`) and load-balancer IPs (-> `SWY-EXT`, or `SWY-FW` with source ranges); last the
//!   jump to `SWY-NODEPORTS`.
//! - nat `SWY-NODEPORTS`: node ports -> `SWY-EXT`.
//! - nat `SWY-SVC-*` (Cluster policy) / `SWY-SVL-*` (Local policy): masquerade rule, ClientIP
//!   affinity rules, then the probability cascade to `SWY-SEP-*`.
//! - nat `SWY-SEP-*`: hairpin masquerade, DNAT.
//! - filter `SWY-SERVICES` / `SWY-EXTERNAL-SERVICES`: REJECT (no endpoints) and DROP (Local policy
//!   without local endpoints); `SWY-PROXY-FIREWALL`: DROP what `SWY-FW` did not accept;
//!   `SWY-NODEPORTS`: health-check node ports; `SWY-FORWARD`: forwarding of marked/established
//!   traffic.

use std::collections::{BTreeMap, BTreeSet};

use crate::backend::Settings;
use crate::backend::names::{ipt_endpoint_chain, ipt_service_chain};
use crate::model::{Changes, Endpoint, IpFamily, Snapshot, categorize};

/// The spellings that differ between `iptables-save` and `ip6tables-save`.
struct Spelling {
    /// Host prefix suffix (`/32`, `/128`).
    host: &'static str,
    /// REJECT for services without endpoints.
    reject: &'static str,
    /// `recent --mask` of a whole address.
    mask: &'static str,
}

fn spelling(family: IpFamily) -> Spelling {
    match family {
        IpFamily::V4 => Spelling {
            host: "/32",
            reject: "REJECT --reject-with icmp-port-unreachable",
            mask: "255.255.255.255",
        },
        IpFamily::V6 => Spelling {
            host: "/128",
            reject: "REJECT --reject-with icmp6-port-unreachable",
            mask: "ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff",
        },
    }
}

/// Prefix of every chain this backend owns.
pub const CHAIN_PREFIX: &str = "SWY-";
/// Top-level dispatch chain (nat and filter).
pub const SERVICES: &str = "SWY-SERVICES";
/// filter: drops/rejects for external destinations.
pub const EXTERNAL_SERVICES: &str = "SWY-EXTERNAL-SERVICES";
/// Node ports (nat: DNAT dispatch; filter: health-check node ports).
pub const NODEPORTS: &str = "SWY-NODEPORTS";
/// nat: masquerade of marked traffic.
pub const POSTROUTING: &str = "SWY-POSTROUTING";
/// nat: sets the masquerade mark.
pub const MARK_MASQ: &str = "SWY-MARK-MASQ";
/// filter: forwarding of service traffic.
pub const FORWARD: &str = "SWY-FORWARD";
/// filter: drops load-balancer traffic not accepted by `loadBalancerSourceRanges`.
pub const PROXY_FIREWALL: &str = "SWY-PROXY-FIREWALL";
/// filter (INPUT, OUTPUT): the guard of localhost NodePorts, kube-proxy's rule in `KUBE-FIREWALL`.
pub const FIREWALL: &str = "SWY-FIREWALL";

/// Top-level chains of the filter table, always fully rewritten.
pub const FILTER_TOP_CHAINS: [&str; 6] = [
    EXTERNAL_SERVICES,
    FIREWALL,
    FORWARD,
    NODEPORTS,
    PROXY_FIREWALL,
    SERVICES,
];

/// The sysctl that lets the kernel route `127.0.0.0/8` destinations DNATed away from loopback.
pub const ROUTE_LOCALNET: &str = "net/ipv4/conf/all/route_localnet";

/// Whether a render of `family` with `settings` serves NodePorts on `127.0.0.1` (and so needs
/// [`ROUTE_LOCALNET`]): IPv4, NodePorts on every local address, and the setting on. IPv6 never
/// (the kernel has no route_localnet for `::1`), as in kube-proxy.
pub fn serves_localhost_node_ports(settings: &Settings, family: IpFamily) -> bool {
    family == IpFamily::V4 && settings.localhost_node_ports && settings.node_port_addresses(family).is_none()
}

/// kube-proxy's guard of localhost NodePorts (CVE-2020-8558): with route_localnet on, drop
/// packets to `127.0.0.0/8` from elsewhere that are not part of a connection conntrack knows
/// (replies, or a DNATed NodePort connection), as `iptables-save` prints it.
pub fn localnet_guard_rule() -> String {
    format!(
        "-A {FIREWALL} ! -s 127.0.0.0/8 -d 127.0.0.0/8 {} -m conntrack ! --ctstate RELATED,ESTABLISHED,DNAT -j DROP",
        comment("block incoming localnet connections")
    )
}
/// Top-level chains of the nat table, always fully rewritten.
pub const NAT_TOP_CHAINS: [&str; 4] = [MARK_MASQ, NODEPORTS, POSTROUTING, SERVICES];

/// One table of a render: chains by name, each with its full rule lines (`-A CHAIN ...`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TableRules {
    /// Chains written by this render (declared, hence flushed, by the restore) and their rules.
    pub chains: BTreeMap<String, Vec<String>>,
}

impl TableRules {
    fn declare(&mut self, chain: &str) {
        self.chains.entry(chain.to_owned()).or_default();
    }

    fn add(&mut self, chain: &str, spec: impl AsRef<str>) {
        self.chains
            .entry(chain.to_owned())
            .or_default()
            .push(format!("-A {chain} {}", spec.as_ref()));
    }

    fn merge(&mut self, other: TableRules) {
        for (chain, rules) in other.chains {
            self.chains.entry(chain).or_default().extend(rules);
        }
    }

    /// Number of rules written.
    pub fn rule_count(&self) -> usize {
        self.chains.values().map(Vec::len).sum()
    }

    /// Writes the `*table ... COMMIT` block; `stale` chains are flushed and deleted (`-X`).
    fn write(&self, name: &str, stale: &BTreeSet<String>, jumps: &[String], out: &mut String) {
        out.push('*');
        out.push_str(name);
        out.push('\n');
        let declared: BTreeSet<&str> = self
            .chains
            .keys()
            .map(String::as_str)
            .chain(stale.iter().map(String::as_str))
            .collect();
        for chain in &declared {
            out.push_str(&format!(":{chain} - [0:0]\n"));
        }
        for rules in self.chains.values() {
            for rule in rules {
                out.push_str(rule);
                out.push('\n');
            }
        }
        for jump in jumps {
            out.push_str(jump);
            out.push('\n');
        }
        for chain in stale {
            out.push_str(&format!("-X {chain}\n"));
        }
        out.push_str("COMMIT\n");
    }
}

/// The result of [`render`]: what to restore, plus what the whole desired state contains.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Rendered {
    /// Chains and rules to write in table `filter`.
    pub filter: TableRules,
    /// Chains and rules to write in table `nat` (on a partial render: top-level chains and the
    /// chains of changed services only).
    pub nat: TableRules,
    /// Every chain of table `filter` in the whole desired state.
    pub filter_chains: BTreeSet<String>,
    /// Every chain of table `nat` in the whole desired state, written by this render or not.
    pub nat_chains: BTreeSet<String>,
    /// Rules in the whole desired state (written or skipped).
    pub rules_total: usize,
    /// Endpoint (`SWY-SEP-*`) chains in the whole desired state.
    pub endpoints: usize,
    /// Service ports rendered.
    pub services: usize,
}

impl Rendered {
    /// `iptables-restore --noflush` input writing this render and deleting the `stale_*` chains.
    pub fn restore_input(&self, stale_filter: &BTreeSet<String>, stale_nat: &BTreeSet<String>) -> String {
        self.restore_input_with_jumps(stale_filter, stale_nat, &[], &[])
    }

    /// Restore input that also inserts jump rules from built-in chains (`-I CHAIN 1 ...` lines,
    /// which `--noflush` applies without flushing the built-in chain).
    pub fn restore_input_with_jumps(
        &self,
        stale_filter: &BTreeSet<String>,
        stale_nat: &BTreeSet<String>,
        filter_jumps: &[String],
        nat_jumps: &[String],
    ) -> String {
        let mut out = String::new();
        self.filter.write("filter", stale_filter, filter_jumps, &mut out);
        self.nat.write("nat", stale_nat, nat_jumps, &mut out);
        out
    }

    /// The render as text (restore input without deletions); for a full render this equals
    /// `iptables-save` of our chains (modulo [`kernel_probability`]).
    pub fn text(&self) -> String {
        self.restore_input(&BTreeSet::new(), &BTreeSet::new())
    }

    /// Chains plus rules this render writes (the size of the restore).
    pub fn objects(&self) -> usize {
        self.filter.chains.len() + self.nat.chains.len() + self.filter.rule_count() + self.nat.rule_count()
    }
}

/// Quotes `value` the way `iptables-save` does (`xtables_save_string`): bare when it consists of
/// `[A-Za-z0-9_-]` only, otherwise in double quotes with `"`, `'` and `\` escaped.
pub fn save_string(value: &str) -> String {
    let bare = !value.is_empty()
        && value
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
    if bare {
        return value.to_owned();
    }
    let mut out = String::with_capacity(value.len() + 2);
    out.push('"');
    for c in value.chars() {
        if matches!(c, '"' | '\'' | '\\') {
            out.push('\\');
        }
        out.push(c);
    }
    out.push('"');
    out
}

/// kube-proxy's probability of the rule for endpoint `i` of `n` counted from the end: `1/k` as
/// `%0.10f`.
pub fn probability(k: usize) -> String {
    format!("{:.10}", 1.0 / k as f64)
}

/// How the kernel prints back a `--probability` value `p`: xt_statistic stores
/// `lround(p * 2^31)` and `iptables-save` prints that fraction with `%.11f`.
pub fn kernel_probability(p: f64) -> String {
    let scale = f64::from(0x8000_0000u32);
    format!("{:.11}", (p * scale).round() / scale)
}

/// `-m comment --comment TEXT`, quoted as iptables-save prints it.
pub fn comment(text: &str) -> String {
    format!("-m comment --comment {}", save_string(text))
}

/// The forward-chain rules every iptables-based backend (iptables, IPVS) writes into its own
/// forward chain: drop conntrack-invalid packets, accept marked and established traffic.
pub fn forward_rules(mark: u32) -> [String; 3] {
    [
        "-m conntrack --ctstate INVALID -j DROP".to_owned(),
        format!(
            "{} -m mark --mark {mark:#x}/{mark:#x} -j ACCEPT",
            comment("switchyard forwarding rules")
        ),
        format!(
            "{} -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT",
            comment("switchyard forwarding conntrack rule")
        ),
    ]
}

/// The postrouting-chain rules of every iptables-based backend: masquerade what carries `mark`,
/// clearing the mark first.
pub fn postrouting_rules(mark: u32) -> [String; 3] {
    [
        format!("-m mark ! --mark {mark:#x}/{mark:#x} -j RETURN"),
        format!("-j MARK --set-xmark {mark:#x}/0x0"),
        format!(
            "{} -j MASQUERADE --random-fully",
            comment("switchyard service traffic requiring SNAT")
        ),
    ]
}

/// Renders `snapshot`. With `changes` (a partial sync) the per-service chains (`SWY-SVC/SVL/EXT/
/// FW/SEP`) of services not in `changes` are left out; top-level chains are always complete.
/// Pure and deterministic: services in `ServicePortName` order, chains sorted by name.
pub fn render(snapshot: &Snapshot, settings: &Settings, changes: Option<&Changes>) -> Rendered {
    let mut filter = TableRules::default();
    let mut nat = TableRules::default();
    for chain in FILTER_TOP_CHAINS {
        filter.declare(chain);
    }
    for chain in NAT_TOP_CHAINS {
        nat.declare(chain);
    }
    let mark = settings.masquerade_mark;

    // Fixed rules.
    for rule in forward_rules(mark) {
        filter.add(FORWARD, rule);
    }
    for rule in postrouting_rules(mark) {
        nat.add(POSTROUTING, rule);
    }
    nat.add(MARK_MASQ, format!("-j MARK --set-xmark {mark:#x}/{mark:#x}"));

    let mut rendered = Rendered {
        services: snapshot.services.len(),
        ..Rendered::default()
    };
    let no_endpoints: Vec<Endpoint> = Vec::new();
    for (name, sp) in &snapshot.services {
        let eps = snapshot.endpoints.get(name).unwrap_or(&no_endpoints);
        let mut own = TableRules::default();
        render_service(sp, eps, settings, &mut filter, &mut nat, &mut own);
        rendered.endpoints += own.chains.keys().filter(|c| c.starts_with("SWY-SEP-")).count();
        rendered.rules_total += own.rule_count();
        rendered.nat_chains.extend(own.chains.keys().cloned());
        let write = changes.is_none_or(|c| c.services.contains(&name.service));
        if write {
            nat.merge(own);
        }
    }

    // Last rule of nat SWY-SERVICES: node ports.
    let np_comment = comment("switchyard service nodeports; NOTE: this must be the last rule in this chain");
    let localhost = serves_localhost_node_ports(settings, snapshot.family);
    if localhost {
        let guard = localnet_guard_rule();
        filter.chains.entry(FIREWALL.to_owned()).or_default().push(guard);
    }
    match settings.node_port_addresses(snapshot.family) {
        // Every local address; loopback only with localhost NodePorts (IPv4 with route_localnet
        // and the guard rule above). Excluded, a connection to 127.0.0.1:<NodePort> is refused at
        // once (nothing listens there) instead of being DNATed into a route the kernel drops.
        None => {
            let not_loopback = match snapshot.family {
                IpFamily::V6 => "! -d ::1/128 ",
                IpFamily::V4 if localhost => "",
                IpFamily::V4 => "! -d 127.0.0.0/8 ",
            };
            nat.add(
                SERVICES,
                format!("{not_loopback}{np_comment} -m addrtype --dst-type LOCAL -j {NODEPORTS}"),
            )
        }
        Some(addresses) => {
            let host = spelling(snapshot.family).host;
            for ip in addresses {
                nat.add(SERVICES, format!("-d {ip}{host} {np_comment} -j {NODEPORTS}"));
            }
        }
    }

    rendered.filter_chains = filter.chains.keys().cloned().collect();
    rendered
        .nat_chains
        .extend(NAT_TOP_CHAINS.iter().map(|c| (*c).to_owned()));
    rendered.rules_total += filter.rule_count()
        + NAT_TOP_CHAINS
            .iter()
            .map(|c| nat.chains.get(*c).map_or(0, Vec::len))
            .sum::<usize>();
    rendered.filter = filter;
    rendered.nat = nat;
    rendered
}

/// Renders one service port: top-level rules into `filter` and `nat`, its own chains into `own`.
fn render_service(
    sp: &crate::model::ServicePort,
    eps: &[Endpoint],
    settings: &Settings,
    filter: &mut TableRules,
    nat: &mut TableRules,
    own: &mut TableRules,
) {
    let name = &sp.name;
    let svc = name.to_string();
    let proto = name.protocol.as_str();
    let cat = categorize(eps, &settings.node);
    let family = sp.family();
    let Spelling {
        host,
        mut reject,
        mask,
    } = spelling(family);
    match crate::backend::fast_reject(family) {
        (protocol, crate::backend::FastReject::TcpReset) if protocol == name.protocol => {
            reject = "REJECT --reject-with tcp-reset";
        }
        (protocol, crate::backend::FastReject::ProtocolUnreachable) if protocol == name.protocol => {
            reject = "REJECT --reject-with icmp-proto-unreachable";
        }
        _ => {}
    }

    // kube-proxy's UsesClusterEndpoints / UsesLocalEndpoints.
    let external = sp.externally_accessible();
    let uses_cluster = !sp.internal_policy_local || external;
    let uses_local = sp.internal_policy_local || (sp.external_policy_local && external);
    let cluster: &[&Endpoint] = if uses_cluster { &cat.cluster } else { &[] };
    let local: &[&Endpoint] = if uses_local { &cat.local } else { &[] };
    let has_endpoints = cat.has_any;

    let svc_chain = ipt_service_chain("SVC", name);
    let svl_chain = ipt_service_chain("SVL", name);
    let ext_chain = ipt_service_chain("EXT", name);
    let fw_chain = ipt_service_chain("FW", name);

    let uses_svc = !cluster.is_empty();
    let uses_svl = !local.is_empty();
    let internal_chain = if sp.internal_policy_local {
        &svl_chain
    } else {
        &svc_chain
    };
    let has_internal = if sp.internal_policy_local {
        !local.is_empty()
    } else {
        has_endpoints
    };
    let external_policy_chain = if sp.external_policy_local {
        &svl_chain
    } else {
        &svc_chain
    };
    let has_external = if sp.external_policy_local {
        !local.is_empty()
    } else {
        has_endpoints
    };
    let uses_ext = has_endpoints && external;
    let uses_fw = has_endpoints && !sp.load_balancer_ips.is_empty() && sp.has_source_ranges();
    let lb_chain = if uses_fw { &fw_chain } else { &ext_chain };

    // What filter does with traffic we cannot (or must not) forward.
    let (internal_target, external_target, filter_comment) = if !has_endpoints {
        (reject, reject, format!("{svc} has no endpoints"))
    } else {
        ("DROP", "DROP", format!("{svc} has no local endpoints"))
    };
    let filter_comment = comment(&filter_comment);
    let port = sp.port;
    // `-d IP/32 -p P -m comment --comment C -m P --dport PORT`
    let dest = |ip: &std::net::IpAddr, text: &str, dport: u16| {
        format!("-d {ip}{host} -p {proto} {text} -m {proto} --dport {dport}")
    };

    // Cluster IP.
    if has_internal {
        let text = comment(&format!("{svc} cluster IP"));
        nat.add(
            SERVICES,
            format!("{} -j {internal_chain}", dest(&sp.cluster_ip, &text, port)),
        );
        // Masquerade off-cluster traffic to the cluster IP (first rule of the internal chain).
        let masq_spec = dest(&sp.cluster_ip, &text, port);
        if settings.masquerade_all {
            own.add(internal_chain, format!("{masq_spec} -j {MARK_MASQ}"));
        } else if let Some(cidr) = settings.cluster_cidr(family) {
            own.add(
                internal_chain,
                format!("! -s {} {masq_spec} -j {MARK_MASQ}", cidr.trunc()),
            );
        }
    } else {
        filter.add(
            SERVICES,
            format!(
                "{} -j {internal_target}",
                dest(&sp.cluster_ip, &filter_comment, port)
            ),
        );
    }

    // External IPs.
    for ip in &sp.external_ips {
        if has_endpoints {
            let text = comment(&format!("{svc} external IP"));
            nat.add(SERVICES, format!("{} -j {ext_chain}", dest(ip, &text, port)));
        }
        if !has_external {
            filter.add(
                EXTERNAL_SERVICES,
                format!("{} -j {external_target}", dest(ip, &filter_comment, port)),
            );
        }
    }

    // Load-balancer IPs.
    for ip in &sp.load_balancer_ips {
        if has_endpoints {
            let text = comment(&format!("{svc} loadbalancer IP"));
            nat.add(SERVICES, format!("{} -j {lb_chain}", dest(ip, &text, port)));
        }
        if uses_fw {
            let text = comment(&format!("{svc} traffic not accepted by {fw_chain}"));
            filter.add(PROXY_FIREWALL, format!("{} -j DROP", dest(ip, &text, port)));
        }
    }
    if !has_external {
        for ip in &sp.load_balancer_ips {
            filter.add(
                EXTERNAL_SERVICES,
                format!("{} -j {external_target}", dest(ip, &filter_comment, port)),
            );
        }
    }

    // Node port.
    if let Some(node_port) = sp.node_port {
        if has_endpoints {
            nat.add(
                NODEPORTS,
                format!(
                    "-p {proto} {} -m {proto} --dport {node_port} -j {ext_chain}",
                    comment(&svc)
                ),
            );
        }
        if !has_external {
            filter.add(
                EXTERNAL_SERVICES,
                format!(
                    "-p {proto} {filter_comment} -m addrtype --dst-type LOCAL -m {proto} --dport {node_port} -j {external_target}"
                ),
            );
        }
    }

    // Health-check node port: always accepted.
    if let Some(hc) = sp.health_check_node_port {
        filter.add(
            NODEPORTS,
            format!(
                "-p tcp {} -m tcp --dport {hc} -j ACCEPT",
                comment(&format!("{svc} health check node port"))
            ),
        );
    }

    // External destinations chain.
    if uses_ext {
        own.declare(&ext_chain);
        if !sp.external_policy_local {
            own.add(
                &ext_chain,
                format!(
                    "{} -j {MARK_MASQ}",
                    comment(&format!("masquerade traffic for {svc} external destinations"))
                ),
            );
        } else {
            if let Some(cidr) = settings.cluster_cidr(family) {
                own.add(
                    &ext_chain,
                    format!(
                        "-s {} {} -j {svc_chain}",
                        cidr.trunc(),
                        comment(&format!("pod traffic for {svc} external destinations"))
                    ),
                );
            }
            own.add(
                &ext_chain,
                format!(
                    "{} -m addrtype --src-type LOCAL -j {MARK_MASQ}",
                    comment(&format!(
                        "masquerade LOCAL traffic for {svc} external destinations"
                    ))
                ),
            );
            own.add(
                &ext_chain,
                format!(
                    "{} -m addrtype --src-type LOCAL -j {svc_chain}",
                    comment(&format!("route LOCAL traffic for {svc} external destinations"))
                ),
            );
        }
        if has_external {
            own.add(&ext_chain, format!("-j {external_policy_chain}"));
        }
    }

    // Firewall chain (loadBalancerSourceRanges).
    if uses_fw {
        own.declare(&fw_chain);
        let text = comment(&format!("{svc} loadbalancer IP"));
        let mut allow_from_node = false;
        for range in &sp.load_balancer_source_ranges {
            own.add(&fw_chain, format!("-s {} {text} -j {ext_chain}", range.trunc()));
            allow_from_node |= settings.node.addresses.iter().any(|a| range.contains(a));
        }
        if allow_from_node {
            for ip in &sp.load_balancer_ips {
                own.add(&fw_chain, format!("-s {ip}{host} {text} -j {ext_chain}"));
            }
        }
    }

    if uses_svc {
        own.declare(&svc_chain);
        endpoint_rules(own, &svc, sp, &svc_chain, cluster);
    }
    if uses_svl {
        own.declare(&svl_chain);
        endpoint_rules(own, &svc, sp, &svl_chain, local);
    }

    // Endpoint chains of every locally reachable endpoint.
    let mut reachable: Vec<&Endpoint> = cluster.iter().chain(local.iter()).copied().collect();
    reachable.sort();
    reachable.dedup();
    for ep in reachable {
        let sep = ipt_endpoint_chain(name, ep);
        let text = comment(&svc);
        own.add(&sep, format!("-s {}{host} {text} -j {MARK_MASQ}", ep.ip));
        let affinity = match sp.affinity_timeout_seconds {
            Some(_) => format!(" -m recent --set --name {sep} --mask {mask} --rsource"),
            None => String::new(),
        };
        own.add(
            &sep,
            format!(
                "-p {proto} {text}{affinity} -m {proto} -j DNAT --to-destination {}",
                std::net::SocketAddr::new(ep.ip, ep.port)
            ),
        );
    }
}

/// The affinity rules and the probability cascade of `chain` to `endpoints`.
fn endpoint_rules(
    own: &mut TableRules,
    svc: &str,
    sp: &crate::model::ServicePort,
    chain: &str,
    endpoints: &[&Endpoint],
) {
    let mask = spelling(sp.family()).mask;
    if let Some(timeout) = sp.affinity_timeout_seconds {
        for ep in endpoints {
            let sep = ipt_endpoint_chain(&sp.name, ep);
            own.add(
                chain,
                format!(
                    "{} -m recent --rcheck --seconds {timeout} --reap --name {sep} --mask {mask} --rsource -j {sep}",
                    comment(&format!("{svc} -> {}", std::net::SocketAddr::new(ep.ip, ep.port)))
                ),
            );
        }
    }
    let n = endpoints.len();
    for (i, ep) in endpoints.iter().enumerate() {
        let sep = ipt_endpoint_chain(&sp.name, ep);
        let text = comment(&format!("{svc} -> {}", std::net::SocketAddr::new(ep.ip, ep.port)));
        if i + 1 < n {
            own.add(
                chain,
                format!(
                    "{text} -m statistic --mode random --probability {} -j {sep}",
                    probability(n - i)
                ),
            );
        } else {
            own.add(chain, format!("{text} -j {sep}"));
        }
    }
}
