//! Switchyard operator: turns ProxyPolicies into per-node desired state, wave by wave.
//!
//! # Protocol with the node agent
//! The operator and the agents talk only through `NodeProxy` objects (one per node, named after it,
//! owned by its Node):
//! - **The operator writes spec** with server-side apply (field manager `switchyard-operator`,
//!   forced) and never status: `desiredMode`, `proxy`, `healthGate`, `policy{name,uid,generation}`
//!   and `rolloutToken`, plus the label `switchyard.dev/policy`. It creates the NodeProxy when missing
//!   (owner reference: the Node). A node the rollout has not reached gets only `policy` and keeps
//!   the `proxy` it runs (no `desiredMode`: the agent keeps the mode it runs); incompatible nodes
//!   likewise. A node that runs the mode with other settings than the policy's keeps its whole spec
//!   until its wave admits it.
//! - **`rolloutToken`** is opaque to the agent and changes whenever the operator asks for a new switch
//!   attempt: `<policy>-g<generation>-<mode>` for a switch (with the policy's `proxy`: mode and
//!   settings in one switch), `<policy>-g<generation>-settings-<mode>` for a settings switch of a
//!   node that runs the mode (the agent takes the settings behind the health gate and answers in
//!   `lastSwitch`, putting the previous ones back when the gate fails),
//!   `<policy>-g<generation>-rollback-<mode>` for a policy rollback. A released node keeps its
//!   token across generations while it is healthy or switching (a generation that does not change
//!   `proxy` re-rolls nothing); a node whose attempt failed gets a new token only with a new policy
//!   generation.
//! - **The agent writes status**: `activeMode`, `phase` (Active/Preparing/CutOver/Verifying/Cleaning/
//!   RollingBack/Failed), `lastSwitch{from,to,result: Succeeded|RolledBack|Failed,reason,rolloutToken}`,
//!   the `Healthy` condition, and `capabilities.supportedModes`.
//! - The operator reads a node as **updated** when `activeMode == desiredMode` and `phase == Active`;
//!   **healthy** when also not `Healthy=False` (its last switch answered the token with `Succeeded`, or
//!   no switch was needed); **failed** when `lastSwitch.rolloutToken == rolloutToken` and the result is
//!   `RolledBack` or `Failed`; **switching** otherwise while desired ≠ active. Nodes without a status
//!   (no agent report) and nodes not serving count against `maxUnavailable`.
//! - **Released nodes**: a NodeProxy whose policy was deleted (or no longer selects it) stops naming
//!   it; the node keeps the mode it runs (see [`planner::lifecycle`]), with the annotation
//!   `switchyard.dev/released-from` and an Event `Released`. A NodeProxy re-created with an empty
//!   spec gets the operator's last spec back (Event `SpecRestored`).
//! - **Approval** of a wave: annotation `approve.switchyard.dev/<wave>: "<generation>"` on the
//!   ProxyPolicy, valid only for the current `metadata.generation`.
//!
//! # Input it cannot use
//! No stored object stops the operator. NodeProxies and ProxyPolicies are watched untyped and
//! decoded one by one ([`decode`]): an object the typed structs cannot read is left out of the
//! caches, logged with its name, counted in `switchyard_operator_decode_failures_total{kind}` and
//! `switchyard_operator_undecodable_objects{kind}`, and (a policy) gets a Warning Event
//! `Undecodable`; every other object is reconciled as usual. A policy that decodes but holds a
//! value the operator cannot use (stored before the schema rejected it: a count out of range, a
//! selector operator other than In/NotIn/Exists/DoesNotExist, an unknown time zone, a name over
//! 63 characters) gets `InvalidSpec=True` with each field and its fix, a Warning Event, and starts
//! nothing new ([`planner::validate`]); `switchyard.dev` annotations it does not act on (an
//! approval for a wave that does not exist, `switchyard.dev/rollback: now`) get
//! `UnknownAnnotations=True` and an Event. An empty wave that requires approval waits for it.
//!
//! # Layout
//! - [`planner`]: the pure wave planner (all decisions, table-tested), the `switchyard-planner` crate
//!   re-exported.
//! - [`controller`]: watch caches, leader election (Lease, kube-lease-manager), the kube-runtime
//!   Controller, `/healthz` and `/metrics`.
//! - [`lease`]: leader election that survives the API going away; [`retry`]: the short watch
//!   backoff and the API reachability shown on `/healthz` and `/metrics`.
//! - [`node_labels`]: the Node label `switchyard.dev/service-proxy=external` that lets another
//!   proxy's DaemonSet start on nodes handed to it (mode `external`).
//! - [`fleet`]: releasing nodes whose policy is gone ([`planner::lifecycle`] documents the outcome)
//!   and restoring the spec of re-created NodeProxies.
//! - [`revert`]: `onRelease: Revert` (the finalizer; a deleted policy's nodes, and nodes that left
//!   a live one's pool, return to `revertMode` through a rollout first: [`planner::revert`]).
//! - [`decode`]: typed views of untyped watches (one undecodable object never fails a list).
//! - [`context`], [`metrics`], [`error`].
//!
//! # Control-plane outages
//! The operator never exits on API errors. Watches retry after 250 ms doubling to 2 s and re-list at
//! once after "too old resource version" (410 Expired); each completed re-list and the API's
//! recovery trigger a reconcile of every policy, and reconciles requeue at the end of a soak. The
//! leader steps down when it cannot renew its Lease for a lease duration and re-acquires it as
//! soon as the API answers. `/healthz` stays 200 and says since when the API is unreachable;
//! `switchyard_operator_api_reachable` is 0 meanwhile.
#![cfg_attr(not(test), warn(clippy::too_many_lines))]

pub use switchyard_crds as crds;

pub mod context;
pub mod controller;
pub mod decode;
pub mod error;
pub mod fleet;
pub mod lease;
pub mod metrics;
pub mod node_labels;
pub use switchyard_planner as planner;
pub mod retry;
pub mod revert;

pub use error::{Error, Result};
