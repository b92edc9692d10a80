//! Runs every cell of the matrix through both twins of a mode, a few cells at a time: a drop is a
//! wait for the attempt's limit, not work, so cells overlap; a spread's 600 connections are
//! milliseconds each. Each cell starts with a pilot of two attempts with a generous limit (3 s: a
//! refusal, even one that needed a SYN retransmission, arrives well within it; a drop uses it up),
//! and only a cell whose pilot was answered runs its remaining attempts, in chunks that stop at
//! the first chunk with a failure.

use std::{
    collections::{BTreeMap, VecDeque},
    sync::Mutex,
};

use crate::{
    Error, Family, Result,
    netns::Cluster,
    traffic::{Outcome, http_get, probe},
};

use super::{
    cell::{self, Cell, Check},
    verdict::{self, Verdict},
};

/// Attempts of the pilot.
const PILOT: u32 = 2;
/// The pilot's limit per attempt, in ms: refused vs dropped is decided here.
pub const PILOT_LIMIT_MS: u64 = 3000;
/// The limit per attempt once the pilot was answered, in ms.
const ANSWER_LIMIT_MS: u64 = 2000;
/// Attempts per probe after the pilot.
const CHUNK: u32 = 200;
/// Cells run at once.
const WORKERS: usize = 6;

/// One cell of one family, through both proxies: `verdicts[i]` is the verdict of `twins[i]`.
#[derive(Debug, Clone)]
pub struct Observed {
    /// The cell's name.
    pub cell: String,
    /// Its family.
    pub family: Family,
    /// One verdict per twin.
    pub verdicts: Vec<Verdict>,
}

/// The cell's verdict through the proxy of `cluster`.
pub fn run_cell(cluster: &Cluster, cell: &Cell, family: Family) -> Result<Verdict> {
    let netns = cell.client_netns(cluster);
    let target = cell
        .destination(cluster, family)
        .ok_or_else(|| Error::Prerequisite(format!("{}: no {family:?} address", cell.name)))?;
    if cell.check == Check::Http {
        let (code, _) = http_get(&netns, target, "/")?;
        return Ok(verdict::of_http(code));
    }
    let total = cell.attempts();
    let mut outcomes = probe(&netns, target, cell.udp, PILOT.min(total), PILOT_LIMIT_MS)?;
    while (outcomes.len() as u32) < total && outcomes.iter().all(|o| o.server().is_some()) {
        let n = CHUNK.min(total - outcomes.len() as u32);
        outcomes.extend(probe(&netns, target, cell.udp, n, ANSWER_LIMIT_MS)?);
    }
    Ok(of(cluster, cell, &outcomes))
}

fn of(cluster: &Cluster, cell: &Cell, outcomes: &[Outcome]) -> Verdict {
    verdict::of_outcomes(outcomes, cell.check, &cell.endpoints(), |ip| {
        cell::owner(cluster, ip)
    })
}

/// One job: (cell index, family, twin index).
type Job = (usize, Family, usize);

/// The jobs of `cells` on `twins` twins, spreads first (the longest).
fn jobs(cells: &[Cell], clusters: &[&Cluster]) -> VecDeque<Job> {
    let mut jobs: Vec<Job> = Vec::new();
    for (i, c) in cells.iter().enumerate() {
        for family in Family::BOTH {
            if c.destination(clusters[0], family).is_none() {
                continue;
            }
            for t in 0..clusters.len() {
                jobs.push((i, family, t));
            }
        }
    }
    jobs.sort_by_key(|&(i, _, _)| std::cmp::Reverse(cells[i].attempts()));
    jobs.into()
}

/// Runs every cell in every family where its target exists, on every twin (by its cluster).
pub fn run_matrix(cells: &[Cell], clusters: &[&Cluster]) -> Result<Vec<Observed>> {
    let queue = Mutex::new(jobs(cells, clusters));
    let results: Mutex<BTreeMap<Job, Result<Verdict>>> = Mutex::new(BTreeMap::new());
    std::thread::scope(|s| {
        for _ in 0..WORKERS {
            s.spawn(|| {
                loop {
                    let Some(job) = queue.lock().ok().and_then(|mut q| q.pop_front()) else {
                        return;
                    };
                    let (i, family, t) = job;
                    let v = run_cell(clusters[t], &cells[i], family);
                    if let Ok(mut r) = results.lock() {
                        r.insert(job, v);
                    }
                }
            });
        }
    });
    let results = results
        .into_inner()
        .map_err(|_| Error::Prerequisite("a cell worker panicked".into()))?;
    collect(cells, clusters.len(), results)
}

/// Groups the per-twin verdicts by cell and family, in the cells' order, IPv4 first.
fn collect(
    cells: &[Cell],
    twins: usize,
    mut results: BTreeMap<Job, Result<Verdict>>,
) -> Result<Vec<Observed>> {
    let mut rows = Vec::new();
    for (i, c) in cells.iter().enumerate() {
        for family in Family::BOTH {
            let mut verdicts = Vec::new();
            for t in 0..twins {
                if let Some(v) = results.remove(&(i, family, t)) {
                    verdicts.push(v.map_err(|e| Error::Prerequisite(format!("{} {family:?}: {e}", c.name)))?);
                }
            }
            if !verdicts.is_empty() {
                rows.push(Observed {
                    cell: c.name.clone(),
                    family,
                    verdicts,
                });
            }
        }
    }
    Ok(rows)
}
