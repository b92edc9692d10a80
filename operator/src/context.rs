//! What every reconcile shares: the client, the watch caches, the Event recorder, metrics, the
//! health state served on `/healthz`, and what this leader term wrote (to read its own writes
//! before the watch caches catch up).

use std::{
    collections::HashMap,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicI64, Ordering},
    },
    time::{Duration, Instant},
};

use k8s_openapi::api::core::v1::Node;
use kube::{
    Client,
    core::PartialObjectMeta,
    runtime::{events::Recorder, reflector::Store},
};
use switchyard_crds::v1alpha1::{NodeProxy, NodeProxySpec, ProxyPolicy, ProxyPolicyStatus};

use crate::{metrics::Metrics, retry::ApiState};

/// How long an own write is preferred over a cache that does not show it yet.
const OWN_WRITE_TTL: Duration = Duration::from_secs(30);

fn unix_millis() -> i64 {
    jiff::Timestamp::now().as_millisecond()
}

/// Liveness of the reconciler, for `/healthz`.
pub struct Health {
    leader: AtomicBool,
    running: AtomicBool,
    last_ok_ms: AtomicI64,
    stale_after: Duration,
    /// Whether the API answers.
    pub api: Arc<ApiState>,
}

impl Health {
    /// A standby replica's state; unhealthy when a leader has not reconciled for `stale_after`
    /// (not counting time the API was unreachable: restarting would not bring it back).
    pub fn new(stale_after: Duration, api: Arc<ApiState>) -> Self {
        Self {
            leader: AtomicBool::new(false),
            running: AtomicBool::new(false),
            last_ok_ms: AtomicI64::new(unix_millis()),
            stale_after,
            api,
        }
    }

    /// Records a leadership change.
    pub fn set_leader(&self, leader: bool) {
        self.leader.store(leader, Ordering::SeqCst);
        if leader {
            self.last_ok_ms.store(unix_millis(), Ordering::SeqCst);
        }
    }

    /// Whether this replica is the leader.
    pub fn is_leader(&self) -> bool {
        self.leader.load(Ordering::SeqCst)
    }

    /// Records whether the controller loop runs.
    pub fn set_running(&self, running: bool) {
        self.running.store(running, Ordering::SeqCst);
    }

    /// Records a successful reconcile.
    pub fn reconciled(&self) {
        self.last_ok_ms.store(unix_millis(), Ordering::SeqCst);
    }

    /// `Ok(description)` when healthy, `Err(why)` when not. `policies` is the number of
    /// ProxyPolicies (with none, a leader has nothing to reconcile and is healthy while its loop runs).
    pub fn check(&self, policies: usize) -> Result<String, String> {
        if let Some((since, error)) = self.api.unreachable() {
            // Still 200: the process is fine and retries; a restart would not help.
            let secs = jiff::Timestamp::now().as_second() - since;
            let role = if self.is_leader() { "leader" } else { "not leading" };
            return Ok(format!(
                "degraded: the Kubernetes API is unreachable since {} ({secs}s; {role}; retrying): {error}",
                jiff::Timestamp::from_second(since)
                    .map(|t| t.to_string())
                    .unwrap_or_default()
            ));
        }
        if !self.is_leader() {
            return Ok("standby: waiting for the leader Lease".into());
        }
        if !self.running.load(Ordering::SeqCst) {
            return Err("leader, but the controller loop is not running".into());
        }
        let age = Duration::from_millis(
            u64::try_from(unix_millis() - self.last_ok_ms.load(Ordering::SeqCst)).unwrap_or(0),
        );
        if policies > 0 && age > self.stale_after {
            return Err(format!(
                "leader, but no reconcile succeeded for {}s (limit {}s)",
                age.as_secs(),
                self.stale_after.as_secs()
            ));
        }
        Ok(format!(
            "leader: last successful reconcile {}s ago",
            age.as_secs()
        ))
    }
}

/// Watch caches shared by every leader term (kept warm on standbys too).
#[derive(Clone)]
pub struct Stores {
    /// Nodes (metadata only).
    pub nodes: Store<PartialObjectMeta<Node>>,
    /// NodeProxies.
    pub proxies: Store<NodeProxy>,
    /// ProxyPolicies.
    pub policies: Store<ProxyPolicy>,
    /// ProxyPolicies left out of `policies` because they cannot be decoded.
    pub bad_policies: crate::decode::Undecodable,
}

struct Written<T> {
    value: T,
    resource_version: Option<u64>,
    at: Instant,
}

/// Writes of this leader term, used while the caches lag behind them.
#[derive(Default)]
pub struct OwnWrites {
    specs: HashMap<String, Written<NodeProxySpec>>,
    statuses: HashMap<String, Written<ProxyPolicyStatus>>,
}

fn rv(meta: &kube::api::ObjectMeta) -> Option<u64> {
    meta.resource_version.as_deref().and_then(|v| v.parse().ok())
}

/// Whether an own write is newer than the cached object (by resourceVersion, which the apiserver
/// backs with etcd revisions; when it cannot be compared, for a short time after writing).
fn newer<T>(w: &Written<T>, cached: Option<u64>) -> bool {
    match (w.resource_version, cached) {
        (Some(mine), Some(theirs)) => mine > theirs,
        _ => w.at.elapsed() < OWN_WRITE_TTL,
    }
}

impl OwnWrites {
    /// Records an applied NodeProxy spec.
    pub fn spec_written(&mut self, node: &str, spec: NodeProxySpec, result: &NodeProxy) {
        self.specs.insert(
            node.into(),
            Written {
                value: spec,
                resource_version: rv(&result.metadata),
                at: Instant::now(),
            },
        );
    }

    /// Records an applied ProxyPolicy status.
    pub fn status_written(&mut self, uid: &str, status: ProxyPolicyStatus, result: &ProxyPolicy) {
        self.statuses.insert(
            uid.into(),
            Written {
                value: status,
                resource_version: rv(&result.metadata),
                at: Instant::now(),
            },
        );
    }

    /// The spec to plan with for `np` (or for a NodeProxy the cache does not have yet).
    pub fn spec(&self, node: &str, cached: Option<&NodeProxy>) -> Option<NodeProxySpec> {
        let w = self.specs.get(node)?;
        newer(w, cached.and_then(|c| rv(&c.metadata))).then(|| w.value.clone())
    }

    /// The status to plan with for `policy`.
    pub fn status(&self, policy: &ProxyPolicy) -> Option<ProxyPolicyStatus> {
        let w = self.statuses.get(policy.metadata.uid.as_deref()?)?;
        newer(w, rv(&policy.metadata)).then(|| w.value.clone())
    }
}

/// The last operator-written spec seen for a node, with the NodeProxy's UID: a NodeProxy deleted
/// and re-created (by its agent, with an empty spec) gets that spec back.
#[derive(Clone, Debug)]
pub struct KnownSpec {
    /// UID of the NodeProxy that carried it.
    pub uid: String,
    /// Its resourceVersion.
    pub resource_version: Option<u64>,
    /// The spec.
    pub spec: NodeProxySpec,
}

/// [`KnownSpec`] per node, for one leader term.
#[derive(Default)]
pub struct KnownSpecs(HashMap<String, KnownSpec>);

impl KnownSpecs {
    /// Learns from a NodeProxy (cached or just written) that carries an operator spec; returns the
    /// spec to restore when `np` is a re-created NodeProxy with an empty spec.
    pub fn observe(&mut self, np: &NodeProxy) -> Option<KnownSpec> {
        let name = np.metadata.name.clone()?;
        let uid = np.metadata.uid.clone()?;
        let version = rv(&np.metadata);
        if np.spec == NodeProxySpec::default() {
            return self.0.get(&name).filter(|k| k.uid != uid).cloned();
        }
        let newer = self.0.get(&name).is_none_or(|k| {
            k.uid != uid || matches!((version, k.resource_version), (Some(a), Some(b)) if a > b)
        });
        if newer {
            self.0.insert(
                name,
                KnownSpec {
                    uid,
                    resource_version: version,
                    spec: np.spec.clone(),
                },
            );
        }
        None
    }

    /// The last spec known for `node`.
    pub fn spec(&self, node: &str) -> Option<NodeProxySpec> {
        self.0.get(node).map(|k| k.spec.clone())
    }

    /// Forgets a node (its spec was released or the node is gone).
    pub fn forget(&mut self, node: &str) {
        self.0.remove(node);
    }
}

/// Shared by the reconciles of one leader term.
pub struct Context {
    /// API client (the operator's identity).
    pub client: Client,
    /// Event recorder (events.k8s.io/v1).
    pub recorder: Recorder,
    /// Watch caches.
    pub stores: Stores,
    /// Metrics.
    pub metrics: Arc<Metrics>,
    /// Health for `/healthz`.
    pub health: Arc<Health>,
    /// This term's own writes.
    pub own: Mutex<OwnWrites>,
    /// Last operator spec per node, to restore re-created NodeProxies.
    pub known: Mutex<KnownSpecs>,
}
