//! `ProxyPolicy`: which nodes run which proxy mode, and how to get them there safely.

use k8s_openapi::apimachinery::pkg::{
    apis::meta::v1::{Condition, LabelSelector, Time},
    util::intstr::IntOrString,
};
use kube::{CustomResource, KubeSchema};
use serde::{Deserialize, Serialize};

use super::{HealthGate, OnRelease, ProxyMode, ProxySettings, RevertMode};

/// A pool of nodes (by label selector), the service-proxy mode they should run, and how to roll the
/// change out: in waves, gated on data-plane health, with pause, approval and rollback.
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "switchyard.dev",
    version = "v1alpha1",
    kind = "ProxyPolicy",
    doc = "A node pool, the service-proxy mode it should run, and how Switchyard rolls that out (waves, health gates, approval, rollback).",
    plural = "proxypolicies",
    shortname = "pp",
    category = "switchyard",
    status = "ProxyPolicyStatus",
    printcolumn(
        name = "Mode",
        type_ = "string",
        json_path = ".spec.mode",
        description = "Proxy mode the pool should run (external: another service proxy)"
    ),
    printcolumn(
        name = "Nodes",
        type_ = "integer",
        json_path = ".status.targetNodes",
        description = "Nodes governed by this policy"
    ),
    printcolumn(
        name = "Updated",
        type_ = "integer",
        json_path = ".status.updatedNodes",
        description = "Nodes whose active mode is the policy's mode"
    ),
    printcolumn(
        name = "Healthy",
        type_ = "integer",
        json_path = ".status.healthyNodes",
        description = "Updated nodes that passed the health gate"
    ),
    printcolumn(
        name = "Wave",
        type_ = "string",
        json_path = ".status.currentWave",
        description = "Wave being rolled out"
    ),
    printcolumn(
        name = "Status",
        type_ = "string",
        json_path = ".status.phase",
        description = "Summary of the rollout"
    ),
    printcolumn(name = "Age", type_ = "date", json_path = ".metadata.creationTimestamp")
)]
#[x_kube(validation = Rule::new("!has(self.fallback) || self.fallback != self.mode").message("spec.fallback must differ from spec.mode (use 'skip' to leave incompatible nodes alone)"))]
#[x_kube(validation = Rule::new("!has(self.proxy) || !has(self.proxy.localhostNodePorts) || !self.proxy.localhostNodePorts || (self.mode in ['iptables', 'nftables'] && (!has(self.fallback) || self.fallback in ['skip', 'iptables', 'nftables']))").message("proxy.localhostNodePorts works in iptables and nftables mode only (IPVS does not serve NodePorts on 127.0.0.1, nor does kube-proxy's IPVS mode): set spec.mode (and spec.fallback, if any) to iptables or nftables, or remove proxy.localhostNodePorts"))]
#[x_kube(validation = Rule::new("self.mode != 'external' || !has(self.fallback) || self.fallback == 'skip'").message("spec.fallback has no meaning with mode external (every node can hand over to another proxy): remove spec.fallback"))]
#[x_kube(validation = Rule::new("self.mode != 'external' || !has(self.proxy)").message("spec.proxy configures Switchyard's own data planes; with mode external another proxy serves the pool and is configured its own way: remove spec.proxy"))]
#[x_kube(validation = Rule::new("!has(self.onRelease) || self.onRelease != 'Revert' || has(self.revertMode)").message("spec.onRelease Revert needs spec.revertMode: the mode released nodes return to (iptables, ipvs or nftables)"))]
#[x_kube(validation = Rule::new("(!has(self.revertMode) && !has(self.revertTimeoutSeconds)) || (has(self.onRelease) && self.onRelease == 'Revert')").message("spec.revertMode and spec.revertTimeoutSeconds apply only with spec.onRelease Revert"))]
#[x_kube(validation = Rule::new("!has(self.revertMode) || self.revertMode != self.mode").message("spec.revertMode must differ from spec.mode (nodes already on spec.mode have nothing to revert: use onRelease Keep)"))]
#[serde(rename_all = "camelCase")]
pub struct ProxyPolicySpec {
    /// Nodes governed by this policy. An empty selector selects every node. Where policies overlap,
    /// the one with the higher priority governs the node (ties: the alphabetically first name); the
    /// others report a Conflict condition.
    pub node_selector: LabelSelector,

    /// Priority where policies overlap: higher wins. Default 0.
    #[serde(default)]
    #[schemars(range(min = -1000, max = 1000))]
    pub priority: i32,

    /// Proxy mode the pool should run: iptables, ipvs or nftables, or external to hand the pool to
    /// another service proxy (kube-proxy, an eBPF data plane): the operator labels its Nodes
    /// `switchyard.dev/service-proxy=external` for that proxy's DaemonSet to select, and the agents
    /// remove their rules once the data-plane probes pass through the other proxy.
    pub mode: ProxyMode,

    /// What to do on a node whose kernel cannot run `mode`: `skip` leaves the node as it is and
    /// reports it Incompatible; a mode name runs that mode there instead. Default skip.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fallback: Option<Fallback>,

    /// How the change reaches the pool: waves, pacing, pause, window and failure handling.
    #[serde(default)]
    pub rollout: Rollout,

    /// How a switched node proves itself healthy.
    #[serde(default)]
    pub health_gate: HealthGate,

    /// Proxy settings for the pool (KubeProxyConfiguration fields).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub proxy: Option<ProxySettings>,

    /// What happens to a node this policy stops governing (the policy is deleted, or the node's
    /// labels no longer match nodeSelector): Keep (default) leaves it serving in the mode it runs,
    /// its NodeProxy no longer naming the policy; Revert returns it to revertMode through a
    /// rollout under this policy's waves, maxUnavailable, failure budget and health gate, and a
    /// deletion waits for that (finalizer switchyard.dev/revert-on-release), at most
    /// revertTimeoutSeconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub on_release: Option<OnRelease>,

    /// With onRelease Revert: the mode released nodes return to (iptables, ipvs or nftables; the
    /// mode the agents were installed with, which the operator cannot see). Nodes that cannot run
    /// it keep their mode.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub revert_mode: Option<RevertMode>,

    /// With onRelease Revert: how long a deletion waits for the nodes to be back on revertMode
    /// (default 1800). Then the finalizer goes anyway, a RevertTimedOut Warning Event names the
    /// nodes not reverted, and those keep the mode they run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 30, max = 86400))]
    pub revert_timeout_seconds: Option<u32>,
}

/// What to do with nodes that cannot run the policy's mode.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default, schemars::JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Fallback {
    /// Leave the node alone and report it Incompatible.
    #[default]
    Skip,
    /// Run iptables mode instead.
    Iptables,
    /// Run IPVS mode instead.
    Ipvs,
    /// Run nftables mode instead.
    Nftables,
    /// Hand the node to another service proxy (mode `external`), which every node can.
    External,
}

/// What happens when more nodes fail their switch than `maxFailures` allows.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default, schemars::JsonSchema)]
pub enum FailurePolicy {
    /// Stop: later waves never start; nodes that failed are already back on their old mode.
    #[default]
    #[serde(rename = "pause")]
    Pause,
    /// Stop and return every node this rollout switched to its previous mode.
    #[serde(rename = "rollback")]
    Rollback,
}

/// Rollout of the policy's mode over its pool.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("!has(self.waves) || self.waves.all(w, self.waves.exists_one(x, x.name == w.name))").message("rollout.waves names must be unique"))]
pub struct Rollout {
    /// Waves in order. Each wave takes `nodes` of the pool (count, or percent of the pool rounded up)
    /// from the nodes not yet placed, preferring nodes matching its `nodeSelector`; the last wave always
    /// takes every node left. Empty: one wave with the whole pool.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 20))]
    pub waves: Vec<Wave>,

    /// Nodes that may be switching or unhealthy at once: a count, or a percent of the pool (rounded
    /// down, at least 1). Default 1.
    #[serde(default = "default_max_unavailable")]
    #[serde(deserialize_with = "crate::tolerant::int_or_string_or_default_one")]
    #[schemars(extend("maxLength" = 16))]
    #[x_kube(validation = Rule::new("type(self) == int ? self >= 1 && self <= 100000 : self.matches('^([1-9][0-9]?|100)%$')").message("rollout.maxUnavailable must be a count from 1 to 100000 or a whole percentage from 1% to 100% (e.g. 25%)"))]
    pub max_unavailable: IntOrString,

    /// Stop starting new switches. The plan is still computed and shown in status (dry run).
    #[serde(default)]
    pub paused: bool,

    /// When switches may start. Absent: any time.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub window: Option<MaintenanceWindow>,

    /// What to do when more than `maxFailures` nodes fail: `pause` or `rollback`. Default pause.
    #[serde(default)]
    pub failure_policy: FailurePolicy,

    /// Failed nodes tolerated before `failurePolicy` applies. Default 0: the first failure applies it.
    #[serde(default)]
    #[schemars(range(min = 0, max = 10000))]
    pub max_failures: u32,

    /// The migration preflight: findings judged on each node before its switch, and the ones
    /// this policy accepts. A node with a blocking finding not accepted here is held.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub preflight: Option<super::Preflight>,
}

impl Default for Rollout {
    fn default() -> Self {
        Self {
            waves: Vec::new(),
            max_unavailable: default_max_unavailable(),
            paused: false,
            window: None,
            failure_policy: FailurePolicy::default(),
            max_failures: 0,
            preflight: None,
        }
    }
}

fn default_max_unavailable() -> IntOrString {
    IntOrString::Int(1)
}

/// One rollout wave.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("has(self.nodes) || has(self.nodeSelector)").message("a wave must set nodes, nodeSelector, or both"))]
pub struct Wave {
    /// Name of the wave, unique in the policy (a DNS label, e.g. `canary`).
    #[schemars(
        length(min = 1, max = 63),
        regex(pattern = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
    )]
    pub name: String,

    /// How many nodes of the pool this wave takes: a count, or a percent of the pool (rounded up).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[serde(deserialize_with = "crate::tolerant::opt_int_or_string")]
    #[schemars(extend("maxLength" = 16))]
    #[x_kube(validation = Rule::new("type(self) == int ? self >= 1 && self <= 100000 : self.matches('^([1-9][0-9]?|100)%$')").message("wave nodes must be a count from 1 to 100000 or a whole percentage from 1% to 100% (e.g. 25%)"))]
    pub nodes: Option<IntOrString>,

    /// Nodes this wave takes first (an explicit canary). Without `nodes`, the wave takes every
    /// unplaced pool node matching it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_selector: Option<LabelSelector>,

    /// Seconds to wait after every node of the wave is healthy before the next wave starts.
    #[serde(default)]
    #[schemars(range(min = 0, max = 604800))]
    pub soak_seconds: u32,

    /// The wave starts only after approval for the policy's current generation:
    /// `kubectl annotate proxypolicy NAME approve.switchyard.dev/WAVE=GENERATION`.
    #[serde(default)]
    pub require_approval: bool,
}

/// Day of the week.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, schemars::JsonSchema)]
pub enum Weekday {
    /// Monday.
    Mon,
    /// Tuesday.
    Tue,
    /// Wednesday.
    Wed,
    /// Thursday.
    Thu,
    /// Friday.
    Fri,
    /// Saturday.
    Sat,
    /// Sunday.
    Sun,
}

/// A recurring maintenance window; switches start only inside it (running ones finish).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("self.start != self.end").message("window.start and window.end must differ"))]
pub struct MaintenanceWindow {
    /// Days on which the window opens. Empty: every day.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 7))]
    pub days: Vec<Weekday>,
    /// Opening time, `HH:MM` (24 h).
    #[schemars(regex(pattern = r"^([01][0-9]|2[0-3]):[0-5][0-9]$"))]
    pub start: String,
    /// Closing time, `HH:MM` (24 h); before `start` means the window runs past midnight.
    #[schemars(regex(pattern = r"^([01][0-9]|2[0-3]):[0-5][0-9]$"))]
    pub end: String,
    /// IANA time zone of start and end, e.g. `Europe/Berlin`. Default UTC.
    #[serde(default = "default_time_zone")]
    #[schemars(length(min = 1, max = 64))]
    pub time_zone: String,
}

fn default_time_zone() -> String {
    "UTC".to_owned()
}

/// One-word summary of a policy's rollout, shown in `kubectl get proxypolicies`.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, schemars::JsonSchema)]
pub enum PolicyPhase {
    /// Nothing planned yet.
    Pending,
    /// Waves are being rolled out.
    Progressing,
    /// `spec.rollout.paused` is set, or a failure paused the rollout.
    Paused,
    /// The next wave waits for approval.
    AwaitingApproval,
    /// Outside the maintenance window.
    WaitingForWindow,
    /// Every node of the pool runs the mode and is healthy.
    Ready,
    /// The failure budget is spent.
    Degraded,
    /// The rollout is returning nodes to their previous mode.
    RollingBack,
}

/// State of one wave.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, schemars::JsonSchema)]
pub enum WaveState {
    /// Not started.
    Pending,
    /// Waits for approval of the current generation.
    AwaitingApproval,
    /// Nodes are switching.
    Progressing,
    /// All nodes healthy; waiting `soakSeconds`.
    Soaking,
    /// Done.
    Completed,
    /// Failed beyond the failure budget.
    Failed,
    /// Its nodes were returned to their previous mode.
    RolledBack,
}

/// Observed state of one wave, and the nodes the plan put in it.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct WaveStatus {
    /// Wave name.
    pub name: String,
    /// State of the wave.
    pub state: WaveState,
    /// Nodes in this wave (the plan), sorted.
    #[serde(default)]
    pub nodes: Vec<String>,
    /// Nodes of the wave running the mode.
    #[serde(default)]
    pub updated: i32,
    /// Updated nodes that passed the health gate.
    #[serde(default)]
    pub healthy: i32,
    /// Nodes of the wave whose switch failed.
    #[serde(default)]
    pub failed: i32,
    /// When the wave started.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started_at: Option<Time>,
    /// When the wave completed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub completed_at: Option<Time>,
}

/// Observed state of a ProxyPolicy, written by the operator.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ProxyPolicyStatus {
    /// Generation of the spec this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// Summary of the rollout.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<PolicyPhase>,
    /// Ready, Progressing, Degraded, Paused, Conflict and IPVSDeprecated.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
    /// Nodes governed by this policy (after conflicts are resolved).
    #[serde(default)]
    pub target_nodes: i32,
    /// Governed nodes whose active mode is the policy's (or fallback) mode.
    #[serde(default)]
    pub updated_nodes: i32,
    /// Updated nodes that passed the health gate.
    #[serde(default)]
    pub healthy_nodes: i32,
    /// Nodes whose last switch failed.
    #[serde(default)]
    pub failed_nodes: i32,
    /// Nodes that cannot run the mode and have no fallback.
    #[serde(default)]
    pub incompatible_nodes: i32,
    /// Governed nodes whose agent runs this generation's `spec.proxy` (answered the switch that
    /// gave it them). A settings change rolls out in waves like a mode change: nodes waiting for
    /// their wave, or whose settings switch failed its health gate, keep the settings they ran
    /// (`kubectl switchyard plan` names each node's settings generation).
    #[serde(default)]
    pub settings_updated_nodes: i32,
    /// Name of the wave being rolled out.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub current_wave: Option<String>,
    /// Every wave with its nodes and state: the plan, also while paused (dry run).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub waves: Vec<WaveStatus>,
    /// The mode advisor's summary over the governed nodes: how many nodes each recommendation
    /// got, and the largest figures (`kubectl switchyard advise NAME` shows every node's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub advice: Option<super::PoolAdvice>,
}
