//! IPVS backend: kube-proxy's IPVS mode with our own names (kubeproxy.md §3).
//!
//! A sync renders the snapshot ([`render::render`], pure), then converges the kernel:
//! 1. sysctls IPVS mode needs (`net/ipv4/vs/conntrack`, `expire_nodest_conn`,
//!    `expire_quiescent_template`, `ip_forward`) and the connection timeouts the settings ask for
//!    (`SET_CONFIG`, only those not 0 and not already in place); strictARP's `arp_ignore=1` /
//!    `arp_announce=2` are the runtime's ([`crate::node_sysctls`], which remembers the node's
//!    values and puts them back when IPVS stops asking or on `--cleanup`);
//! 2. the dummy link [`render::LINK`];
//! 3. the `SWY-*` ipsets that changed, each replaced atomically with one `ipset restore`;
//! 4. our iptables chains `SWY-IPVS-*` with one `iptables-restore --noflush` (on full syncs the
//!    jump rules from the built-in chains are brought to the bypass state in the same restore);
//! 5. the addresses on the dummy link (new ones before the virtual servers appear);
//! 6. the virtual servers, diffed against the kernel's dump (full syncs) or the last applied state
//!    (partial syncs), written in batched generic-netlink requests ([`crate::sys::ipvs`]);
//! 7. addresses no longer used are unbound.
//!
//! Ownership: a virtual server is ours when we created it, when its address is bound on the dummy
//! link, or when it sits on a node address in the NodePort range; never when its address is in
//! `excludeCIDRs`: syncs neither create, edit nor delete such a virtual server (a Service whose
//! address lies there is not served by IPVS), and cleanup leaves it, as kube-proxy's. Nothing
//! else in the host's IPVS table is touched (no flush).
//!
//! Settings: IPVS may not be rebuilt while it serves (graceful termination lives in its memory),
//! so it takes new settings in place ([`Backend::take_settings`]) and its next sync is full: a
//! new scheduler reaches the existing virtual servers with `SET_SERVICE` (real servers and their
//! connections stay), new timeouts with `SET_CONFIG`, new `excludeCIDRs` change what it owns.
//!
//! Graceful termination: a real server that leaves a TCP service is set to weight 0 (no new
//! connections) and deleted at a later sync once it has no active connection; UDP and SCTP real
//! servers are deleted at once (`expire_nodest_conn` drops their flows). A real server that comes
//! back while terminating gets weight 1 again.
//!
//! # Bypass (the switch's cut-over primitive, [`Backend::set_bypass`])
//!
//! Where IPVS sits (kernel 6.1, `ip_vs_core.c`): it schedules remote clients' packets in
//! LOCAL_IN (priority 99, after filter INPUT at 0), so only packets whose destination is a local
//! address — a service address bound on [`LINK`] or a node address — reach it; and node-local
//! clients' packets in LOCAL_OUT at -98, after nat OUTPUT (-100). nftables' and iptables' DNAT
//! runs in nat PREROUTING/OUTPUT at -100, before routing: a connection another backend DNATs
//! never reaches IPVS. Both nf_nat and IPVS decide once per connection: later packets follow
//! the conntrack NAT binding (nftables/iptables) or IPVS's own connection table.
//!
//! Bypassed, every object stays programmed (virtual servers, real servers, ipsets, chains, and
//! the addresses on [`LINK`]), but the jump rules from the built-in chains into `SWY-IPVS-*`
//! ([`render::JUMPS`]) are removed and one jump from filter INPUT into [`render::BYPASS`] is
//! inserted instead; that chain rejects (ICMP port unreachable) every *new* connection to an
//! IPVS destination: bound service addresses, external and load-balancer addresses, node ports.
//! Entering or leaving the bypass is one `iptables-restore --noflush` of only those jump rules
//! (filter committed first when closing, nat first when opening). Why not unbind the
//! addresses or set the link down: unbinding makes the addresses non-local, so packets of
//! connections IPVS already serves would no longer reach it and those connections would break
//! at the cut-over (and rebinding thousands of addresses is not one step); link state does not
//! matter at all — the local routes of a down dummy link's addresses stay, which is why
//! kube-proxy keeps `kube-ipvs0` down (checked in the VM tier).
//!
//! Guarantees:
//! - A bypassed IPVS backend accepts no new connection arriving from other hosts or pods: when
//!   another backend is active its DNAT takes the connection first; when none is, the bypass
//!   chain refuses it (no local socket on the node answers for a service address either).
//! - Connections IPVS already serves keep working while it is bypassed (their packets are not
//!   `NEW`, and the addresses stay local), until [`Backend::cleanup`] removes the virtual servers
//!   and the link. Unlike a DNAT binding in conntrack, IPVS's binding lives in its own connection
//!   table, which packets stop reaching once the addresses are gone: leaving IPVS ends the
//!   connections it still serves at Cleaning (connections through nftables/iptables survive
//!   both directions).
//! - Node-local clients: IPVS's LOCAL_OUT hook runs after nat OUTPUT, so an active
//!   nftables/iptables backend takes them first; a bypassed IPVS backend alone would still
//!   schedule a node-local connection (filter OUTPUT runs after IPVS has rewritten it, and
//!   nothing before nat OUTPUT may drop it without also breaking the other backend).
//! - Un-bypassing is one step and opens every entry point; the state survives later syncs (full
//!   syncs bring the jump rules to it in the same restore that rewrites the chains).
//!
//! Hence both directions of a switch with nftables or iptables are make-before-break with the
//! driver's order (un-bypass new, then bypass old): *to* IPVS, its virtual servers and bound
//! addresses are in place while the old backend still DNATs every new connection, and new
//! connections fall through to IPVS the moment the old one is bypassed; *from* IPVS, the new
//! backend's DNAT takes new connections as soon as it is un-bypassed, before IPVS is bypassed.
//! Measured with traffic in the VM tier (`vm_k_*`: the switch driver under a client load).
//!
//! # Adapters
//! [`IpvsBackend`] reaches the kernel only through its adapters: iptables tools
//! ([`SaveRestore`]), the IPVS table ([`IpvsTable`]), ipsets ([`Ipsets`]), links ([`Links`]) and
//! sysctls ([`Sysctl`]). [`IpvsBackend::new`] uses the kernel's; tests pass fakes to
//! [`IpvsBackend::with_adapters`] (the conformance suite runs on both).

pub mod render;

#[cfg(test)]
mod tests;

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, Ipv4Addr};

use switchyard_crds::v1alpha1::{IpvsScheduler, IpvsSettings, ProxyMode};

use crate::backend::{Backend, BackendError, Settings, SyncStats};
use crate::model::{Changes, DualSnapshot, Ipv4Net, Snapshot};
use crate::sys::KernelError;
use crate::sys::ipset::{self, Ipsets, KernelIpsets};
use crate::sys::iptables::{Iptables, IptablesError, SaveRestore, Table, Variant};
use crate::sys::ipvs::{Destination, IpvsTable, KernelIpvs, Op, ServiceKey, Timeouts, VirtualAddr};
use crate::sys::link::{KernelLinks, Links};
use crate::sys::sysctl::{HostSysctl, Sysctl};

use render::{Desired, JumpEdits, LINK};

const BACKEND: &str = "ipvs";

/// IPVS-mode settings (KubeProxyConfiguration `ipvs`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IpvsOptions {
    /// Scheduler of every virtual service (`rr`, `wrr`, `lc`, `wlc`, `lblc`, `lblcr`, `sh`, `dh`,
    /// `sed`, `nq`, `fo`, `ovf`, `mh`, `twos`).
    pub scheduler: String,
    /// Set `arp_ignore=1` and `arp_announce=2` so the node does not answer ARP for the service
    /// addresses on the dummy link (written by the runtime, see the module doc).
    pub strict_arp: bool,
    /// Virtual servers on addresses in these CIDRs are never touched or cleaned up.
    pub exclude_cidrs: Vec<Ipv4Net>,
    /// Connection timeouts to set (`ipvsadm --set`); a 0 leaves the kernel's.
    pub timeouts: Timeouts,
}

impl Default for IpvsOptions {
    fn default() -> Self {
        Self {
            scheduler: "rr".into(),
            strict_arp: false,
            exclude_cidrs: Vec::new(),
            timeouts: Timeouts::default(),
        }
    }
}

impl IpvsOptions {
    /// The options a policy's `proxy.ipvs` asks for, kube-proxy's defaults where it is silent:
    /// `rr`, no strictARP, nothing excluded, timeouts left alone (absent, 0 or negative). IPv6
    /// CIDRs and unparsable ones are left out (IPVS mode programs IPv4 only; the CRD validates
    /// them).
    pub fn from_policy(policy: Option<&IpvsSettings>) -> Self {
        let Some(p) = policy else {
            return Self::default();
        };
        let seconds = |v: Option<i32>| v.and_then(|v| u32::try_from(v).ok()).unwrap_or(0);
        Self {
            scheduler: p.scheduler.map_or("rr", scheduler_name).to_owned(),
            strict_arp: p.strict_arp.unwrap_or(false),
            exclude_cidrs: p
                .exclude_cidrs
                .iter()
                .filter_map(|c| c.trim().parse::<Ipv4Net>().ok())
                .map(|n| n.trunc())
                .collect(),
            timeouts: Timeouts {
                tcp: seconds(p.tcp_timeout_seconds),
                tcp_fin: seconds(p.tcp_fin_timeout_seconds),
                udp: seconds(p.udp_timeout_seconds),
            },
        }
    }
}

/// The kernel's name of `scheduler` (`ip_vs_<name>`).
pub fn scheduler_name(scheduler: IpvsScheduler) -> &'static str {
    match scheduler {
        IpvsScheduler::Rr => "rr",
        IpvsScheduler::Wrr => "wrr",
        IpvsScheduler::Lc => "lc",
        IpvsScheduler::Wlc => "wlc",
        IpvsScheduler::Lblc => "lblc",
        IpvsScheduler::Lblcr => "lblcr",
        IpvsScheduler::Sh => "sh",
        IpvsScheduler::Dh => "dh",
        IpvsScheduler::Sed => "sed",
        IpvsScheduler::Nq => "nq",
        IpvsScheduler::Fo => "fo",
        IpvsScheduler::Ovf => "ovf",
        IpvsScheduler::Mh => "mh",
        IpvsScheduler::Twos => "twos",
    }
}

/// An IPVS adapter's error: a socket failure as the agent's, a refusal as the kernel's.
fn ipvs_err(e: KernelError) -> BackendError {
    match e {
        KernelError::Transport(e) => BackendError::Agent(e),
        other => BackendError::Kernel {
            backend: BACKEND,
            detail: other.to_string(),
        },
    }
}

fn cmd_err(command: &str) -> impl Fn(String) -> BackendError + '_ {
    move |detail| BackendError::Command {
        backend: BACKEND,
        command: command.to_owned(),
        detail,
    }
}

fn ipt_err(e: IptablesError) -> BackendError {
    BackendError::Command {
        backend: BACKEND,
        command: e.command().to_owned(),
        detail: e.detail(),
    }
}

/// A real server identity within one virtual server.
type RealKey = (VirtualAddr, IpAddr, u16);

/// The IPVS data plane, on the kernel's adapters unless built [`with_adapters`](Self::with_adapters).
#[derive(Debug)]
pub struct IpvsBackend<
    I: SaveRestore = Iptables,
    T: IpvsTable = KernelIpvs,
    P: Ipsets = KernelIpsets,
    L: Links = KernelLinks,
    S: Sysctl = HostSysctl,
> {
    settings: Settings,
    ipt: I,
    ipvs: T,
    ipsets: P,
    links: L,
    sysctl: S,
    /// Virtual servers and real servers (weight 1) applied by the last successful sync.
    applied: BTreeMap<VirtualAddr, (crate::sys::ipvs::Service, BTreeSet<(Ipv4Addr, u16)>)>,
    /// Real servers kept at weight 0 until their connections end.
    terminating: BTreeSet<RealKey>,
    /// Set contents applied by the last successful sync.
    sets: BTreeMap<String, ipset::SetSpec>,
    /// Addresses bound on the link after the last successful sync.
    bound: BTreeSet<Ipv4Addr>,
    /// Node addresses NodePorts were programmed on.
    node_port_ips: Vec<Ipv4Addr>,
    /// Rules per (table is nat, chain) written by the last successful sync.
    rules: BTreeMap<(bool, &'static str), usize>,
    needs_full: bool,
    /// Whether the "IPv4 only" warning was logged.
    warned_ipv6: bool,
    /// Entry points off (see the module doc).
    bypassed: bool,
    /// Our chains were written since the last cleanup (jump rules may reference them).
    programmed: bool,
}

impl IpvsBackend {
    /// A backend using the `variant` iptables tools, in the current network namespace.
    pub fn new(variant: Variant, settings: Settings) -> Self {
        Self::with_adapters(
            settings,
            Iptables::new(variant, None),
            KernelIpvs::new(),
            KernelIpsets,
            KernelLinks,
            HostSysctl::new(None),
        )
    }
}

impl<I: SaveRestore, T: IpvsTable, P: Ipsets, L: Links, S: Sysctl> IpvsBackend<I, T, P, L, S> {
    /// A backend on the given adapters: IPv4 iptables tools, IPVS table, ipsets, links, sysctls.
    pub fn with_adapters(settings: Settings, ipt: I, ipvs: T, ipsets: P, links: L, sysctl: S) -> Self {
        Self {
            settings,
            ipt,
            ipvs,
            ipsets,
            links,
            sysctl,
            applied: BTreeMap::new(),
            terminating: BTreeSet::new(),
            sets: BTreeMap::new(),
            bound: BTreeSet::new(),
            node_port_ips: Vec::new(),
            rules: BTreeMap::new(),
            needs_full: true,
            warned_ipv6: false,
            bypassed: false,
            programmed: false,
        }
    }

    /// Whether the entry points are off.
    pub fn bypassed(&self) -> bool {
        self.bypassed
    }

    /// The settings it renders with.
    pub fn settings(&self) -> &Settings {
        &self.settings
    }

    /// Real servers currently draining (weight 0, waiting for their connections to end).
    pub fn terminating(&self) -> &BTreeSet<(VirtualAddr, IpAddr, u16)> {
        &self.terminating
    }

    /// The iptables tools.
    pub fn iptables(&self) -> &I {
        &self.ipt
    }

    /// The iptables tools, to inject faults.
    pub fn iptables_mut(&mut self) -> &mut I {
        &mut self.ipt
    }

    /// The IPVS table.
    pub fn ipvs_table(&self) -> &T {
        &self.ipvs
    }

    /// The IPVS table, to inject faults or play traffic on a fake.
    pub fn ipvs_table_mut(&mut self) -> &mut T {
        &mut self.ipvs
    }

    /// The ipsets.
    pub fn ipsets(&self) -> &P {
        &self.ipsets
    }

    /// The ipsets, to inject faults.
    pub fn ipsets_mut(&mut self) -> &mut P {
        &mut self.ipsets
    }

    /// The links.
    pub fn links(&self) -> &L {
        &self.links
    }

    /// The links, to inject faults or add node addresses on a fake.
    pub fn links_mut(&mut self) -> &mut L {
        &mut self.links
    }

    /// Local IPv4 addresses outside the dummy link, except loopback (where NodePorts may go).
    /// kube-proxy's `kube-ipvs0` carries service addresses, not node ones (while a takeover
    /// removes it), as kube-proxy leaves it out too.
    fn node_addresses(&self) -> Result<Vec<Ipv4Addr>, BackendError> {
        let all = self
            .links
            .all_addresses()
            .map_err(|e| cmd_err("ip addr")(e.to_string()))?;
        Ok(all
            .into_iter()
            .filter(|(dev, a)| dev != LINK && dev != crate::takeover::KUBE_IPVS_LINK && !a.is_loopback())
            .map(|(_, a)| a)
            .collect())
    }

    fn excluded(&self, addr: &IpAddr) -> bool {
        match addr {
            IpAddr::V4(a) => self.settings.ipvs.exclude_cidrs.iter().any(|c| c.contains(a)),
            IpAddr::V6(_) => true,
        }
    }

    /// The addresses NodePort virtual servers go on: the configured ones, or every local IPv4
    /// address except loopback and the dummy link's.
    pub fn node_port_addresses(&self) -> Result<Vec<Ipv4Addr>, BackendError> {
        if let Some(list) = self.settings.node_port_addresses(crate::model::IpFamily::V4) {
            return Ok(render::ipv4s(&list));
        }
        let mut ips = self.node_addresses()?;
        ips.sort();
        ips.dedup();
        Ok(ips)
    }

    /// Renders with the node addresses this backend would use (reads local addresses when the
    /// settings do not list NodePort addresses).
    pub fn desired(&self, snapshot: &Snapshot) -> Result<Desired, BackendError> {
        Ok(render::render(
            snapshot,
            &self.settings,
            &self.node_port_addresses()?,
        ))
    }

    fn sysctls(&mut self) -> Result<(), BackendError> {
        let list = [
            ("net/ipv4/vs/conntrack", "1"),
            ("net/ipv4/vs/expire_nodest_conn", "1"),
            ("net/ipv4/vs/expire_quiescent_template", "1"),
            ("net/ipv4/ip_forward", "1"),
        ];
        for (path, value) in list {
            self.sysctl
                .ensure(path, value)
                .map_err(|e| cmd_err("sysctl")(format!("{path}={value}: {e}")))?;
        }
        Ok(())
    }

    /// The timeouts the settings ask for, where the kernel's differ (`None`: nothing to write).
    fn timeouts_to_set(&self) -> Result<Option<Timeouts>, BackendError> {
        let want = self.settings.ipvs.timeouts;
        if want.is_unset() {
            return Ok(None);
        }
        let current = self.ipvs.timeouts().map_err(ipvs_err)?;
        Ok((want.over(current) != current).then_some(want))
    }

    /// Sets the connection timeouts the settings ask for (`SET_CONFIG`), when they differ.
    fn timeouts(&mut self) -> Result<usize, BackendError> {
        match self.timeouts_to_set()? {
            Some(t) => {
                self.ipvs.set_timeouts(&t).map_err(ipvs_err)?;
                Ok(1)
            }
            None => Ok(0),
        }
    }

    /// The jump rule edits that bring the kernel to the current bypass state.
    fn jump_edits(&self) -> Result<JumpEdits, BackendError> {
        let (filter, nat) = match (self.ipt.save(Table::Filter), self.ipt.save(Table::Nat)) {
            (Ok(filter), Ok(nat)) => (filter, nat),
            // Without the variant's tools there are no jump rules of ours.
            (Err(IptablesError::Spawn { .. }), _) | (_, Err(IptablesError::Spawn { .. })) => {
                (String::new(), String::new())
            }
            (Err(e), _) | (_, Err(e)) => return Err(ipt_err(e)),
        };
        Ok(JumpEdits::compute(self.bypassed, &filter, &nat))
    }

    /// Whether kernel virtual server `v` is ours (see the module doc).
    fn owns(
        &self,
        v: &VirtualAddr,
        desired: &Desired,
        linked: &BTreeSet<Ipv4Addr>,
        node_ips: &[Ipv4Addr],
    ) -> bool {
        if self.excluded(&v.addr) {
            return false;
        }
        let IpAddr::V4(a) = v.addr else { return false };
        desired.virtual_servers.contains_key(v)
            || self.applied.contains_key(v)
            || linked.contains(&a)
            || (node_ips.contains(&a) && render::NODE_PORT_RANGE.contains(&v.port))
    }

    fn sync_inner(&mut self, snapshot: &Snapshot, full: bool) -> Result<SyncStats, BackendError> {
        let mut objects = 0;
        if full {
            self.sysctls()?;
            objects += self.timeouts()?;
            if self
                .links
                .ensure_dummy(LINK)
                .map_err(|e| cmd_err("ip link")(e.to_string()))?
            {
                objects += 1;
            }
            self.node_port_ips = self.node_port_addresses()?;
        }
        let desired = render::render(snapshot, &self.settings, &self.node_port_ips);

        // ipsets (before the rules that reference them).
        let changed: Vec<&ipset::SetSpec> = desired
            .sets
            .values()
            .filter(|s| full || self.sets.get(&s.name) != Some(*s))
            .collect();
        self.ipsets
            .restore(&changed)
            .map_err(|e| cmd_err("ipset restore")(e.to_string()))?;
        objects += changed.iter().map(|s| s.entries.len() + 1).sum::<usize>();

        // iptables: the chains are small and fixed; rewrite them every sync (with the jump rules
        // on full syncs, in the same commits).
        let jumps = if full {
            self.jump_edits()?
        } else {
            JumpEdits::default()
        };
        self.ipt
            .restore(&desired.restore_input_with(&jumps))
            .map_err(ipt_err)?;
        self.programmed = true;
        objects += desired.filter.rule_count() + desired.nat.rule_count() + jumps.len();
        self.rules = [(false, &desired.filter), (true, &desired.nat)]
            .into_iter()
            .flat_map(|(nat, t)| t.chains.iter().map(move |(c, r)| ((nat, *c), r.len())))
            .collect();

        // Addresses: bind new ones first.
        let linked = if full {
            self.links
                .addresses(LINK)
                .map_err(|e| cmd_err("ip addr")(e.to_string()))?
        } else {
            self.bound.clone()
        };
        let add: BTreeSet<Ipv4Addr> = desired.bind.difference(&linked).copied().collect();
        self.links
            .update_addresses(LINK, &add, &BTreeSet::new())
            .map_err(|e| cmd_err("ip -batch")(e.to_string()))?;
        objects += add.len();

        objects += self.sync_ipvs(&desired, &linked, full)?;

        let remove: BTreeSet<Ipv4Addr> = linked.difference(&desired.bind).copied().collect();
        self.links
            .update_addresses(LINK, &BTreeSet::new(), &remove)
            .map_err(|e| cmd_err("ip -batch")(e.to_string()))?;
        objects += remove.len();

        self.bound = desired.bind.clone();
        self.sets = desired.sets.clone();
        self.applied = desired
            .virtual_servers
            .iter()
            .filter(|(k, _)| !self.excluded(&k.addr))
            .map(|(k, v)| (*k, (v.service.clone(), v.reals.clone())))
            .collect();
        Ok(SyncStats {
            full,
            services: desired.services,
            endpoints: desired.endpoints,
            objects_written: objects,
            rules_total: desired.objects(),
        })
    }

    /// Converges the IPVS table; returns the number of requests sent.
    fn sync_ipvs(
        &mut self,
        desired: &Desired,
        linked: &BTreeSet<Ipv4Addr>,
        full: bool,
    ) -> Result<usize, BackendError> {
        let node_ips = self.node_port_ips.clone();
        let listed = self.ipvs.services().map_err(ipvs_err)?;
        let mut kernel: BTreeMap<VirtualAddr, crate::sys::ipvs::Service> = BTreeMap::new();
        for (key, svc) in listed {
            if let (ServiceKey::Addr(v), Some(svc)) = (key, svc)
                && self.owns(&v, desired, linked, &node_ips)
            {
                kernel.insert(v, svc);
            }
        }
        let (mut adds, mut dest_ops, mut deletes) = (Vec::new(), Vec::new(), Vec::new());
        let mut terminating = BTreeSet::new();
        for (key, vs) in desired
            .virtual_servers
            .iter()
            .filter(|(k, _)| !self.excluded(&k.addr))
        {
            let Some(current) = kernel.get(key) else {
                adds.push(Op::AddService(vs.service.clone()));
                for (ip, port) in &vs.reals {
                    adds.push(Op::AddDest(*key, Destination::masq(IpAddr::V4(*ip), *port, 1)));
                }
                continue;
            };
            if *current != vs.service {
                adds.push(Op::UpdateService(vs.service.clone()));
            }
            let draining = self.terminating.iter().any(|(v, _, _)| v == key);
            let unchanged = self.applied.get(key).is_some_and(|(_, reals)| *reals == vs.reals);
            if !full && unchanged && !draining {
                continue;
            }
            let dests = self.ipvs.destinations(key).map_err(ipvs_err)?;
            let want = |d: &Destination| match d.addr {
                IpAddr::V4(a) => vs.reals.contains(&(a, d.port)),
                IpAddr::V6(_) => false,
            };
            for d in &dests {
                if want(d) {
                    if d.weight != 1 || d.fwd_method != crate::sys::ipvs::FWD_MASQ {
                        dest_ops.push(Op::UpdateDest(*key, Destination::masq(d.addr, d.port, 1)));
                    }
                } else if key.protocol != crate::sys::ipvs::Protocol::Tcp || d.active_conns == 0 {
                    dest_ops.push(Op::DeleteDest(*key, d.addr, d.port));
                } else {
                    if d.weight != 0 {
                        dest_ops.push(Op::UpdateDest(
                            *key,
                            Destination {
                                weight: 0,
                                ..d.clone()
                            },
                        ));
                    }
                    terminating.insert((*key, d.addr, d.port));
                }
            }
            for (ip, port) in &vs.reals {
                if !dests.iter().any(|d| d.addr == IpAddr::V4(*ip) && d.port == *port) {
                    dest_ops.push(Op::AddDest(*key, Destination::masq(IpAddr::V4(*ip), *port, 1)));
                }
            }
        }
        for key in kernel.keys().filter(|k| !desired.virtual_servers.contains_key(k)) {
            deletes.push(Op::DeleteService(*key));
        }
        let mut ops = adds;
        ops.extend(dest_ops);
        ops.extend(deletes);
        let refused = self.ipvs.apply(&ops).map_err(ipvs_err)?;
        self.terminating = terminating;
        if let Some((_, error)) = refused.first() {
            return Err(BackendError::Kernel {
                backend: BACKEND,
                detail: format!(
                    "{} of {} IPVS requests refused; first: {error}",
                    refused.len(),
                    ops.len(),
                ),
            });
        }
        Ok(ops.len())
    }

    fn cleanup_ipvs(&mut self) -> Result<(), BackendError> {
        let listed = match self.ipvs.services() {
            Ok(listed) => listed,
            // No IPVS in this kernel: nothing of ours can exist.
            Err(KernelError::Unsupported { .. }) => return Ok(()),
            Err(e) => return Err(ipvs_err(e)),
        };
        let linked = self
            .links
            .addresses(LINK)
            .map_err(|e| cmd_err("ip addr")(e.to_string()))?;
        let node_ips = self.node_addresses()?;
        let empty = Desired::default();
        let ops: Vec<Op> = listed
            .into_iter()
            .filter_map(|(key, _)| match key {
                ServiceKey::Addr(v) if self.owns(&v, &empty, &linked, &node_ips) => {
                    Some(Op::DeleteService(v))
                }
                _ => None,
            })
            .collect();
        let refused = self.ipvs.apply(&ops).map_err(ipvs_err)?;
        // Not found: somebody else removed it meanwhile (IPVS answers ESRCH).
        if let Some((_, error)) = refused.iter().find(|(_, e)| !e.is_not_found()) {
            return Err(BackendError::Kernel {
                backend: BACKEND,
                detail: error.to_string(),
            });
        }
        Ok(())
    }

    /// Differences between the kernel and the last sync (see [`Backend::verify`]).
    fn drift(&self) -> Result<Vec<String>, BackendError> {
        let mut drift = Vec::new();
        if !self.programmed || self.needs_full {
            drift.push("not programmed (the last sync did not succeed)".to_owned());
            return Ok(drift);
        }
        // The link and its addresses.
        if !self
            .links
            .exists(LINK)
            .map_err(|e| cmd_err("ip link")(e.to_string()))?
        {
            drift.push(format!("link {LINK} is missing"));
        }
        let linked = self
            .links
            .addresses(LINK)
            .map_err(|e| cmd_err("ip addr")(e.to_string()))?;
        diff_sets(&mut drift, &format!("address on {LINK}"), &self.bound, &linked);

        // ipsets, from one `ipset save`.
        let kernel_sets = self
            .ipsets
            .save_all(ipset::SET_PREFIX)
            .map_err(|e| cmd_err("ipset save")(e.to_string()))?;
        for (name, spec) in &self.sets {
            match kernel_sets.get(name) {
                None => drift.push(format!("ipset {name} is missing")),
                Some(entries) => diff_sets(
                    &mut drift,
                    &format!("entry of ipset {name}"),
                    &spec.entries,
                    entries,
                ),
            }
        }

        self.iptables_drift(&mut drift)?;
        self.ipvs_drift(&mut drift, &linked)?;
        if let Some(t) = self.timeouts_to_set()? {
            let have = self.ipvs.timeouts().map_err(ipvs_err)?;
            drift.push(format!(
                "IPVS timeouts are {have:?}, want the non-zero ones of {t:?}"
            ));
        }
        Ok(drift)
    }

    /// Drift of our iptables chains (their rule counts) and of the jump rules of the bypass state.
    fn iptables_drift(&self, drift: &mut Vec<String>) -> Result<(), BackendError> {
        for table in [Table::Filter, Table::Nat] {
            let nat = table == Table::Nat;
            let save = self.ipt.save(table).map_err(ipt_err)?;
            for ((_, chain), want) in self.rules.iter().filter(|((n, _), _)| *n == nat) {
                let declared = format!(":{chain} ");
                let prefix = format!("-A {chain} ");
                if !save.lines().any(|l| l.starts_with(&declared)) {
                    drift.push(format!("chain {chain} ({}) is missing", table.as_str()));
                    continue;
                }
                let have = save.lines().filter(|l| l.starts_with(&prefix)).count();
                if have != *want {
                    drift.push(format!("chain {chain} has {have} rules, want {want}"));
                }
            }
            let (filter, nat_save) = if nat {
                ("", save.as_str())
            } else {
                (save.as_str(), "")
            };
            let edits = JumpEdits::compute(self.bypassed, filter, nat_save);
            for line in if nat { &edits.nat } else { &edits.filter } {
                drift.push(format!(
                    "jump rule to fix ({}, bypassed={}): {line}",
                    table.as_str(),
                    self.bypassed
                ));
            }
        }

        Ok(())
    }

    /// Drift of our virtual servers and their real servers.
    fn ipvs_drift(
        &self,
        drift: &mut Vec<String>,
        linked: &BTreeSet<std::net::Ipv4Addr>,
    ) -> Result<(), BackendError> {
        let node_ips = self.node_port_ips.clone();
        let empty = Desired::default();
        let mut kernel = BTreeMap::new();
        for (key, svc) in self.ipvs.services().map_err(ipvs_err)? {
            if let (ServiceKey::Addr(v), Some(svc)) = (key, svc)
                && self.owns(&v, &empty, linked, &node_ips)
            {
                kernel.insert(v, svc);
            }
        }
        for key in kernel.keys().filter(|k| !self.applied.contains_key(k)) {
            drift.push(format!("virtual server {key:?} is not ours to keep"));
        }
        for (key, (service, reals)) in &self.applied {
            let Some(current) = kernel.get(key) else {
                drift.push(format!("virtual server {key:?} is missing"));
                continue;
            };
            if current != service {
                drift.push(format!("virtual server {key:?} is {current:?}, want {service:?}"));
            }
            let mut want: BTreeSet<(IpAddr, u16, u32)> = reals
                .iter()
                .map(|(ip, port)| (IpAddr::V4(*ip), *port, 1))
                .collect();
            want.extend(
                self.terminating
                    .iter()
                    .filter(|(v, _, _)| v == key)
                    .map(|(_, ip, port)| (*ip, *port, 0)),
            );
            let have: BTreeSet<(IpAddr, u16, u32)> = self
                .ipvs
                .destinations(key)
                .map_err(ipvs_err)?
                .into_iter()
                .map(|d| (d.addr, d.port, d.weight))
                .collect();
            diff_sets(
                drift,
                &format!("real server (addr, port, weight) of {key:?}"),
                &want,
                &have,
            );
        }
        Ok(())
    }

    /// Destroys every `SWY-*` set (none when the `ipset` tool is not installed).
    fn cleanup_ipsets(&mut self) -> Result<(), BackendError> {
        let names: Vec<String> = match self.ipsets.save_all(ipset::SET_PREFIX) {
            Ok(sets) => sets.into_keys().collect(),
            Err(ipset::IpsetError::Spawn { .. }) => return Ok(()),
            Err(e) => return Err(cmd_err("ipset list")(e.to_string())),
        };
        self.ipsets
            .destroy(&names)
            .map_err(|e| cmd_err("ipset destroy")(e.to_string()))
    }

    /// Removes our jump rules and `SWY-IPVS-*` chains from filter and nat. A table is read whole
    /// (`iptables-save`) only when it holds one of [`render::CHAINS`], every chain IPVS mode writes;
    /// jump rules cannot outlive the chains they jump to.
    fn cleanup_iptables(&mut self) -> Result<(), BackendError> {
        for table in [Table::Filter, Table::Nat] {
            // By name first: beside another mode's rules (iptables-nft mode at 10k Services) a
            // whole-table read costs seconds, and most cleanups find nothing of ours.
            match self
                .ipt
                .existing_chains(table, &render::chains(table == Table::Nat))
            {
                Ok(found) if found.is_empty() => continue,
                Ok(_) => {}
                Err(IptablesError::Spawn { .. }) => continue,
                Err(e) => return Err(ipt_err(e)),
            }
            let save = match self.ipt.save(table) {
                Ok(s) => s,
                // The variant's tools are not installed: nothing of ours there.
                Err(IptablesError::Spawn { .. }) => continue,
                Err(e) => return Err(ipt_err(e)),
            };
            let Some(input) = render::cleanup_input(table == Table::Nat, &save) else {
                continue;
            };
            // One restore: the jump rules as iptables-save printed them, then our chains.
            if self.ipt.restore(&input).is_ok() {
                continue;
            }
            // A jump rule in another spelling: remove the jumps one by one (`iptables -C/-D`).
            for jump in render::all_jumps() {
                if jump.nat == (table == Table::Nat) {
                    let declared = format!(":{} ", jump.target);
                    if save.lines().any(|l| l.starts_with(&declared)) {
                        self.ipt
                            .remove_rule(table, jump.chain, &jump.spec())
                            .map_err(ipt_err)?;
                    }
                }
            }
            let save = self.ipt.save(table).map_err(ipt_err)?;
            if let Some(input) = render::cleanup_input(table == Table::Nat, &save) {
                self.ipt.restore(&input).map_err(ipt_err)?;
            }
        }
        Ok(())
    }
}

/// Appends "missing"/"unexpected" lines for the differences between `want` and `have` (at most
/// a few each, with the total).
fn diff_sets<T: Ord + std::fmt::Debug>(
    drift: &mut Vec<String>,
    what: &str,
    want: &BTreeSet<T>,
    have: &BTreeSet<T>,
) {
    const SHOWN: usize = 3;
    for (label, list) in [
        ("missing", want.difference(have).collect::<Vec<_>>()),
        ("unexpected", have.difference(want).collect::<Vec<_>>()),
    ] {
        if !list.is_empty() {
            let shown: Vec<String> = list.iter().take(SHOWN).map(|x| format!("{x:?}")).collect();
            let more = list.len().saturating_sub(SHOWN);
            let tail = if more > 0 {
                format!(" and {more} more")
            } else {
                String::new()
            };
            drift.push(format!("{label} {what}: {}{tail}", shown.join(", ")));
        }
    }
}

impl<I: SaveRestore, T: IpvsTable, P: Ipsets, L: Links, S: Sysctl> Backend for IpvsBackend<I, T, P, L, S> {
    fn mode(&self) -> ProxyMode {
        ProxyMode::Ipvs
    }

    fn presence(&self) -> Result<super::Presence, BackendError> {
        let (filter, nat) = match (self.ipt.save(Table::Filter), self.ipt.save(Table::Nat)) {
            (Ok(filter), Ok(nat)) => (filter, nat),
            // Without the variant's tools there are no jump rules of ours.
            (Err(IptablesError::Spawn { .. }), _) | (_, Err(IptablesError::Spawn { .. })) => {
                (String::new(), String::new())
            }
            (Err(e), _) | (_, Err(e)) => return Err(ipt_err(e)),
        };
        let linked = self
            .links
            .exists(LINK)
            .map_err(|e| cmd_err("ip link")(e.to_string()))?;
        let chains = [&filter, &nat]
            .iter()
            .any(|save| save.lines().any(|l| l.starts_with(":SWY-IPVS")));
        if !linked && !chains {
            return Ok(super::Presence::Absent);
        }
        // Serving: the jump rules are in their un-bypassed state (nothing to edit to get there).
        Ok(if JumpEdits::compute(false, &filter, &nat).is_empty() {
            super::Presence::Serving
        } else {
            super::Presence::Bypassed
        })
    }

    /// Programs the IPv4 snapshot: IPVS mode is IPv4-only here (IPv6 services are logged once
    /// and left to the other modes).
    fn sync(
        &mut self,
        snapshot: &DualSnapshot,
        _changes: &Changes,
        full: bool,
    ) -> Result<SyncStats, BackendError> {
        if !snapshot.v6.services.is_empty() && !self.warned_ipv6 {
            tracing::warn!(
                services = snapshot.v6.services.len(),
                "IPVS mode programs IPv4 only; IPv6 service ports are not served in this mode"
            );
            self.warned_ipv6 = true;
        }
        // Partial syncs diff against the last applied state (the change set is implied by it).
        let full = full || self.needs_full;
        let result = self.sync_inner(&snapshot.v4, full);
        self.needs_full = result.is_err();
        result
    }

    fn cleanup(&mut self) -> Result<(), BackendError> {
        self.needs_full = true;
        self.programmed = false;
        self.rules.clear();
        self.applied.clear();
        self.terminating.clear();
        self.sets.clear();
        self.bound.clear();
        // Independent parts, each tried whatever the others did; every failure is reported.
        let mut errors: Vec<BackendError> = Vec::new();
        errors.extend(self.cleanup_ipvs().err());
        if let Err(e) = self.links.delete(LINK) {
            errors.push(cmd_err("ip link del")(e.to_string()));
        }
        match self.cleanup_iptables() {
            // Sets last: iptables rules referencing them block their destruction.
            Ok(()) => errors.extend(self.cleanup_ipsets().err()),
            // Our chains still reference the sets, which the kernel would refuse to destroy: they
            // stay for the next cleanup, and this error says why.
            Err(e) => errors.push(e),
        }
        BackendError::collect(errors)
    }

    /// Takes `settings` in place (see the module doc): the next sync is full and programs them;
    /// what is draining keeps draining.
    fn take_settings(&mut self, settings: &Settings) -> bool {
        if *settings != self.settings {
            self.settings = settings.clone();
            self.needs_full = true;
        }
        true
    }

    fn render_text(&self, snapshot: &DualSnapshot) -> String {
        let ips = self
            .node_port_addresses()
            .unwrap_or_else(|_| render::ipv4s(&self.settings.node.addresses));
        render::render(&snapshot.v4, &self.settings, &ips).text()
    }

    /// See the module doc: toggles only the jump rules (one `iptables-restore`); virtual
    /// servers, sets, chains and bound addresses stay. Before the first sync it only records the
    /// state, which that sync then programs.
    fn set_bypass(&mut self, bypassed: bool) -> Result<(), BackendError> {
        self.bypassed = bypassed;
        if !self.programmed {
            return Ok(());
        }
        let edits = self.jump_edits()?;
        if edits.is_empty() {
            return Ok(());
        }
        self.ipt.restore(&edits.restore_input(bypassed)).map_err(ipt_err)
    }

    /// Reads back the link addresses, ipsets (one `ipset save`), our chains' rule counts, the
    /// jump rules (against the bypass state) and our virtual and real servers (one dump per
    /// virtual server), and lists every difference from the last sync.
    fn verify(&self) -> Result<Vec<String>, BackendError> {
        self.drift()
    }
}
