//! `--takeover-kube-proxy`: once Switchyard serves a node, remove what kube-proxy left behind
//! (kube-proxy never deletes its rules on exit, KEP-2448): its nftables tables and its iptables
//! chains, in both iptables variants and both IP families, in tables filter, nat and mangle. Chains
//! kubelet owns (`KUBE-FIREWALL`, `KUBE-KUBELET-CANARY`, `KUBE-IPTABLES-HINT`, `KUBE-MARK-DROP`)
//! are kept, as kube-proxy's own cleanup keeps them. [`kube_proxy_found`] tells, read only,
//! whether kube-proxy serves the node (mode `external` waits for it before bypassing Switchyard).
//!
//! kube-proxy's IPVS mode leaves more ([`ipvs_leftovers`]): the dummy link `kube-ipvs0` with the
//! service addresses, its virtual servers, and its `KUBE-*` ipsets. A virtual server on an address
//! of `kube-ipvs0` that our own link (`swy-ipvs0`) does not also hold is kube-proxy's and is
//! deleted; one our IPVS backend wants has the same identity and was adopted by our first sync
//! (its real servers rewritten in place, so open connections keep their entries), and the address
//! stays local on our link when `kube-ipvs0` goes. The ipsets go last, once no rule of either
//! variant references them.

use std::{collections::BTreeSet, net::IpAddr};

use crate::{
    model::IpFamily,
    sys::{
        self,
        iptables::{Iptables, Table, Variant},
        ipvs::{IpvsTable, KernelIpvs, Op, ServiceKey, VirtualAddr},
    },
};

/// kube-proxy's IPVS dummy link.
pub const KUBE_IPVS_LINK: &str = "kube-ipvs0";

/// kube-proxy's IPVS-mode ipsets (pkg/proxy/ipvs `ipsetInfo`); its IPv6 sets are the same names
/// with `KUBE-6-` for `KUBE-`, cut to 31 characters.
const KUBE_IPSETS: [&str; 19] = [
    "KUBE-LOOP-BACK",
    "KUBE-CLUSTER-IP",
    "KUBE-EXTERNAL-IP",
    "KUBE-EXTERNAL-IP-LOCAL",
    "KUBE-LOAD-BALANCER",
    "KUBE-LOAD-BALANCER-FW",
    "KUBE-LOAD-BALANCER-LOCAL",
    "KUBE-LOAD-BALANCER-SOURCE-IP",
    "KUBE-LOAD-BALANCER-SOURCE-CIDR",
    "KUBE-NODE-PORT-TCP",
    "KUBE-NODE-PORT-LOCAL-TCP",
    "KUBE-NODE-PORT-UDP",
    "KUBE-NODE-PORT-LOCAL-UDP",
    "KUBE-NODE-PORT-SCTP-HASH",
    "KUBE-NODE-PORT-LOCAL-SCTP-HASH",
    "KUBE-HEALTH-CHECK-NODE-PORT",
    "KUBE-IPVS-IPS",
    // Older releases' names, still possibly on a node upgraded in place.
    "KUBE-NODE-PORT-SCTP",
    "KUBE-NODE-PORT-LOCAL-SCTP",
];

/// Whether an ipset is kube-proxy's (IPv4 or IPv6 name).
pub fn is_kube_proxy_ipset(name: &str) -> bool {
    KUBE_IPSETS.iter().any(|set| {
        let v6: String = set
            .replacen("KUBE-", "KUBE-6-", 1)
            .chars()
            .take(sys::ipset::MAX_NAME)
            .collect();
        name == *set || name == v6
    })
}

/// kube-proxy's virtual servers among `listed`: those on an address of `kube-ipvs0` that our own
/// link does not hold (pure).
pub fn kube_proxy_virtual_servers(
    listed: &[ServiceKey],
    kube_link: &BTreeSet<IpAddr>,
    ours: &BTreeSet<IpAddr>,
) -> Vec<VirtualAddr> {
    listed
        .iter()
        .filter_map(|key| match key {
            ServiceKey::Addr(v) if kube_link.contains(&v.addr) && !ours.contains(&v.addr) => Some(*v),
            _ => None,
        })
        .collect()
}

/// kube-proxy's fixed chains (its per-service chains are matched by prefix).
const FIXED: [&str; 13] = [
    "KUBE-SERVICES",
    "KUBE-EXTERNAL-SERVICES",
    "KUBE-FORWARD",
    "KUBE-NODEPORTS",
    "KUBE-POSTROUTING",
    "KUBE-MARK-MASQ",
    "KUBE-PROXY-FIREWALL",
    "KUBE-PROXY-CANARY",
    // IPVS mode's (kube-proxy's pkg/proxy/ipvs `iptablesChains`).
    "KUBE-NODE-PORT",
    "KUBE-LOAD-BALANCER",
    "KUBE-SOURCE-RANGES-FIREWALL",
    "KUBE-IPVS-FILTER",
    "KUBE-IPVS-OUT-FILTER",
];
const PER_SERVICE: [&str; 5] = ["KUBE-SVC-", "KUBE-SVL-", "KUBE-EXT-", "KUBE-FW-", "KUBE-SEP-"];

/// Whether a chain is kube-proxy's to remove.
pub fn is_kube_proxy_chain(chain: &str) -> bool {
    FIXED.contains(&chain) || PER_SERVICE.iter().any(|p| chain.starts_with(p))
}

/// The `iptables-restore --noflush` input that removes kube-proxy's chains from one table's
/// `iptables-save` output: first every rule of other chains that jumps into them, then the chains
/// (declared, which flushes them, then `-X`). Pure; empty when there is nothing to remove.
pub fn removal_input(table: &str, save: &str) -> String {
    let chains: Vec<&str> = save
        .lines()
        .filter_map(|l| l.strip_prefix(':')?.split_whitespace().next())
        .filter(|c| is_kube_proxy_chain(c))
        .collect();
    if chains.is_empty() {
        return String::new();
    }
    let mut out = format!("*{table}\n");
    for line in save.lines().filter(|l| l.starts_with("-A ")) {
        let mut words = line.split_whitespace().skip(1);
        let chain = words.next().unwrap_or_default();
        let target = line
            .split(" -j ")
            .nth(1)
            .and_then(|t| t.split_whitespace().next())
            .unwrap_or_default();
        if !is_kube_proxy_chain(chain) && is_kube_proxy_chain(target) {
            out.push_str(&line.replacen("-A ", "-D ", 1));
            out.push('\n');
        }
    }
    for c in &chains {
        out.push_str(&format!(":{c} - [0:0]\n"));
    }
    for c in &chains {
        out.push_str(&format!("-X {c}\n"));
    }
    out.push_str("COMMIT\n");
    out
}

/// What of kube-proxy's serving objects this network namespace holds (IPv4, which kube-proxy
/// always programs): its `kube-proxy` nftables table, or `KUBE-SERVICES` in the nat table of
/// either iptables variant. Read only. Empty: kube-proxy has not synced here (or is another proxy
/// Switchyard does not recognise). Unreadable parts count as absent.
pub fn kube_proxy_found() -> Vec<String> {
    let mut found = Vec::new();
    if sys::nft::other_table_exists(IpFamily::V4.nfproto(), "kube-proxy").unwrap_or(false) {
        found.push("nftables table ip kube-proxy".to_owned());
    }
    for variant in [Variant::Legacy, Variant::Nft] {
        let ipt = Iptables::new(variant, None).for_family(IpFamily::V4);
        let Ok(save) = ipt.save(Table::Nat) else { continue };
        if has_chain(&save, "KUBE-SERVICES") {
            found.push(format!("{} nat KUBE-SERVICES", ipt.binary("iptables")));
        }
    }
    found
}

/// Whether an `iptables-save` output declares `chain`.
fn has_chain(save: &str, chain: &str) -> bool {
    save.lines()
        .filter_map(|l| l.strip_prefix(':')?.split_whitespace().next())
        .any(|c| c == chain)
}

/// Removes kube-proxy's leftovers from this network namespace; returns what it removed, and the
/// errors of the steps that failed (each step is independent).
pub fn takeover() -> (Vec<String>, Vec<String>) {
    let (mut removed, mut errors) = (Vec::new(), Vec::new());
    ipvs_leftovers(&mut removed, &mut errors);
    for family in IpFamily::ALL {
        match sys::nft::delete_table_if_present(family.nfproto(), "kube-proxy") {
            Ok(true) => removed.push(format!(
                "nftables table {} kube-proxy",
                crate::backend::nftables::ir::family_name(family)
            )),
            Ok(false) => {}
            Err(e) => errors.push(format!("nftables kube-proxy table: {e}")),
        }
    }
    for (variant, family) in [Variant::Legacy, Variant::Nft]
        .into_iter()
        .flat_map(|v| IpFamily::ALL.map(|f| (v, f)))
    {
        let ipt = Iptables::new(variant, None).for_family(family);
        let tool = ipt.binary("iptables");
        // kube-proxy's canary (`KUBE-PROXY-CANARY`) is in mangle too. Reading a table never creates
        // it (`Iptables::save`), so a node without legacy tables keeps none.
        for table in [Table::Filter, Table::Nat, Table::Mangle] {
            let name = table.as_str();
            let save = match ipt.save(table) {
                Ok(s) => s,
                Err(_) => continue, // variant or table unusable here: nothing of kube-proxy's to remove
            };
            let input = removal_input(name, &save);
            if input.is_empty() {
                continue;
            }
            match ipt.restore(&input) {
                Ok(()) => removed.push(format!("{tool} {name} KUBE-* chains")),
                Err(e) => errors.push(format!("{tool} {name}: {e}")),
            }
        }
    }
    kube_proxy_ipsets(&mut removed, &mut errors);
    (removed, errors)
}

/// kube-proxy's IPVS virtual servers and its `kube-ipvs0` link (nothing when the link is absent:
/// kube-proxy's IPVS mode never ran here, or a pass removed it already).
fn ipvs_leftovers(removed: &mut Vec<String>, errors: &mut Vec<String>) {
    match sys::link::exists(KUBE_IPVS_LINK) {
        Ok(true) => {}
        Ok(false) => return,
        Err(e) => return errors.push(format!("{KUBE_IPVS_LINK}: {e}")),
    }
    let addrs = |link: &str| -> Result<BTreeSet<IpAddr>, String> {
        sys::link::addresses(link)
            .map(|set| set.into_iter().map(IpAddr::V4).collect())
            .map_err(|e| e.to_string())
    };
    let (kube_link, ours) = match (addrs(KUBE_IPVS_LINK), addrs(crate::backend::ipvs::render::LINK)) {
        (Ok(k), Ok(o)) => (k, o),
        (Err(e), _) | (_, Err(e)) => return errors.push(format!("{KUBE_IPVS_LINK} addresses: {e}")),
    };
    let mut ipvs = KernelIpvs::new();
    match ipvs.services() {
        Ok(listed) => {
            let keys: Vec<ServiceKey> = listed.into_iter().map(|(k, _)| k).collect();
            let theirs = kube_proxy_virtual_servers(&keys, &kube_link, &ours);
            let ops: Vec<Op> = theirs.iter().map(|v| Op::DeleteService(*v)).collect();
            match ipvs.apply(&ops) {
                Ok(refused) => {
                    // Not found: gone meanwhile.
                    errors.extend(
                        refused
                            .iter()
                            .filter(|(_, e)| !e.is_not_found())
                            .map(|(op, e)| format!("IPVS {op}: {e}")),
                    );
                    if !ops.is_empty() {
                        removed.push(format!("{} IPVS virtual servers on {KUBE_IPVS_LINK}", ops.len()));
                    }
                }
                Err(e) => errors.push(format!("IPVS: {e}")),
            }
        }
        // No IPVS in this kernel: the link is all there is.
        Err(sys::KernelError::Unsupported { .. }) => {}
        Err(e) => errors.push(format!("IPVS services: {e}")),
    }
    match sys::link::delete(KUBE_IPVS_LINK) {
        Ok(_) => removed.push(format!("link {KUBE_IPVS_LINK}")),
        Err(e) => errors.push(format!("{KUBE_IPVS_LINK}: {e}")),
    }
}

/// kube-proxy's ipsets, once no iptables rule references them (none where `ipset list` fails).
fn kube_proxy_ipsets(removed: &mut Vec<String>, errors: &mut Vec<String>) {
    let names: Vec<String> = match sys::ipset::list_names("KUBE-") {
        Ok(names) => names.into_iter().filter(|n| is_kube_proxy_ipset(n)).collect(),
        // No `ipset` tool, or no ipset support in the kernel: no set of kube-proxy's can exist.
        Err(_) => return,
    };
    if names.is_empty() {
        return;
    }
    match sys::ipset::destroy(&names) {
        Ok(()) => removed.push(format!("ipsets {}", names.join(" "))),
        Err(e) => errors.push(format!("ipset destroy: {e}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn removal_deletes_jumps_then_kube_proxy_chains_and_keeps_kubelets() {
        let save = "*nat\n:PREROUTING ACCEPT [0:0]\n:KUBE-SERVICES - [0:0]\n:KUBE-SVC-ABC - [0:0]\n:KUBE-MARK-DROP - [0:0]\n\
            -A PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES\n\
            -A PREROUTING -j KUBE-MARK-DROP\n-A KUBE-SERVICES -d 10.96.0.1/32 -j KUBE-SVC-ABC\nCOMMIT\n";
        let input = removal_input("nat", save);
        assert_eq!(
            input,
            "*nat\n-D PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES\n\
             :KUBE-SERVICES - [0:0]\n:KUBE-SVC-ABC - [0:0]\n-X KUBE-SERVICES\n-X KUBE-SVC-ABC\nCOMMIT\n"
        );
        assert_eq!(
            removal_input(
                "nat",
                "*nat\n:PREROUTING ACCEPT [0:0]\n:KUBE-MARK-DROP - [0:0]\nCOMMIT\n"
            ),
            ""
        );
    }

    #[test]
    fn kube_proxys_service_chain_is_recognised_not_kubelets() {
        let save =
            "*nat\n:PREROUTING ACCEPT [0:0]\n:KUBE-MARK-DROP - [0:0]\n:KUBE-SERVICES - [0:0]\nCOMMIT\n";
        assert!(has_chain(save, "KUBE-SERVICES"));
        let kubelet_only =
            "*nat\n:KUBE-MARK-DROP - [0:0]\n:KUBE-KUBELET-CANARY - [0:0]\n-A X -j KUBE-SERVICES\nCOMMIT\n";
        assert!(!has_chain(kubelet_only, "KUBE-SERVICES"), "a jump is no chain");
    }

    #[test]
    fn kube_proxys_ipvs_objects_are_recognised() {
        for set in [
            "KUBE-CLUSTER-IP",
            "KUBE-6-CLUSTER-IP",
            "KUBE-NODE-PORT-TCP",
            "KUBE-6-LOAD-BALANCER-SOURCE-CID",
        ] {
            assert!(is_kube_proxy_ipset(set), "{set}");
        }
        for set in [
            "SWY-CLUSTER-IP",
            "KUBE-SOMEONE-ELSE",
            "KUBE-6-LOAD-BALANCER-SOURCE-CIDR",
        ] {
            assert!(!is_kube_proxy_ipset(set), "{set}");
        }
        for chain in [
            "KUBE-NODE-PORT",
            "KUBE-IPVS-FILTER",
            "KUBE-IPVS-OUT-FILTER",
            "KUBE-LOAD-BALANCER",
        ] {
            assert!(is_kube_proxy_chain(chain), "{chain}");
        }
        let vs = |a: [u8; 4], port| VirtualAddr {
            protocol: crate::model::Protocol::Tcp,
            addr: IpAddr::from(a),
            port,
        };
        let listed = [
            ServiceKey::Addr(vs([10, 96, 0, 1], 443)),
            ServiceKey::Addr(vs([10, 96, 0, 9], 80)),
            ServiceKey::Addr(vs([10, 0, 1, 1], 30120)),
            ServiceKey::Foreign("fwmark 7".into()),
        ];
        let kube: BTreeSet<IpAddr> = [[10, 96, 0, 1], [10, 96, 0, 9]].map(IpAddr::from).into();
        let ours: BTreeSet<IpAddr> = [IpAddr::from([10, 96, 0, 1])].into();
        assert_eq!(
            kube_proxy_virtual_servers(&listed, &kube, &ours),
            [vs([10, 96, 0, 9], 80)],
            "only kube-ipvs0's addresses our link does not hold"
        );
    }

    #[test]
    fn removal_in_mangle_takes_kube_proxys_canary_and_keeps_kubelets_markers() {
        let save = "*mangle\n:PREROUTING ACCEPT [0:0]\n:KUBE-IPTABLES-HINT - [0:0]\n:KUBE-KUBELET-CANARY - [0:0]\n:KUBE-PROXY-CANARY - [0:0]\nCOMMIT\n";
        assert_eq!(
            removal_input("mangle", save),
            "*mangle\n:KUBE-PROXY-CANARY - [0:0]\n-X KUBE-PROXY-CANARY\nCOMMIT\n"
        );
        for kubelet in [
            "KUBE-IPTABLES-HINT",
            "KUBE-KUBELET-CANARY",
            "KUBE-FIREWALL",
            "KUBE-MARK-DROP",
        ] {
            assert!(!is_kube_proxy_chain(kubelet), "{kubelet} is kubelet's");
        }
    }
}
