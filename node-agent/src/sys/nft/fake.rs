//! An in-memory nf_tables for tests without root: it applies [`Batch`]es to tables held in memory
//! with the kernel's rules for what it refuses (missing objects, chains and sets still in use,
//! elements that exist with other data), all or nothing, and lists a table in the text
//! `nft list table` prints, so that tests compare it with the same golden listings the kernel
//! produces (the kernel stays the oracle). Deterministic; faults can be injected.

use std::{collections::VecDeque, fmt::Write as _};

use super::{
    NfTables, Objects,
    codec::{Batch, Op, key_bytes},
    ir::{BaseChain, Element, Expr, Hook, KeyType, Rule, SetDef, TABLE, Verdict, family_name},
};
use crate::{
    model::IpFamily,
    sys::error::{KernelError, KernelResult},
};

/// One set or map and its elements.
#[derive(Debug, Clone)]
struct FakeSet {
    def: SetDef,
    elements: Vec<Element>,
}

/// One chain and its rules.
#[derive(Debug, Clone)]
struct FakeChain {
    name: String,
    base: Option<BaseChain>,
    rules: Vec<Rule>,
}

/// One table; sets and chains in creation order, as the kernel lists them.
#[derive(Debug, Clone, Default)]
struct FakeTable {
    comment: Option<String>,
    sets: Vec<FakeSet>,
    chains: Vec<FakeChain>,
}

/// The fake: our table of each family, the transactions applied, and faults to inject.
#[derive(Debug, Default)]
pub struct FakeNft {
    tables: [Option<FakeTable>; 2],
    applied: usize,
    faults: VecDeque<KernelError>,
}

impl FakeNft {
    /// An empty nf_tables.
    pub fn new() -> Self {
        Self::default()
    }

    /// Makes the next transaction fail with `error` (queued: one fault per transaction).
    pub fn fail_next(&mut self, error: KernelError) {
        self.faults.push_back(error);
    }

    /// Transactions committed so far.
    pub fn applied(&self) -> usize {
        self.applied
    }

    /// `nft list table ip switchyard` (`ip6`), or `None` when the table does not exist.
    pub fn listing(&self, family: IpFamily) -> Option<String> {
        self.tables[family as usize]
            .as_ref()
            .map(|t| table_text(family, t))
    }
}

/// Any adapter with injected faults: the next `n` transactions fail (for tests of how a backend
/// handles refusals, on the fake or on the kernel).
#[derive(Debug, Default)]
pub struct Faulty<N> {
    inner: N,
    failing: usize,
}

impl<N: NfTables> Faulty<N> {
    /// `inner` without faults.
    pub fn new(inner: N) -> Self {
        Self { inner, failing: 0 }
    }

    /// Makes the next `n` transactions fail (with `EINVAL`, as a refusal the backend cannot foresee).
    pub fn fail_next(&mut self, n: usize) {
        self.failing = n;
    }

    /// The wrapped adapter.
    pub fn inner(&self) -> &N {
        &self.inner
    }
}

impl<N: NfTables> NfTables for Faulty<N> {
    fn apply(&mut self, batch: Batch) -> KernelResult<()> {
        if self.failing > 0 && !batch.is_empty() {
            self.failing -= 1;
            return Err(KernelError::from_errno("injected fault", 22));
        }
        self.inner.apply(batch)
    }

    fn list(&self, family: IpFamily, objects: Objects) -> KernelResult<Vec<String>> {
        self.inner.list(family, objects)
    }

    fn table_exists(&self, family: IpFamily) -> KernelResult<bool> {
        self.inner.table_exists(family)
    }

    fn rule_comment_exists(&self, family: IpFamily, comment: &str) -> KernelResult<bool> {
        self.inner.rule_comment_exists(family, comment)
    }
}

impl NfTables for FakeNft {
    fn apply(&mut self, batch: Batch) -> KernelResult<()> {
        if batch.is_empty() {
            return Ok(());
        }
        if let Some(fault) = self.faults.pop_front() {
            return Err(fault);
        }
        let family = batch.family();
        let mut table = self.tables[family as usize].clone();
        for (i, op) in batch.ops().iter().enumerate() {
            apply_op(&mut table, op).map_err(|e| prefix(e, i + 1))?;
        }
        self.tables[family as usize] = table;
        self.applied += 1;
        Ok(())
    }

    fn list(&self, family: IpFamily, objects: Objects) -> KernelResult<Vec<String>> {
        let Some(t) = &self.tables[family as usize] else {
            return Ok(Vec::new());
        };
        Ok(match objects {
            Objects::Chains => t.chains.iter().map(|c| c.name.clone()).collect(),
            Objects::Sets => t.sets.iter().map(|s| s.def.name.clone()).collect(),
        })
    }

    fn table_exists(&self, family: IpFamily) -> KernelResult<bool> {
        Ok(self.tables[family as usize].is_some())
    }

    fn rule_comment_exists(&self, family: IpFamily, comment: &str) -> KernelResult<bool> {
        Ok(self.tables[family as usize].as_ref().is_some_and(|t| {
            t.chains
                .iter()
                .flat_map(|c| &c.rules)
                .any(|r| r.comment.as_deref() == Some(comment))
        }))
    }
}

/// The error of operation `n` of a transaction, named as the kernel's ack names it.
fn prefix(e: KernelError, n: usize) -> KernelError {
    let what = |w: String| format!("nf_tables message {n}: {w}");
    match e {
        KernelError::NotFound { what: w } => KernelError::NotFound { what: what(w) },
        KernelError::Exists { what: w } => KernelError::Exists { what: what(w) },
        KernelError::Busy { what: w } => KernelError::Busy { what: what(w) },
        other => other,
    }
}

fn not_found(what: impl Into<String>) -> KernelError {
    KernelError::NotFound { what: what.into() }
}

fn busy(what: impl Into<String>) -> KernelError {
    KernelError::Busy { what: what.into() }
}

fn apply_op(table: &mut Option<FakeTable>, op: &Op) -> KernelResult<()> {
    match op {
        Op::AddTable(comment) => {
            let t = table.get_or_insert_with(FakeTable::default);
            t.comment = Some(comment.clone());
            Ok(())
        }
        Op::DeleteTable => match table.take() {
            Some(_) => Ok(()),
            None => Err(not_found(format!("table {TABLE}"))),
        },
        other => {
            let t = table
                .as_mut()
                .ok_or_else(|| not_found(format!("table {TABLE}")))?;
            apply_in_table(t, other)
        }
    }
}

fn apply_in_table(t: &mut FakeTable, op: &Op) -> KernelResult<()> {
    match op {
        Op::AddChain(name, base) => {
            if t.chain(name).is_none() {
                t.chains.push(FakeChain {
                    name: name.clone(),
                    base: *base,
                    rules: Vec::new(),
                });
            }
            Ok(())
        }
        Op::FlushChain(name) => {
            t.chain_mut(name)?.rules.clear();
            Ok(())
        }
        Op::DeleteChain(name) => t.delete_chain(name),
        Op::AddRule(chain, rule) => t.add_rule(chain, rule),
        Op::AddSet(def) => t.add_set(def),
        Op::DeleteSet(name) => t.delete_set(name),
        Op::FlushSet(name) => {
            t.set_mut(name)?.elements.clear();
            Ok(())
        }
        Op::Elements(set, elements, true) => t.add_elements(set, elements),
        Op::Elements(set, elements, false) => t.delete_elements(set, elements),
        Op::AddTable(_) | Op::DeleteTable => Ok(()),
    }
}

impl FakeTable {
    fn chain(&self, name: &str) -> Option<&FakeChain> {
        self.chains.iter().find(|c| c.name == name)
    }

    fn chain_mut(&mut self, name: &str) -> KernelResult<&mut FakeChain> {
        self.chains
            .iter_mut()
            .find(|c| c.name == name)
            .ok_or_else(|| not_found(format!("chain {name}")))
    }

    fn set(&self, name: &str) -> Option<&FakeSet> {
        self.sets.iter().find(|s| s.def.name == name)
    }

    fn set_mut(&mut self, name: &str) -> KernelResult<&mut FakeSet> {
        self.sets
            .iter_mut()
            .find(|s| s.def.name == name)
            .ok_or_else(|| not_found(format!("set {name}")))
    }

    /// Whether a rule or a verdict-map element jumps to chain `name`.
    fn chain_referenced(&self, name: &str) -> bool {
        let target = |v: &Verdict| matches!(v, Verdict::Jump(c) | Verdict::Goto(c) if c == name);
        let in_rules = self
            .chains
            .iter()
            .flat_map(|c| &c.rules)
            .any(|r| rule_refs(r).0.contains(&name));
        in_rules
            || self
                .sets
                .iter()
                .flat_map(|s| &s.elements)
                .any(|e| e.verdict.as_ref().is_some_and(target))
    }

    fn delete_chain(&mut self, name: &str) -> KernelResult<()> {
        let chain = self
            .chain(name)
            .ok_or_else(|| not_found(format!("chain {name}")))?;
        if !chain.rules.is_empty() || self.chain_referenced(name) {
            return Err(busy(format!("chain {name}")));
        }
        self.chains.retain(|c| c.name != name);
        Ok(())
    }

    fn add_rule(&mut self, chain: &str, rule: &Rule) -> KernelResult<()> {
        let (chains, sets) = rule_refs(rule);
        if let Some(c) = chains.iter().find(|c| self.chain(c).is_none()) {
            return Err(not_found(format!("chain {c}")));
        }
        if let Some(s) = sets.iter().find(|s| self.set(s).is_none()) {
            return Err(not_found(format!("set {s}")));
        }
        self.chain_mut(chain)?.rules.push(rule.clone());
        Ok(())
    }

    fn add_set(&mut self, def: &SetDef) -> KernelResult<()> {
        match self.set(&def.name) {
            None => {
                self.sets.push(FakeSet {
                    def: def.clone(),
                    elements: Vec::new(),
                });
                Ok(())
            }
            Some(s)
                if s.def.key == def.key
                    && s.def.verdict_map == def.verdict_map
                    && s.def.timeout_seconds == def.timeout_seconds =>
            {
                Ok(())
            }
            Some(_) => Err(KernelError::Exists {
                what: format!("set {} with another type", def.name),
            }),
        }
    }

    fn delete_set(&mut self, name: &str) -> KernelResult<()> {
        self.set(name).ok_or_else(|| not_found(format!("set {name}")))?;
        let used = self
            .chains
            .iter()
            .flat_map(|c| &c.rules)
            .any(|r| rule_refs(r).1.contains(&name));
        if used {
            return Err(busy(format!("set {name}")));
        }
        self.sets.retain(|s| s.def.name != name);
        Ok(())
    }

    fn add_elements(&mut self, set: &str, elements: &[Element]) -> KernelResult<()> {
        for e in elements {
            if let Some(Verdict::Jump(c) | Verdict::Goto(c)) = &e.verdict
                && self.chain(c).is_none()
            {
                return Err(not_found(format!("chain {c}")));
            }
            let s = self.set_mut(set)?;
            match s.elements.iter().find(|x| x.key == e.key) {
                None => s.elements.push(e.clone()),
                Some(x) if x.verdict == e.verdict && x.dnat == e.dnat => {}
                Some(_) => {
                    return Err(KernelError::Exists {
                        what: format!("element {} of {set}", e.key.text()),
                    });
                }
            }
        }
        Ok(())
    }

    fn delete_elements(&mut self, set: &str, elements: &[Element]) -> KernelResult<()> {
        let s = self.set_mut(set)?;
        for e in elements {
            let at = s
                .elements
                .iter()
                .position(|x| x.key == e.key)
                .ok_or_else(|| not_found(format!("element {} of {set}", e.key.text())))?;
            s.elements.remove(at);
        }
        Ok(())
    }
}

/// The chains a rule jumps to and the sets it reads or writes.
fn rule_refs(rule: &Rule) -> (Vec<&str>, Vec<&str>) {
    let (mut chains, mut sets) = (Vec::new(), Vec::new());
    for e in &rule.exprs {
        match e {
            Expr::Verdict(Verdict::Jump(c) | Verdict::Goto(c)) => chains.push(c.as_str()),
            Expr::DaddrInSet(s)
            | Expr::SaddrInSet(s)
            | Expr::SaddrDaddrInSet(s)
            | Expr::DaddrProtoPortInSet(s)
            | Expr::ProtoPortInSet(s)
            | Expr::DnatDaddrProtoPortSlot(_, s)
            | Expr::DnatProtoPortSlot(_, s)
            | Expr::UpdateSaddr(s)
            | Expr::VmapDaddrProtoPort(s)
            | Expr::VmapProtoPort(s) => sets.push(s.as_str()),
            _ => {}
        }
    }
    (chains, sets)
}

fn table_text(family: IpFamily, t: &FakeTable) -> String {
    let mut s = format!("table {} {TABLE} {{\n", family_name(family));
    if let Some(c) = &t.comment {
        let _ = writeln!(s, "\tcomment \"{c}\"");
    }
    let blocks: Vec<String> = t
        .sets
        .iter()
        .map(|set| set_text(family, set))
        .chain(t.chains.iter().map(|c| chain_text(family, c)))
        .collect();
    s.push_str(&blocks.join("\n"));
    s.push_str("}\n");
    s
}

fn set_text(family: IpFamily, set: &FakeSet) -> String {
    let def = &set.def;
    let kind = if def.verdict_map || def.key.is_endpoint_map() {
        "map"
    } else {
        "set"
    };
    let mut s = format!(
        "\t{kind} {} {{\n\t\t{}\n",
        def.name,
        def.key.declaration(family, def.verdict_map)
    );
    if let Some(t) = def.timeout_seconds {
        let _ = write!(
            s,
            "\t\tsize 65535\n\t\tflags dynamic,timeout\n\t\ttimeout {}\n",
            duration_text(t)
        );
    }
    if let Some(c) = &def.comment {
        let _ = writeln!(s, "\t\tcomment \"{c}\"");
    }
    if !set.elements.is_empty() {
        let _ = writeln!(
            s,
            "\t\telements = {{ {} }}",
            elements_text(family, def.key, &set.elements)
        );
    }
    s.push_str("\t}\n");
    s
}

/// Elements as `nft list` prints them: sorted as nft sorts them (the key bytes read as one
/// host-endian number), IPv4 addresses two to a line, everything else one to a line.
fn elements_text(family: IpFamily, key: KeyType, elements: &[Element]) -> String {
    let mut sorted: Vec<(Vec<u8>, &Element)> = elements
        .iter()
        .map(|e| {
            let mut bytes = key_bytes(&e.key);
            bytes.reverse();
            (bytes, e)
        })
        .collect();
    sorted.sort_by(|a, b| a.0.cmp(&b.0));
    let per_line = if key == KeyType::Addr && family == IpFamily::V4 {
        2
    } else {
        1
    };
    let mut s = String::new();
    for (i, (_, e)) in sorted.iter().enumerate() {
        if i > 0 {
            s.push_str(if i % per_line == 0 { ",\n\t\t\t     " } else { ", " });
        }
        s.push_str(&e.text());
    }
    s
}

/// A timeout as nft prints it (`10m`, `1h30s`).
fn duration_text(seconds: u32) -> String {
    let mut s = String::new();
    let mut rest = seconds;
    for (unit, n) in [("d", 86_400), ("h", 3_600), ("m", 60), ("s", 1)] {
        if rest >= n {
            let _ = write!(s, "{}{unit}", rest / n);
            rest %= n;
        }
    }
    if s.is_empty() {
        s.push_str("0s");
    }
    s
}

/// A base chain's priority as nft prints it: a standard name where one is within 10 (`dstnat -
/// 10`), else the number.
fn priority_text(base: &BaseChain) -> String {
    const NAMES: [(&str, i32, Option<Hook>); 6] = [
        ("raw", -300, None),
        ("mangle", -150, None),
        ("dstnat", -100, Some(Hook::Prerouting)),
        ("filter", 0, None),
        ("security", 50, None),
        ("srcnat", 100, Some(Hook::Postrouting)),
    ];
    let named = NAMES
        .iter()
        .filter(|(_, _, hook)| hook.is_none_or(|h| h == base.hook))
        .find(|(_, value, _)| (base.priority - value).abs() <= 10);
    match named {
        Some((name, value, _)) if base.priority == *value => (*name).to_owned(),
        Some((name, value, _)) if base.priority < *value => format!("{name} - {}", value - base.priority),
        Some((name, value, _)) => format!("{name} + {}", base.priority - value),
        None => base.priority.to_string(),
    }
}

/// A rule as nft lists it: the `meta l4proto tcp` a `reject with tcp reset` depends on is implied,
/// so nft leaves it out (wherever it stands before the reject).
fn listed_rule(rule: &Rule) -> std::borrow::Cow<'_, Rule> {
    let tcp = |e: &Expr| matches!(e, Expr::L4Proto(crate::model::Protocol::Tcp));
    let Some(reject) = rule.exprs.iter().position(|e| matches!(e, Expr::RejectTcpReset)) else {
        return std::borrow::Cow::Borrowed(rule);
    };
    let Some(dependency) = rule.exprs[..reject].iter().rposition(tcp) else {
        return std::borrow::Cow::Borrowed(rule);
    };
    let mut listed = rule.clone();
    listed.exprs.remove(dependency);
    std::borrow::Cow::Owned(listed)
}

fn chain_text(family: IpFamily, c: &FakeChain) -> String {
    let mut s = format!("\tchain {} {{\n", c.name);
    if let Some(b) = &c.base {
        let _ = writeln!(
            s,
            "\t\ttype {} hook {} priority {}; policy accept;",
            if b.nat { "nat" } else { "filter" },
            b.hook.text(),
            priority_text(b)
        );
    }
    for rule in &c.rules {
        let _ = writeln!(s, "\t\t{}", listed_rule(rule).text(family));
    }
    s.push_str("\t}\n");
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Protocol;

    fn rule_to(chain: &str) -> Rule {
        Rule::new(vec![Expr::Verdict(Verdict::Jump(chain.into()))])
    }

    #[test]
    fn transactions_are_all_or_nothing_and_refusals_are_typed() {
        let mut nft = FakeNft::new();
        let mut b = Batch::new(IpFamily::V4);
        b.add_table("t");
        b.add_chain("a", None);
        b.add_chain("b", None);
        b.add_rule("a", &rule_to("b"));
        nft.apply(b).expect("first transaction");
        let before = nft.listing(IpFamily::V4);
        // A referenced chain cannot go, and nothing of the failed transaction stays.
        let mut b = Batch::new(IpFamily::V4);
        b.add_chain("c", None);
        b.delete_chain("b");
        assert!(matches!(nft.apply(b), Err(KernelError::Busy { .. })));
        assert_eq!(nft.listing(IpFamily::V4), before);
        let mut b = Batch::new(IpFamily::V4);
        b.add_rule("a", &rule_to("missing"));
        assert!(matches!(nft.apply(b), Err(KernelError::NotFound { .. })));
        let mut b = Batch::new(IpFamily::V4);
        b.flush_chain("a");
        b.delete_chain("b");
        nft.apply(b).expect("flush, then delete the unreferenced chain");
        assert_eq!(
            nft.list(IpFamily::V4, Objects::Chains).ok(),
            Some(vec!["a".to_owned()])
        );
        assert_eq!(nft.listing(IpFamily::V6), None);
        assert_eq!(nft.applied(), 2);
    }

    #[test]
    fn elements_with_other_data_exist_and_faults_are_injected() {
        let mut nft = FakeNft::new();
        let def = SetDef {
            name: "m".into(),
            key: KeyType::ProtoPort,
            verdict_map: true,
            timeout_seconds: None,
            comment: None,
        };
        let elem = |v: Verdict| Element {
            key: crate::sys::nft::ir::Key::ProtoPort(Protocol::Tcp, 80),
            verdict: Some(v),
            dnat: None,
            comment: None,
        };
        let mut b = Batch::new(IpFamily::V4);
        b.add_table("t");
        b.add_set(&def);
        b.elements("m", &[&elem(Verdict::Drop)], true);
        nft.apply(b).expect("create");
        let mut b = Batch::new(IpFamily::V4);
        b.elements("m", &[&elem(Verdict::Return)], true);
        assert!(matches!(nft.apply(b), Err(KernelError::Exists { .. })));
        nft.fail_next(KernelError::from_errno("injected", 22));
        let mut b = Batch::new(IpFamily::V4);
        b.elements("m", &[&elem(Verdict::Drop)], false);
        assert!(matches!(
            nft.apply(b),
            Err(KernelError::Refused { errno: 22, .. })
        ));
        assert!(
            nft.listing(IpFamily::V4)
                .is_some_and(|l| l.contains("tcp . 80 : drop"))
        );
    }

    #[test]
    fn priorities_and_timeouts_print_as_nft_prints_them() {
        let base = |hook, priority| BaseChain {
            nat: false,
            hook,
            priority,
        };
        assert_eq!(priority_text(&base(Hook::Prerouting, -110)), "dstnat - 10");
        assert_eq!(priority_text(&base(Hook::Output, -110)), "-110");
        assert_eq!(priority_text(&base(Hook::Output, -100)), "-100");
        assert_eq!(priority_text(&base(Hook::Postrouting, 100)), "srcnat");
        assert_eq!(priority_text(&base(Hook::Input, 5)), "filter + 5");
        assert_eq!(duration_text(600), "10m");
        assert_eq!(duration_text(10_830), "3h30s");
    }
}
