//! The wave planner: a pure function from policies, Nodes, NodeProxies and the clock to what the
//! operator should write. No API calls, no clock reads, no randomness: the same inputs give the same
//! [`Plan`], which is what lets a new leader continue a rollout where the old one stopped.
//!
//! [`plan`] decides, per [`PolicyInput`]:
//! - **membership**: nodes matching the policy's `nodeSelector`; a node matched by several
//!   policies belongs to the highest `priority`, ties to the alphabetically first name; the losers get
//!   a `Conflict` condition naming the nodes and the winner;
//! - **compatibility**: the mode, or the `fallback` mode, must be in the agent's
//!   `capabilities.supportedModes`; otherwise the node is `Incompatible` and left alone;
//! - **waves** ([`waves`]): stable assignment, explicit selectors first, then hash order;
//! - **gates**, for the first wave that is not complete: `paused` (dry run: the plan is still shown),
//!   a manual rollback (`switchyard.dev/rollback: "<generation>"`, see [`ROLLBACK_ANNOTATION`]),
//!   failure budget (`maxFailures`, then `failurePolicy` pause or rollback), approval
//!   (`approve.switchyard.dev/<wave>: "<generation>"`), maintenance window ([`window`]), and
//!   `maxUnavailable` (switching, unknown and unhealthy nodes all count); a healthy wave then soaks
//!   `soakSeconds` before the next wave starts;
//! - **writes**: the NodeProxy spec of every governed node, and the ProxyPolicy status with its
//!   conditions; **events** for transitions against the previous status.
//!
//! Each policy is planned by a pipeline of stages, each a function with a named result that is
//! table-tested alone (module `policy`): classify (per-node state) → waves (assignment, pinned by
//! the previous status) → budget (`maxFailures`, rollback, `maxUnavailable`) → gates (the wave walk:
//! hold, admissions, soak) → writes → status (phase, headline, counts) → conditions → events.
//!
//! The crate is pure: no API client calls, no server, no async runtime, no IO (the maintenance
//! window's time zone comes from jiff's bundled database). The operator (`operator::planner`) and
//! `kubectl switchyard plan` both run it.
//!
//! Progress is derived from NodeProxy state (spec written by the operator, status by the agents),
//! never from memory: a released node is one whose spec asks for the policy's mode with a rollout
//! token of this policy; a wave is complete when all its nodes are healthy (or the previous status
//! recorded it complete for this generation and none of its nodes still needs a switch).
#![cfg_attr(not(test), warn(clippy::too_many_lines))]

pub mod advisor;
pub mod labels;
pub mod lifecycle;
mod policy;
pub mod preflight;
pub mod revert;
pub mod selector;
pub mod validate;
pub mod waves;
pub mod window;

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::type_complexity)]
mod tests;

use std::{
    collections::{BTreeMap, HashMap},
    time::Duration,
};

use jiff::Timestamp;
use switchyard_crds::v1alpha1::{
    NodeProxy, NodeProxySpec, NodeProxyStatus, ProxyMode, ProxyPolicy, ProxyPolicySpec, ProxyPolicyStatus,
};

use selector::Selector;

/// Errors of the planner: a maintenance window it cannot evaluate (the plan then holds the wave
/// and says why).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// `spec.rollout.window.timeZone` is not in the tz database.
    #[error("window.timeZone {zone:?} is not a known IANA time zone")]
    TimeZone {
        /// The zone as written.
        zone: String,
    },
    /// `spec.rollout.window.start` or `.end` is not `HH:MM`.
    #[error("window.{field} {value:?} is not HH:MM")]
    Time {
        /// `start` or `end`.
        field: &'static str,
        /// The value as written.
        value: String,
    },
}

/// Result alias of the planner.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Annotation prefix approving a wave: `approve.switchyard.dev/<wave>: "<generation>"`.
pub const APPROVE_PREFIX: &str = "approve.switchyard.dev/";

/// Annotation requesting a manual rollback: `switchyard.dev/rollback: "<generation>"`. For that
/// generation of the policy the operator returns every node this rollout switched to its previous
/// mode (as `failurePolicy: rollback` does after a failure) and starts nothing new; the policy then
/// reports phase Paused. A new spec (a new generation) makes the annotation stale, so the rollout
/// resumes only when someone changes the spec.
pub const ROLLBACK_ANNOTATION: &str = "switchyard.dev/rollback";

/// Condition types the operator sets on a ProxyPolicy.
pub mod conditions {
    /// Every governed node runs the mode and is healthy.
    pub const READY: &str = "Ready";
    /// Waves are being rolled out (or rolled back).
    pub const PROGRESSING: &str = "Progressing";
    /// The failure budget is spent.
    pub const DEGRADED: &str = "Degraded";
    /// Nothing new starts: spec pause, failure pause, approval or window.
    pub const PAUSED: &str = "Paused";
    /// Another policy with higher precedence governs some of the selected nodes.
    pub const CONFLICT: &str = "Conflict";
    /// The policy makes nodes run IPVS, deprecated upstream since Kubernetes v1.35.
    pub const IPVS_DEPRECATED: &str = "IPVSDeprecated";
    /// The spec holds a value the operator cannot use (stored before the schema rejected it):
    /// nothing new switches until it is fixed.
    pub const INVALID_SPEC: &str = "InvalidSpec";
    /// The policy carries `switchyard.dev` annotations the operator does not act on.
    pub const UNKNOWN_ANNOTATIONS: &str = "UnknownAnnotations";
}

/// A ProxyPolicy as the planner needs it.
#[derive(Clone, Debug)]
pub struct PolicyInput {
    /// Policy name.
    pub name: String,
    /// Policy UID (seeds the rollout order).
    pub uid: String,
    /// `metadata.generation`.
    pub generation: i64,
    /// The spec.
    pub spec: ProxyPolicySpec,
    /// Approval annotations: wave name → annotation value.
    pub approvals: BTreeMap<String, String>,
    /// Value of the [`ROLLBACK_ANNOTATION`] annotation, if any (honoured only when it names
    /// `generation`).
    pub rollback: Option<String>,
    /// Other annotation keys in the `switchyard.dev` domain (none is understood: they are reported).
    pub annotations: Vec<String>,
    /// The status last written (previous plan): wave timestamps, pinned wave membership, and the
    /// baseline for transition events.
    pub status: Option<ProxyPolicyStatus>,
}

impl PolicyInput {
    /// Extracts the planner's view of a ProxyPolicy object.
    pub fn from_policy(policy: &ProxyPolicy) -> Self {
        let approvals = policy
            .metadata
            .annotations
            .iter()
            .flatten()
            .filter_map(|(k, v)| {
                k.strip_prefix(APPROVE_PREFIX)
                    .map(|wave| (wave.to_owned(), v.clone()))
            })
            .collect();
        Self {
            name: policy.metadata.name.clone().unwrap_or_default(),
            uid: policy.metadata.uid.clone().unwrap_or_default(),
            generation: policy.metadata.generation.unwrap_or(0),
            spec: policy.spec.clone(),
            approvals,
            rollback: policy
                .metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get(ROLLBACK_ANNOTATION))
                .cloned(),
            annotations: policy
                .metadata
                .annotations
                .iter()
                .flatten()
                .map(|(k, _)| k)
                .filter(|k| {
                    is_switchyard_key(k) && !k.starts_with(APPROVE_PREFIX) && *k != ROLLBACK_ANNOTATION
                })
                .cloned()
                .collect(),
            status: policy.status.clone(),
        }
    }
}

/// Whether an annotation key is in the `switchyard.dev` domain (`switchyard.dev/…` or
/// `<sub>.switchyard.dev/…`).
fn is_switchyard_key(key: &str) -> bool {
    key.split_once('/')
        .is_some_and(|(prefix, _)| prefix == "switchyard.dev" || prefix.ends_with(".switchyard.dev"))
}

/// A Node as the planner needs it.
#[derive(Clone, Debug, Default)]
pub struct NodeInput {
    /// Node name.
    pub name: String,
    /// Node UID (seeds the rollout order; owner reference of its NodeProxy).
    pub uid: String,
    /// Node labels.
    pub labels: BTreeMap<String, String>,
}

/// A NodeProxy as the planner needs it.
#[derive(Clone, Debug, Default)]
pub struct NodeProxyInput {
    /// NodeProxy (and node) name.
    pub name: String,
    /// Spec as last written by the operator.
    pub spec: NodeProxySpec,
    /// Status as reported by the node's agent.
    pub status: Option<NodeProxyStatus>,
}

impl NodeProxyInput {
    /// Extracts the planner's view of a NodeProxy object.
    pub fn from_node_proxy(np: &NodeProxy) -> Self {
        Self {
            name: np.metadata.name.clone().unwrap_or_default(),
            spec: np.spec.clone(),
            status: np.status.clone(),
        }
    }
}

/// Rollout state of one governed node.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum NodeState {
    /// Not yet asked to switch (and not running the target mode).
    Pending,
    /// Asked to switch; the agent has not reported success or failure yet.
    Switching,
    /// Runs the target mode, phase Active, health gate passed (or no switch was needed).
    Healthy,
    /// Runs the target mode but is not serving healthily (phase not Active or Healthy=False).
    Unhealthy,
    /// Its switch for the current generation was rolled back or failed.
    Failed,
    /// Cannot run the mode and has no usable fallback; left alone.
    Incompatible,
    /// No agent report yet (no NodeProxy status).
    Unknown,
    /// Being returned to its previous mode by a policy rollback.
    RollingBack,
    /// Returned to its previous mode by a policy rollback.
    RolledBack,
}

/// The planner's decision for one governed node.
#[derive(Clone, Debug, PartialEq)]
pub struct NodePlan {
    /// Node name.
    pub name: String,
    /// Wave it belongs to (none when incompatible).
    pub wave: Option<String>,
    /// Its state.
    pub state: NodeState,
    /// Mode it should end up in (`None`: incompatible).
    pub target: Option<ProxyMode>,
    /// Why it failed or is incompatible, for people.
    pub reason: Option<String>,
    /// The policy generation whose `spec.proxy` the node runs (`None`: not this policy's, or
    /// still being switched to).
    pub settings_generation: Option<i64>,
    /// Migration preflight findings of a node still to switch ([`preflight`]); one that
    /// [`holds`](preflight::Finding::holds) keeps it from its wave.
    pub preflight: Vec<preflight::Finding>,
}

/// A NodeProxy spec the operator must apply (server-side apply, field manager
/// `switchyard-operator`; creating the NodeProxy, owned by its Node, when missing).
#[derive(Clone, Debug, PartialEq)]
pub struct NodeWrite {
    /// Node (and NodeProxy) name.
    pub node: String,
    /// Node UID, for the owner reference.
    pub node_uid: String,
    /// The full spec the operator owns.
    pub spec: NodeProxySpec,
}

/// Reason of an Event the operator publishes on a ProxyPolicy.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum EventReason {
    /// A wave started switching nodes.
    WaveStarted,
    /// Every node of a wave is healthy.
    WaveCompleted,
    /// A node's switch was rolled back or failed.
    NodeSwitchFailed,
    /// The policy started returning nodes to their previous mode.
    RolledBack,
    /// The rollout stopped starting switches (spec pause, approval, failure budget).
    Paused,
    /// Another policy governs some of the selected nodes.
    Conflict,
    /// The spec cannot be used (see the InvalidSpec condition).
    InvalidSpec,
    /// Annotations the operator does not understand (see the UnknownAnnotations condition).
    UnknownAnnotations,
}

impl EventReason {
    /// The PascalCase reason string.
    pub fn as_str(self) -> &'static str {
        match self {
            EventReason::WaveStarted => "WaveStarted",
            EventReason::WaveCompleted => "WaveCompleted",
            EventReason::NodeSwitchFailed => "NodeSwitchFailed",
            EventReason::RolledBack => "RolledBack",
            EventReason::Paused => "Paused",
            EventReason::Conflict => "Conflict",
            EventReason::InvalidSpec => "InvalidSpec",
            EventReason::UnknownAnnotations => "UnknownAnnotations",
        }
    }
}

/// An Event to publish on the policy (only planned on transitions).
#[derive(Clone, Debug, PartialEq)]
pub struct PlanEvent {
    /// Warning (true) or Normal.
    pub warning: bool,
    /// Reason.
    pub reason: EventReason,
    /// What was done, e.g. `StartWave/canary/g2`. Distinct per wave and generation, so the Event
    /// recorder (which folds repeats of the same reason and action into one series) keeps them apart.
    pub action: String,
    /// Message for people.
    pub note: String,
}

/// Everything the operator does for one policy.
#[derive(Clone, Debug)]
pub struct PolicyPlan {
    /// Policy name.
    pub name: String,
    /// Status to write.
    pub status: ProxyPolicyStatus,
    /// NodeProxy specs to apply (only those that differ from the current spec).
    pub writes: Vec<NodeWrite>,
    /// Events to publish.
    pub events: Vec<PlanEvent>,
    /// When to look again even if nothing changes (soak end, window, progress).
    pub requeue_after: Duration,
    /// Per-node decisions, sorted by name.
    pub nodes: Vec<NodePlan>,
}

/// The plan for every policy, sorted by name.
#[derive(Clone, Debug, Default)]
pub struct Plan {
    /// One entry per policy.
    pub policies: Vec<PolicyPlan>,
}

impl Plan {
    /// The plan of the policy `name`.
    pub fn policy(&self, name: &str) -> Option<&PolicyPlan> {
        self.policies.iter().find(|p| p.name == name)
    }
}

/// A node another policy wins: (node name, winner's name, winner's priority).
pub(crate) type Lost<'a> = (&'a str, &'a str, i32);

/// Plans every policy. See the module documentation for the rules.
pub fn plan(
    policies: &[PolicyInput],
    nodes: &[NodeInput],
    proxies: &[NodeProxyInput],
    now: Timestamp,
) -> Plan {
    let selectors: Vec<Selector> = policies
        .iter()
        .map(|p| Selector::new(&p.spec.node_selector))
        .collect();
    // Precedence: higher priority first, then name.
    let mut rank: Vec<usize> = (0..policies.len()).collect();
    rank.sort_by(|&a, &b| {
        policies[b]
            .spec
            .priority
            .cmp(&policies[a].spec.priority)
            .then_with(|| policies[a].name.cmp(&policies[b].name))
    });
    let by_name: HashMap<&str, &NodeProxyInput> = proxies.iter().map(|np| (np.name.as_str(), np)).collect();
    let mut governed: Vec<Vec<&NodeInput>> = vec![Vec::new(); policies.len()];
    let mut lost: Vec<Vec<Lost<'_>>> = vec![Vec::new(); policies.len()];
    for node in nodes {
        let mut winner: Option<usize> = None;
        for &p in &rank {
            // A name too long for the NodeProxy label cannot govern a node (InvalidSpec says so):
            // it must not take nodes from the policies that can.
            if !selectors[p].matches(&node.labels)
                || policies[p].name.len() > switchyard_crds::MAX_POLICY_NAME
            {
                continue;
            }
            match winner {
                None => {
                    winner = Some(p);
                    governed[p].push(node);
                }
                Some(w) => lost[p].push((
                    node.name.as_str(),
                    policies[w].name.as_str(),
                    policies[w].spec.priority,
                )),
            }
        }
    }
    for l in lost.iter_mut() {
        l.sort();
    }
    let mut out: Vec<PolicyPlan> = policies
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let mut plan = policy::plan_policy(p, &governed[i], &by_name, &lost[i], now);
            // The mode advisor's summary of the agents' recommendations for the pool.
            let advice = governed[i].iter().map(|n| {
                let status = by_name.get(n.name.as_str()).and_then(|np| np.status.as_ref());
                status.and_then(|s| s.advice.as_ref())
            });
            plan.status.advice = Some(advisor::pool_advice(advice));
            plan
        })
        .collect();
    out.sort_by(|a, b| a.name.cmp(&b.name));
    Plan { policies: out }
}
