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
use std::net::{IpAddr, SocketAddr};

use crate::backend::Settings;
use crate::backend::names::{ipt_endpoint_chain, ipt_service_chain};
use crate::model::{Changes, Endpoint, IpFamily, Protocol, ServicePort, Snapshot, categorize};

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
    /// Whether the per-endpoint rules were written without comments ([`large_cluster`]).
    pub large_cluster: bool,
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

/// iptables mode's forward-chain rules: [`forward_rules`] with the conntrack-invalid drop counted
/// into kube-proxy's nfacct counter (`kubeproxy_iptables_ct_state_invalid_dropped_packets_total`,
/// the migration preflight's measure of what nftables mode would let through). `iptables-save`
/// prints two spaces before the name.
pub fn counted_forward_rules(mark: u32) -> [String; 3] {
    let [_, marked, established] = forward_rules(mark);
    [
        format!(
            "-m conntrack --ctstate INVALID -m nfacct --nfacct-name  {} -j DROP",
            crate::sys::nfacct::CT_STATE_INVALID_DROPPED
        ),
        marked,
        established,
    ]
}

/// Counts the packets of NodePort connections made to `127.0.0.0/8` (both directions: they are
/// DNATed from a loopback destination) into kube-proxy's nfacct counter
/// (`kubeproxy_iptables_localhost_nodeports_accepted_packets_total`), in `SWY-FIREWALL` after the
/// guard; no verdict.
pub fn localhost_counter_rule() -> String {
    format!(
        "-A {FIREWALL} {} -m conntrack --ctstate DNAT --ctorigdst 127.0.0.0/8 -m nfacct --nfacct-name  {}",
        comment("count localhost nodeport packets"),
        crate::sys::nfacct::LOCALHOST_NODEPORTS_ACCEPTED
    )
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

/// More endpoints than this in a family and its per-endpoint rules carry no comments
/// (kube-proxy's `largeClusterEndpointsThreshold`).
pub const LARGE_CLUSTER_ENDPOINTS: usize = 1000;

/// Whether `snapshot` is a large cluster: more than [`LARGE_CLUSTER_ENDPOINTS`] endpoints. Its
/// rules to and in the endpoint chains then carry no `-m comment` (as kube-proxy's do not): three
/// quarters of the comments at 2 endpoints per service, and each costs restore input, kernel
/// memory and, in iptables-nft, a compat match that every later restore reads back.
pub fn large_cluster(snapshot: &Snapshot) -> bool {
    snapshot.endpoints.values().map(Vec::len).sum::<usize>() > LARGE_CLUSTER_ENDPOINTS
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
    for rule in counted_forward_rules(mark) {
        filter.add(FORWARD, rule);
    }
    for rule in postrouting_rules(mark) {
        nat.add(POSTROUTING, rule);
    }
    nat.add(MARK_MASQ, format!("-j MARK --set-xmark {mark:#x}/{mark:#x}"));

    let mut rendered = Rendered {
        services: snapshot.services.len(),
        large_cluster: large_cluster(snapshot),
        ..Rendered::default()
    };
    let no_endpoints: Vec<Endpoint> = Vec::new();
    for (name, sp) in &snapshot.services {
        let eps = snapshot.endpoints.get(name).unwrap_or(&no_endpoints);
        let mut own = TableRules::default();
        render_service(
            sp,
            eps,
            settings,
            rendered.large_cluster,
            [&mut filter, &mut nat, &mut own],
        );
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
        let firewall = filter.chains.entry(FIREWALL.to_owned()).or_default();
        firewall.push(guard);
        firewall.push(localhost_counter_rule());
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
    sp: &ServicePort,
    eps: &[Endpoint],
    settings: &Settings,
    large_cluster: bool,
    [filter, nat, own]: [&mut TableRules; 3],
) {
    let mut port = PortRules::new(sp, eps, settings);
    port.endpoint_comments = !large_cluster;
    port.cluster_ip(filter, nat, own);
    port.external_ips(filter, nat);
    port.load_balancer_ips(filter, nat);
    port.node_port(filter, nat);
    port.health_check_node_port(filter);
    if port.uses_ext {
        port.external_chain(own);
    }
    if port.uses_fw {
        port.firewall_chain(own);
    }
    port.policy_chains(own);
    port.endpoint_chains(own);
}

/// One service port being rendered: its spellings, its endpoints per traffic policy, its chain
/// names and what it uses, read by every stage of [`render_service`].
struct PortRules<'a> {
    sp: &'a ServicePort,
    settings: &'a Settings,
    /// The port's name, the base of its comments.
    svc: String,
    /// Whether the rules to and in its endpoint chains carry comments (not in a large cluster).
    endpoint_comments: bool,
    proto: &'static str,
    host: &'static str,
    mask: &'static str,
    /// Endpoints for Cluster traffic policies (empty when no policy uses them).
    cluster: Vec<&'a Endpoint>,
    /// Node-local endpoints for Local traffic policies (empty when no policy uses them).
    local: Vec<&'a Endpoint>,
    has_endpoints: bool,
    svc_chain: String,
    svl_chain: String,
    ext_chain: String,
    fw_chain: String,
    /// Whether the ClusterIP has endpoints for the internal policy.
    has_internal: bool,
    /// Whether the external destinations have endpoints for the external policy.
    has_external: bool,
    uses_ext: bool,
    uses_fw: bool,
    /// What filter does with traffic we cannot (or must not) forward: REJECT without any
    /// endpoint, DROP without local ones.
    filter_target: &'static str,
    filter_comment: String,
}

impl<'a> PortRules<'a> {
    fn new(sp: &'a ServicePort, eps: &'a [Endpoint], settings: &'a Settings) -> Self {
        let name = &sp.name;
        let svc = name.to_string();
        let cat = categorize(eps, &settings.node);
        let Spelling { host, reject, mask } = spelling(sp.family());
        let reject = protocol_reject(sp.family(), name.protocol).unwrap_or(reject);

        // kube-proxy's UsesClusterEndpoints / UsesLocalEndpoints.
        let external = sp.externally_accessible();
        let uses_cluster = !sp.internal_policy_local || external;
        let uses_local = sp.internal_policy_local || (sp.external_policy_local && external);
        let cluster = if uses_cluster { cat.cluster } else { Vec::new() };
        let local = if uses_local { cat.local } else { Vec::new() };
        let has_endpoints = cat.has_any;
        let has_internal = if sp.internal_policy_local {
            !local.is_empty()
        } else {
            has_endpoints
        };
        let has_external = if sp.external_policy_local {
            !local.is_empty()
        } else {
            has_endpoints
        };
        let (filter_target, filter_comment) = if !has_endpoints {
            (reject, format!("{svc} has no endpoints"))
        } else {
            ("DROP", format!("{svc} has no local endpoints"))
        };
        Self {
            sp,
            settings,
            proto: name.protocol.as_str(),
            host,
            mask,
            svc_chain: ipt_service_chain("SVC", name),
            svl_chain: ipt_service_chain("SVL", name),
            ext_chain: ipt_service_chain("EXT", name),
            fw_chain: ipt_service_chain("FW", name),
            has_internal,
            has_external,
            uses_ext: has_endpoints && external,
            uses_fw: has_endpoints && !sp.load_balancer_ips.is_empty() && sp.has_source_ranges(),
            filter_target,
            filter_comment: comment(&filter_comment),
            svc,
            endpoint_comments: true,
            cluster,
            local,
            has_endpoints,
        }
    }

    /// The chain of the internal traffic policy.
    fn internal_chain(&self) -> &str {
        if self.sp.internal_policy_local {
            &self.svl_chain
        } else {
            &self.svc_chain
        }
    }

    /// The chain of the external traffic policy.
    fn external_policy_chain(&self) -> &str {
        if self.sp.external_policy_local {
            &self.svl_chain
        } else {
            &self.svc_chain
        }
    }

    /// `-d IP/32 -p P -m comment --comment C -m P --dport PORT`
    fn dest(&self, ip: &IpAddr, text: &str, dport: u16) -> String {
        let (host, proto) = (self.host, self.proto);
        format!("-d {ip}{host} -p {proto} {text} -m {proto} --dport {dport}")
    }

    /// The filter rule for an external IP or load-balancer IP without endpoints.
    fn blocked_external(&self, filter: &mut TableRules, ip: &IpAddr) {
        let spec = self.dest(ip, &self.filter_comment, self.sp.port);
        filter.add(EXTERNAL_SERVICES, format!("{spec} -j {}", self.filter_target));
    }

    /// Cluster IP: dispatched to the internal chain, whose first rule masquerades off-cluster
    /// traffic; without endpoints rejected (or dropped) in filter.
    fn cluster_ip(&self, filter: &mut TableRules, nat: &mut TableRules, own: &mut TableRules) {
        let sp = self.sp;
        if !self.has_internal {
            let spec = self.dest(&sp.cluster_ip, &self.filter_comment, sp.port);
            filter.add(SERVICES, format!("{spec} -j {}", self.filter_target));
            return;
        }
        let internal_chain = self.internal_chain();
        let text = comment(&format!("{} cluster IP", self.svc));
        let spec = self.dest(&sp.cluster_ip, &text, sp.port);
        nat.add(SERVICES, format!("{spec} -j {internal_chain}"));
        if self.settings.masquerade_all {
            own.add(internal_chain, format!("{spec} -j {MARK_MASQ}"));
        } else if let Some(cidr) = self.settings.cluster_cidr(sp.family()) {
            own.add(
                internal_chain,
                format!("! -s {} {spec} -j {MARK_MASQ}", cidr.trunc()),
            );
        }
    }

    /// External IPs: to the external destinations chain, blocked in filter without endpoints.
    fn external_ips(&self, filter: &mut TableRules, nat: &mut TableRules) {
        for ip in &self.sp.external_ips {
            if self.has_endpoints {
                let text = comment(&format!("{} external IP", self.svc));
                let spec = self.dest(ip, &text, self.sp.port);
                nat.add(SERVICES, format!("{spec} -j {}", self.ext_chain));
            }
            if !self.has_external {
                self.blocked_external(filter, ip);
            }
        }
    }

    /// Load-balancer IPs: to the firewall chain with source ranges (dropping in filter what it
    /// did not accept), else to the external destinations chain.
    fn load_balancer_ips(&self, filter: &mut TableRules, nat: &mut TableRules) {
        let lb_chain = if self.uses_fw {
            &self.fw_chain
        } else {
            &self.ext_chain
        };
        for ip in &self.sp.load_balancer_ips {
            if self.has_endpoints {
                let text = comment(&format!("{} loadbalancer IP", self.svc));
                let spec = self.dest(ip, &text, self.sp.port);
                nat.add(SERVICES, format!("{spec} -j {lb_chain}"));
            }
            if self.uses_fw {
                let text = comment(&format!("{} traffic not accepted by {}", self.svc, self.fw_chain));
                let spec = self.dest(ip, &text, self.sp.port);
                filter.add(PROXY_FIREWALL, format!("{spec} -j DROP"));
            }
        }
        // After every load-balancer IP's own rules, as kube-proxy writes them.
        if !self.has_external {
            for ip in &self.sp.load_balancer_ips {
                self.blocked_external(filter, ip);
            }
        }
    }

    /// Node port: to the external destinations chain, blocked in filter without endpoints.
    fn node_port(&self, filter: &mut TableRules, nat: &mut TableRules) {
        let Some(node_port) = self.sp.node_port else {
            return;
        };
        let proto = self.proto;
        if self.has_endpoints {
            nat.add(
                NODEPORTS,
                format!(
                    "-p {proto} {} -m {proto} --dport {node_port} -j {}",
                    comment(&self.svc),
                    self.ext_chain
                ),
            );
        }
        if !self.has_external {
            filter.add(
                EXTERNAL_SERVICES,
                format!(
                    "-p {proto} {} -m addrtype --dst-type LOCAL -m {proto} --dport {node_port} -j {}",
                    self.filter_comment, self.filter_target
                ),
            );
        }
    }

    /// Health-check node port: always accepted.
    fn health_check_node_port(&self, filter: &mut TableRules) {
        if let Some(hc) = self.sp.health_check_node_port {
            filter.add(
                NODEPORTS,
                format!(
                    "-p tcp {} -m tcp --dport {hc} -j ACCEPT",
                    comment(&format!("{} health check node port", self.svc))
                ),
            );
        }
    }

    /// External destinations chain: with a Cluster policy masquerade everything; with a Local
    /// policy pod and node traffic goes to all endpoints (node traffic masqueraded), the rest
    /// to the policy chain.
    fn external_chain(&self, own: &mut TableRules) {
        let (svc, svc_chain, ext_chain) = (&self.svc, &self.svc_chain, &self.ext_chain);
        own.declare(ext_chain);
        if !self.sp.external_policy_local {
            own.add(
                ext_chain,
                format!(
                    "{} -j {MARK_MASQ}",
                    comment(&format!("masquerade traffic for {svc} external destinations"))
                ),
            );
        } else {
            if let Some(cidr) = self.settings.cluster_cidr(self.sp.family()) {
                own.add(
                    ext_chain,
                    format!(
                        "-s {} {} -j {svc_chain}",
                        cidr.trunc(),
                        comment(&format!("pod traffic for {svc} external destinations"))
                    ),
                );
            }
            own.add(
                ext_chain,
                format!(
                    "{} -m addrtype --src-type LOCAL -j {MARK_MASQ}",
                    comment(&format!(
                        "masquerade LOCAL traffic for {svc} external destinations"
                    ))
                ),
            );
            own.add(
                ext_chain,
                format!(
                    "{} -m addrtype --src-type LOCAL -j {svc_chain}",
                    comment(&format!("route LOCAL traffic for {svc} external destinations"))
                ),
            );
        }
        if self.has_external {
            own.add(ext_chain, format!("-j {}", self.external_policy_chain()));
        }
    }

    /// Firewall chain (loadBalancerSourceRanges): allowed sources go on to the external
    /// destinations chain, and the load-balancer IPs themselves when a range holds the node.
    fn firewall_chain(&self, own: &mut TableRules) {
        let (fw_chain, ext_chain, host) = (&self.fw_chain, &self.ext_chain, self.host);
        own.declare(fw_chain);
        let text = comment(&format!("{} loadbalancer IP", self.svc));
        let mut allow_from_node = false;
        for range in &self.sp.load_balancer_source_ranges {
            own.add(fw_chain, format!("-s {} {text} -j {ext_chain}", range.trunc()));
            allow_from_node |= self.settings.node.addresses.iter().any(|a| range.contains(a));
        }
        if allow_from_node {
            for ip in &self.sp.load_balancer_ips {
                own.add(fw_chain, format!("-s {ip}{host} {text} -j {ext_chain}"));
            }
        }
    }

    /// The policy chains in use: `SWY-SVC` over the cluster endpoints, `SWY-SVL` over the
    /// local ones.
    fn policy_chains(&self, own: &mut TableRules) {
        if !self.cluster.is_empty() {
            own.declare(&self.svc_chain);
            endpoint_rules(
                own,
                self.endpoint_comment(),
                self.sp,
                &self.svc_chain,
                &self.cluster,
            );
        }
        if !self.local.is_empty() {
            own.declare(&self.svl_chain);
            endpoint_rules(
                own,
                self.endpoint_comment(),
                self.sp,
                &self.svl_chain,
                &self.local,
            );
        }
    }

    /// The base of the comments of the rules to and in the endpoint chains, if they carry any.
    fn endpoint_comment(&self) -> Option<&str> {
        self.endpoint_comments.then_some(self.svc.as_str())
    }

    /// Endpoint chains of every locally reachable endpoint: hairpin masquerade, then the DNAT
    /// (recording the client for ClientIP affinity).
    fn endpoint_chains(&self, own: &mut TableRules) {
        let (proto, host, mask) = (self.proto, self.host, self.mask);
        let mut reachable: Vec<&Endpoint> = self.cluster.iter().chain(self.local.iter()).copied().collect();
        reachable.sort();
        reachable.dedup();
        for ep in reachable {
            let sep = ipt_endpoint_chain(&self.sp.name, ep);
            let text = self
                .endpoint_comment()
                .map(|c| format!(" {}", comment(c)))
                .unwrap_or_default();
            own.add(&sep, format!("-s {}{host}{text} -j {MARK_MASQ}", ep.ip));
            let affinity = match self.sp.affinity_timeout_seconds {
                Some(_) => format!(" -m recent --set --name {sep} --mask {mask} --rsource"),
                None => String::new(),
            };
            own.add(
                &sep,
                format!(
                    "-p {proto}{text}{affinity} -m {proto} -j DNAT --to-destination {}",
                    SocketAddr::new(ep.ip, ep.port)
                ),
            );
        }
    }
}

/// The REJECT of `protocol`'s services without endpoints when [`crate::backend::fast_reject`]
/// picks that protocol in `family` (a TCP reset or protocol-unreachable), else `None`.
fn protocol_reject(family: IpFamily, protocol: Protocol) -> Option<&'static str> {
    match crate::backend::fast_reject(family) {
        (p, crate::backend::FastReject::TcpReset) if p == protocol => Some("REJECT --reject-with tcp-reset"),
        (p, crate::backend::FastReject::ProtocolUnreachable) if p == protocol => {
            Some("REJECT --reject-with icmp-proto-unreachable")
        }
        _ => None,
    }
}

/// The affinity rules and the probability cascade of `chain` to `endpoints`, commented with
/// `svc -> endpoint` unless `svc` is `None` (a large cluster).
fn endpoint_rules(
    own: &mut TableRules,
    svc: Option<&str>,
    sp: &ServicePort,
    chain: &str,
    endpoints: &[&Endpoint],
) {
    let mask = spelling(sp.family()).mask;
    // `-m comment …` and a separating space, or nothing.
    let text = |ep: &Endpoint| {
        svc.map(|svc| {
            format!(
                "{} ",
                comment(&format!("{svc} -> {}", SocketAddr::new(ep.ip, ep.port)))
            )
        })
        .unwrap_or_default()
    };
    if let Some(timeout) = sp.affinity_timeout_seconds {
        for ep in endpoints {
            let sep = ipt_endpoint_chain(&sp.name, ep);
            own.add(
                chain,
                format!(
                    "{}-m recent --rcheck --seconds {timeout} --reap --name {sep} --mask {mask} --rsource -j {sep}",
                    text(ep)
                ),
            );
        }
    }
    let n = endpoints.len();
    for (i, ep) in endpoints.iter().enumerate() {
        let sep = ipt_endpoint_chain(&sp.name, ep);
        let text = text(ep);
        if i + 1 < n {
            own.add(
                chain,
                format!(
                    "{text}-m statistic --mode random --probability {} -j {sep}",
                    probability(n - i)
                ),
            );
        } else {
            own.add(chain, format!("{text}-j {sep}"));
        }
    }
}
