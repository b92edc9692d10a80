//! The iptables tools (`iptables`, `iptables-save`, `iptables-restore`) in their `legacy` or `nft`
//! variant: the only place the iptables backend runs processes. Optionally every command runs in a
//! named network namespace (`ip netns exec NS ...`), which the kernel tests use.

pub mod fake;

use std::str::FromStr;

use crate::model::IpFamily;

/// Seconds to wait for the xtables lock (`-w`).
const LOCK_WAIT_SECONDS: &str = "5";

/// Which iptables implementation to drive.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Variant {
    /// `iptables-legacy*` (x_tables via setsockopt).
    Legacy,
    /// `iptables-nft*` (x_tables rules translated to nf_tables).
    Nft,
}

impl Variant {
    /// `"legacy"` or `"nft"`.
    pub fn as_str(self) -> &'static str {
        match self {
            Variant::Legacy => "legacy",
            Variant::Nft => "nft",
        }
    }

    /// The variant's binary for `tool` (`iptables`, `iptables-save`, `iptables-restore`).
    pub fn binary(self, tool: &str) -> String {
        match tool.strip_prefix("iptables") {
            Some(rest) => format!("iptables-{}{rest}", self.as_str()),
            None => tool.to_owned(),
        }
    }
}

impl FromStr for Variant {
    type Err = IptablesError;

    /// Parses `"legacy"` or `"nft"`.
    fn from_str(name: &str) -> Result<Self, Self::Err> {
        match name {
            "legacy" => Ok(Variant::Legacy),
            "nft" => Ok(Variant::Nft),
            other => Err(IptablesError::UnknownVariant(other.to_owned())),
        }
    }
}

impl std::fmt::Display for Variant {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An iptables table this backend uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Table {
    /// `filter`.
    Filter,
    /// `nat`.
    Nat,
    /// `mangle` (kube-proxy's and kubelet's canary chains; read, never written by our backends).
    Mangle,
}

impl Table {
    /// The table's name.
    pub fn as_str(self) -> &'static str {
        match self {
            Table::Filter => "filter",
            Table::Nat => "nat",
            Table::Mangle => "mangle",
        }
    }
}

/// Errors of the iptables tools.
#[derive(Debug, thiserror::Error)]
pub enum IptablesError {
    /// The variant name is neither `legacy` nor `nft`.
    #[error("unknown iptables variant {0:?} (expected \"legacy\" or \"nft\")")]
    UnknownVariant(String),
    /// The program could not be started.
    #[error("{command}: cannot run: {reason}")]
    Spawn {
        /// The command line.
        command: String,
        /// Why it could not run.
        reason: String,
    },
    /// The program ran and failed.
    #[error("{command}: exit status {status}: {stderr}")]
    Failed {
        /// The command line.
        command: String,
        /// Exit code (-1 when killed by a signal).
        status: i32,
        /// Its stderr (trimmed), plus the offending input line for `iptables-restore`.
        stderr: String,
    },
}

impl IptablesError {
    /// The command line the error is about (empty for [`IptablesError::UnknownVariant`]).
    pub fn command(&self) -> &str {
        match self {
            IptablesError::UnknownVariant(_) => "",
            IptablesError::Spawn { command, .. } | IptablesError::Failed { command, .. } => command,
        }
    }

    /// What went wrong, without the command line.
    pub fn detail(&self) -> String {
        match self {
            IptablesError::UnknownVariant(name) => format!("unknown iptables variant {name:?}"),
            IptablesError::Spawn { reason, .. } => reason.clone(),
            IptablesError::Failed { status, stderr, .. } => format!("exit status {status}: {stderr}"),
        }
    }
}

/// A finished command.
struct Finished {
    status: i32,
    stdout: String,
    stderr: String,
}

/// Runner of one variant's tools for one IP family (`iptables*` or `ip6tables*`), optionally
/// inside a network namespace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Iptables {
    variant: Variant,
    netns: Option<String>,
    family: IpFamily,
}

impl Iptables {
    /// IPv4 tools of `variant`; with `netns`, every command runs as `ip netns exec NETNS ...`.
    pub fn new(variant: Variant, netns: Option<String>) -> Self {
        Self {
            variant,
            netns,
            family: IpFamily::V4,
        }
    }

    /// The same tools for `family` (`ip6tables*` for IPv6).
    pub fn for_family(mut self, family: IpFamily) -> Self {
        self.family = family;
        self
    }

    /// The IP family whose tables the tools edit.
    pub fn family(&self) -> IpFamily {
        self.family
    }

    /// The binary of `tool` (`iptables`, `iptables-save`, `iptables-restore`) for this variant and
    /// family, e.g. `ip6tables-legacy-restore`.
    pub fn binary(&self, tool: &str) -> String {
        let binary = self.variant.binary(tool);
        match self.family {
            IpFamily::V4 => binary,
            IpFamily::V6 => binary
                .strip_prefix("ip")
                .map_or(binary.clone(), |rest| format!("ip6{rest}")),
        }
    }

    /// The variant.
    pub fn variant(&self) -> Variant {
        self.variant
    }

    /// The network namespace commands run in, if any.
    pub fn netns(&self) -> Option<&str> {
        self.netns.as_deref()
    }

    /// Runs `tool args...`; returns the command line and how it finished.
    fn run(
        &self,
        tool: &str,
        args: &[&str],
        stdin: Option<&str>,
    ) -> Result<(String, Finished), IptablesError> {
        let binary = self.binary(tool);
        let mut argv: Vec<&str> = Vec::with_capacity(args.len() + 4);
        if let Some(ns) = &self.netns {
            argv.extend(["netns", "exec", ns.as_str()]);
        }
        argv.push(&binary);
        argv.extend_from_slice(args);
        let (program, rest) = if self.netns.is_some() {
            ("ip", &argv[..])
        } else {
            (binary.as_str(), &argv[1..])
        };
        let command_line = std::iter::once(program)
            .chain(rest.iter().copied())
            .collect::<Vec<_>>()
            .join(" ");
        let spawn_err = |e: std::io::Error| IptablesError::Spawn {
            command: command_line.clone(),
            reason: e.to_string(),
        };
        let out = super::exec::run_with_input(program, rest, stdin).map_err(spawn_err)?;
        let finished = Finished {
            status: out.code,
            stdout: out.stdout,
            stderr: out.stderr,
        };
        Ok((command_line, finished))
    }

    /// Runs `tool args...`; a non-zero exit status is an error.
    fn run_ok(&self, tool: &str, args: &[&str], stdin: Option<&str>) -> Result<Finished, IptablesError> {
        let (command_line, finished) = self.run(tool, args, stdin)?;
        if finished.status == 0 {
            Ok(finished)
        } else {
            Err(failed(command_line, finished))
        }
    }

    /// `iptables-restore -w 5 --noflush --counters` with `input` on stdin. On failure the error
    /// names the input line the tool refused when it says which.
    pub fn restore(&self, input: &str) -> Result<(), IptablesError> {
        // The nfacct counters a rule counts into must exist before the rule (kube-proxy's names);
        // a kernel without nfacct gets the rules without the count, as kube-proxy does.
        let uncounted: Vec<&str> = super::nfacct::names_in(input)
            .into_iter()
            .filter(|name| {
                super::nfacct::in_netns(self.netns(), || super::nfacct::ensure(name))
                    .map_err(|e| super::nfacct::warn_once(name, &e))
                    .is_err()
            })
            .collect();
        let counted;
        let input = if uncounted.is_empty() {
            input
        } else {
            counted = super::nfacct::without(input, &uncounted);
            counted.as_str()
        };
        match self.run_ok(
            "iptables-restore",
            &["-w", LOCK_WAIT_SECONDS, "--noflush", "--counters"],
            Some(input),
        ) {
            Ok(_) => Ok(()),
            Err(IptablesError::Failed {
                command,
                status,
                stderr,
            }) => {
                let line = failed_line(&stderr).and_then(|n| input.lines().nth(n.saturating_sub(1)));
                let stderr = match line {
                    Some(line) => format!("{stderr} (input line: {line})"),
                    None => stderr,
                };
                Err(IptablesError::Failed {
                    command,
                    status,
                    stderr,
                })
            }
            Err(e) => Err(e),
        }
    }

    /// `iptables-save -t TABLE`. Reading never creates the table: the legacy tools instantiate
    /// a table a network namespace does not have yet when asked for it by name (and
    /// `iptables-nft-save` then warns "iptables-legacy tables present"), so for the legacy variant
    /// a table missing from `/proc/net/ip{,6}_tables_names` reads as empty without running the tool.
    /// (The nft variant's tools list a missing table without creating it.)
    pub fn save(&self, table: Table) -> Result<String, IptablesError> {
        if self.variant == Variant::Legacy && !self.legacy_table_exists(table)? {
            return Ok(String::new());
        }
        self.run_ok("iptables-save", &["-t", table.as_str()], None)
            .map(|f| f.stdout)
    }

    /// `iptables -S CHAIN -t TABLE`: the chain's rules in save format (`-A CHAIN …` lines), empty
    /// when the table or the chain does not exist. The nft variant fetches only that chain, where
    /// `iptables-save` fetches the whole table (seconds at 10k Services); like [`Self::save`], a
    /// legacy table that does not exist is not created by reading it.
    pub fn chain_rules(&self, table: Table, chain: &str) -> Result<String, IptablesError> {
        Ok(self
            .chain_listing(table, chain)?
            .unwrap_or_default()
            .lines()
            .filter(|l| l.starts_with("-A "))
            .map(|l| format!("{l}\n"))
            .collect())
    }

    /// Which of `chains` exist in `table`. The nft variant asks for each chain alone (`iptables -S
    /// CHAIN`); the legacy tools read the whole table for any question, so it is read once.
    pub fn existing_chains(
        &self,
        table: Table,
        chains: &[&'static str],
    ) -> Result<Vec<&'static str>, IptablesError> {
        if self.variant == Variant::Legacy {
            let save = self.save(table)?;
            return Ok(chains.iter().copied().filter(|c| declares(&save, c)).collect());
        }
        let mut found = Vec::new();
        for chain in chains {
            if self.chain_listing(table, chain)?.is_some() {
                found.push(*chain);
            }
        }
        Ok(found)
    }

    /// `iptables -S CHAIN -t TABLE`, `None` when the table or the chain does not exist.
    fn chain_listing(&self, table: Table, chain: &str) -> Result<Option<String>, IptablesError> {
        if self.variant == Variant::Legacy && !self.legacy_table_exists(table)? {
            return Ok(None);
        }
        let args = ["-w", LOCK_WAIT_SECONDS, "-t", table.as_str(), "-S", chain];
        match self.run("iptables", &args, None)? {
            (_, finished) if finished.status == 0 => Ok(Some(finished.stdout)),
            (_, finished) if finished.status == 1 && chain_missing(self.variant, &finished.stderr) => {
                Ok(None)
            }
            (command, finished) => Err(failed(command, finished)),
        }
    }

    /// Whether the legacy (x_tables) `table` of this family exists in the network namespace:
    /// listed in `/proc/net/ip_tables_names` (`ip6_tables_names`). Without that file (x_tables
    /// not loaded) no legacy table exists.
    pub fn legacy_table_exists(&self, table: Table) -> Result<bool, IptablesError> {
        // The calling thread's namespace: `/proc/net` follows the process's main thread, which a
        // thread that entered another network namespace (as the kernel tests do) is not.
        let file = match self.family {
            IpFamily::V4 => "/proc/thread-self/net/ip_tables_names",
            IpFamily::V6 => "/proc/thread-self/net/ip6_tables_names",
        };
        let names = match &self.netns {
            None => std::fs::read_to_string(file).unwrap_or_default(),
            Some(ns) => {
                let command = format!("ip netns exec {ns} cat {file}");
                let out = super::exec::run_with_input("ip", &["netns", "exec", ns, "cat", file], None)
                    .map_err(|e| IptablesError::Spawn {
                        command: command.clone(),
                        reason: e.to_string(),
                    })?;
                if !out.success && out.stderr.contains("No such file") {
                    String::new()
                } else if !out.success {
                    return Err(IptablesError::Failed {
                        command,
                        status: out.code,
                        stderr: out.stderr,
                    });
                } else {
                    out.stdout
                }
            }
        };
        Ok(table_listed(&names, table))
    }

    /// Whether this variant's tools run at all (`iptables -V`, which touches no table).
    pub fn tools_run(&self) -> Result<(), IptablesError> {
        self.run_ok("iptables", &["-V"], None).map(|_| ())
    }

    fn rule_command(
        &self,
        op: &str,
        table: Table,
        chain: &str,
        spec: &[&str],
    ) -> Result<Finished, IptablesError> {
        let mut args = vec!["-w", LOCK_WAIT_SECONDS, "-t", table.as_str(), op, chain];
        args.extend_from_slice(spec);
        self.run("iptables", &args, None).map(|(_, f)| f)
    }

    /// `iptables -C`: whether the rule exists (exit status 1 means it, or its chain, does not).
    pub fn rule_exists(&self, table: Table, chain: &str, spec: &[&str]) -> Result<bool, IptablesError> {
        let f = self.rule_command("-C", table, chain, spec)?;
        match f.status {
            0 => Ok(true),
            1 => Ok(false),
            _ => Err(failed(self.describe("-C", table, chain, spec), f)),
        }
    }

    /// `iptables -I CHAIN 1 SPEC`: prepends the rule.
    pub fn insert_rule(&self, table: Table, chain: &str, spec: &[&str]) -> Result<(), IptablesError> {
        let mut args = vec!["-w", LOCK_WAIT_SECONDS, "-t", table.as_str(), "-I", chain, "1"];
        args.extend_from_slice(spec);
        let (_, f) = self.run("iptables", &args, None)?;
        if f.status == 0 {
            Ok(())
        } else {
            Err(failed(self.describe("-I", table, chain, spec), f))
        }
    }

    /// `iptables -D CHAIN SPEC`: deletes one copy of the rule.
    pub fn delete_rule(&self, table: Table, chain: &str, spec: &[&str]) -> Result<(), IptablesError> {
        let f = self.rule_command("-D", table, chain, spec)?;
        if f.status == 0 {
            Ok(())
        } else {
            Err(failed(self.describe("-D", table, chain, spec), f))
        }
    }

    /// Prepends the rule unless it exists; returns whether it was inserted.
    pub fn ensure_rule(&self, table: Table, chain: &str, spec: &[&str]) -> Result<bool, IptablesError> {
        if self.rule_exists(table, chain, spec)? {
            return Ok(false);
        }
        self.insert_rule(table, chain, spec)?;
        Ok(true)
    }

    /// Deletes every copy of the rule; returns how many were deleted. Absent rules (and absent
    /// chains) are fine.
    pub fn remove_rule(&self, table: Table, chain: &str, spec: &[&str]) -> Result<usize, IptablesError> {
        let mut removed = 0;
        while self.rule_exists(table, chain, spec)? {
            self.delete_rule(table, chain, spec)?;
            removed += 1;
        }
        Ok(removed)
    }

    fn describe(&self, op: &str, table: Table, chain: &str, spec: &[&str]) -> String {
        let prefix = self
            .netns
            .as_ref()
            .map(|ns| format!("ip netns exec {ns} "))
            .unwrap_or_default();
        format!(
            "{prefix}{} -t {} {op} {chain} {}",
            self.binary("iptables"),
            table.as_str(),
            spec.join(" ")
        )
    }
}

fn failed(command: String, f: Finished) -> IptablesError {
    IptablesError::Failed {
        command,
        status: f.status,
        stderr: f.stderr,
    }
}

/// Whether `table` is a line of an `ip_tables_names` listing.
fn table_listed(names: &str, table: Table) -> bool {
    names.lines().any(|l| l.trim() == table.as_str())
}

/// The 1-based input line of an `iptables-restore` error (`... line N failed`, `Error occurred at
/// line: N`).
fn failed_line(stderr: &str) -> Option<usize> {
    for marker in ["line: ", "line "] {
        for (i, _) in stderr.match_indices(marker) {
            let digits: String = stderr[i + marker.len()..]
                .chars()
                .take_while(char::is_ascii_digit)
                .collect();
            if let Ok(n) = digits.parse() {
                return Some(n);
            }
        }
    }
    None
}

/// One family's iptables tools as the backends use them: `iptables-save` of a table,
/// `iptables-restore --noflush` of an input, and removing every copy of a rule.
///
/// # Guarantees (of every implementation)
/// - `restore` applies the whole input or fails naming the line it refused.
/// - `save` lists user chains sorted, and each chain's rules in order, as `iptables-save` does.
pub trait SaveRestore: std::fmt::Debug + Send {
    /// The IP family whose tables the tools edit.
    fn family(&self) -> IpFamily;
    /// The `iptables` tool's name, for messages (e.g. `ip6tables-legacy`).
    fn tool(&self) -> String;
    /// `iptables-save -t TABLE`.
    fn save(&self, table: Table) -> Result<String, IptablesError>;
    /// `iptables-restore --noflush --counters` of `input`.
    fn restore(&mut self, input: &str) -> Result<(), IptablesError>;
    /// Deletes every copy of the rule `spec` in `chain`; absent rules and chains are fine.
    fn remove_rule(&mut self, table: Table, chain: &str, spec: &[&str]) -> Result<usize, IptablesError>;
    /// The `-A CHAIN …` lines of `chain` in `table` (save format; empty without the chain). The
    /// default reads them out of [`Self::save`]; the kernel tools fetch only the chain.
    fn chain_rules(&self, table: Table, chain: &str) -> Result<String, IptablesError> {
        let prefix = format!("-A {chain} ");
        Ok(self
            .save(table)?
            .lines()
            .filter(|l| l.starts_with(&prefix))
            .map(|l| format!("{l}\n"))
            .collect())
    }

    /// Which of `chains` exist in `table`. The default reads them out of [`Self::save`]; the
    /// nft variant's kernel tools ask for each chain alone (`iptables-save` of a table fetches
    /// all its rules: 8.4 s for nat beside 10k Services of iptables-nft mode).
    fn existing_chains(
        &self,
        table: Table,
        chains: &[&'static str],
    ) -> Result<Vec<&'static str>, IptablesError> {
        let save = self.save(table)?;
        Ok(chains.iter().copied().filter(|c| declares(&save, c)).collect())
    }
}

/// Whether `iptables -S CHAIN` failed (status 1) because the chain or its table is not there:
/// the legacy tools say "No chain/target/match by that name."; iptables-nft 1.8.9 says "chain
/// `CHAIN' in table `TABLE' is incompatible, use 'nft' tool." (checked on this machine's 1.8.9: a
/// chain it cannot parse fails with status 3 and a parse error instead).
fn chain_missing(variant: Variant, stderr: &str) -> bool {
    stderr.contains("No chain") || (variant == Variant::Nft && stderr.contains("is incompatible"))
}

/// Whether `iptables-save` output declares `chain` (a `:CHAIN POLICY [p:b]` line).
pub fn declares(save: &str, chain: &str) -> bool {
    save.lines()
        .filter_map(|l| l.strip_prefix(':'))
        .any(|l| l.split_whitespace().next() == Some(chain))
}

impl SaveRestore for Iptables {
    fn family(&self) -> IpFamily {
        Iptables::family(self)
    }

    fn tool(&self) -> String {
        self.binary("iptables")
    }

    fn save(&self, table: Table) -> Result<String, IptablesError> {
        Iptables::save(self, table)
    }

    fn restore(&mut self, input: &str) -> Result<(), IptablesError> {
        Iptables::restore(self, input)
    }

    fn chain_rules(&self, table: Table, chain: &str) -> Result<String, IptablesError> {
        Iptables::chain_rules(self, table, chain)
    }

    fn existing_chains(
        &self,
        table: Table,
        chains: &[&'static str],
    ) -> Result<Vec<&'static str>, IptablesError> {
        Iptables::existing_chains(self, table, chains)
    }

    fn remove_rule(&mut self, table: Table, chain: &str, spec: &[&str]) -> Result<usize, IptablesError> {
        Iptables::remove_rule(self, table, chain, spec)
    }
}

/// Chooses the variant the host uses, like the iptables wrappers of Kubernetes images: the one
/// whose `iptables-save` shows more rules; `nft` on a tie (including an empty host). A variant whose
/// tools are missing counts as having no rules; an error only when neither can be run.
pub fn detect_variant(netns: Option<&str>) -> Result<Variant, IptablesError> {
    let count = |variant: Variant| -> Result<usize, IptablesError> {
        let ipt = Iptables::new(variant, netns.map(str::to_owned));
        let out = ipt.run_ok("iptables-save", &[], None)?;
        Ok(out.stdout.lines().filter(|l| l.starts_with("-A ")).count())
    };
    match (count(Variant::Legacy), count(Variant::Nft)) {
        (Ok(legacy), Ok(nft)) => Ok(if legacy > nft {
            Variant::Legacy
        } else {
            Variant::Nft
        }),
        (Ok(_), Err(_)) => Ok(Variant::Legacy),
        (Err(_), Ok(_)) => Ok(Variant::Nft),
        (Err(e), Err(_)) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn iptables_variant_names_and_binaries() {
        assert_eq!("legacy".parse::<Variant>().ok(), Some(Variant::Legacy));
        assert_eq!("nft".parse::<Variant>().ok(), Some(Variant::Nft));
        assert!(matches!(
            "xt".parse::<Variant>(),
            Err(IptablesError::UnknownVariant(_))
        ));
        assert_eq!(
            Variant::Legacy.binary("iptables-restore"),
            "iptables-legacy-restore"
        );
        assert_eq!(Variant::Nft.binary("iptables"), "iptables-nft");
        assert_eq!(Variant::Nft.binary("iptables-save"), "iptables-nft-save");
        let v6 = Iptables::new(Variant::Legacy, None).for_family(IpFamily::V6);
        assert_eq!(v6.binary("iptables-restore"), "ip6tables-legacy-restore");
        assert_eq!(v6.binary("iptables"), "ip6tables-legacy");
    }

    #[test]
    fn legacy_tables_are_read_only_when_listed() {
        assert!(table_listed("nat\nfilter\n", Table::Filter));
        assert!(!table_listed("nat\n", Table::Filter));
        assert!(!table_listed("", Table::Mangle));
        assert!(!table_listed("mangle2\n", Table::Mangle));
    }

    #[test]
    fn iptables_restore_error_line() {
        assert_eq!(
            failed_line(
                "iptables-restore v1.8.9 (legacy): Couldn't load target `X'\n\nError occurred at line: 7"
            ),
            Some(7)
        );
        assert_eq!(failed_line("iptables-restore: line 12 failed"), Some(12));
        assert_eq!(failed_line("something else"), None);
    }
}
