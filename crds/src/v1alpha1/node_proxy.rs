//! `NodeProxy`: one per node; the operator's wish (spec) and the agent's report (status).

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::CustomResource;
use serde::{Deserialize, Serialize};

use super::{HealthGate, ProxyMode, ProxySettings};

/// Desired proxy state of one node. Named after the node and owned by it. Written by the operator
/// only; the node's agent reports in status.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq, schemars::JsonSchema)]
#[kube(
    group = "switchyard.dev",
    version = "v1alpha1",
    kind = "NodeProxy",
    doc = "Proxy state of one node: the mode the operator wants (spec) and what the node's agent reports (status).",
    plural = "nodeproxies",
    shortname = "np",
    category = "switchyard",
    status = "NodeProxyStatus",
    printcolumn(
        name = "Desired",
        type_ = "string",
        json_path = ".spec.desiredMode",
        description = "Mode the operator wants (external: another service proxy)"
    ),
    printcolumn(
        name = "Active",
        type_ = "string",
        json_path = ".status.activeMode",
        description = "Mode the agent runs (external: another service proxy serves the node)"
    ),
    printcolumn(
        name = "Phase",
        type_ = "string",
        json_path = ".status.phase",
        description = "Switch phase"
    ),
    printcolumn(
        name = "Kernel",
        type_ = "string",
        json_path = ".status.capabilities.kernelVersion",
        description = "Kernel release"
    ),
    printcolumn(
        name = "Modes",
        type_ = "string",
        json_path = ".status.capabilities.supportedModes",
        priority = 1,
        description = "Modes this kernel can run"
    ),
    printcolumn(
        name = "Policy",
        type_ = "string",
        json_path = ".spec.policy.name",
        priority = 1,
        description = "Governing ProxyPolicy"
    ),
    printcolumn(name = "Age", type_ = "date", json_path = ".metadata.creationTimestamp")
)]
#[serde(rename_all = "camelCase")]
pub struct NodeProxySpec {
    /// Mode the node should run. Absent: the agent keeps the mode it runs (or its configured default).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub desired_mode: Option<ProxyMode>,
    /// Effective proxy settings from the governing policy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub proxy: Option<ProxySettings>,
    /// Health gate the agent must pass after switching.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub health_gate: Option<HealthGate>,
    /// Policy (and its generation) this desired state came from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub policy: Option<PolicyReference>,
    /// Changes whenever the operator asks for a new switch attempt (including a rollback), so the
    /// agent can tell a retry from the request it already answered.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rollout_token: Option<String>,
}

/// Reference to a ProxyPolicy at one generation.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PolicyReference {
    /// Policy name.
    pub name: String,
    /// Policy UID.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uid: Option<String>,
    /// Policy generation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub generation: Option<i64>,
}

/// Phase of the mode switch state machine.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, schemars::JsonSchema)]
pub enum SwitchPhase {
    /// The agent is starting and has not programmed anything yet.
    Initializing,
    /// One backend is active and serving.
    Active,
    /// The new backend's rules are being programmed without taking traffic.
    Preparing,
    /// New connections move to the new backend; existing ones keep their conntrack binding.
    CutOver,
    /// The health gate runs against the new backend.
    Verifying,
    /// The old backend's objects are being removed.
    Cleaning,
    /// The switch failed; the old backend takes traffic again.
    RollingBack,
    /// The agent cannot serve in any mode (see conditions).
    Failed,
}

/// One capability, with a reason or version for people.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Capability {
    /// Whether it is usable here.
    pub usable: bool,
    /// Why not, or what was found (version, variant).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
}

/// What the node's kernel and userspace can do, as probed by the agent.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Capabilities {
    /// Kernel release (`uname -r`).
    pub kernel_version: String,
    /// Modes this node can run, derived from the facts below.
    #[serde(default)]
    pub supported_modes: Vec<ProxyMode>,
    /// nf_tables usable: a throwaway table could be created (and the kernel is 5.13 or newer for
    /// nftables mode).
    pub nftables: Capability,
    /// iptables-legacy userspace and kernel x_tables usable.
    pub iptables_legacy: Capability,
    /// iptables-nft userspace usable.
    pub iptables_nft: Capability,
    /// The iptables variant the iptables backend uses (`legacy` or `nft`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub iptables_variant: Option<String>,
    /// IPVS usable: the generic-netlink family `IPVS` resolves.
    pub ipvs: Capability,
    /// IPVS schedulers available (loaded or loadable).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ipvs_schedulers: Vec<String>,
    /// ipset usable.
    pub ipset: Capability,
    /// Connection-tracking settings as found.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub conntrack: Option<ConntrackFacts>,
}

/// Connection-tracking sysctls as read on the node.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ConntrackFacts {
    /// net.netfilter.nf_conntrack_max.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max: Option<i64>,
    /// net.netfilter.nf_conntrack_tcp_be_liberal.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tcp_be_liberal: Option<bool>,
    /// net.netfilter.nf_conntrack_tcp_timeout_established.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tcp_established_timeout_seconds: Option<i64>,
    /// net.netfilter.nf_conntrack_udp_timeout.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub udp_timeout_seconds: Option<i64>,
}

/// Outcome of the last mode switch.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SwitchResult {
    /// Mode before the switch.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from: Option<ProxyMode>,
    /// Mode requested.
    pub to: ProxyMode,
    /// `Succeeded`, `RolledBack` or `Failed`.
    #[schemars(extend("enum" = ["Succeeded", "RolledBack", "Failed"]))]
    pub result: String,
    /// Why, in words a person can act on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// Rollout token the switch answered.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rollout_token: Option<String>,
    /// When the switch started.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started_at: Option<Time>,
    /// When it ended.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finished_at: Option<Time>,
}

/// Result of one health-gate probe.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ProbeResult {
    /// `namespace/name:port` of the Service probed.
    pub target: String,
    /// Whether an endpoint answered.
    pub ok: bool,
    /// Endpoint that answered, or the error.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
}

/// Statistics of the last rules sync.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SyncStats {
    /// When the last sync finished.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_sync_time: Option<Time>,
    /// Duration of the last sync in milliseconds.
    #[serde(default)]
    pub last_sync_millis: i64,
    /// Service ports programmed.
    #[serde(default)]
    pub services: i64,
    /// Endpoints programmed.
    #[serde(default)]
    pub endpoints: i64,
    /// Kernel objects (rules, map elements, virtual servers) programmed.
    #[serde(default)]
    pub rules: i64,
}

/// Observed state of a node's proxy, written by its agent.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NodeProxyStatus {
    /// Generation of the spec the agent last acted on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// Version of the agent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent_version: Option<String>,
    /// What the node can do.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capabilities: Option<Capabilities>,
    /// Mode serving traffic now.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub active_mode: Option<ProxyMode>,
    /// Phase of the switch state machine.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<SwitchPhase>,
    /// Outcome of the last switch.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_switch: Option<SwitchResult>,
    /// Latest health-gate probe results.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub probes: Vec<ProbeResult>,
    /// Statistics of the last rules sync.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sync: Option<SyncStats>,
    /// Sync durations over a recent window of syncs and the size of what is programmed,
    /// refreshed about once a minute (the mode advisor's input).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub measurements: Option<super::SyncMeasurements>,
    /// The mode advisor's recommendation for this node, from `measurements` and `capabilities`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub advice: Option<super::ModeAdvice>,
    /// What the migration preflight reads on this node (localhost NodePort and conntrack-invalid
    /// counters, tcp_be_liberal, NodePort addresses, kernel); the planner judges them against a
    /// policy's mode before the node switches.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub preflight_facts: Option<super::PreflightFacts>,
    /// `Healthy`: True while the node runs its desired mode and the last switch for the current
    /// rollout token passed its health gate; False with the reason (`Switching`, `RolledBack`,
    /// `Failed`) otherwise.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
}
