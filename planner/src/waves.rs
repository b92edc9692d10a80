//! Wave assignment: which pool nodes go into which wave, in a stable order.
//!
//! Order inside the pool is the SHA-256 of `node UID / policy UID` (as the system-upgrade-controller
//! orders nodes): deterministic across leaders and restarts, different per policy, and not chosen by
//! node names. Assignment, in passes:
//! 0. nodes the previous status already listed in a wave stay there (a plan does not reshuffle when
//!    nodes come and go, and a finished wave is not refilled with already-switched nodes);
//! 1. waves with a `nodeSelector` take matching unplaced nodes (up to their size; all matching ones
//!    without `nodes`), in wave order;
//! 2. waves with a size take unplaced nodes in pool order until full;
//! 3. the last wave takes every node left.

use std::collections::HashMap;

use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use sha2::{Digest, Sha256};
use switchyard_crds::v1alpha1::Rollout;

use super::selector::Selector;

/// Name of the single wave of a policy that declares none.
pub const IMPLICIT_WAVE: &str = "all";

/// One wave of a rollout, with its size resolved against the pool.
#[derive(Clone, Debug)]
pub struct WaveDef {
    /// Wave name.
    pub name: String,
    /// Nodes it takes; `None`: every matching node (selector waves) or the remainder (last wave).
    pub size: Option<usize>,
    /// Preferred nodes.
    pub selector: Option<Selector>,
    /// Seconds to wait after the wave is healthy.
    pub soak_seconds: u32,
    /// Needs approval for the current generation.
    pub require_approval: bool,
}

/// Resolves `count` or `percent` against `pool` nodes: percent rounds up.
pub fn resolve_up(value: &IntOrString, pool: usize) -> usize {
    match value {
        IntOrString::Int(n) => usize::try_from(*n).unwrap_or(0),
        IntOrString::String(s) => match s.strip_suffix('%') {
            Some(p) => p
                .trim()
                .parse::<usize>()
                .map(|p| (p * pool).div_ceil(100))
                .unwrap_or(1),
            None => s.trim().parse().unwrap_or(1),
        },
    }
}

/// Resolves `maxUnavailable` against `pool` nodes: percent rounds down, at least 1.
pub fn resolve_max_unavailable(value: &IntOrString, pool: usize) -> usize {
    let n = match value {
        IntOrString::Int(n) => usize::try_from(*n).unwrap_or(1),
        IntOrString::String(s) => match s.strip_suffix('%') {
            Some(p) => p.trim().parse::<usize>().map(|p| p * pool / 100).unwrap_or(1),
            None => s.trim().parse().unwrap_or(1),
        },
    };
    n.max(1)
}

/// The waves of `rollout` for a pool of `pool` nodes (one implicit wave when none are declared).
pub fn wave_defs(rollout: &Rollout, pool: usize) -> Vec<WaveDef> {
    if rollout.waves.is_empty() {
        return vec![WaveDef {
            name: IMPLICIT_WAVE.to_owned(),
            size: None,
            selector: None,
            soak_seconds: 0,
            require_approval: false,
        }];
    }
    let last = rollout.waves.len() - 1;
    rollout
        .waves
        .iter()
        .enumerate()
        .map(|(i, w)| WaveDef {
            name: w.name.clone(),
            size: if i == last {
                None
            } else {
                w.nodes.as_ref().map(|n| resolve_up(n, pool))
            },
            selector: w.node_selector.as_ref().map(Selector::new),
            soak_seconds: w.soak_seconds,
            require_approval: w.require_approval,
        })
        .collect()
}

/// Stable rollout-order key of a node within a policy.
pub fn order_key(node_uid: &str, policy_uid: &str) -> u64 {
    let digest = Sha256::new()
        .chain_update(node_uid.as_bytes())
        .chain_update(b"/")
        .chain_update(policy_uid.as_bytes())
        .finalize();
    let mut first = [0u8; 8];
    first.copy_from_slice(&digest[..8]);
    u64::from_be_bytes(first)
}

/// A pool node as the assignment sees it.
pub struct PoolNode<'a> {
    /// Node name.
    pub name: &'a str,
    /// Rollout-order key ([`order_key`]).
    pub key: u64,
    /// Node labels.
    pub labels: &'a std::collections::BTreeMap<String, String>,
}

/// Assigns pool nodes to waves. Returns, per wave, indices into `pool` in rollout order.
/// `pins` maps node names to the wave index the previous status listed them in.
pub fn assign(defs: &[WaveDef], pool: &[PoolNode<'_>], pins: &HashMap<&str, usize>) -> Vec<Vec<usize>> {
    let mut order: Vec<usize> = (0..pool.len()).collect();
    order.sort_by(|&a, &b| {
        pool[a]
            .key
            .cmp(&pool[b].key)
            .then_with(|| pool[a].name.cmp(pool[b].name))
    });
    let mut placed: Vec<Option<usize>> = vec![None; pool.len()];
    let mut counts = vec![0usize; defs.len()];
    let last = defs.len().saturating_sub(1);
    // Pass 0: pins.
    for &i in &order {
        if let Some(&w) = pins.get(pool[i].name).filter(|&&w| w < defs.len()) {
            placed[i] = Some(w);
            counts[w] += 1;
        }
    }
    let room = |w: usize, counts: &[usize]| -> bool {
        match defs[w].size {
            Some(size) if w != last => counts[w] < size,
            _ => true,
        }
    };
    // Pass 1: explicit selectors.
    for (w, def) in defs.iter().enumerate() {
        let Some(selector) = &def.selector else { continue };
        for &i in &order {
            if placed[i].is_none() && room(w, &counts) && selector.matches(pool[i].labels) {
                placed[i] = Some(w);
                counts[w] += 1;
            }
        }
    }
    // Pass 2: sized waves fill up in pool order.
    for (w, def) in defs.iter().enumerate().take(last) {
        if def.size.is_none() {
            continue;
        }
        for &i in &order {
            if !room(w, &counts) {
                break;
            }
            if placed[i].is_none() {
                placed[i] = Some(w);
                counts[w] += 1;
            }
        }
    }
    // Pass 3: the last wave takes the rest.
    let mut waves = vec![Vec::new(); defs.len()];
    for &i in &order {
        let w = placed[i].unwrap_or(last);
        if let Some(wave) = waves.get_mut(w) {
            wave.push(i);
        }
    }
    waves
}
