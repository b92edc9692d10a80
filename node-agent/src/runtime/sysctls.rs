//! Applies the policy's `proxy.conntrack`, the `route_localnet` localhost NodePorts need, and
//! the `arp_ignore`/`arp_announce` of IPVS's strictARP to the node's sysctls: reads the current values, writes what [`crate::node_sysctls::plan`] says
//! through the [`Sysctl`] adapter, and keeps the values it replaced in the state file so that they
//! are put back when nothing asks any more (or on `--cleanup`, [`restore_from`]). It runs when the
//! asked-for values change (and once at start), never in a retry loop: a knob the kernel refuses
//! (`nf_conntrack_max` and the hash size are host-global, read-only inside a non-initial network
//! namespace; any of them under a read-only `/proc/sys`) is logged once with the reason and
//! reported in the `ConntrackSysctls` or `LocalhostNodePorts` status condition.
//!
//! The data planes serve NodePorts on 127.0.0.1 only once `route_localnet` is known to be 1
//! ([`ConntrackSysctls::gate_localhost`]), and `route_localnet` is put back only after a round
//! whose settings no longer serve them ([`ConntrackSysctls::release_pending`]): in between, the
//! kernel would drop DNATed packets and a client would wait for a SYN retransmission instead of
//! being served or refused at once.

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use switchyard_crds::v1alpha1::{ConntrackSettings, ProxyMode};

use crate::{
    backend::{Settings, iptables, nftables},
    model::IpFamily,
    node_sysctls::{self, Knob, Plan, Replaced, Wanted},
    state_store::StateFile,
    switch::SwitchState,
    sys::{
        host,
        sysctl::{HostSysctl, Sysctl},
    },
};

/// The status condition's type.
pub(super) const CONDITION: &str = "ConntrackSysctls";

/// The type of the condition on `route_localnet` for localhost NodePorts.
pub(super) const LOCALNET_CONDITION: &str = "LocalhostNodePorts";

/// Whether a data plane programmed now (the serving one, and during a switch its target) would
/// serve NodePorts on 127.0.0.1 with `settings` (the policy's and the flags', before
/// [`ConntrackSysctls::gate_localhost`]), and so needs `route_localnet=1`.
pub(super) fn localhost_wanted(settings: &Settings, state: &SwitchState) -> bool {
    let serves = |mode: ProxyMode| match mode {
        ProxyMode::Iptables => iptables::render::serves_localhost_node_ports(settings, IpFamily::V4),
        ProxyMode::Nftables => nftables::render::serves_localhost_node_ports(settings, IpFamily::V4),
        _ => false,
    };
    std::iter::once(state.active).chain(state.target).any(serves)
}

/// Whether IPVS serves (or, during a switch, is the target) with strictARP in `settings`, and so
/// needs `arp_ignore=1` / `arp_announce=2`.
pub(super) fn strict_arp_wanted(settings: &Settings, state: &SwitchState) -> bool {
    settings.ipvs.strict_arp
        && std::iter::once(state.active)
            .chain(state.target)
            .any(|m| m == ProxyMode::Ipvs)
}

/// The adapter's name of a knob: its path under `/proc/sys/`, or the absolute path of a file
/// elsewhere (the hash size under `/sys/module/`; joined to `/proc/sys` an absolute path stays
/// itself).
fn sysctl_name(knob: Knob) -> &'static str {
    knob.path().strip_prefix("/proc/sys/").unwrap_or(knob.path())
}

/// The node's values now; a knob that cannot be read is absent.
fn current() -> BTreeMap<Knob, u64> {
    Knob::ALL
        .into_iter()
        .filter_map(|k| {
            let value = host::sysctl_i64(sysctl_name(k))?;
            u64::try_from(value).ok().map(|v| (k, v))
        })
        .collect()
}

/// The CPUs this agent may run on, as kube-proxy's `runtime.NumCPU()` counts them: the CPU
/// affinity mask, not a cgroup CPU quota (which `available_parallelism` would follow, giving a
/// pod with a CPU limit a smaller table than kube-proxy).
fn cores() -> u32 {
    let affinity = nix::sched::sched_getaffinity(nix::unistd::Pid::from_raw(0)).ok();
    let count = affinity.map_or(0, |set| {
        (0..nix::sched::CpuSet::count())
            .filter(|cpu| set.is_set(*cpu).unwrap_or(false))
            .count()
    });
    if count > 0 {
        u32::try_from(count).unwrap_or(u32::MAX)
    } else {
        std::thread::available_parallelism().map_or(1, |n| u32::try_from(n.get()).unwrap_or(u32::MAX))
    }
}

/// Why a refused knob stays as it is, for the log and the condition.
fn refusal(knob: Knob, error: &str) -> String {
    let scope = if knob.per_netns() {
        ""
    } else {
        " (host-global: writable only from the node's initial network namespace)"
    };
    if error.contains(knob.path()) {
        format!("{error}{scope}")
    } else {
        format!("{}: {error}{scope}", knob.path())
    }
}

/// Performs `plan`'s writes; returns the replaced values that hold afterwards and the refusals.
/// A refused write replaces nothing: the values remembered before stay remembered.
fn perform(sysctl: &mut dyn Sysctl, plan: Plan, before: &Replaced) -> (Replaced, BTreeMap<Knob, String>) {
    let mut replaced = plan.replaced;
    let mut refused = BTreeMap::new();
    for (knob, value) in plan.writes {
        if let Err(e) = sysctl.ensure(sysctl_name(knob), &value.to_string()) {
            refused.insert(knob, refusal(knob, &e.to_string()));
            replaced.0.remove(&knob);
            if let Some(old) = before.0.get(&knob) {
                replaced.0.insert(knob, *old);
            }
        }
    }
    (replaced, refused)
}

/// The conntrack sysctls of this node, as the policy asks for them, and `route_localnet`.
#[derive(Debug)]
pub(super) struct ConntrackSysctls {
    file: StateFile,
    sysctl: HostSysctl,
    /// What was asked for at the last pass (none before the first).
    applied: Option<Wanted>,
    replaced: Replaced,
    /// Knobs the kernel refused, with the reason already logged.
    refused: BTreeMap<Knob, String>,
    /// The last settings [`Self::gate_localhost`] handed on served localhost NodePorts.
    served: bool,
    /// The last round wanted localhost NodePorts (whether or not they could be served).
    wanted: bool,
}

/// The status conditions a pass changed, by type (`None`: no such condition any more).
pub(super) type Conditions = [(&'static str, Option<Condition>); 2];

impl ConntrackSysctls {
    /// Sysctls of the agent's network namespace, remembering replaced values in `file`.
    pub fn new(file: StateFile) -> Self {
        let replaced = file.load_sysctls();
        Self {
            file,
            sysctl: HostSysctl::new(None),
            applied: None,
            replaced,
            refused: BTreeMap::new(),
            served: false,
            wanted: false,
        }
    }

    /// Localhost NodePorts in `settings` only while they are `wanted` and `route_localnet` is 1
    /// as the last pass asked (none before the first pass, none where the kernel refused it):
    /// the data planes then refuse 127.0.0.1:<NodePort> at once instead of DNATing into a route
    /// the kernel drops.
    pub fn gate_localhost(&mut self, settings: &mut Settings, wanted: bool) {
        self.wanted = wanted;
        self.served = wanted && self.route_localnet_set();
        if !self.served {
            settings.localhost_node_ports = false;
            settings.nftables_localhost_node_ports = false;
        }
    }

    /// Whether the last pass asked for `route_localnet` (held, or set).
    fn route_localnet_asked(&self) -> bool {
        self.applied
            .as_ref()
            .is_some_and(|w| w.contains_key(&Knob::RouteLocalnet))
    }

    /// Whether the last pass set `route_localnet` (asked for it, and the kernel took it).
    fn route_localnet_set(&self) -> bool {
        self.route_localnet_asked() && !self.refused.contains_key(&Knob::RouteLocalnet)
    }

    /// Whether `route_localnet` is still held for rules that the round just synced has removed:
    /// the next pass puts it back, so another round should follow soon. Not while the rules
    /// still want it (a `route_localnet` the kernel refused stays asked for: no release is due,
    /// and asking for another round each time would loop).
    pub fn release_pending(&self) -> bool {
        !self.wanted && self.route_localnet_asked()
    }

    /// Brings the sysctls to what `settings` ask for, with `route_localnet=1` when `localhost`
    /// or while the rules last handed on still serve them, and strictARP's values when
    /// `strict_arp`, if that changed since the last pass; returns the status conditions when
    /// they may have changed.
    pub fn apply(
        &mut self,
        settings: Option<&ConntrackSettings>,
        localhost: bool,
        strict_arp: bool,
    ) -> Option<Conditions> {
        let localhost = localhost || self.served;
        let wanted = node_sysctls::with_route_localnet(node_sysctls::wanted(settings, cores()), localhost);
        let wanted = node_sysctls::with_strict_arp(wanted, strict_arp);
        if self.applied.as_ref() == Some(&wanted) {
            return None;
        }
        let plan = node_sysctls::plan(&wanted, &current(), &self.replaced);
        let writes = plan.writes.clone();
        let (replaced, refused) = perform(&mut self.sysctl, plan, &self.replaced);
        for (knob, why) in refused
            .iter()
            .filter(|(k, why)| self.refused.get(*k) != Some(*why))
        {
            if knob.is_conntrack() {
                tracing::warn!(knob = ?knob, reason = %why, "conntrack sysctl not written; the node keeps its value");
            } else if *knob != Knob::RouteLocalnet {
                tracing::warn!(knob = ?knob, reason = %why, "strictARP sysctl not written: the node may answer ARP for service addresses");
            } else {
                tracing::warn!(reason = %why, "route_localnet cannot be set: NodePorts on 127.0.0.1 are refused");
            }
        }
        if !writes.is_empty() {
            tracing::info!(?writes, refused = refused.len(), "node sysctls written");
        }
        if replaced != self.replaced {
            if let Err(e) = self.file.store_sysctls(&replaced) {
                tracing::warn!(error = %e, "storing the replaced conntrack sysctl values failed");
            }
            self.replaced = replaced;
        }
        self.refused = refused;
        let conditions = [
            (CONDITION, condition(&wanted, &self.refused)),
            (LOCALNET_CONDITION, localnet_condition(localhost, &self.refused)),
        ];
        self.applied = Some(wanted);
        Some(conditions)
    }
}

/// A condition of `type_` as of now.
fn new_condition(type_: &str, ok: bool, reason: &str, message: String) -> Condition {
    Condition {
        type_: type_.into(),
        status: if ok { "True".into() } else { "False".into() },
        reason: reason.into(),
        message,
        last_transition_time: k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
            k8s_openapi::jiff::Timestamp::now(),
        ),
        observed_generation: None,
    }
}

/// The `LocalhostNodePorts` condition: none unless a data plane serves them.
fn localnet_condition(localhost: bool, refused: &BTreeMap<Knob, String>) -> Option<Condition> {
    if !localhost {
        return None;
    }
    Some(match refused.get(&Knob::RouteLocalnet) {
        None => new_condition(
            LOCALNET_CONDITION,
            true,
            "Served",
            "route_localnet=1: NodePorts answer on 127.0.0.1 (IPv4)".into(),
        ),
        Some(why) => new_condition(
            LOCALNET_CONDITION,
            false,
            "NotWritable",
            format!("route_localnet cannot be set, so NodePorts on 127.0.0.1 are refused: {why}"),
        ),
    })
}

/// The `ConntrackSysctls` condition: none when nothing is asked or refused.
fn condition(wanted: &Wanted, refused: &BTreeMap<Knob, String>) -> Option<Condition> {
    let wanted: Wanted = wanted
        .iter()
        .filter(|(k, _)| k.is_conntrack())
        .map(|(k, v)| (*k, *v))
        .collect();
    let refused: BTreeMap<Knob, String> = refused
        .iter()
        .filter(|(k, _)| k.is_conntrack())
        .map(|(k, v)| (*k, v.clone()))
        .collect();
    if wanted.is_empty() && refused.is_empty() {
        return None;
    }
    let (ok, reason, message) = if refused.is_empty() {
        let values: Vec<String> = wanted
            .iter()
            .map(|(k, v)| format!("{}={v}", k.path().rsplit('/').next().unwrap_or_default()))
            .collect();
        (
            true,
            "Applied",
            format!("set as the policy asks: {}", values.join(", ")),
        )
    } else {
        let why: Vec<&str> = refused.values().map(String::as_str).collect();
        (false, "NotWritable", format!("not written: {}", why.join("; ")))
    };
    Some(new_condition(CONDITION, ok, reason, message))
}

/// `--cleanup`: puts back every conntrack sysctl value the agent replaced (remembered in `file`);
/// returns what could not be put back.
pub fn restore_from(file: &StateFile) -> Vec<String> {
    let before = file.load_sysctls();
    if before.0.is_empty() {
        return Vec::new();
    }
    let plan = node_sysctls::restore(&current(), &before);
    let mut sysctl = HostSysctl::new(None);
    let (left, refused) = perform(&mut sysctl, plan, &before);
    let mut errors: Vec<String> = refused.into_values().collect();
    if let Err(e) = file.store_sysctls(&left) {
        errors.push(format!("{}: {e}", file.0.display()));
    }
    errors
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sys::sysctl::FakeSysctl;

    #[test]
    fn refused_writes_replace_nothing_and_are_reported() {
        let mut fake = FakeSysctl::new();
        let want: Wanted = [(Knob::UdpTimeout, 30), (Knob::ConntrackMax, 1000)].into();
        let now = [(Knob::UdpTimeout, 60), (Knob::ConntrackMax, 500)].into();
        let plan = node_sysctls::plan(&want, &now, &Replaced::default());
        let (replaced, refused) = perform(&mut fake, plan, &Replaced::default());
        assert_eq!(fake.get("net/netfilter/nf_conntrack_udp_timeout"), "30");
        assert_eq!(
            replaced.0,
            [(Knob::UdpTimeout, 60), (Knob::ConntrackMax, 500)].into()
        );
        assert!(refused.is_empty());

        let mut read_only = FakeSysctl::new();
        read_only.make_read_only();
        let plan = node_sysctls::plan(&want, &now, &Replaced::default());
        let (replaced, refused) = perform(&mut read_only, plan, &Replaced::default());
        assert!(replaced.0.is_empty(), "nothing was replaced: {replaced:?}");
        assert_eq!(refused.len(), 2);
        assert!(
            refused[&Knob::ConntrackMax].contains("host-global"),
            "{refused:?}"
        );
        let c = condition(&want, &refused).expect("a condition");
        assert_eq!((c.status.as_str(), c.reason.as_str()), ("False", "NotWritable"));
        assert!(c.message.contains("nf_conntrack_max"), "{}", c.message);

        let ok = condition(&want, &BTreeMap::new()).expect("a condition");
        assert_eq!(ok.status, "True");
        assert!(
            ok.message.contains("nf_conntrack_udp_timeout=30"),
            "{}",
            ok.message
        );
        assert!(condition(&Wanted::new(), &BTreeMap::new()).is_none());
    }

    #[test]
    fn localhost_node_ports_need_a_confirmed_route_localnet() {
        let state = |active, target| SwitchState {
            target,
            ..SwitchState::active(active)
        };
        let defaults = Settings::default();
        assert!(localhost_wanted(&defaults, &state(ProxyMode::Iptables, None)));
        assert!(!localhost_wanted(&defaults, &state(ProxyMode::Nftables, None)));
        assert!(!localhost_wanted(&defaults, &state(ProxyMode::Ipvs, None)));
        // During a switch the target counts too.
        assert!(localhost_wanted(
            &defaults,
            &state(ProxyMode::Nftables, Some(ProxyMode::Iptables))
        ));
        let nft_on = Settings {
            nftables_localhost_node_ports: true,
            ..Settings::default()
        };
        assert!(localhost_wanted(&nft_on, &state(ProxyMode::Nftables, None)));

        let mut sysctls = ConntrackSysctls::new(StateFile("/nonexistent/state.json".into()));
        let mut gated = nft_on.clone();
        sysctls.gate_localhost(&mut gated, true);
        assert!(
            !gated.nftables_localhost_node_ports && !gated.localhost_node_ports,
            "nothing applied yet: not served"
        );
        assert!(!sysctls.release_pending());
        sysctls.applied = Some(node_sysctls::with_route_localnet(Wanted::new(), true));
        let mut gated = nft_on.clone();
        sysctls.gate_localhost(&mut gated, true);
        assert_eq!(gated, nft_on, "route_localnet set: served as asked");
        assert!(!sysctls.release_pending());
        // Turned off: not served from this round on; route_localnet is held until the next pass.
        let mut gated = nft_on.clone();
        sysctls.gate_localhost(&mut gated, false);
        assert!(!gated.nftables_localhost_node_ports);
        assert!(sysctls.release_pending(), "held until the rules are gone");
        sysctls.applied = Some(Wanted::new());
        assert!(!sysctls.release_pending(), "released");
        sysctls.applied = Some(node_sysctls::with_route_localnet(Wanted::new(), true));
        sysctls.refused.insert(
            Knob::RouteLocalnet,
            "/proc/sys/net/ipv4/conf/all/route_localnet: Read-only file system".into(),
        );
        let mut gated = nft_on.clone();
        sysctls.gate_localhost(&mut gated, true);
        assert!(!gated.nftables_localhost_node_ports, "refused: not served");
        assert!(
            !sysctls.release_pending(),
            "refused but still wanted: no release due (another round would change nothing)"
        );

        let c = localnet_condition(true, &sysctls.refused).expect("a condition");
        assert_eq!((c.status.as_str(), c.reason.as_str()), ("False", "NotWritable"));
        assert!(c.message.contains("Read-only"), "{}", c.message);
        assert!(
            condition(&Wanted::new(), &sysctls.refused).is_none(),
            "not a conntrack refusal"
        );
        let ok = localnet_condition(true, &BTreeMap::new()).expect("a condition");
        assert_eq!((ok.status.as_str(), ok.reason.as_str()), ("True", "Served"));
        assert!(localnet_condition(false, &BTreeMap::new()).is_none());
    }

    #[test]
    fn strict_arp_is_wanted_while_ipvs_serves_or_is_the_target_with_it() {
        let state = |active, target| SwitchState {
            target,
            ..SwitchState::active(active)
        };
        let mut strict = Settings::default();
        strict.ipvs.strict_arp = true;
        assert!(strict_arp_wanted(&strict, &state(ProxyMode::Ipvs, None)));
        assert!(strict_arp_wanted(
            &strict,
            &state(ProxyMode::Nftables, Some(ProxyMode::Ipvs))
        ));
        assert!(!strict_arp_wanted(&strict, &state(ProxyMode::Nftables, None)));
        assert!(!strict_arp_wanted(
            &Settings::default(),
            &state(ProxyMode::Ipvs, None)
        ));
        assert_eq!(sysctl_name(Knob::ArpIgnore), "net/ipv4/conf/all/arp_ignore");
    }

    /// strictARP on the VM's kernel (`scripts/ipvs-vm.sh`, which runs the `vm_` tests here):
    /// from a policy's `proxy.ipvs` through the backend settings, written while IPVS serves with
    /// it, the node's own values put back when the policy stops asking and by `--cleanup`.
    #[test]
    #[ignore = "needs the IPVS kernel: scripts/ipvs-vm.sh"]
    fn vm_strict_arp_is_written_and_the_nodes_values_come_back() {
        use switchyard_crds::v1alpha1::IpvsSettings;
        assert!(
            std::env::var_os("SWITCHYARD_IPVS_VM").is_some(),
            "VM-only test: run scripts/ipvs-vm.sh"
        );
        let read = || {
            let v = |k: Knob| host::sysctl_i64(sysctl_name(k)).unwrap_or(-1);
            (v(Knob::ArpIgnore), v(Knob::ArpAnnounce))
        };
        // A value of the node's own to come back (the kernel's default is 0).
        let mut sysctl = HostSysctl::new(None);
        sysctl.ensure(sysctl_name(Knob::ArpAnnounce), "1").expect("write");
        let node = read();
        assert_eq!(node, (0, 1));
        let dir = std::env::temp_dir().join("swy-strict-arp");
        std::fs::create_dir_all(&dir).expect("dir");
        let file = StateFile(dir.join("state.json"));
        let mut sysctls = ConntrackSysctls::new(StateFile(file.0.clone()));
        let policy = IpvsSettings {
            strict_arp: Some(true),
            ..Default::default()
        };
        let mut settings = Settings {
            ipvs: crate::backend::ipvs::IpvsOptions::from_policy(Some(&policy)),
            ..Settings::default()
        };
        let ipvs = SwitchState::active(ProxyMode::Ipvs);
        sysctls.apply(None, false, strict_arp_wanted(&settings, &ipvs));
        assert_eq!(read(), (1, 2), "written while IPVS serves with strictARP");
        assert_eq!(
            file.load_sysctls().0,
            [(Knob::ArpIgnore, 0), (Knob::ArpAnnounce, 1)].into(),
            "the node's values remembered in the state file"
        );
        settings.ipvs = crate::backend::ipvs::IpvsOptions::from_policy(None);
        sysctls.apply(None, false, strict_arp_wanted(&settings, &ipvs));
        assert_eq!(read(), node, "the policy stopped asking");
        assert!(file.load_sysctls().0.is_empty());
        sysctls.apply(None, false, true);
        assert_eq!(read(), (1, 2));
        assert_eq!(restore_from(&file), Vec::<String>::new());
        assert_eq!(read(), node, "--cleanup put them back");
        println!(
            "VMTEST strictARP: arp_ignore/arp_announce {node:?} -> (1, 2) while IPVS serves with it; \
             {node:?} again when the policy stops asking and after --cleanup"
        );
        sysctl.ensure(sysctl_name(Knob::ArpAnnounce), "0").expect("write");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn knobs_are_named_as_the_adapter_takes_them() {
        assert_eq!(
            sysctl_name(Knob::UdpTimeout),
            "net/netfilter/nf_conntrack_udp_timeout"
        );
        assert_eq!(
            sysctl_name(Knob::HashSize),
            "/sys/module/nf_conntrack/parameters/hashsize"
        );
    }
}
