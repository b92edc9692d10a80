//! Capability probing: gather [`HostFacts`] once (through `sys`), then decide with pure functions
//! what the node can run. Decisions are table-tested; kube-proxy once shipped an inverted
//! kernel-version check, so the comparisons here are numeric and tested at their edges.

use switchyard_crds::v1alpha1::{Capabilities, Capability, ConntrackFacts, ProxyMode};

use crate::sys::{
    self,
    iptables::{Iptables, Table, Variant},
};

/// Oldest kernel on which nftables mode is supported (kube-proxy's requirement).
pub const NFTABLES_MIN_KERNEL: KernelVersion = KernelVersion(5, 13, 0);

/// Schedulers the IPVS backend knows how to configure.
pub const IPVS_SCHEDULERS: [&str; 14] = [
    "rr", "wrr", "lc", "wlc", "lblc", "lblcr", "sh", "dh", "sed", "nq", "fo", "ovf", "mh", "twos",
];

/// A kernel version `major.minor.patch`, compared numerically.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct KernelVersion(pub u32, pub u32, pub u32);

impl KernelVersion {
    /// Parses the leading `major.minor[.patch]` of a release such as `6.18.44-fc-v657`.
    pub fn parse(release: &str) -> Option<Self> {
        let numeric: String = release
            .chars()
            .take_while(|c| c.is_ascii_digit() || *c == '.')
            .collect();
        let mut parts = numeric
            .split('.')
            .filter(|p| !p.is_empty())
            .map(|p| p.parse::<u32>());
        let major = parts.next()?.ok()?;
        let minor = parts.next()?.ok()?;
        let patch = parts.next().and_then(|p| p.ok()).unwrap_or(0);
        Some(Self(major, minor, patch))
    }
}

/// Raw facts about the host, gathered once; everything else is decided from these.
#[derive(Debug, Clone, PartialEq)]
pub struct HostFacts {
    /// `uname -r`.
    pub kernel_release: String,
    /// Result of creating and deleting a throwaway nf_tables table: `Ok` or the kernel's refusal.
    pub nf_tables: Result<(), String>,
    /// The legacy tools run (`Ok(rules in table nat)`, 0 when the namespace has no legacy nat
    /// table, which the probe never creates) or why not.
    pub iptables_legacy: Result<usize, String>,
    /// `iptables-nft-save -t nat` worked (`Ok(rules)`) or why not.
    pub iptables_nft: Result<usize, String>,
    /// kubelet's marker chains (`KUBE-IPTABLES-HINT`, `KUBE-KUBELET-CANARY`) are in the legacy
    /// `mangle` table.
    pub kubelet_chains_legacy: bool,
    /// The same in the nft variant's `mangle` table.
    pub kubelet_chains_nft: bool,
    /// Generic netlink family `IPVS` resolved, or why not.
    pub ipvs_family: Result<u16, String>,
    /// Module names seen for IPVS schedulers (`ip_vs_rr.ko`, `ip_vs_sh`, ...).
    pub ipvs_modules: Vec<String>,
    /// `ipset list -n` worked, or why not.
    pub ipset: Result<(), String>,
    /// Conntrack sysctls.
    pub conntrack: ConntrackFacts,
}

impl HostFacts {
    /// Gathers the facts from the running kernel, in the caller's network namespace.
    pub fn gather() -> Self {
        let kernel_release = sys::host::kernel_release().unwrap_or_default();
        let probe_table = format!("swy-probe-{}", std::process::id());
        let nf_tables = match sys::nft::try_throwaway_table(&probe_table) {
            Ok(None) => Ok(()),
            Ok(Some(reason)) => Err(reason),
            Err(e) => Err(e.to_string()),
        };
        let ipvs_family = sys::genl::resolve_family("IPVS").map_err(|e| e.to_string());
        let (iptables_legacy, kubelet_chains_legacy) = iptables_facts(Variant::Legacy);
        let (iptables_nft, kubelet_chains_nft) = iptables_facts(Variant::Nft);
        Self {
            ipvs_modules: sys::host::ipvs_scheduler_modules(&kernel_release),
            kernel_release,
            nf_tables,
            iptables_legacy,
            iptables_nft,
            kubelet_chains_legacy,
            kubelet_chains_nft,
            ipvs_family,
            ipset: command_ok("ipset", &["list", "-n"]),
            conntrack: ConntrackFacts {
                max: sys::host::sysctl_i64("net/netfilter/nf_conntrack_max"),
                tcp_be_liberal: sys::host::sysctl_i64("net/netfilter/nf_conntrack_tcp_be_liberal")
                    .map(|v| v != 0),
                tcp_established_timeout_seconds: sys::host::sysctl_i64(
                    "net/netfilter/nf_conntrack_tcp_timeout_established",
                ),
                udp_timeout_seconds: sys::host::sysctl_i64("net/netfilter/nf_conntrack_udp_timeout"),
            },
        }
    }
}

/// kubelet's marker chains in table `mangle`, which iptables-wrapper looks for to tell which
/// variant the node uses.
pub const KUBELET_MARKER_CHAINS: [&str; 2] = ["KUBE-IPTABLES-HINT", "KUBE-KUBELET-CANARY"];

/// One variant's facts: its nat rule count (or why its tools fail), and whether kubelet's marker
/// chains are in its mangle table. Only reads: no table is created (see [`Iptables::save`]).
fn iptables_facts(variant: Variant) -> (Result<usize, String>, bool) {
    let ipt = Iptables::new(variant, None);
    let first_line = |e: sys::iptables::IptablesError| {
        let detail = e.detail();
        format!(
            "{}: {}",
            ipt.binary("iptables"),
            detail.lines().next().unwrap_or("failed")
        )
    };
    if let Err(e) = ipt.tools_run() {
        return (Err(first_line(e)), false);
    }
    let rules = ipt
        .save(Table::Nat)
        .map(|s| s.lines().filter(|l| l.starts_with("-A ")).count())
        .map_err(first_line);
    let marked = ipt.save(Table::Mangle).is_ok_and(|s| has_kubelet_chains(&s));
    (rules, marked)
}

/// Whether an `iptables-save` text declares one of [`KUBELET_MARKER_CHAINS`].
pub fn has_kubelet_chains(save: &str) -> bool {
    save.lines()
        .filter_map(|l| l.strip_prefix(':')?.split_whitespace().next())
        .any(|c| KUBELET_MARKER_CHAINS.contains(&c))
}

fn command_ok(program: &str, args: &[&str]) -> Result<(), String> {
    let out = sys::exec::run(program, args)?;
    if out.success {
        Ok(())
    } else {
        Err(format!(
            "{program}: {}",
            out.stderr.lines().next().unwrap_or("failed")
        ))
    }
}

fn capability<T>(fact: &Result<T, String>, detail: impl FnOnce(&T) -> Option<String>) -> Capability {
    match fact {
        Ok(v) => Capability {
            usable: true,
            detail: detail(v),
        },
        Err(reason) => Capability {
            usable: false,
            detail: Some(reason.clone()),
        },
    }
}

/// Decides the iptables variant as iptables-wrapper (which picks kube-proxy's) does, so our rules
/// live in the backend kubelet's and the CNI's do: the variant whose `mangle` table holds kubelet's
/// marker chains, nft first, then legacy; without markers the one already holding more nat rules;
/// on a tie (an empty node included) nft.
pub fn iptables_variant(facts: &HostFacts) -> Option<&'static str> {
    let (legacy, nft) = (&facts.iptables_legacy, &facts.iptables_nft);
    match (legacy, nft) {
        (_, Ok(_)) if facts.kubelet_chains_nft => Some("nft"),
        (Ok(_), _) if facts.kubelet_chains_legacy => Some("legacy"),
        (Ok(l), Ok(n)) if l > n => Some("legacy"),
        (_, Ok(_)) => Some("nft"),
        (Ok(_), Err(_)) => Some("legacy"),
        (Err(_), Err(_)) => None,
    }
}

/// Decides every capability and the supported modes from the facts.
pub fn decide(facts: &HostFacts) -> Capabilities {
    let kernel = KernelVersion::parse(&facts.kernel_release);
    let nftables = match (&facts.nf_tables, kernel) {
        (Err(reason), _) => Capability {
            usable: false,
            detail: Some(reason.clone()),
        },
        (Ok(()), None) => Capability {
            usable: false,
            detail: Some(format!("cannot parse kernel release {:?}", facts.kernel_release)),
        },
        (Ok(()), Some(v)) if v < NFTABLES_MIN_KERNEL => Capability {
            usable: false,
            detail: Some(format!(
                "kernel {}.{} is older than 5.13, which nftables mode needs",
                v.0, v.1
            )),
        },
        (Ok(()), Some(_)) => Capability {
            usable: true,
            detail: None,
        },
    };
    let iptables_legacy = capability(&facts.iptables_legacy, |n| Some(format!("{n} nat rules present")));
    let iptables_nft = capability(&facts.iptables_nft, |n| Some(format!("{n} nat rules present")));
    let iptables_variant = iptables_variant(facts);
    let ipvs = capability(&facts.ipvs_family, |id| Some(format!("genetlink family id {id}")));
    let ipset = capability(&facts.ipset, |_| None);
    let ipvs_schedulers: Vec<String> = if ipvs.usable {
        IPVS_SCHEDULERS
            .iter()
            .filter(|s| {
                let module = format!("ip_vs_{s}");
                facts
                    .ipvs_modules
                    .iter()
                    .any(|m| m == &module || m.starts_with(&format!("{module}.ko")))
            })
            .map(|s| (*s).to_owned())
            .collect()
    } else {
        Vec::new()
    };
    let mut supported_modes = Vec::new();
    if iptables_variant.is_some() {
        supported_modes.push(ProxyMode::Iptables);
    }
    if ipvs.usable && ipset.usable && iptables_variant.is_some() && !ipvs_schedulers.is_empty() {
        supported_modes.push(ProxyMode::Ipvs);
    }
    if nftables.usable {
        supported_modes.push(ProxyMode::Nftables);
    }
    // Handing the node to another service proxy needs nothing of this kernel.
    supported_modes.push(ProxyMode::External);
    Capabilities {
        kernel_version: facts.kernel_release.clone(),
        supported_modes,
        nftables,
        iptables_legacy,
        iptables_nft,
        iptables_variant: iptables_variant.map(str::to_owned),
        ipvs,
        ipvs_schedulers,
        ipset,
        conntrack: Some(facts.conntrack.clone()),
    }
}

#[cfg(test)]
mod tests;
