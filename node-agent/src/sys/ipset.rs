//! ipsets through the `ipset` tool: bulk loads with one `ipset restore` per sync (kube-proxy's way
//! of being fast; the `ipset` crate cannot add `hash:ip,port` entries, see crates.md §2.1), plus
//! listing and destroying our `SWY-*` sets.
//!
//! A set is replaced atomically: its contents are loaded into a temporary set of the same type
//! that is then swapped in (`swap`) and destroyed, so packets always see either the old or the
//! new contents.

use std::collections::{BTreeMap, BTreeSet};

/// Prefix of every set the agent owns.
pub const SET_PREFIX: &str = "SWY-";
/// The kernel's limit on set names (`IPSET_MAXNAMELEN` - 1).
pub const MAX_NAME: usize = 31;

/// Errors of the ipset tool.
#[derive(Debug, thiserror::Error)]
pub enum IpsetError {
    /// `ipset` could not be started.
    #[error("ipset {args}: cannot run: {reason}")]
    Spawn {
        /// Arguments.
        args: String,
        /// Why.
        reason: String,
    },
    /// `ipset` ran and failed.
    #[error("ipset {args}: {stderr}")]
    Failed {
        /// Arguments.
        args: String,
        /// Its stderr (plus the offending input line for `restore`).
        stderr: String,
    },
}

/// The desired contents of one set.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SetSpec {
    /// Name (`SWY-...`, at most 31 characters).
    pub name: String,
    /// Type and create options (`hash:ip,port`, `bitmap:port range 0-65535`).
    pub kind: String,
    /// Entries as `ipset add` spells them (`10.96.0.1,tcp:80`).
    pub entries: std::collections::BTreeSet<String>,
}

/// The temporary set used to replace `name`.
pub fn temp_name(name: &str) -> String {
    let mut t = format!("SWY-T-{}", name.trim_start_matches(SET_PREFIX));
    t.truncate(MAX_NAME);
    t
}

/// `ipset restore` input that creates missing sets and replaces the contents of `sets`.
pub fn restore_input(sets: &[&SetSpec]) -> String {
    let mut out = String::new();
    for set in sets {
        let tmp = temp_name(&set.name);
        out.push_str(&format!("create {} {} -exist\n", set.name, set.kind));
        out.push_str(&format!("create {tmp} {} -exist\n", set.kind));
        out.push_str(&format!("flush {tmp}\n"));
        for entry in &set.entries {
            out.push_str(&format!("add {tmp} {entry} -exist\n"));
        }
        out.push_str(&format!("swap {tmp} {}\n", set.name));
        out.push_str(&format!("destroy {tmp}\n"));
    }
    out
}

fn run(args: &[&str], stdin: Option<&str>) -> Result<String, IpsetError> {
    let joined = args.join(" ");
    let spawn = |e: std::io::Error| IpsetError::Spawn {
        args: joined.clone(),
        reason: e.to_string(),
    };
    let out = super::exec::run_with_input("ipset", args, stdin).map_err(spawn)?;
    if out.success {
        return Ok(out.stdout);
    }
    let mut stderr = out.stderr;
    // "ipset v7.17: Error in line 3: ..." -> name the line.
    if let (Some(input), Some(n)) = (stdin, line_number(&stderr))
        && let Some(line) = input.lines().nth(n.saturating_sub(1))
    {
        stderr.push_str(&format!(" (input line: {line})"));
    }
    Err(IpsetError::Failed { args: joined, stderr })
}

fn line_number(stderr: &str) -> Option<usize> {
    let i = stderr.find("line ")?;
    stderr[i + 5..]
        .chars()
        .take_while(char::is_ascii_digit)
        .collect::<String>()
        .parse()
        .ok()
}

/// Loads `sets` with one `ipset restore`.
pub fn restore(sets: &[&SetSpec]) -> Result<(), IpsetError> {
    if sets.is_empty() {
        return Ok(());
    }
    run(&["restore"], Some(&restore_input(sets))).map(|_| ())
}

/// Names of the sets starting with `prefix`.
pub fn list_names(prefix: &str) -> Result<Vec<String>, IpsetError> {
    Ok(run(&["list", "-n"], None)?
        .lines()
        .map(str::trim)
        .filter(|n| n.starts_with(prefix))
        .map(str::to_owned)
        .collect())
}

/// Entries of set `name` (`add NAME ENTRY` lines of `ipset save`, without the prefix).
pub fn entries(name: &str) -> Result<Vec<String>, IpsetError> {
    let out = run(&["save", name], None)?;
    let prefix = format!("add {name} ");
    Ok(out
        .lines()
        .filter_map(|l| l.strip_prefix(&prefix))
        .map(str::to_owned)
        .collect())
}

/// Every set whose name starts with `prefix`, with its entries, from one `ipset save` (the
/// drift check of the IPVS backend). Entries are spelled as `ipset save` prints them.
pub fn save_all(
    prefix: &str,
) -> Result<std::collections::BTreeMap<String, std::collections::BTreeSet<String>>, IpsetError> {
    Ok(parse_save(&run(&["save"], None)?, prefix))
}

/// Parses `ipset save` output (`create NAME ...` and `add NAME ENTRY` lines) into the sets whose
/// names start with `prefix`.
pub fn parse_save(
    text: &str,
    prefix: &str,
) -> std::collections::BTreeMap<String, std::collections::BTreeSet<String>> {
    let mut sets: std::collections::BTreeMap<String, std::collections::BTreeSet<String>> =
        std::collections::BTreeMap::new();
    for line in text.lines() {
        let mut words = line.split_whitespace();
        let (Some(verb), Some(name)) = (words.next(), words.next()) else {
            continue;
        };
        if !name.starts_with(prefix) {
            continue;
        }
        match (verb, words.next()) {
            ("create", _) => {
                sets.entry(name.to_owned()).or_default();
            }
            ("add", Some(entry)) => {
                sets.entry(name.to_owned()).or_default().insert(entry.to_owned());
            }
            _ => {}
        }
    }
    sets
}

/// Destroys the sets named; absent ones are fine. Sets still referenced by iptables rules fail.
pub fn destroy(names: &[String]) -> Result<(), IpsetError> {
    if names.is_empty() {
        return Ok(());
    }
    let existing = list_names("")?;
    let input: String = names
        .iter()
        .filter(|n| existing.contains(n))
        .map(|n| format!("destroy {n}\n"))
        .collect();
    if input.is_empty() {
        return Ok(());
    }
    run(&["restore"], Some(&input)).map(|_| ())
}

/// Our ipsets, as the IPVS backend uses them.
pub trait Ipsets: std::fmt::Debug + Send {
    /// Creates missing sets and replaces the contents of `sets`, each atomically.
    fn restore(&mut self, sets: &[&SetSpec]) -> Result<(), IpsetError>;
    /// Every set whose name starts with `prefix`, with its entries.
    fn save_all(&self, prefix: &str) -> Result<BTreeMap<String, BTreeSet<String>>, IpsetError>;
    /// Destroys the sets named; absent ones are fine.
    fn destroy(&mut self, names: &[String]) -> Result<(), IpsetError>;
}

/// The kernel's ipsets, through the `ipset` tool.
#[derive(Debug, Clone, Copy, Default)]
pub struct KernelIpsets;

impl Ipsets for KernelIpsets {
    fn restore(&mut self, sets: &[&SetSpec]) -> Result<(), IpsetError> {
        restore(sets)
    }

    fn save_all(&self, prefix: &str) -> Result<BTreeMap<String, BTreeSet<String>>, IpsetError> {
        save_all(prefix)
    }

    fn destroy(&mut self, names: &[String]) -> Result<(), IpsetError> {
        destroy(names)
    }
}

/// ipsets in memory: name to (type, entries). Sets marked in use cannot be destroyed, as sets an
/// iptables rule references.
#[derive(Debug, Clone, Default)]
pub struct FakeIpsets {
    sets: BTreeMap<String, (String, BTreeSet<String>)>,
    in_use: BTreeSet<String>,
}

impl FakeIpsets {
    /// No sets.
    pub fn new() -> Self {
        Self::default()
    }

    /// Marks `name` referenced (destroying it fails) or not.
    pub fn set_in_use(&mut self, name: &str, in_use: bool) {
        if in_use {
            self.in_use.insert(name.to_owned());
        } else {
            self.in_use.remove(name);
        }
    }
}

impl Ipsets for FakeIpsets {
    fn restore(&mut self, sets: &[&SetSpec]) -> Result<(), IpsetError> {
        for set in sets {
            if let Some((kind, _)) = self.sets.get(&set.name).filter(|(k, _)| *k != set.kind) {
                return Err(IpsetError::Failed {
                    args: "restore".into(),
                    stderr: format!("set {} exists with another type ({kind})", set.name),
                });
            }
        }
        for set in sets {
            self.sets
                .insert(set.name.clone(), (set.kind.clone(), set.entries.clone()));
        }
        Ok(())
    }

    fn save_all(&self, prefix: &str) -> Result<BTreeMap<String, BTreeSet<String>>, IpsetError> {
        Ok(self
            .sets
            .iter()
            .filter(|(name, _)| name.starts_with(prefix))
            .map(|(name, (_, entries))| (name.clone(), entries.clone()))
            .collect())
    }

    fn destroy(&mut self, names: &[String]) -> Result<(), IpsetError> {
        if let Some(busy) = names
            .iter()
            .find(|n| self.in_use.contains(*n) && self.sets.contains_key(*n))
        {
            return Err(IpsetError::Failed {
                args: "restore".into(),
                stderr: format!("set {busy} is in use by a kernel component"),
            });
        }
        for name in names {
            self.sets.remove(name);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ipset_restore_input_swaps_through_a_temporary_set() {
        let set = SetSpec {
            name: "SWY-CLUSTER-IP".into(),
            kind: "hash:ip,port family inet".into(),
            entries: ["10.96.0.1,tcp:80".to_owned(), "10.96.0.2,udp:53".to_owned()].into(),
        };
        assert_eq!(
            restore_input(&[&set]),
            "create SWY-CLUSTER-IP hash:ip,port family inet -exist\n\
             create SWY-T-CLUSTER-IP hash:ip,port family inet -exist\n\
             flush SWY-T-CLUSTER-IP\n\
             add SWY-T-CLUSTER-IP 10.96.0.1,tcp:80 -exist\n\
             add SWY-T-CLUSTER-IP 10.96.0.2,udp:53 -exist\n\
             swap SWY-T-CLUSTER-IP SWY-CLUSTER-IP\n\
             destroy SWY-T-CLUSTER-IP\n"
        );
        assert!(temp_name("SWY-LOAD-BALANCER-SOURCE-CIDR-XYZ").len() <= MAX_NAME);
        assert_eq!(line_number("ipset v7.17: Error in line 3: Syntax error"), Some(3));
    }

    #[test]
    fn ipset_save_parses_our_sets_only() {
        let text = "create SWY-CLUSTER-IP hash:ip,port family inet hashsize 1024 maxelem 1048576\n\
                    add SWY-CLUSTER-IP 10.96.0.10,tcp:80\n\
                    add SWY-CLUSTER-IP 10.96.0.53,udp:53\n\
                    create SWY-NODE-PORT-TCP bitmap:port range 0-65535\n\
                    create other hash:ip\n\
                    add other 192.0.2.1\n";
        let sets = parse_save(text, SET_PREFIX);
        assert_eq!(sets.len(), 2);
        assert_eq!(sets["SWY-CLUSTER-IP"].len(), 2);
        assert!(sets["SWY-NODE-PORT-TCP"].is_empty());
    }

    #[test]
    fn fake_ipsets_replace_contents_and_keep_sets_in_use() {
        let mut sets = FakeIpsets::new();
        let spec = |entries: &[&str]| SetSpec {
            name: "SWY-A".into(),
            kind: "hash:ip".into(),
            entries: entries.iter().map(|e| (*e).to_owned()).collect(),
        };
        sets.restore(&[&spec(&["10.0.0.1", "10.0.0.2"])])
            .expect("restore");
        sets.restore(&[&spec(&["10.0.0.3"])]).expect("replace");
        let saved = sets.save_all(SET_PREFIX).expect("save");
        assert_eq!(saved["SWY-A"].iter().collect::<Vec<_>>(), ["10.0.0.3"]);
        sets.set_in_use("SWY-A", true);
        assert!(sets.destroy(&["SWY-A".into()]).is_err());
        sets.set_in_use("SWY-A", false);
        sets.destroy(&["SWY-A".into(), "SWY-B".into()])
            .expect("absent sets are fine");
        assert!(sets.save_all("").expect("save").is_empty());
    }
}
