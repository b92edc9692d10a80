//! `--takeover-kube-proxy`: once Switchyard serves a node, remove what kube-proxy left behind
//! (kube-proxy never deletes its rules on exit, KEP-2448): its nftables tables and its iptables
//! chains, in both iptables variants and both IP families, in tables filter, nat and mangle. Chains
//! kubelet owns (`KUBE-FIREWALL`, `KUBE-KUBELET-CANARY`, `KUBE-IPTABLES-HINT`, `KUBE-MARK-DROP`)
//! are kept, as kube-proxy's own cleanup keeps them. [`kube_proxy_found`] tells, read only,
//! whether kube-proxy serves the node (mode `external` waits for it before bypassing Switchyard).

use crate::{
    model::IpFamily,
    sys::{
        self,
        iptables::{Iptables, Table, Variant},
    },
};

/// kube-proxy's fixed chains (its per-service chains are matched by prefix).
const FIXED: [&str; 8] = [
    "KUBE-SERVICES",
    "KUBE-EXTERNAL-SERVICES",
    "KUBE-FORWARD",
    "KUBE-NODEPORTS",
    "KUBE-POSTROUTING",
    "KUBE-MARK-MASQ",
    "KUBE-PROXY-FIREWALL",
    "KUBE-PROXY-CANARY",
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
    (removed, errors)
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
