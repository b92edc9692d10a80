//! Reading a namespace node's packet-filter state for checks. Every listing is one command whose
//! exit status is checked: a listing that fails is an error, never an empty text, so an absence
//! check ("no `SWY` chain left") can only pass on a listing that succeeded and lacks the object.
//! (`sh -c "a; b"` would report only `b`'s status; each command runs on its own here.)

use crate::{Family, Result, netns::Cluster};

/// `nft list tables` in `netns`.
pub fn nft_tables(netns: &str) -> Result<String> {
    Cluster::exec(netns, &["nft", "list", "tables"])
}

/// `nft list ruleset` in `netns`: every family's tables.
pub fn nft_ruleset(netns: &str) -> Result<String> {
    Cluster::exec(netns, &["nft", "list", "ruleset"])
}

/// The saves of both iptables variants (legacy, then nft) of each of `families`, concatenated.
pub fn iptables_saves(netns: &str, families: &[Family]) -> Result<String> {
    let mut all = String::new();
    for family in families {
        let tools: [&str; 2] = match family {
            Family::V4 => ["iptables-legacy-save", "iptables-nft-save"],
            Family::V6 => ["ip6tables-legacy-save", "ip6tables-nft-save"],
        };
        for tool in tools {
            all.push_str(&Cluster::exec(netns, &[tool])?);
        }
    }
    Ok(all)
}

/// Everything of a backend (`"nftables"`, or an iptables mode) in the node's kernel: the whole
/// nftables ruleset, or both iptables variants' saves of each of `families`.
pub fn backend_state(netns: &str, mode: &str, families: &[Family]) -> Result<String> {
    if mode == "nftables" {
        nft_ruleset(netns)
    } else {
        iptables_saves(netns, families)
    }
}

/// What of Switchyard is in a node's kernel: (an nft table named `switchyard`, `SWY` objects in
/// either IPv4 iptables variant).
pub fn ours(netns: &str) -> Result<(bool, bool)> {
    let nft = nft_tables(netns)?;
    let ipt = iptables_saves(netns, &[Family::V4])?;
    Ok((nft.contains("switchyard"), ipt.contains("SWY")))
}

/// Every `:KUBE-*` chain declared in the four saves (variant × family) of `netns`, as
/// `tool table chain`, sorted; every listing must succeed.
pub fn kube_chains(netns: &str) -> Result<Vec<String>> {
    let mut found = Vec::new();
    for tool in [
        "iptables-legacy-save",
        "iptables-nft-save",
        "ip6tables-legacy-save",
        "ip6tables-nft-save",
    ] {
        let save = Cluster::exec(netns, &[tool])?;
        let mut table = "";
        for line in save.lines() {
            if let Some(t) = line.strip_prefix('*') {
                table = t.trim();
            } else if let Some(c) = line.strip_prefix(':').and_then(|l| l.split_whitespace().next())
                && c.starts_with("KUBE-")
            {
                found.push(format!("{tool} {table} {c}"));
            }
        }
    }
    found.sort();
    Ok(found)
}

#[cfg(test)]
mod tests {
    //! A broken listing (here: a namespace that does not exist, so `ip netns exec` fails) must be
    //! an error in every helper: the absence checks built on them ("no SWY chain left") would
    //! otherwise pass on an empty text.
    use super::*;

    const MISSING: &str = "swy-listing-check-no-such-netns";

    #[test]
    fn every_listing_fails_when_its_command_fails() {
        assert!(nft_tables(MISSING).is_err(), "nft list tables");
        assert!(nft_ruleset(MISSING).is_err(), "nft list ruleset");
        assert!(
            iptables_saves(MISSING, &[Family::V4]).is_err(),
            "iptables saves v4"
        );
        assert!(
            iptables_saves(MISSING, &[Family::V6]).is_err(),
            "iptables saves v6"
        );
        for mode in ["nftables", "iptables"] {
            assert!(backend_state(MISSING, mode, &[Family::V4]).is_err(), "{mode}");
        }
        assert!(ours(MISSING).is_err(), "ours()");
        assert!(kube_chains(MISSING).is_err(), "kube_chains()");
    }
}
