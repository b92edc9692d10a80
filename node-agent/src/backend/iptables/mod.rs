//! iptables backend: kube-proxy's iptables mode with our own `SWY-*` chains.
//!
//! A sync renders the snapshot ([`render::render`], pure) and applies it with one
//! `iptables-restore --noflush --counters` transaction covering tables `filter` and `nat`. Built-in
//! chains are never written by the restore (`--noflush` would still flush any chain it declares);
//! the jump rules from them into our chains are ensured one by one (`iptables -C`, then `-I` when
//! missing) on full syncs. A partial sync rewrites the top-level chains and the chains of changed
//! services only, and flushes and deletes (`-X`) the chains no longer wanted. Which `SWY-*` chains
//! exist is read with `iptables-save` on full syncs and tracked in memory in between; any failure
//! makes the next sync full.
//!
//! All processes are run by [`crate::sys::iptables`].

pub mod render;

#[cfg(test)]
mod tests;

use std::collections::BTreeSet;

use switchyard_crds::v1alpha1::ProxyMode;

use crate::backend::{Backend, BackendError, Settings, SyncStats};
use crate::model::{Changes, Snapshot};
use crate::sys::iptables::{Iptables, IptablesError, Table, Variant};

use render::{CHAIN_PREFIX, EXTERNAL_SERVICES, FORWARD, NODEPORTS, POSTROUTING, PROXY_FIREWALL, SERVICES};

const BACKEND: &str = "iptables";

/// A jump rule from a built-in chain into one of our top-level chains.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct JumpRule {
    /// Table.
    pub table: Table,
    /// Built-in chain the rule is in.
    pub chain: &'static str,
    /// Our chain it jumps to.
    pub target: &'static str,
    /// Only for `--ctstate NEW` connections.
    pub new_only: bool,
    /// Its comment.
    pub comment: &'static str,
}

impl JumpRule {
    /// The rule specification as `iptables` arguments (after `-t TABLE -C CHAIN`).
    pub fn spec(&self) -> Vec<&'static str> {
        let mut spec = Vec::with_capacity(10);
        if self.new_only {
            spec.extend(["-m", "conntrack", "--ctstate", "NEW"]);
        }
        spec.extend(["-m", "comment", "--comment", self.comment, "-j", self.target]);
        spec
    }

    /// The rule as `iptables-save` prints it.
    pub fn save_line(&self) -> String {
        let ctstate = if self.new_only {
            " -m conntrack --ctstate NEW"
        } else {
            ""
        };
        format!(
            "-A {}{ctstate} -m comment --comment {} -j {}",
            self.chain,
            render::save_string(self.comment),
            self.target
        )
    }
}

/// Jump rules from built-in chains (kube-proxy's `iptablesJumpChains` with our chains).
pub const JUMP_RULES: [JumpRule; 12] = {
    const fn j(
        table: Table,
        chain: &'static str,
        target: &'static str,
        new_only: bool,
        comment: &'static str,
    ) -> JumpRule {
        JumpRule {
            table,
            chain,
            target,
            new_only,
            comment,
        }
    }
    const EXT: &str = "switchyard externally-visible service portals";
    const HC: &str = "switchyard health check service ports";
    const SVC: &str = "switchyard service portals";
    const FWD: &str = "switchyard forwarding rules";
    const FW: &str = "switchyard load balancer firewall";
    const POST: &str = "switchyard postrouting rules";
    [
        j(Table::Filter, "INPUT", EXTERNAL_SERVICES, true, EXT),
        j(Table::Filter, "FORWARD", EXTERNAL_SERVICES, true, EXT),
        j(Table::Filter, "INPUT", NODEPORTS, false, HC),
        j(Table::Filter, "FORWARD", SERVICES, true, SVC),
        j(Table::Filter, "OUTPUT", SERVICES, true, SVC),
        j(Table::Filter, "FORWARD", FORWARD, false, FWD),
        j(Table::Filter, "INPUT", PROXY_FIREWALL, true, FW),
        j(Table::Filter, "OUTPUT", PROXY_FIREWALL, true, FW),
        j(Table::Filter, "FORWARD", PROXY_FIREWALL, true, FW),
        j(Table::Nat, "OUTPUT", SERVICES, false, SVC),
        j(Table::Nat, "PREROUTING", SERVICES, false, SVC),
        j(Table::Nat, "POSTROUTING", POSTROUTING, false, POST),
    ]
};

impl From<IptablesError> for BackendError {
    fn from(e: IptablesError) -> Self {
        BackendError::Command {
            backend: BACKEND,
            command: e.command().to_owned(),
            detail: e.detail(),
        }
    }
}

/// The iptables data plane.
#[derive(Debug)]
pub struct IptablesBackend {
    variant: Variant,
    settings: Settings,
    ipt: Iptables,
    /// Our chains in the kernel after the last successful sync, per table.
    filter_chains: BTreeSet<String>,
    nat_chains: BTreeSet<String>,
    /// Set after a failure: the next sync is full whatever the caller asks.
    needs_full: bool,
}

impl IptablesBackend {
    /// A backend driving the `variant` tools in the current network namespace.
    pub fn new(variant: Variant, settings: Settings) -> Self {
        Self::with_netns(variant, settings, None)
    }

    /// A backend whose every command runs in network namespace `netns` (`ip netns exec`), or in
    /// the current one with `None`.
    pub fn with_netns(variant: Variant, settings: Settings, netns: Option<String>) -> Self {
        Self {
            variant,
            settings,
            ipt: Iptables::new(variant, netns),
            filter_chains: BTreeSet::new(),
            nat_chains: BTreeSet::new(),
            needs_full: true,
        }
    }

    /// A backend for the variant named `"legacy"` or `"nft"`.
    pub fn from_variant_name(name: &str, settings: Settings) -> Result<Self, BackendError> {
        let variant = name.parse::<Variant>()?;
        Ok(Self::new(variant, settings))
    }

    /// The variant in use.
    pub fn variant(&self) -> Variant {
        self.variant
    }

    /// The settings it renders with.
    pub fn settings(&self) -> &Settings {
        &self.settings
    }

    /// Our (`SWY-*`) chains currently in `table`, read with `iptables-save`.
    pub fn kernel_chains(&self, table: Table) -> Result<BTreeSet<String>, BackendError> {
        Ok(own_chains(&self.ipt.save(table)?))
    }

    fn sync_inner(
        &mut self,
        snapshot: &Snapshot,
        changes: &Changes,
        full: bool,
    ) -> Result<SyncStats, BackendError> {
        // One iptables-save per table on full syncs: our chains, and which jump rules exist. Running
        // `iptables -C` per jump rule would cost a whole-table fetch each on large tables.
        let (existing_filter, existing_nat, missing_jumps) = if full {
            let filter_save = self.ipt.save(Table::Filter)?;
            let nat_save = self.ipt.save(Table::Nat)?;
            let missing: Vec<&JumpRule> = JUMP_RULES
                .iter()
                .filter(|r| {
                    let save = if r.table == Table::Filter { &filter_save } else { &nat_save };
                    !save.lines().any(|l| l == r.save_line())
                })
                .collect();
            (own_chains(&filter_save), own_chains(&nat_save), missing)
        } else {
            (self.filter_chains.clone(), self.nat_chains.clone(), Vec::new())
        };
        let mut rendered = render::render(snapshot, &self.settings, if full { None } else { Some(changes) });
        let mut full = full;
        if !full {
            // Chains of unchanged services must already exist; otherwise our view is off: go full.
            let missing = rendered
                .nat_chains
                .iter()
                .any(|c| !rendered.nat.chains.contains_key(c) && !existing_nat.contains(c));
            if missing {
                full = true;
                rendered = render::render(snapshot, &self.settings, None);
            }
        }
        let stale_filter: BTreeSet<String> = existing_filter
            .difference(&rendered.filter_chains)
            .cloned()
            .collect();
        let stale_nat: BTreeSet<String> = existing_nat.difference(&rendered.nat_chains).cloned().collect();
        // Inserting at position 1 in reverse keeps JUMP_RULES' order at the top of each chain.
        let insert = |table: Table| -> Vec<String> {
            missing_jumps
                .iter()
                .rev()
                .filter(|r| r.table == table)
                .map(|r| r.save_line().replacen(&format!("-A {} ", r.chain), &format!("-I {} 1 ", r.chain), 1))
                .collect()
        };
        let input = if full {
            rendered.restore_input_with_jumps(&stale_filter, &stale_nat, &insert(Table::Filter), &insert(Table::Nat))
        } else {
            rendered.restore_input(&stale_filter, &stale_nat)
        };
        self.ipt.restore(&input).map_err(|e| match e {
            IptablesError::Failed { stderr, .. } => BackendError::Kernel {
                backend: BACKEND,
                detail: stderr,
            },
            other => other.into(),
        })?;
        let objects = rendered.objects() + stale_filter.len() + stale_nat.len() + missing_jumps.len();
        self.filter_chains = rendered.filter_chains.clone();
        self.nat_chains = rendered.nat_chains.clone();
        Ok(SyncStats {
            full,
            services: rendered.services,
            endpoints: rendered.endpoints,
            objects_written: objects,
            rules_total: rendered.rules_total,
        })
    }
}

/// The `SWY-*` chains declared in `iptables-save` output.
pub fn own_chains(save: &str) -> BTreeSet<String> {
    save.lines()
        .filter_map(|l| l.strip_prefix(':'))
        .filter_map(|l| l.split_whitespace().next())
        .filter(|c| c.starts_with(CHAIN_PREFIX))
        .map(str::to_owned)
        .collect()
}

impl Backend for IptablesBackend {
    fn mode(&self) -> ProxyMode {
        ProxyMode::Iptables
    }

    fn sync(
        &mut self,
        snapshot: &Snapshot,
        changes: &Changes,
        full: bool,
    ) -> Result<SyncStats, BackendError> {
        let full = full || self.needs_full;
        let result = self.sync_inner(snapshot, changes, full);
        self.needs_full = result.is_err();
        result
    }

    fn cleanup(&mut self) -> Result<(), BackendError> {
        self.needs_full = true;
        let filter = self.kernel_chains(Table::Filter)?;
        let nat = self.kernel_chains(Table::Nat)?;
        // A jump rule can only exist while its target chain does (and `-C` fails without it).
        for rule in &JUMP_RULES {
            let chains = if rule.table == Table::Filter {
                &filter
            } else {
                &nat
            };
            if chains.contains(rule.target) {
                self.ipt.remove_rule(rule.table, rule.chain, &rule.spec())?;
            }
        }
        if !filter.is_empty() || !nat.is_empty() {
            // Declaring flushes every chain first, so references between our chains do not block -X.
            let input = render::Rendered::default().restore_input(&filter, &nat);
            self.ipt.restore(&input)?;
        }
        self.filter_chains.clear();
        self.nat_chains.clear();
        Ok(())
    }

    fn render_text(&self, snapshot: &Snapshot) -> String {
        render::render(snapshot, &self.settings, None).text()
    }
}
