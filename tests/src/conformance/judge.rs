//! The comparison: every cell must agree, unless it is named in the allow-list of deliberate
//! differences or in the list of known bugs — and a listed cell must differ exactly as listed
//! (kube-proxy's verdict and ours pinned as text), so neither list can hide a new difference or
//! outlive a fix: a listed cell that agrees, or an entry that names no cell, fails the test too.

use std::fmt::Write as _;

use crate::Family;

use super::verdict::Verdict;

/// A listed difference: one cell (in one mode and family, or `"*"` for all) and both verdicts.
#[derive(Debug, Clone, Copy)]
pub struct Difference {
    /// `nftables`, `iptables` or `*`.
    pub mode: &'static str,
    /// `v4`, `v6` or `*`.
    pub family: &'static str,
    /// The cell's name.
    pub cell: &'static str,
    /// kube-proxy's verdict, as printed.
    pub kube_proxy: &'static str,
    /// Ours, as printed.
    pub ours: &'static str,
    /// Why (deliberate), or which rule is wrong (bug).
    pub reason: &'static str,
}

/// One compared cell.
#[derive(Debug, Clone)]
pub struct Row {
    /// The mode.
    pub mode: &'static str,
    /// The family.
    pub family: Family,
    /// The cell's name.
    pub cell: String,
    /// kube-proxy's verdict.
    pub kube_proxy: Verdict,
    /// Ours.
    pub ours: Verdict,
}

/// How a row came out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Status {
    /// Same verdict.
    Equal,
    /// A deliberate difference, as listed.
    Deliberate,
    /// A known bug, as listed.
    KnownBug,
    /// Anything else: a failure.
    Failed(String),
}

/// `v4` / `v6`.
pub fn family_name(f: Family) -> &'static str {
    match f {
        Family::V4 => "v4",
        Family::V6 => "v6",
    }
}

fn matches(d: &Difference, row: &Row) -> bool {
    (d.mode == "*" || d.mode == row.mode)
        && (d.family == "*" || d.family == family_name(row.family))
        && d.cell == row.cell
}

fn judge_row(row: &Row, allowed: &[Difference], bugs: &[Difference]) -> Status {
    let listed = allowed
        .iter()
        .map(|d| (d, Status::Deliberate, "allow-list"))
        .chain(bugs.iter().map(|d| (d, Status::KnownBug, "KNOWN_BUGS")))
        .find(|(d, _, _)| matches(d, row));
    let equal = row.kube_proxy == row.ours;
    match listed {
        None if equal => Status::Equal,
        None => Status::Failed("differs from kube-proxy".into()),
        Some((_, _, list)) if equal => Status::Failed(format!("agrees now: drop it from the {list}")),
        Some((d, status, list)) => {
            let (kp, ours) = (row.kube_proxy.to_string(), row.ours.to_string());
            if kp == d.kube_proxy && ours == d.ours {
                status
            } else {
                Status::Failed(format!(
                    "differs otherwise than the {list} says (listed: kube-proxy {:?}, ours {:?})",
                    d.kube_proxy, d.ours
                ))
            }
        }
    }
}

/// Judges every row; the failures include list entries that name no row.
pub fn judge(rows: &[Row], allowed: &[Difference], bugs: &[Difference]) -> (Vec<Status>, Vec<String>) {
    let statuses: Vec<Status> = rows.iter().map(|r| judge_row(r, allowed, bugs)).collect();
    let mut failures: Vec<String> = rows
        .iter()
        .zip(&statuses)
        .filter_map(|(r, s)| match s {
            Status::Failed(why) => Some(format!(
                "{} {} {}: {why}\n    kube-proxy: {}\n    switchyard: {}",
                r.mode,
                family_name(r.family),
                r.cell,
                r.kube_proxy,
                r.ours
            )),
            _ => None,
        })
        .collect();
    for d in allowed.iter().chain(bugs) {
        if !rows.iter().any(|r| matches(d, r)) {
            failures.push(format!(
                "listed difference names no cell: {} {} {}",
                d.mode, d.family, d.cell
            ));
        }
    }
    (statuses, failures)
}

/// The matrix as text: one line per row, the verdict once where both agree.
pub fn render(rows: &[Row], statuses: &[Status]) -> String {
    let width = rows.iter().map(|r| r.cell.chars().count()).max().unwrap_or(0);
    let mut out = String::new();
    for (r, s) in rows.iter().zip(statuses) {
        let tag = match s {
            Status::Equal => "=",
            Status::Deliberate => "≠ deliberate",
            Status::KnownBug => "≠ KNOWN BUG",
            Status::Failed(_) => "≠ FAILED",
        };
        let cell = format!("{:<width$}", r.cell);
        let _ = match s {
            Status::Equal => writeln!(
                out,
                "{:<8} {} {cell}  {:<12} {}",
                r.mode,
                family_name(r.family),
                tag,
                r.ours
            ),
            _ => writeln!(
                out,
                "{:<8} {} {cell}  {:<12} kube-proxy: {} | switchyard: {}",
                r.mode,
                family_name(r.family),
                tag,
                r.kube_proxy,
                r.ours
            ),
        };
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refused() -> Verdict {
        Verdict {
            refused: true,
            ..Verdict::default()
        }
    }

    fn dropped() -> Verdict {
        Verdict {
            dropped: true,
            ..Verdict::default()
        }
    }

    fn row(cell: &str, kube_proxy: Verdict, ours: Verdict) -> Row {
        Row {
            mode: "nftables",
            family: Family::V6,
            cell: cell.into(),
            kube_proxy,
            ours,
        }
    }

    const LISTED: Difference = Difference {
        mode: "nftables",
        family: "*",
        cell: "c",
        kube_proxy: "refused",
        ours: "dropped",
        reason: "test",
    };

    #[test]
    fn equal_cells_pass_and_unlisted_differences_fail() {
        let rows = [row("a", refused(), refused()), row("b", refused(), dropped())];
        let (s, f) = judge(&rows, &[], &[]);
        assert_eq!(s[0], Status::Equal);
        assert!(matches!(s[1], Status::Failed(_)));
        assert_eq!(f.len(), 1, "{f:?}");
    }

    #[test]
    fn a_listed_difference_passes_only_as_listed() {
        let (s, f) = judge(&[row("c", refused(), dropped())], &[LISTED], &[]);
        assert_eq!((s[0].clone(), f.len()), (Status::Deliberate, 0));
        let (s, _) = judge(&[row("c", refused(), dropped())], &[], &[LISTED]);
        assert_eq!(s[0], Status::KnownBug);
        // Another difference in the same cell is not the listed one.
        let (s, _) = judge(&[row("c", dropped(), refused())], &[], &[LISTED]);
        assert!(matches!(s[0], Status::Failed(_)));
    }

    #[test]
    fn a_known_bug_that_agrees_and_an_entry_without_a_cell_fail() {
        let (s, f) = judge(&[row("c", refused(), refused())], &[], &[LISTED]);
        assert!(
            matches!(&s[0], Status::Failed(w) if w.contains("KNOWN_BUGS")),
            "{s:?}"
        );
        assert_eq!(f.len(), 1);
        let (_, f) = judge(&[row("a", refused(), refused())], &[LISTED], &[]);
        assert!(f.iter().any(|x| x.contains("names no cell")), "{f:?}");
    }
}
