//! nftables backend: tables `ip switchyard` and `ip6 switchyard` (one per family, the same shape),
//! programmed over netlink in atomic transactions, one per family.
//!
//! Full syncs rewrite every chain and reload every map (one transaction); partial syncs rewrite
//! only the chains of changed services and add or delete only the map elements that changed,
//! tracked with reference counts because several service ports may contribute the same element
//! (e.g. a hairpin pair). Most services have no chains at all (see [`render`]): their partial
//! syncs are element changes only, plus a new endpoint map and its DNAT rule the first time a
//! service has a given endpoint count. Chains and sets that are no longer rendered are flushed in
//! the main transaction and deleted in a follow-up one (kernels before 6.2 release a chain's
//! references to map elements only after the transaction; kube-proxy found the same).

pub mod render;

/// The object model and its netlink codec live with the adapter in [`crate::sys::nft`].
pub use crate::sys::nft::{codec as encode, ir};

use std::collections::{BTreeMap, BTreeSet, HashMap};

use encode::Batch;
use ir::{Element, Key};
use render::{EndpointMaps, Fragment};
use switchyard_crds::v1alpha1::ProxyMode;

use super::{Backend, BackendError, FamilyResults, Settings, SyncStats};
use crate::{
    model::{Changes, DualSnapshot, IpFamily, ServiceName, ServicePortName, Snapshot, ports_of},
    sys::{
        KernelError,
        nft::{KernelNft, NfTables, Objects},
    },
};

/// The nftables backend, programming through the nf_tables adapter `N`.
#[derive(Debug)]
pub struct Nftables<N: NfTables = KernelNft> {
    settings: Settings,
    /// The `ip` and `ip6` tables.
    tables: [Table; 2],
    /// Entry points off: every base chain starts with `return`.
    bypassed: bool,
    /// The kernel (or a fake).
    nft: N,
}

/// The nftables backend on the kernel.
pub type NftablesBackend = Nftables<KernelNft>;

/// What we programmed in one family's table.
#[derive(Debug)]
struct Table {
    family: IpFamily,
    fragments: BTreeMap<ServicePortName, Fragment>,
    /// Elements in the kernel per (set, key), with how many fragments want them.
    elements: ElementIndex,
    /// Endpoint maps in the kernel, with how many fragments fill them.
    endpoint_maps: EndpointMaps,
    /// Fragments with `firewall-ips` elements: the table has [`render::firewall_hooks`] while
    /// there are any.
    firewalled: usize,
    /// Chains and sets to delete in a follow-up transaction (retried by later syncs if it fails).
    stale_chains: BTreeSet<String>,
    stale_sets: BTreeSet<String>,
    /// Whether a full sync has programmed the table.
    programmed: bool,
    /// Whether this family has worked on this node (see [`FamilyResults`]).
    results: FamilyResults,
}

fn kernel(source: KernelError) -> BackendError {
    BackendError::Sys {
        backend: "nftables",
        source,
    }
}

impl Nftables<KernelNft> {
    /// A backend on the kernel that renders with `settings`.
    pub fn new(settings: Settings) -> Self {
        Self::with_adapter(settings, KernelNft::default())
    }
}

impl<N: NfTables> Nftables<N> {
    /// A backend that renders with `settings` and programs through `nft`.
    pub fn with_adapter(settings: Settings, nft: N) -> Self {
        Self {
            settings,
            tables: IpFamily::ALL.map(Table::new),
            bypassed: false,
            nft,
        }
    }

    /// The adapter (for tests: the fake's listing).
    pub fn adapter(&self) -> &N {
        &self.nft
    }

    /// The adapter, mutable (for tests: injecting faults).
    pub fn adapter_mut(&mut self) -> &mut N {
        &mut self.nft
    }
}

/// Comment of the `return` rule that bypasses a base chain (read back by [`Backend::presence`]).
const BYPASS_COMMENT: &str = "bypassed by switchyard";

/// The fixed part of `family`'s table, with [`render::firewall_hooks`] if `firewalled` and the
/// bypass applied to base chains.
fn base(settings: &Settings, family: IpFamily, bypassed: bool, firewalled: bool) -> ir::Ruleset {
    let mut base = render::base(settings, family);
    if firewalled {
        render::add_firewall_hooks(&mut base);
    }
    if bypassed {
        base.chains.iter_mut().for_each(bypass);
    }
    base
}

/// Puts the bypass (`return`) first in `chain` if it is a base chain.
fn bypass(chain: &mut ir::Chain) {
    if chain.base.is_some() {
        chain.rules.insert(
            0,
            ir::Rule::new(vec![ir::Expr::Verdict(ir::Verdict::Return)]).comment(BYPASS_COMMENT),
        );
    }
}

/// What the element index keeps per (set, key): a fingerprint of the element's value (verdict,
/// DNAT target, comment) and how many fragments want it. The value itself lives in the fragments:
/// a copy here cost ~100 bytes per element (90 MiB of the agent's heap at 250k endpoints). Two
/// different values of one key share a 64-bit fingerprint with probability 2^-64 per change.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Wanted {
    value: u64,
    fragments: u32,
}

/// The elements in the kernel per (set, key).
type ElementIndex = HashMap<(&'static str, Key), Wanted>;

/// The fingerprint of `e`'s value (everything but its key).
fn fingerprint(e: &Element) -> u64 {
    use std::hash::{Hash, Hasher};
    // Fixed keys: the same value always has the same fingerprint within the process.
    let mut h = std::collections::hash_map::DefaultHasher::new();
    e.verdict.hash(&mut h);
    e.dnat.hash(&mut h);
    e.comment.hash(&mut h);
    h.finish()
}

/// A deletion of the element with `key`: the kernel finds it by key alone.
fn by_key(key: Key) -> Element {
    Element {
        key,
        verdict: None,
        dnat: None,
        comment: None,
    }
}

/// A full sync's elements: adds each (set, key) once to `batch`, set by set and each set's sorted
/// (the first fragment wanting a key gives its value: the base's NodePort addresses, then the
/// fragments in name order), and returns the index counting every fragment that wants it.
fn add_desired_elements(
    batch: &mut Batch,
    base: &ir::Ruleset,
    fragments: &BTreeMap<ServicePortName, Fragment>,
) -> ElementIndex {
    let nodeport_ips = base
        .elements
        .iter()
        .filter(|(set, _)| *set == render::sets::NODEPORT_IPS)
        .flat_map(|(_, list)| list.iter().map(|e| (render::sets::NODEPORT_IPS, e)));
    let wanted = fragments
        .values()
        .flat_map(|f| f.elements.iter().map(|(set, e)| (*set, e)));
    let capacity = nodeport_ips.clone().count() + fragments.values().map(|f| f.elements.len()).sum::<usize>();
    let mut index = ElementIndex::with_capacity(capacity);
    let mut by_set: BTreeMap<std::borrow::Cow<'static, str>, Vec<&Element>> = BTreeMap::new();
    for (set, e) in nodeport_ips.chain(wanted) {
        match index.entry((set, e.key.clone())) {
            std::collections::hash_map::Entry::Occupied(mut o) => o.get_mut().fragments += 1,
            std::collections::hash_map::Entry::Vacant(v) => {
                v.insert(Wanted {
                    value: fingerprint(e),
                    fragments: 1,
                });
                by_set
                    .entry(render::element_set(set, &e.key))
                    .or_default()
                    .push(e);
            }
        }
    }
    for (set, list) in &mut by_set {
        list.sort();
        batch.elements(set, list, true);
    }
    index
}

impl Table {
    fn new(family: IpFamily) -> Self {
        Self {
            family,
            fragments: BTreeMap::new(),
            elements: HashMap::new(),
            endpoint_maps: EndpointMaps::new(),
            firewalled: 0,
            stale_chains: BTreeSet::new(),
            stale_sets: BTreeSet::new(),
            programmed: false,
            results: FamilyResults::default(),
        }
    }

    fn forget(&mut self) {
        self.fragments.clear();
        self.elements.clear();
        self.endpoint_maps.clear();
        self.firewalled = 0;
    }

    fn render_fragments(
        settings: &Settings,
        snapshot: &Snapshot,
        only: Option<&ServiceName>,
    ) -> BTreeMap<ServicePortName, Fragment> {
        let render = |(name, port): (&ServicePortName, &crate::model::ServicePort)| {
            let eps = snapshot
                .endpoints
                .get(name)
                .map(Vec::as_slice)
                .unwrap_or_default();
            (name.clone(), render::service(port, eps, settings))
        };
        match only {
            None => snapshot.services.iter().map(render).collect(),
            Some(service) => ports_of(&snapshot.services, service).map(render).collect(),
        }
    }

    fn delete_stale(&mut self, nft: &mut impl NfTables) -> Result<(), BackendError> {
        if self.stale_chains.is_empty() && self.stale_sets.is_empty() {
            return Ok(());
        }
        let mut batch = Batch::new(self.family);
        for c in &self.stale_chains {
            batch.delete_chain(c);
        }
        for s in &self.stale_sets {
            batch.delete_set(s);
        }
        match nft.apply(batch) {
            Err(KernelError::Transport(e)) => Err(e.into()),
            Ok(()) => {
                self.stale_chains.clear();
                self.stale_sets.clear();
                Ok(())
            }
            Err(e) => {
                tracing::warn!(error = %e, "deleting stale nftables chains failed; will retry next sync");
                Ok(())
            }
        }
    }

    fn full_sync(
        &mut self,
        nft: &mut impl NfTables,
        settings: &Settings,
        bypassed: bool,
        snapshot: &Snapshot,
    ) -> Result<SyncStats, BackendError> {
        let fragments = Self::render_fragments(settings, snapshot, None);
        let firewalled = fragments.values().filter(|f| render::firewalls(f)).count();
        let mut base = base(settings, self.family, bypassed, firewalled > 0);
        let mut endpoint_maps = EndpointMaps::new();
        for m in fragments.values().flat_map(render::endpoint_maps) {
            *endpoint_maps.entry(m).or_default() += 1;
        }
        render::add_dispatch(&mut base, &endpoint_maps, settings);
        let existing_chains: BTreeSet<String> = nft
            .list(self.family, Objects::Chains)
            .map_err(kernel)?
            .into_iter()
            .collect();
        let existing_sets: BTreeSet<String> = nft
            .list(self.family, Objects::Sets)
            .map_err(kernel)?
            .into_iter()
            .collect();

        let mut batch = Batch::new(self.family);
        batch.add_table("rules for switchyard");
        for set in &base.sets {
            batch.add_set(set);
            batch.flush_set(&set.name);
        }
        let all_chains = base
            .chains
            .iter()
            .chain(fragments.values().flat_map(|f| f.chains.iter()));
        let mut desired_chains = BTreeSet::new();
        for chain in all_chains.clone() {
            batch.add_chain(&chain.name, chain.base);
            if existing_chains.contains(&chain.name) {
                batch.flush_chain(&chain.name);
            }
            desired_chains.insert(chain.name.clone());
        }
        let mut desired_sets: BTreeSet<String> = base.sets.iter().map(|s| s.name.clone()).collect();
        for set in fragments.values().flat_map(|f| f.sets.iter()) {
            // Affinity sets are created but never flushed: client stickiness survives a resync.
            batch.add_set(set);
            desired_sets.insert(set.name.clone());
        }
        for chain in all_chains {
            for rule in &chain.rules {
                batch.add_rule(&chain.name, rule);
            }
        }
        let elements = add_desired_elements(&mut batch, &base, &fragments);
        let stale_chains: BTreeSet<String> = existing_chains.difference(&desired_chains).cloned().collect();
        for c in &stale_chains {
            batch.flush_chain(c);
        }
        let messages = batch.len() as usize;
        nft.apply(batch).map_err(kernel)?;
        self.stale_chains = stale_chains;
        self.stale_sets = existing_sets.difference(&desired_sets).cloned().collect();
        let stats = SyncStats {
            full: true,
            services: fragments.len(),
            endpoints: fragments.values().map(|f| f.endpoints).sum(),
            objects_written: messages,
            rules_total: base.object_count()
                + fragments
                    .values()
                    .map(|f| f.chains.iter().map(|c| c.rules.len()).sum::<usize>())
                    .sum::<usize>()
                + elements.len(),
        };
        self.fragments = fragments;
        self.elements = elements;
        self.endpoint_maps = endpoint_maps;
        self.firewalled = firewalled;
        self.programmed = true;
        self.delete_stale(nft)?;
        Ok(stats)
    }

    /// Creates the endpoint maps a change starts using and rewrites their dispatch; returns the
    /// sets it stops using, to delete once their rules are gone.
    fn update_endpoint_maps<'a>(
        &mut self,
        batch: &mut Batch,
        mark: u32,
        removed: &[Fragment],
        added: impl Iterator<Item = &'a Fragment>,
    ) -> Vec<String> {
        let counts = |maps: &EndpointMaps| render::ENDPOINT_MAP_KINDS.map(|k| render::counts_of(maps, k));
        let before = counts(&self.endpoint_maps);
        for m in removed.iter().flat_map(render::endpoint_maps) {
            if let Some(n) = self.endpoint_maps.get_mut(&m) {
                *n -= 1;
                if *n == 0 {
                    self.endpoint_maps.remove(&m);
                }
            }
        }
        for m in added.flat_map(render::endpoint_maps) {
            *self.endpoint_maps.entry(m).or_default() += 1;
        }
        let after = counts(&self.endpoint_maps);
        let mut stale_sets = Vec::new();
        for ((kind, old), new) in render::ENDPOINT_MAP_KINDS.into_iter().zip(before).zip(after) {
            if old != new {
                let (old, new) = (
                    render::dispatch(kind, &old, mark),
                    render::dispatch(kind, &new, mark),
                );
                stale_sets.extend(self.update_dispatch(batch, &old, &new));
            }
        }
        stale_sets
    }

    /// Moves one kind's dispatch from `old` to `new`: creates the sets and chains it starts
    /// using, rewrites the chains whose rules change (after every chain they may jump to exists),
    /// and empties the chains it stops using (deleted with the returned sets once unreferenced).
    fn update_dispatch(
        &mut self,
        batch: &mut Batch,
        old: &render::Dispatch,
        new: &render::Dispatch,
    ) -> Vec<String> {
        for set in new.sets.iter().filter(|s| !old.sets.contains(s)) {
            self.stale_sets.remove(&set.name);
            batch.add_set(set);
        }
        let old_chains: BTreeMap<&str, &ir::Chain> =
            old.chains.iter().map(|c| (c.name.as_str(), c)).collect();
        let mut rewrite: Vec<(&str, &[ir::Rule])> = Vec::new();
        for chain in &new.chains {
            match old_chains.get(chain.name.as_str()) {
                Some(was) if was.rules == chain.rules => {}
                Some(_) => {
                    batch.flush_chain(&chain.name);
                    rewrite.push((&chain.name, &chain.rules));
                }
                None => {
                    self.stale_chains.remove(&chain.name);
                    batch.add_chain(&chain.name, None);
                    rewrite.push((&chain.name, &chain.rules));
                }
            }
        }
        for (chain, rules) in rewrite {
            for rule in rules {
                batch.add_rule(chain, rule);
            }
        }
        let kept: BTreeSet<&str> = new.chains.iter().map(|c| c.name.as_str()).collect();
        for gone in old.chains.iter().filter(|c| !kept.contains(c.name.as_str())) {
            batch.flush_chain(&gone.name);
            self.stale_chains.insert(gone.name.clone());
        }
        old.sets
            .iter()
            .filter(|s| !new.sets.iter().any(|n| n.name == s.name))
            .map(|s| s.name.clone())
            .collect()
    }

    /// Adds [`render::firewall_hooks`] when the first fragment with `firewall-ips` elements comes,
    /// and empties them (deleted in the follow-up transaction) when the last one goes. Their rules
    /// only jump to `firewall-check`, which always exists, so the order in the batch is free.
    fn update_firewall_hooks<'a>(
        &mut self,
        batch: &mut Batch,
        bypassed: bool,
        removed: &[Fragment],
        added: impl Iterator<Item = &'a Fragment>,
    ) {
        let before = self.firewalled;
        let gone = removed.iter().filter(|f| render::firewalls(f)).count();
        let came = added.filter(|f| render::firewalls(f)).count();
        self.firewalled = (before + came).saturating_sub(gone);
        let mut hooks = render::firewall_hooks();
        if bypassed {
            hooks.iter_mut().for_each(bypass);
        }
        match (before > 0, self.firewalled > 0) {
            (false, true) => {
                for chain in &hooks {
                    self.stale_chains.remove(&chain.name);
                    batch.add_chain(&chain.name, chain.base);
                    batch.flush_chain(&chain.name);
                    for rule in &chain.rules {
                        batch.add_rule(&chain.name, rule);
                    }
                }
            }
            (true, false) => {
                for chain in &hooks {
                    batch.flush_chain(&chain.name);
                    self.stale_chains.insert(chain.name.clone());
                }
            }
            _ => {}
        }
    }

    /// Element reference counting: deletes what nobody wants any more, adds what is new or changed.
    fn element_changes(
        &mut self,
        batch: &mut Batch,
        removed: &[Fragment],
        added: &BTreeMap<ServicePortName, Fragment>,
    ) {
        let mut deletes: Vec<(&'static str, Element)> = Vec::new();
        let mut adds: Vec<(&'static str, Element)> = Vec::new();
        for (set, e) in removed.iter().flat_map(|f| f.elements.iter()) {
            if let Some(wanted) = self.elements.get_mut(&(*set, e.key.clone())) {
                wanted.fragments -= 1;
            }
        }
        for (set, e) in added.values().flat_map(|f| f.elements.iter()) {
            let value = fingerprint(e);
            match self.elements.get_mut(&(*set, e.key.clone())) {
                // In the kernel already (possibly released by this sync and wanted again).
                Some(wanted) if wanted.value == value => wanted.fragments += 1,
                Some(wanted) => {
                    deletes.push((set, by_key(e.key.clone())));
                    adds.push((set, e.clone()));
                    wanted.value = value;
                    wanted.fragments += 1;
                }
                None => {
                    adds.push((set, e.clone()));
                    self.elements
                        .insert((*set, e.key.clone()), Wanted { value, fragments: 1 });
                }
            }
        }
        for (set, e) in removed.iter().flat_map(|f| f.elements.iter()) {
            let key = (*set, e.key.clone());
            if self.elements.get(&key).is_some_and(|w| w.fragments == 0) {
                self.elements.remove(&key);
                deletes.push((set, by_key(key.1)));
            }
        }
        let group = |list: &[(&'static str, Element)]| {
            let mut by_set: BTreeMap<std::borrow::Cow<'static, str>, Vec<Element>> = BTreeMap::new();
            for (s, e) in list {
                by_set
                    .entry(render::element_set(s, &e.key))
                    .or_default()
                    .push(e.clone());
            }
            by_set
        };
        for (set, list) in group(&deletes) {
            batch.elements(&set, &list.iter().collect::<Vec<_>>(), false);
        }
        for (set, list) in group(&adds) {
            batch.elements(&set, &list.iter().collect::<Vec<_>>(), true);
        }
    }

    fn partial_sync(
        &mut self,
        nft: &mut impl NfTables,
        settings: &Settings,
        bypassed: bool,
        snapshot: &Snapshot,
        changes: &Changes,
    ) -> Result<SyncStats, BackendError> {
        let mut batch = Batch::new(self.family);
        let mut removed: Vec<Fragment> = Vec::new();
        let mut added: BTreeMap<ServicePortName, Fragment> = BTreeMap::new();
        for service in &changes.services {
            let old_keys: Vec<ServicePortName> = ports_of(&self.fragments, service)
                .map(|(k, _)| k.clone())
                .collect();
            removed.extend(old_keys.iter().filter_map(|k| self.fragments.remove(k)));
            added.extend(Self::render_fragments(settings, snapshot, Some(service)));
        }
        if removed.is_empty() && added.is_empty() {
            // Nothing of this family changed (e.g. an IPv4-only Service in the IPv6 table).
            return Ok(SyncStats::default());
        }
        let old_chains: BTreeSet<&str> = removed
            .iter()
            .flat_map(|f| f.chains.iter().map(|c| c.name.as_str()))
            .collect();
        let new_chains: BTreeSet<&str> = added
            .values()
            .flat_map(|f| f.chains.iter().map(|c| c.name.as_str()))
            .collect();
        for chain in added.values().flat_map(|f| f.chains.iter()) {
            batch.add_chain(&chain.name, chain.base);
            if old_chains.contains(chain.name.as_str()) {
                batch.flush_chain(&chain.name);
            }
        }
        let old_sets: BTreeSet<&str> = removed
            .iter()
            .flat_map(|f| f.sets.iter().map(|s| s.name.as_str()))
            .collect();
        let new_sets: BTreeSet<&str> = added
            .values()
            .flat_map(|f| f.sets.iter().map(|s| s.name.as_str()))
            .collect();
        for set in added.values().flat_map(|f| f.sets.iter()) {
            if !old_sets.contains(set.name.as_str()) {
                batch.add_set(set);
            }
        }
        let stale_maps =
            self.update_endpoint_maps(&mut batch, settings.masquerade_mark, &removed, added.values());
        self.update_firewall_hooks(&mut batch, bypassed, &removed, added.values());
        for chain in added.values().flat_map(|f| f.chains.iter()) {
            for rule in &chain.rules {
                batch.add_rule(&chain.name, rule);
            }
        }
        self.element_changes(&mut batch, &removed, &added);
        let stale: Vec<String> = old_chains
            .difference(&new_chains)
            .map(|s| (*s).to_owned())
            .collect();
        for c in &stale {
            batch.flush_chain(c);
        }
        let mut stale_sets: Vec<String> = old_sets.difference(&new_sets).map(|s| (*s).to_owned()).collect();
        stale_sets.extend(stale_maps);
        let messages = batch.len() as usize;
        let result = nft.apply(batch).map_err(kernel);
        let stats = SyncStats {
            full: false,
            services: added.len(),
            endpoints: added.values().map(|f| f.endpoints).sum(),
            objects_written: messages,
            rules_total: 0,
        };
        self.fragments.extend(added);
        result?;
        self.stale_chains.extend(stale);
        self.stale_sets.extend(stale_sets);
        self.delete_stale(nft)?;
        Ok(stats)
    }
}

impl Table {
    fn sync(
        &mut self,
        nft: &mut impl NfTables,
        settings: &Settings,
        bypassed: bool,
        snapshot: &Snapshot,
        changes: &Changes,
        full: bool,
    ) -> Result<SyncStats, BackendError> {
        let result = if full || !self.programmed {
            self.full_sync(nft, settings, bypassed, snapshot)
        } else {
            self.partial_sync(nft, settings, bypassed, snapshot, changes)
        };
        if result.is_err() {
            // Our view of the kernel is unknown now: the next sync must be full.
            self.forget();
            self.programmed = false;
        }
        result
    }

    fn cleanup(&mut self, nft: &mut impl NfTables) -> Result<(), BackendError> {
        self.forget();
        self.programmed = false;
        self.stale_chains.clear();
        self.stale_sets.clear();
        if !nft.table_exists(self.family).map_err(kernel)? {
            return Ok(());
        }
        let mut batch = Batch::new(self.family);
        batch.delete_table();
        nft.apply(batch).map_err(kernel)
    }

    fn set_bypass(
        &mut self,
        nft: &mut impl NfTables,
        settings: &Settings,
        bypassed: bool,
    ) -> Result<(), BackendError> {
        if !self.programmed {
            return Ok(()); // the next full sync programs the base chains accordingly
        }
        let mut batch = Batch::new(self.family);
        for chain in base(settings, self.family, bypassed, self.firewalled > 0)
            .chains
            .iter()
            .filter(|c| c.base.is_some())
        {
            batch.flush_chain(&chain.name);
            for rule in &chain.rules {
                batch.add_rule(&chain.name, rule);
            }
        }
        nft.apply(batch).map_err(kernel)
    }

    fn verify(
        &self,
        nft: &impl NfTables,
        settings: &Settings,
        bypassed: bool,
    ) -> Result<Vec<String>, BackendError> {
        if !self.programmed {
            return Ok(Vec::new());
        }
        let kernel: BTreeSet<String> = nft
            .list(self.family, Objects::Chains)
            .map_err(kernel)?
            .into_iter()
            .collect();
        let mut desired: BTreeSet<String> = base(settings, self.family, bypassed, self.firewalled > 0)
            .chains
            .iter()
            .chain(self.fragments.values().flat_map(|f| f.chains.iter()))
            .map(|c| c.name.clone())
            .collect();
        for kind in render::ENDPOINT_MAP_KINDS {
            let counts = render::counts_of(&self.endpoint_maps, kind);
            let dispatch = render::dispatch(kind, &counts, settings.masquerade_mark);
            desired.extend(dispatch.chains.into_iter().map(|c| c.name));
        }
        let table = format!("{} {}", ir::family_name(self.family), ir::TABLE);
        let mut drift: Vec<String> = desired
            .difference(&kernel)
            .map(|c| format!("{table}: chain {c} is missing"))
            .collect();
        drift.extend(
            kernel
                .difference(&desired)
                .filter(|c| !self.stale_chains.contains(*c))
                .map(|c| format!("{table}: chain {c} is not ours to keep")),
        );
        Ok(drift)
    }
}

impl<N: NfTables> Backend for Nftables<N> {
    fn mode(&self) -> ProxyMode {
        ProxyMode::Nftables
    }

    fn sync(
        &mut self,
        snapshot: &DualSnapshot,
        changes: &Changes,
        full: bool,
    ) -> Result<SyncStats, BackendError> {
        let mut total: Option<SyncStats> = None;
        for i in 0..self.tables.len() {
            let table = &mut self.tables[i];
            let family_snapshot = snapshot.get(table.family);
            let result = table.sync(
                &mut self.nft,
                &self.settings,
                self.bypassed,
                family_snapshot,
                changes,
                full,
            );
            match table.results.check(table.family, result) {
                Ok(Some(stats)) => total = Some(total.map_or(stats.clone(), |t| t.plus(&stats))),
                Ok(None) => {}
                Err(e) => {
                    // The other table may have missed these changes too: both go full next time.
                    for other in &mut self.tables {
                        other.forget();
                        other.programmed = false;
                    }
                    return Err(e);
                }
            }
        }
        Ok(total.unwrap_or_default())
    }

    fn cleanup(&mut self) -> Result<(), BackendError> {
        // Each table on its own: a failure in one does not keep the other.
        let errors = self
            .tables
            .iter_mut()
            .filter_map(|table| table.cleanup(&mut self.nft).err())
            .collect();
        BackendError::collect(errors)
    }

    fn render_text(&self, snapshot: &DualSnapshot) -> String {
        snapshot
            .families()
            .iter()
            .map(|s| render::full(s, &self.settings).text())
            .collect()
    }

    fn set_bypass(&mut self, bypassed: bool) -> Result<(), BackendError> {
        if self.bypassed == bypassed {
            return Ok(());
        }
        self.bypassed = bypassed;
        for table in &mut self.tables {
            table.set_bypass(&mut self.nft, &self.settings, bypassed)?;
        }
        Ok(())
    }

    fn presence(&self) -> Result<super::Presence, BackendError> {
        if !self.nft.table_exists(IpFamily::V4).map_err(kernel)? {
            return Ok(super::Presence::Absent);
        }
        // A bypassed base chain starts with a `return` carrying BYPASS_COMMENT (its user data).
        let bypassed = self
            .nft
            .rule_comment_exists(IpFamily::V4, BYPASS_COMMENT)
            .map_err(kernel)?;
        Ok(if bypassed {
            super::Presence::Bypassed
        } else {
            super::Presence::Serving
        })
    }

    fn verify(&self) -> Result<Vec<String>, BackendError> {
        let mut drift = Vec::new();
        for table in &self.tables {
            drift.extend(table.verify(&self.nft, &self.settings, self.bypassed)?);
        }
        Ok(drift)
    }

    /// Every chain of the last sync in place (a chain listing per family, no rules or elements)
    /// and the bypass as it was left.
    fn intact(&self) -> Result<Option<bool>, BackendError> {
        if !self.verify()?.is_empty() {
            return Ok(Some(false));
        }
        let v4_programmed = self
            .tables
            .iter()
            .any(|t| t.family == IpFamily::V4 && t.programmed);
        if !v4_programmed {
            return Ok(Some(true));
        }
        let bypassed = self
            .nft
            .rule_comment_exists(IpFamily::V4, BYPASS_COMMENT)
            .map_err(kernel)?;
        Ok(Some(bypassed == self.bypassed))
    }
}

#[cfg(test)]
mod tests;
