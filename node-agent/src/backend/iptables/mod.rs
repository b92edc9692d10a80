//! iptables backend: kube-proxy's iptables mode with our own `SWY-*` chains.
//!
//! A sync renders the snapshot ([`render::render`], pure) and applies it with one
//! `iptables-restore --noflush --counters` transaction covering tables `filter` and `nat`. Built-in
//! chains are never written by the restore (`--noflush` would still flush any chain it declares);
//! the jump rules from them into our chains are ensured one by one (`iptables -C`, then `-I` when
//! missing) on full syncs. A partial sync rewrites the chains of changed services and those
//! top-level chains whose rules changed only, and flushes and deletes (`-X`) the chains no longer
//! wanted. Which `SWY-*` chains exist is read with `iptables-save` on full syncs and tracked in
//! memory in between; any failure makes the next sync full.
//!
//! IPv4 goes through `iptables-*`, IPv6 through `ip6tables-*` of the same variant, each with its
//! own snapshot and chain tracking; a sync does IPv4 first, then IPv6.
//!
//! All processes are run by [`crate::sys::iptables`], through the [`SaveRestore`] adapter (one
//! per family) and the [`Sysctl`] adapter, so the backend also runs on their fakes.

pub mod render;

#[cfg(test)]
mod tests;

use std::collections::{BTreeSet, HashMap};

use switchyard_crds::v1alpha1::ProxyMode;

use crate::backend::{Backend, BackendError, FamilyResults, Settings, SyncStats};
use crate::model::{Changes, DualSnapshot, IpFamily, ServiceName, Snapshot, ports_of};
use crate::sys::{
    iptables::{Iptables, IptablesError, SaveRestore, Table, Variant},
    sysctl::{HostSysctl, Sysctl},
};

use render::{
    CHAIN_PREFIX, EXTERNAL_SERVICES, FIREWALL, FORWARD, NODEPORTS, POSTROUTING, PROXY_FIREWALL, SERVICES,
};

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
pub const JUMP_RULES: [JumpRule; 14] = {
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
    const GUARD: &str = "switchyard localnet guard";
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
        j(Table::Filter, "INPUT", FIREWALL, false, GUARD),
        j(Table::Filter, "OUTPUT", FIREWALL, false, GUARD),
        j(Table::Nat, "OUTPUT", SERVICES, false, SVC),
        j(Table::Nat, "PREROUTING", SERVICES, false, SVC),
        j(Table::Nat, "POSTROUTING", POSTROUTING, false, POST),
    ]
};

impl From<IptablesError> for BackendError {
    fn from(e: IptablesError) -> Self {
        if matches!(e, IptablesError::Spawn { .. }) {
            return BackendError::ToolMissing {
                backend: BACKEND,
                command: e.command().to_owned(),
                detail: e.detail(),
            };
        }
        BackendError::Command {
            backend: BACKEND,
            command: e.command().to_owned(),
            detail: e.detail(),
        }
    }
}

/// The iptables data plane, on the tools `I` (one per family) and the sysctls `S`.
#[derive(Debug)]
pub struct IptablesProxier<I: SaveRestore = Iptables, S: Sysctl = HostSysctl> {
    variant: Variant,
    settings: Settings,
    /// `iptables` (IPv4) and `ip6tables` (IPv6).
    families: [FamilyTables<I>; 2],
    /// Entry points off: no jump rules from built-in chains into ours.
    bypassed: bool,
    /// Where `route_localnet` is set.
    sysctl: S,
}

/// The iptables data plane on the kernel's tools.
pub type IptablesBackend = IptablesProxier<Iptables, HostSysctl>;

/// One family's tools and what we programmed with them.
#[derive(Debug)]
struct FamilyTables<I> {
    ipt: I,
    /// Our chains in the kernel after the last successful sync, per table.
    filter_chains: BTreeSet<String>,
    nat_chains: BTreeSet<String>,
    /// Services with ports of this family after the last successful sync.
    services: BTreeSet<ServiceName>,
    /// Set after a failure: the next sync is full whatever the caller asks.
    needs_full: bool,
    /// Whether the last successful sync rendered a large cluster (no per-endpoint comments): a
    /// sync that crosses the threshold is full, so no chain keeps the other style.
    large_cluster: Option<bool>,
    /// Whether this family has worked on this node (see [`FamilyResults`]).
    results: FamilyResults,
    /// A failure to set route_localnet was logged.
    localnet_warned: bool,
    /// Fingerprints of the top-level chains of `filter` and `nat` as the last successful restore
    /// wrote them (see [`leave_out_unchanged`]).
    top_written: [HashMap<&'static str, u64>; 2],
}

impl IptablesBackend {
    /// A backend driving the `variant` tools in the current network namespace.
    pub fn new(variant: Variant, settings: Settings) -> Self {
        Self::with_netns(variant, settings, None)
    }

    /// A backend whose every command runs in network namespace `netns` (`ip netns exec`), or in
    /// the current one with `None`.
    pub fn with_netns(variant: Variant, settings: Settings, netns: Option<String>) -> Self {
        let tools = IpFamily::ALL.map(|family| Iptables::new(variant, netns.clone()).for_family(family));
        Self::with_adapters(variant, settings, tools, HostSysctl::new(netns))
    }

    /// A backend for the variant named `"legacy"` or `"nft"`.
    pub fn from_variant_name(name: &str, settings: Settings) -> Result<Self, BackendError> {
        let variant = name.parse::<Variant>()?;
        Ok(Self::new(variant, settings))
    }
}

impl<I: SaveRestore, S: Sysctl> IptablesProxier<I, S> {
    /// A backend on `tools` (IPv4, then IPv6) and `sysctl`, reporting `variant`.
    pub fn with_adapters(variant: Variant, settings: Settings, tools: [I; 2], sysctl: S) -> Self {
        let families = tools.map(|ipt| FamilyTables {
            ipt,
            filter_chains: BTreeSet::new(),
            nat_chains: BTreeSet::new(),
            services: BTreeSet::new(),
            needs_full: true,
            large_cluster: None,
            results: FamilyResults::default(),
            localnet_warned: false,
            top_written: Default::default(),
        });
        Self {
            variant,
            settings,
            families,
            bypassed: false,
            sysctl,
        }
    }

    /// The tools of `family` (for tests: the fake's tables).
    pub fn tools(&self, family: IpFamily) -> &I {
        &self.families[family as usize].ipt
    }

    /// The tools of `family`, mutable (for tests: injecting faults).
    pub fn tools_mut(&mut self, family: IpFamily) -> &mut I {
        &mut self.families[family as usize].ipt
    }

    /// The sysctls (for tests).
    pub fn sysctl(&self) -> &S {
        &self.sysctl
    }

    /// The variant in use.
    pub fn variant(&self) -> Variant {
        self.variant
    }

    /// The settings it renders with.
    pub fn settings(&self) -> &Settings {
        &self.settings
    }

    /// Our (`SWY-*`) chains currently in `table` of `family`, read with `iptables-save` or
    /// `ip6tables-save`.
    pub fn kernel_chains(&self, family: IpFamily, table: Table) -> Result<BTreeSet<String>, BackendError> {
        Ok(own_chains(&self.families[family as usize].ipt.save(table)?))
    }
}

/// Restore lines that bring the jump rules in line with the bypass state: `-I CHAIN 1 ...` for
/// missing ones (in reverse, so JUMP_RULES' order ends up at the top of each chain), or `-D ...`
/// for present ones when bypassed. Returns (filter lines, nat lines).
fn jump_edits(bypassed: bool, filter_save: &str, nat_save: &str) -> (Vec<String>, Vec<String>) {
    {
        let (mut filter, mut nat) = (Vec::new(), Vec::new());
        for rule in JUMP_RULES.iter().rev() {
            let save = if rule.table == Table::Filter {
                filter_save
            } else {
                nat_save
            };
            let present = save.lines().any(|l| l == rule.save_line());
            let prefix = format!("-A {} ", rule.chain);
            let line = match (bypassed, present) {
                (true, true) => Some(
                    rule.save_line()
                        .replacen(&prefix, &format!("-D {} ", rule.chain), 1),
                ),
                (false, false) => Some(rule.save_line().replacen(
                    &prefix,
                    &format!("-I {} 1 ", rule.chain),
                    1,
                )),
                _ => None,
            };
            if let Some(line) = line {
                if rule.table == Table::Filter {
                    filter.push(line)
                } else {
                    nat.push(line)
                }
            }
        }
        (filter, nat)
    }
}

impl<I: SaveRestore> FamilyTables<I> {
    /// Sets [`render::ROUTE_LOCALNET`] to 1 unless it is; false (logged once) when it cannot be.
    fn ensure_route_localnet(&mut self, sysctl: &mut impl Sysctl) -> bool {
        match sysctl.ensure(render::ROUTE_LOCALNET, "1") {
            Ok(changed) => {
                if changed {
                    tracing::info!(
                        sysctl = render::ROUTE_LOCALNET,
                        "set to 1 for NodePorts on 127.0.0.1 (guarded by {FIREWALL})"
                    );
                }
                self.localnet_warned = false;
                true
            }
            Err(e) => {
                if !self.localnet_warned {
                    tracing::warn!(sysctl = render::ROUTE_LOCALNET, error = %e, "cannot set; NodePorts on 127.0.0.1 are refused");
                    self.localnet_warned = true;
                }
                false
            }
        }
    }

    fn sync_inner(
        &mut self,
        sysctl: &mut impl Sysctl,
        settings: &Settings,
        bypassed: bool,
        snapshot: &Snapshot,
        changes: &Changes,
        full: bool,
    ) -> Result<SyncStats, BackendError> {
        // One iptables-save per table on full syncs: our chains, and which jump rules exist. Running
        // `iptables -C` per jump rule would cost a whole-table fetch each on large tables.
        let (existing_filter, existing_nat, jumps) = if full {
            let filter_save = self.ipt.save(Table::Filter)?;
            let nat_save = self.ipt.save(Table::Nat)?;
            let jumps = jump_edits(bypassed, &filter_save, &nat_save);
            (own_chains(&filter_save), own_chains(&nat_save), jumps)
        } else {
            (
                self.filter_chains.clone(),
                self.nat_chains.clone(),
                (Vec::new(), Vec::new()),
            )
        };
        let in_snapshot = |s: &ServiceName| ports_of(&snapshot.services, s).next().is_some();
        if !full
            && !changes
                .services
                .iter()
                .any(|s| in_snapshot(s) || self.services.contains(s))
        {
            // Nothing of this family changed (e.g. an IPv4-only Service, seen from ip6tables).
            return Ok(SyncStats::default());
        }
        // Localhost NodePorts need route_localnet: set (through `sys`) before the rules that rely
        // on it; where it cannot be set (a read-only /proc/sys) they are refused instead.
        let localnet_settings;
        let settings = if render::serves_localhost_node_ports(settings, self.ipt.family())
            && !self.ensure_route_localnet(sysctl)
        {
            localnet_settings = Settings {
                localhost_node_ports: false,
                ..settings.clone()
            };
            &localnet_settings
        } else {
            settings
        };
        let mut rendered = render::render(snapshot, settings, if full { None } else { Some(changes) });
        let mut full = full;
        if !full {
            // Chains of unchanged services must already exist; otherwise our view is off: go full.
            let missing = rendered
                .nat_chains
                .iter()
                .any(|c| !rendered.nat.chains.contains_key(c) && !existing_nat.contains(c));
            if missing || self.large_cluster != Some(rendered.large_cluster) {
                full = true;
                rendered = render::render(snapshot, settings, None);
            }
        }
        let stale_filter: BTreeSet<String> = existing_filter
            .difference(&rendered.filter_chains)
            .cloned()
            .collect();
        let stale_nat: BTreeSet<String> = existing_nat.difference(&rendered.nat_chains).cloned().collect();
        let top = [
            fingerprints(&rendered.filter, &render::FILTER_TOP_CHAINS),
            fingerprints(&rendered.nat, &render::NAT_TOP_CHAINS),
        ];
        if !full {
            leave_out_unchanged(&mut rendered.filter, &top[0], &self.top_written[0]);
            leave_out_unchanged(&mut rendered.nat, &top[1], &self.top_written[1]);
        }
        let input = rendered.restore_input_with_jumps(&stale_filter, &stale_nat, &jumps.0, &jumps.1);
        self.ipt.restore(&input).map_err(|e| match e {
            IptablesError::Failed { stderr, .. } => BackendError::Kernel {
                backend: BACKEND,
                detail: stderr,
            },
            other => other.into(),
        })?;
        let objects =
            rendered.objects() + stale_filter.len() + stale_nat.len() + jumps.0.len() + jumps.1.len();
        self.filter_chains = rendered.filter_chains.clone();
        self.nat_chains = rendered.nat_chains.clone();
        self.large_cluster = Some(rendered.large_cluster);
        self.top_written = top;
        if full {
            self.services = snapshot.services.keys().map(|k| k.service.clone()).collect();
        } else {
            for service in &changes.services {
                if in_snapshot(service) {
                    self.services.insert(service.clone());
                } else {
                    self.services.remove(service);
                }
            }
        }
        Ok(SyncStats {
            full,
            services: rendered.services,
            endpoints: rendered.endpoints,
            objects_written: objects,
            rules_total: rendered.rules_total,
        })
    }
}

/// The fingerprint of each of the top-level chains `tops` in `rules` (a render always holds them
/// complete): a hash of its rule lines.
fn fingerprints(rules: &render::TableRules, tops: &[&'static str]) -> HashMap<&'static str, u64> {
    use std::hash::{Hash, Hasher};
    tops.iter()
        .filter_map(|&chain| {
            let lines = rules.chains.get(chain)?;
            // Fixed keys: the same rules always hash the same within the process.
            let mut h = std::collections::hash_map::DefaultHasher::new();
            lines.hash(&mut h);
            Some((chain, h.finish()))
        })
        .collect()
}

/// Leaves out of a partial sync's `rules` the top-level chains whose rules (`now`) are what the
/// last successful restore wrote (`written`), so the kernel holds them already. On iptables-nft a
/// restore costs per chain it names (iptables 1.8.9 keeps every chain a command names, jump
/// targets included, in a sorted list it inserts into one by one, then fetches each chain on
/// its own), and nat `SWY-SERVICES` names every service's chain: rewritten on every sync, it
/// made an endpoint change at 10k Services cost ~0.8 s. Two different rule lists of one chain
/// share a 64-bit fingerprint with probability 2^-64 per sync; any failure makes the next sync
/// full, which writes every chain.
fn leave_out_unchanged(
    rules: &mut render::TableRules,
    now: &HashMap<&'static str, u64>,
    written: &HashMap<&'static str, u64>,
) {
    for (chain, fingerprint) in now {
        if written.get(chain) == Some(fingerprint) {
            rules.chains.remove(*chain);
        }
    }
}

/// The `SWY-*` chains declared in `iptables-save` output, except the IPVS backend's
/// `SWY-IPVS-*` (each backend owns only its own objects).
pub fn own_chains(save: &str) -> BTreeSet<String> {
    save.lines()
        .filter_map(|l| l.strip_prefix(':'))
        .filter_map(|l| l.split_whitespace().next())
        .filter(|c| c.starts_with(CHAIN_PREFIX) && !c.starts_with("SWY-IPVS-"))
        .map(str::to_owned)
        .collect()
}

impl<I: SaveRestore> FamilyTables<I> {
    fn sync(
        &mut self,
        sysctl: &mut impl Sysctl,
        settings: &Settings,
        bypassed: bool,
        snapshot: &Snapshot,
        changes: &Changes,
        full: bool,
    ) -> Result<SyncStats, BackendError> {
        let full = full || self.needs_full;
        let result = self.sync_inner(sysctl, settings, bypassed, snapshot, changes, full);
        self.needs_full = result.is_err();
        result
    }

    fn cleanup(&mut self) -> Result<(), BackendError> {
        self.needs_full = true;
        let (filter, nat) = match (self.ipt.save(Table::Filter), self.ipt.save(Table::Nat)) {
            (Ok(filter), Ok(nat)) => (own_chains(&filter), own_chains(&nat)),
            // Without the IPv6 tools, or without IPv6, there is nothing of ours in ip6tables.
            (Err(e), _) | (_, Err(e))
                if self.ipt.family() == IpFamily::V6
                    && (matches!(e, IptablesError::Spawn { .. }) || !crate::sys::host::ipv6_enabled()) =>
            {
                return Ok(());
            }
            (Err(e), _) | (_, Err(e)) => return Err(e.into()),
        };
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
        self.services.clear();
        self.top_written = Default::default();
        Ok(())
    }

    fn set_bypass(&mut self, bypassed: bool) -> Result<(), BackendError> {
        if self.nat_chains.is_empty() && self.filter_chains.is_empty() {
            return Ok(()); // nothing programmed yet: the next full sync honours the flag
        }
        let (filter, nat) = jump_edits(
            bypassed,
            &self.ipt.save(Table::Filter)?,
            &self.ipt.save(Table::Nat)?,
        );
        if filter.is_empty() && nat.is_empty() {
            return Ok(());
        }
        // No chain declarations: with --noflush nothing but these lines changes.
        let input = format!(
            "*filter\n{}COMMIT\n*nat\n{}COMMIT\n",
            filter.iter().map(|l| format!("{l}\n")).collect::<String>(),
            nat.iter().map(|l| format!("{l}\n")).collect::<String>()
        );
        self.ipt.restore(&input)?;
        Ok(())
    }

    /// The cheap check after an idle period: every base-chain jump as `bypassed` wants it, read
    /// from the base chains alone (a jump keeps its target chain from being deleted, and a table
    /// flush or a firewall reload removes the jumps). Nothing programmed here: nothing to check.
    fn intact(&self, bypassed: bool) -> Result<bool, BackendError> {
        if self.filter_chains.is_empty() && self.nat_chains.is_empty() {
            return Ok(true);
        }
        let mut base: Vec<(Table, &str, String)> = Vec::new();
        for rule in &JUMP_RULES {
            if !base.iter().any(|(t, c, _)| *t == rule.table && *c == rule.chain) {
                base.push((
                    rule.table,
                    rule.chain,
                    self.ipt.chain_rules(rule.table, rule.chain)?,
                ));
            }
        }
        let text = |table: Table| -> String {
            base.iter()
                .filter(|(t, _, _)| *t == table)
                .map(|(_, _, rules)| rules.as_str())
                .collect()
        };
        let (filter, nat) = jump_edits(bypassed, &text(Table::Filter), &text(Table::Nat));
        Ok(filter.is_empty() && nat.is_empty())
    }

    fn verify(&self) -> Result<Vec<String>, BackendError> {
        let mut drift = Vec::new();
        if self.filter_chains.is_empty() && self.nat_chains.is_empty() && self.ipt.family() == IpFamily::V6 {
            return Ok(drift); // nothing programmed in ip6tables (e.g. no IPv6 on this node)
        }
        let tool = self.ipt.tool();
        for (table, ours) in [
            (Table::Filter, &self.filter_chains),
            (Table::Nat, &self.nat_chains),
        ] {
            let kernel = own_chains(&self.ipt.save(table)?);
            drift.extend(
                ours.difference(&kernel)
                    .map(|c| format!("{tool}: chain {c} is missing")),
            );
            drift.extend(
                kernel
                    .difference(ours)
                    .map(|c| format!("{tool}: chain {c} is not ours to keep")),
            );
        }
        Ok(drift)
    }
}

impl<I: SaveRestore, S: Sysctl> Backend for IptablesProxier<I, S> {
    fn mode(&self) -> ProxyMode {
        ProxyMode::Iptables
    }

    fn presence(&self) -> Result<super::Presence, BackendError> {
        let Some(v4) = self.families.iter().find(|t| t.ipt.family() == IpFamily::V4) else {
            return Ok(super::Presence::Absent);
        };
        let (filter, nat) = match (v4.ipt.save(Table::Filter), v4.ipt.save(Table::Nat)) {
            (Ok(filter), Ok(nat)) => (filter, nat),
            // The variant's tools are not installed: nothing of ours can be there.
            (Err(IptablesError::Spawn { .. }), _) | (_, Err(IptablesError::Spawn { .. })) => {
                return Ok(super::Presence::Absent);
            }
            (Err(e), _) | (_, Err(e)) => return Err(e.into()),
        };
        if own_chains(&filter).is_empty() && own_chains(&nat).is_empty() {
            return Ok(super::Presence::Absent);
        }
        // Serving: every nat jump into our chains is in place (the bypass removes them).
        let (_, nat_edits) = jump_edits(false, &filter, &nat);
        Ok(if nat_edits.is_empty() {
            super::Presence::Serving
        } else {
            super::Presence::Bypassed
        })
    }

    fn sync(
        &mut self,
        snapshot: &DualSnapshot,
        changes: &Changes,
        full: bool,
    ) -> Result<SyncStats, BackendError> {
        let mut total: Option<SyncStats> = None;
        for i in 0..self.families.len() {
            let tables = &mut self.families[i];
            let family = tables.ipt.family();
            let family_snapshot = snapshot.get(family);
            let result = tables.sync(
                &mut self.sysctl,
                &self.settings,
                self.bypassed,
                family_snapshot,
                changes,
                full,
            );
            match tables.results.check(family, result) {
                Ok(Some(stats)) => total = Some(total.map_or(stats.clone(), |t| t.plus(&stats))),
                Ok(None) => {}
                Err(e) => {
                    // The other family may have missed these changes too: both go full next time.
                    for other in &mut self.families {
                        other.needs_full = true;
                    }
                    return Err(e);
                }
            }
        }
        Ok(total.unwrap_or_default())
    }

    fn cleanup(&mut self) -> Result<(), BackendError> {
        // Each family on its own: a failure in one does not keep the other.
        let errors = self
            .families
            .iter_mut()
            .filter_map(|tables| tables.cleanup().err())
            .collect();
        BackendError::collect(errors)
    }

    fn render_text(&self, snapshot: &DualSnapshot) -> String {
        let v4 = render::render(&snapshot.v4, &self.settings, None).text();
        let v6 = render::render(&snapshot.v6, &self.settings, None).text();
        format!("# iptables-restore input (IPv4)\n{v4}# ip6tables-restore input (IPv6)\n{v6}")
    }

    fn set_bypass(&mut self, bypassed: bool) -> Result<(), BackendError> {
        self.bypassed = bypassed;
        for tables in &mut self.families {
            tables.set_bypass(bypassed)?;
        }
        Ok(())
    }

    fn verify(&self) -> Result<Vec<String>, BackendError> {
        let mut drift = Vec::new();
        for tables in &self.families {
            drift.extend(tables.verify()?);
        }
        Ok(drift)
    }

    fn intact(&self) -> Result<Option<bool>, BackendError> {
        for tables in &self.families {
            if !tables.intact(self.bypassed)? {
                return Ok(Some(false));
            }
        }
        Ok(Some(true))
    }
}
