//! The mode advisor's API: the sync figures a node's agent measures (`NodeProxy`
//! `status.measurements`), the recommendation it derives from them (`status.advice`), and the
//! pool's summary the operator writes (`ProxyPolicy` `status.advice`). The rules themselves are
//! `switchyard_planner::advisor`'s (pure, shared by the agent, the operator and the plugin).

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use serde::{Deserialize, Serialize};

use super::ProxyMode;

/// Reason codes of a [`ModeAdvice`] (several may apply; the message gives the numbers).
pub mod advice_reasons {
    /// iptables syncs over the window average above the limit (the articles' rule: well above
    /// 1 s means the cluster outgrew iptables mode).
    pub const SYNC_SLOW: &str = "SyncSlow";
    /// iptables mode with so many service ports that every new connection walks a long
    /// linear rule list (nftables looks them up in one map).
    pub const MANY_SERVICES: &str = "ManyServices";
    /// IPVS mode: deprecated upstream since v1.35, off by default from v1.40, removed in v1.43.
    pub const IPVS_DEPRECATED: &str = "IPVSDeprecated";
    /// nftables would be advised but this node cannot run it (kernel below 5.13, or nf_tables
    /// unusable): iptables is the mode for such nodes, not IPVS.
    pub const NFTABLES_UNAVAILABLE: &str = "NftablesUnavailable";
    /// iptables mode within every limit: no reason to move.
    pub const WITHIN_LIMITS: &str = "WithinLimits";
    /// nftables mode: the upstream successor of both other modes.
    pub const NFTABLES: &str = "Nftables";
    /// Another service proxy serves the node: nothing is measured.
    pub const EXTERNAL: &str = "External";
    /// Too few syncs measured for the sync-duration rule (the other rules still apply).
    pub const FEW_SYNCS: &str = "FewSyncs";
}

/// Sync durations the agent measured over a recent window of syncs, with the size of what the
/// last sync programmed. Refreshed at a bounded rate (about once a minute, and when the advice
/// changes), not after every sync.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SyncMeasurements {
    /// Mode the syncs ran in (the window restarts when the mode changes).
    pub mode: ProxyMode,
    /// When these figures were taken.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub measured_at: Option<Time>,
    /// Seconds from the oldest sync in the window to the newest.
    #[serde(default)]
    pub window_seconds: i64,
    /// Syncs in the window (the most recent ones, up to 100 within the last 15 minutes).
    #[serde(default)]
    pub syncs: i64,
    /// Of those, full syncs (the first after a start, periodic resyncs, retries).
    #[serde(default)]
    pub full_syncs: i64,
    /// Average sync duration over the window, milliseconds.
    #[serde(default)]
    pub average_millis: i64,
    /// 90th percentile (nearest rank) of the sync durations in the window, milliseconds.
    #[serde(default)]
    pub p90_millis: i64,
    /// Longest sync in the window, milliseconds.
    #[serde(default)]
    pub max_millis: i64,
    /// Service ports the last sync programmed (both IP families).
    #[serde(default)]
    pub services: i64,
    /// Endpoints the last sync programmed.
    #[serde(default)]
    pub endpoints: i64,
    /// Kernel objects (rules, map elements, virtual servers) of the last sync's desired state.
    #[serde(default)]
    pub rules: i64,
}

/// Whether the advisor recommends moving the node.
#[derive(
    Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, schemars::JsonSchema,
)]
pub enum AdviceAction {
    /// Keep the mode the node runs.
    #[default]
    Stay,
    /// Move the node to `recommendedMode`.
    Switch,
}

/// The figures a recommendation was made from.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct AdviceFigures {
    /// Mode the node runs (the one measured).
    pub mode: ProxyMode,
    /// Kernel release (`uname -r`).
    #[serde(default)]
    pub kernel_version: String,
    /// Whether this node can run nftables mode (kernel 5.13 or newer and nf_tables usable).
    #[serde(default)]
    pub nftables_usable: bool,
    /// Syncs measured (the window of `status.measurements`).
    #[serde(default)]
    pub syncs: i64,
    /// Average sync duration, milliseconds.
    #[serde(default)]
    pub sync_average_millis: i64,
    /// 90th percentile sync duration, milliseconds.
    #[serde(default)]
    pub sync_p90_millis: i64,
    /// Service ports programmed.
    #[serde(default)]
    pub services: i64,
    /// Endpoints programmed.
    #[serde(default)]
    pub endpoints: i64,
    /// Kernel objects programmed.
    #[serde(default)]
    pub rules: i64,
}

/// The mode advisor's recommendation for one node, written by its agent.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ModeAdvice {
    /// `Stay` on the mode the node runs, or `Switch` to `recommendedMode`.
    pub action: AdviceAction,
    /// Mode the advisor recommends (the mode the node runs when `action` is `Stay`).
    pub recommended_mode: ProxyMode,
    /// Reason codes: SyncSlow, ManyServices, IPVSDeprecated, NftablesUnavailable, WithinLimits,
    /// Nftables, External, FewSyncs.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub reasons: Vec<String>,
    /// The recommendation in words, with the figures and the limits they were held against.
    #[serde(default)]
    pub message: String,
    /// The figures the recommendation was made from.
    pub figures: AdviceFigures,
}

/// How many nodes of a pool got one recommendation.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PoolRecommendation {
    /// `Stay` or `Switch`.
    pub action: AdviceAction,
    /// The recommended mode.
    pub mode: ProxyMode,
    /// Nodes with this recommendation.
    pub nodes: i32,
    /// Every reason code given to these nodes, sorted.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub reasons: Vec<String>,
}

/// The largest figures over a pool's measured nodes.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PoolFigures {
    /// Largest average sync duration of a node, milliseconds.
    #[serde(default)]
    pub max_sync_average_millis: i64,
    /// Largest 90th percentile sync duration of a node, milliseconds.
    #[serde(default)]
    pub max_sync_p90_millis: i64,
    /// Most service ports on a node.
    #[serde(default)]
    pub max_services: i64,
    /// Most endpoints on a node.
    #[serde(default)]
    pub max_endpoints: i64,
    /// Most kernel objects on a node.
    #[serde(default)]
    pub max_rules: i64,
    /// Nodes that cannot run nftables mode.
    #[serde(default)]
    pub nodes_without_nftables: i32,
}

/// The advisor's summary over a policy's nodes, written by the operator from its agents'
/// recommendations (`kubectl switchyard advise POLICY` shows each node's).
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PoolAdvice {
    /// Governed nodes whose agent reported a recommendation.
    #[serde(default)]
    pub advised_nodes: i32,
    /// Governed nodes without one yet (no agent report, or no sync measured).
    #[serde(default)]
    pub unadvised_nodes: i32,
    /// Nodes per recommendation, switches first.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub recommendations: Vec<PoolRecommendation>,
    /// The largest figures over the advised nodes.
    #[serde(default)]
    pub figures: PoolFigures,
    /// The summary in words.
    #[serde(default)]
    pub message: String,
}
