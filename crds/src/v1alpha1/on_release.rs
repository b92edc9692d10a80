//! What a ProxyPolicy does with the nodes it stops governing (`spec.onRelease`): the policy is
//! deleted, or a node's labels no longer match its `nodeSelector`.

use serde::{Deserialize, Serialize};

use super::ProxyMode;

/// Finalizer the operator puts on a ProxyPolicy with `onRelease: Revert` (and only on those), so
/// that a deletion first returns the policy's nodes to `revertMode` through a rollout; removed
/// when that is done, or when `revertTimeoutSeconds` have passed since the deletion.
pub const REVERT_FINALIZER: &str = "switchyard.dev/revert-on-release";

/// Default of `spec.revertTimeoutSeconds`.
pub const DEFAULT_REVERT_TIMEOUT_SECONDS: u32 = 1800;

/// What happens to a node this policy stops governing (the policy is deleted, or the node's
/// labels no longer match nodeSelector). Keep (default): the node keeps serving in the mode it
/// runs, its NodeProxy no longer names the policy and nothing switches (a switch in flight
/// finishes or rolls back under its own health gate). Revert: the node returns to revertMode
/// (with the agent's own settings) through a rollout under this policy's waves, maxUnavailable,
/// failure budget and health gate, then is released as with Keep; a deletion waits for that
/// (finalizer switchyard.dev/revert-on-release), at most revertTimeoutSeconds.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default, schemars::JsonSchema)]
pub enum OnRelease {
    /// The node keeps serving in the mode it runs.
    #[default]
    Keep,
    /// The node returns to revertMode through a rollout first.
    Revert,
}

/// With onRelease Revert: the mode released nodes return to: iptables, ipvs or nftables (the mode
/// the agents were installed with, which the operator cannot see). Nodes that cannot run it keep
/// their mode.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, schemars::JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum RevertMode {
    /// iptables mode.
    Iptables,
    /// IPVS mode.
    Ipvs,
    /// nftables mode.
    Nftables,
}

impl From<RevertMode> for ProxyMode {
    fn from(m: RevertMode) -> Self {
        match m {
            RevertMode::Iptables => ProxyMode::Iptables,
            RevertMode::Ipvs => ProxyMode::Ipvs,
            RevertMode::Nftables => ProxyMode::Nftables,
        }
    }
}
