//! The ProxyPolicy controller: watch caches, leader election, the reconcile loop and the
//! `/healthz` + `/metrics` server.
//!
//! `reconcile(policy)` = read the caches → [`planner::plan`] over every policy (conflicts need all of
//! them) → apply the policy's NodeProxy specs (server-side apply, forced, field manager
//! `switchyard-operator`) → apply its status → publish the transition Events → requeue after the
//! plan's timer. Any Node or NodeProxy change requeues every policy.

use std::{
    future::Future,
    net::SocketAddr,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use axum::{Router, extract::State, http::StatusCode, routing::get};
use futures::{Stream, StreamExt};
use k8s_openapi::api::core::v1::Node;
use kube::{
    Api, Client, Resource, ResourceExt,
    api::{DynamicObject, Patch, PatchParams},
    runtime::{
        Controller, WatchStreamExt,
        controller::{self, Action},
        events::{Event, EventType, Recorder, Reporter},
        reflector, watcher,
    },
};
use serde_json::json;
use switchyard_crds::{
    consts::{OPERATOR_FIELD_MANAGER, POLICY_LABEL},
    v1alpha1::{NodeProxy, NodeProxySpec, ProxyPolicy},
};
use tokio::sync::{broadcast, watch};

use crate::{
    Error, Result,
    context::{Context, Health, KnownSpecs, OwnWrites, Stores},
    decode::{self, Undecodable},
    fleet,
    lease::{self, LeaseConfig},
    metrics::{Metrics, ReasonLabel},
    planner::{self, NodeInput, NodeProxyInput, NodeWrite, PlanEvent, PolicyInput},
    retry::{self, ApiState, RetryBackoff},
};

/// Settings of [`run`].
#[derive(Clone, Debug)]
pub struct Config {
    /// Namespace of the leader-election Lease.
    pub namespace: String,
    /// Name of the Lease.
    pub lease_name: String,
    /// This replica's identity (Lease holder, Event reporter instance).
    pub identity: String,
    /// Lease duration.
    pub lease_duration: Duration,
    /// How long before expiry the leader renews.
    pub lease_grace: Duration,
    /// Address of `/healthz` and `/metrics`.
    pub healthz_bind_address: SocketAddr,
    /// `/healthz` fails when a leader has not reconciled successfully for this long.
    pub stale_after: Duration,
}

/// Runs the operator until `shutdown` resolves: serves `/healthz` and `/metrics`, keeps the watch
/// caches warm, and reconciles only while holding the Lease. API errors never end it: watches and
/// the Lease are retried with [`crate::retry::RetryBackoff`]; only a configuration error (the
/// health address cannot be bound) returns early.
pub async fn run(client: Client, config: Config, shutdown: impl Future<Output = ()>) -> Result<()> {
    let metrics = Arc::new(Metrics::new());
    let (trigger, _) = broadcast::channel::<()>(64);
    let api = Arc::new(ApiState::new(trigger.clone()));
    let health = Arc::new(Health::new(config.stale_after, api.clone()));
    let stores = start_caches(&client, &trigger, &api, &metrics);
    let server = serve(
        config.healthz_bind_address,
        health.clone(),
        metrics.clone(),
        stores.clone(),
    )
    .await?;

    let (mut leader, lease_task) = lease::spawn(
        client.clone(),
        LeaseConfig {
            namespace: config.namespace.clone(),
            name: config.lease_name.clone(),
            identity: config.identity.clone(),
            duration: config.lease_duration,
            grace: config.lease_grace,
        },
        api.clone(),
    );
    tracing::info!(identity = %config.identity, lease = %config.lease_name, namespace = %config.namespace, "waiting for leadership");

    tokio::pin!(shutdown);
    let outcome = loop {
        tokio::select! {
            () = &mut shutdown => break Ok(()),
            r = leader.wait_for(|l| *l) => if r.is_err() { break Err(Error::LeaseStopped) },
        }
        tracing::info!(identity = %config.identity, "became leader; reconciling");
        health.set_leader(true);
        metrics.leader.set(1);
        let term = leader_term(
            client.clone(),
            &config,
            stores.clone(),
            &trigger,
            metrics.clone(),
            health.clone(),
        );
        let lost = lost_leadership(&mut leader);
        let stop = tokio::select! {
            () = &mut shutdown => Some(Ok(())),
            r = lost => {
                tracing::warn!(identity = %config.identity, "lost leadership; stopped reconciling");
                r.err().map(Err)
            }
            () = term => {
                // Not expected: the Controller runs until dropped. Start a new term.
                tracing::error!("the controller stopped while leader; starting it again");
                tokio::time::sleep(Duration::from_secs(1)).await;
                None
            }
        };
        health.set_running(false);
        health.set_leader(false);
        metrics.leader.set(0);
        if let Some(outcome) = stop {
            break outcome;
        }
    };
    health.set_running(false);
    // Closing the channel makes the lease task release the Lease, so a standby takes over at once.
    drop(leader);
    if tokio::time::timeout(Duration::from_secs(5), lease_task)
        .await
        .is_err()
    {
        tracing::warn!("the Lease was not released in time");
    }
    server.abort();
    outcome
}

async fn lost_leadership(leader: &mut watch::Receiver<bool>) -> Result<()> {
    leader
        .wait_for(|l| !*l)
        .await
        .map(|_| ())
        .map_err(|_| Error::LeaseStopped)
}

/// Reflector tasks for Nodes (metadata only), NodeProxies and ProxyPolicies, retried with the short
/// backoff of [`retry::retrying`]; every change, and every completed (re-)list, sends a trigger
/// that requeues all policies.
fn start_caches(
    client: &Client,
    trigger: &broadcast::Sender<()>,
    api: &Arc<ApiState>,
    metrics: &Arc<Metrics>,
) -> Stores {
    let (nodes, nodes_writer) = reflector::store::<kube::core::PartialObjectMeta<Node>>();
    let (proxies, proxies_writer) = reflector::store::<NodeProxy>();
    let (policies, policies_writer) = reflector::store::<ProxyPolicy>();
    let cfg = watcher::Config::default;
    let node_stream = watcher(
        Api::<kube::core::PartialObjectMeta<Node>>::all(client.clone()),
        cfg(),
    )
    .modify(|n| n.managed_fields_mut().clear())
    .reflect(nodes_writer);
    spawn_cache(
        "Node",
        retry::retrying("Node", node_stream, api.clone()),
        trigger.clone(),
    );
    // NodeProxies and ProxyPolicies are watched untyped and decoded one by one: an object the
    // typed structs cannot read is left out (and reported) instead of failing the whole list.
    let bad_proxies = Undecodable::new("NodeProxy", metrics.clone());
    let np_stream = decode::typed::<NodeProxy, _>(untyped::<NodeProxy>(client), bad_proxies)
        .modify(|n| n.managed_fields_mut().clear())
        .reflect(proxies_writer);
    spawn_cache(
        "NodeProxy",
        retry::retrying("NodeProxy", np_stream, api.clone()),
        trigger.clone(),
    );
    let bad_policies = Undecodable::new("ProxyPolicy", metrics.clone());
    let pp_stream = decode::typed::<ProxyPolicy, _>(untyped::<ProxyPolicy>(client), bad_policies.clone())
        .modify(|n| n.managed_fields_mut().clear())
        .reflect(policies_writer);
    // Policy changes reach the Controller through its own watch; this cache feeds the planner, and
    // a deleted policy must reach the fleet pass (which releases its nodes).
    spawn_cache(
        "ProxyPolicy",
        retry::retrying("ProxyPolicy", pp_stream, api.clone()),
        trigger.clone(),
    );
    Stores {
        nodes,
        proxies,
        policies,
        bad_policies,
    }
}

/// An untyped watch of every `K`.
fn untyped<K: Resource<DynamicType = ()>>(
    client: &Client,
) -> impl Stream<Item = Result<watcher::Event<DynamicObject>, watcher::Error>> + Send + 'static {
    let ar = decode::api_resource::<K>();
    watcher(
        Api::<DynamicObject>::all_with(client.clone(), &ar),
        watcher::Config::default(),
    )
}

fn spawn_cache<K, S>(kind: &'static str, stream: S, trigger: broadcast::Sender<()>)
where
    S: Stream<Item = Result<watcher::Event<K>, watcher::Error>> + Send + 'static,
    K: Send,
{
    tokio::spawn(stream.for_each(move |r| {
        match r {
            Ok(watcher::Event::Init | watcher::Event::InitApply(_)) => {}
            Ok(watcher::Event::InitDone) => {
                tracing::info!(kind, "watch cache (re-)listed; reconciling every policy");
                let _ = trigger.send(());
            }
            Ok(watcher::Event::Apply(_) | watcher::Event::Delete(_)) => {
                let _ = trigger.send(());
            }
            Err(e) => tracing::debug!(kind, error = %e, "watch"),
        }
        futures::future::ready(())
    }));
}

async fn serve(
    addr: SocketAddr,
    health: Arc<Health>,
    metrics: Arc<Metrics>,
    stores: Stores,
) -> Result<tokio::task::JoinHandle<()>> {
    #[derive(Clone)]
    struct Http {
        health: Arc<Health>,
        metrics: Arc<Metrics>,
        stores: Stores,
    }
    async fn healthz(State(s): State<Http>) -> (StatusCode, String) {
        match s.health.check(s.stores.policies.len()) {
            Ok(m) => (StatusCode::OK, format!("ok: {m}\n")),
            Err(m) => (StatusCode::SERVICE_UNAVAILABLE, format!("unhealthy: {m}\n")),
        }
    }
    async fn metrics_text(State(s): State<Http>) -> ([(axum::http::HeaderName, &'static str); 1], String) {
        let down = s.health.api.unreachable();
        s.metrics.api_reachable.set(i64::from(down.is_none()));
        s.metrics
            .api_unreachable_since
            .set(down.map(|(since, _)| since).unwrap_or(0));
        (
            [(
                axum::http::header::CONTENT_TYPE,
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
            )],
            s.metrics.encode(),
        )
    }
    let app = Router::new()
        .route("/healthz", get(healthz))
        .route("/metrics", get(metrics_text))
        .with_state(Http {
            health,
            metrics,
            stores,
        });
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|source| Error::Io {
            context: format!("bind {addr}"),
            source,
        })?;
    tracing::info!(%addr, "serving /healthz and /metrics");
    Ok(tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            tracing::error!(error = %e, "http server stopped");
        }
    }))
}

/// One leadership term: the Controller (and the fleet pass) run until dropped (leadership lost or
/// shutdown).
async fn leader_term(
    client: Client,
    config: &Config,
    stores: Stores,
    trigger: &broadcast::Sender<()>,
    metrics: Arc<Metrics>,
    health: Arc<Health>,
) {
    wait_for_caches(&stores).await;
    let reporter = Reporter {
        controller: OPERATOR_FIELD_MANAGER.into(),
        instance: Some(config.identity.clone()),
    };
    let ctx = Arc::new(Context {
        recorder: Recorder::new(client.clone(), reporter),
        client: client.clone(),
        stores,
        metrics,
        health: health.clone(),
        own: Mutex::new(OwnWrites::default()),
        known: Mutex::new(KnownSpecs::default()),
    });
    health.set_running(true);
    let fleet = fleet::run(ctx.clone(), subscribe(trigger));
    let ar = decode::api_resource::<ProxyPolicy>();
    let controller = Controller::new_with(
        Api::<DynamicObject>::all_with(client, &ar),
        watcher::Config::default(),
        ar,
    )
    .trigger_backoff(RetryBackoff::new())
    .reconcile_all_on(subscribe(trigger))
    .with_config(controller::Config::default().debounce(Duration::from_millis(200)))
    .run(reconcile, error_policy, ctx)
    .for_each(|r| async move {
        if let Err(e) = r {
            tracing::debug!(error = %e, "reconcile");
        }
    });
    tokio::select! {
        () = controller => {}
        () = fleet => {}
    }
    health.set_running(false);
}

/// The trigger channel as a stream (a lagging receiver still triggers).
fn subscribe(trigger: &broadcast::Sender<()>) -> impl Stream<Item = ()> + Send + 'static {
    futures::stream::unfold(trigger.subscribe(), |mut rx| async move {
        match rx.recv().await {
            Ok(()) | Err(broadcast::error::RecvError::Lagged(_)) => Some(((), rx)),
            Err(broadcast::error::RecvError::Closed) => None,
        }
    })
}

/// Waits until every cache has listed once (however long the API takes: the caches retry).
async fn wait_for_caches(stores: &Stores) {
    let ready = async {
        let _ = stores.nodes.wait_until_ready().await;
        let _ = stores.proxies.wait_until_ready().await;
        let _ = stores.policies.wait_until_ready().await;
    };
    tokio::pin!(ready);
    loop {
        tokio::select! {
            () = &mut ready => return,
            () = tokio::time::sleep(Duration::from_secs(30)) => {
                tracing::warn!("leader, but the watch caches have not listed yet; waiting for the API");
            }
        }
    }
}

fn error_policy(policy: Arc<DynamicObject>, error: &Error, ctx: Arc<Context>) -> Action {
    tracing::warn!(policy = %policy.name_any(), error = %error, "reconcile failed");
    ctx.metrics
        .reconcile_errors
        .get_or_create(&crate::metrics::ErrorLabel {
            error: error.metric_label().into(),
        })
        .inc();
    Action::requeue(Duration::from_secs(5))
}

/// The planner's inputs from the caches, with this term's own writes laid over them.
/// How soon a reconcile whose policy cache lags the triggering version runs again.
const CACHE_BEHIND_REQUEUE: Duration = Duration::from_millis(100);

/// Whether the cache `cached` holds `policy` at its resource version (compared for equality only:
/// versions are opaque). A watch delivers in order, so the cache then also holds every policy
/// written before it.
fn cache_holds(cached: &[Arc<ProxyPolicy>], policy: &ProxyPolicy) -> bool {
    cached.iter().any(|p| {
        p.metadata.uid == policy.metadata.uid
            && p.metadata.resource_version == policy.metadata.resource_version
    })
}

pub(crate) fn snapshot(
    ctx: &Context,
    current: &ProxyPolicy,
) -> (Vec<PolicyInput>, Vec<NodeInput>, Vec<NodeProxyInput>) {
    let own = ctx.own.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let mut policies: Vec<PolicyInput> = ctx
        .stores
        .policies
        .state()
        .iter()
        .filter(|p| p.metadata.deletion_timestamp.is_none() && p.metadata.uid != current.metadata.uid)
        .map(|p| PolicyInput::from_policy(p))
        .collect();
    if current.metadata.deletion_timestamp.is_none() {
        policies.push(PolicyInput::from_policy(current));
    }
    for input in policies.iter_mut() {
        let object = if input.uid == current.uid().unwrap_or_default() {
            Some(Arc::new(current.clone()))
        } else {
            ctx.stores
                .policies
                .state()
                .into_iter()
                .find(|p| p.uid().as_deref() == Some(input.uid.as_str()))
        };
        if let Some(status) = object.and_then(|o| own.status(&o)) {
            input.status = Some(status);
        }
    }
    let nodes: Vec<NodeInput> = ctx
        .stores
        .nodes
        .state()
        .iter()
        .map(|n| NodeInput {
            name: n.name_any(),
            uid: n.uid().unwrap_or_default(),
            labels: n.labels().clone(),
        })
        .collect();
    let cached: Vec<Arc<NodeProxy>> = ctx.stores.proxies.state();
    let mut proxies: Vec<NodeProxyInput> = cached
        .iter()
        .map(|np| {
            let mut input = NodeProxyInput::from_node_proxy(np);
            if let Some(spec) = own.spec(&input.name, Some(np)) {
                input.spec = spec;
            }
            input
        })
        .collect();
    // A NodeProxy deleted under us (its agent re-creates it): plan with the spec it had, so the
    // operator neither re-creates it with less nor forgets the switch in progress.
    let known = ctx
        .known
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    for node in &nodes {
        if !proxies.iter().any(|p| p.name == node.name)
            && let Some(spec) = own.spec(&node.name, None).or_else(|| known.spec(&node.name))
        {
            proxies.push(NodeProxyInput {
                name: node.name.clone(),
                spec,
                status: None,
            });
        }
    }
    (policies, nodes, proxies)
}

/// Decodes the Controller's untyped object and reconciles it; an object that does not decode is
/// reported (a Warning Event on it, besides the cache's metric and log line) and waits for a change.
async fn reconcile(object: Arc<DynamicObject>, ctx: Arc<Context>) -> Result<Action> {
    match decode::decode::<ProxyPolicy>("ProxyPolicy", &object) {
        Ok(policy) => reconcile_policy(Arc::new(policy), ctx).await,
        Err(error) => {
            ctx.stores.bad_policies.failed(&object, &error);
            let ev = Event {
                type_: EventType::Warning,
                reason: "Undecodable".into(),
                note: Some(
                    format!("{error}; the operator leaves this policy out until it is fixed (kubectl edit proxypolicy {})", object.name_any())
                        .chars()
                        .take(1000)
                        .collect(),
                ),
                action: "Decode".into(),
                secondary: None,
            };
            let reference = object.object_ref(&decode::api_resource::<ProxyPolicy>());
            if let Err(e) = ctx.recorder.publish(&ev, &reference).await {
                tracing::warn!(error = %e, "could not publish event");
            }
            Ok(Action::await_change())
        }
    }
}

async fn reconcile_policy(policy: Arc<ProxyPolicy>, ctx: Arc<Context>) -> Result<Action> {
    let started = Instant::now();
    ctx.metrics.reconciles.inc();
    if !ctx.health.is_leader() {
        return Ok(Action::await_change());
    }
    // onRelease Revert: the finalizer, and a deleted policy's revert instead of its rollout.
    if let Some(action) = crate::revert::reconcile(&ctx, &policy).await? {
        return Ok(action);
    }
    let name = policy.name_any();
    // The Controller's watch and the planner's cache are two streams: plan only once the cache has
    // seen this very version, so every policy created before it (an overlapping one of higher
    // priority in the same apply) is in the plan too.
    if !cache_holds(&ctx.stores.policies.state(), &policy) {
        tracing::debug!(policy = %name, "policy cache behind the triggering version; requeued");
        return Ok(Action::requeue(CACHE_BEHIND_REQUEUE));
    }
    // A NodeProxy re-created with an empty spec gets its spec back before anything is planned.
    fleet::restore_recreated(&ctx).await;
    let (policies, nodes, proxies) = snapshot(&ctx, &policy);
    let plan_started = Instant::now();
    let plan = planner::plan(&policies, &nodes, &proxies, jiff::Timestamp::now());
    ctx.metrics
        .plan_duration
        .observe(plan_started.elapsed().as_secs_f64());
    let Some(pp) = plan.policy(&name) else {
        return Ok(Action::requeue(Duration::from_secs(60)));
    };
    // A name too long for a label (stored before the schema limited it) cannot be written on a
    // NodeProxy: only the status (its InvalidSpec condition says so) is written.
    if name.len() <= switchyard_crds::MAX_POLICY_NAME {
        for write in &pp.writes {
            apply_node_proxy(&ctx, &name, write).await?;
        }
    }
    // After the specs: a node asked for `external` is labelled so the other proxy can start there.
    crate::node_labels::apply(&ctx, &nodes, &proxies, &pp.writes).await?;
    let previous = policies
        .iter()
        .find(|p| p.name == name)
        .and_then(|p| p.status.clone());
    if previous.as_ref() != Some(&pp.status) {
        let api: Api<ProxyPolicy> = Api::all(ctx.client.clone());
        let body =
            json!({"apiVersion": "switchyard.dev/v1alpha1", "kind": "ProxyPolicy", "status": pp.status});
        let result = api
            .patch_status(
                &name,
                &PatchParams::apply(OPERATOR_FIELD_MANAGER).force(),
                &Patch::Apply(&body),
            )
            .await
            .map_err(Error::kube(format!("apply status of ProxyPolicy {name}")))?;
        ctx.own
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .status_written(&policy.uid().unwrap_or_default(), pp.status.clone(), &result);
    }
    for event in &pp.events {
        publish(&ctx, &policy, event).await;
    }
    let s = &pp.status;
    ctx.metrics.set_policy_nodes(
        &name,
        [
            s.target_nodes,
            s.updated_nodes,
            s.healthy_nodes,
            s.failed_nodes,
            s.incompatible_nodes,
        ],
    );
    ctx.health.reconciled();
    ctx.metrics
        .reconcile_duration
        .observe(started.elapsed().as_secs_f64());
    tracing::debug!(policy = %name, phase = ?s.phase, wave = ?s.current_wave, writes = pp.writes.len(), "reconciled");
    Ok(Action::requeue(pp.requeue_after))
}

/// Applies a policy's NodeProxy spec (with the policy label).
pub(crate) async fn apply_node_proxy(ctx: &Context, policy: &str, write: &NodeWrite) -> Result<NodeProxy> {
    let result = apply_spec(
        ctx,
        &write.node,
        &write.node_uid,
        json!({POLICY_LABEL: policy}),
        json!({}),
        &write.spec,
    )
    .await?;
    tracing::info!(policy, node = %write.node, desired = ?write.spec.desired_mode, token = ?write.spec.rollout_token, "applied NodeProxy spec");
    Ok(result)
}

/// Server-side applies the operator's part of a NodeProxy: `labels`, `annotations`, the owner
/// reference (its Node) and `spec`. Fields the operator set before and leaves out here are removed.
pub(crate) async fn apply_spec(
    ctx: &Context,
    node: &str,
    node_uid: &str,
    labels: serde_json::Value,
    annotations: serde_json::Value,
    spec: &NodeProxySpec,
) -> Result<NodeProxy> {
    let api: Api<NodeProxy> = Api::all(ctx.client.clone());
    let body = json!({
        "apiVersion": "switchyard.dev/v1alpha1",
        "kind": "NodeProxy",
        "metadata": {
            "name": node,
            "labels": labels,
            "annotations": annotations,
            "ownerReferences": [{"apiVersion": "v1", "kind": "Node", "name": node, "uid": node_uid}],
        },
        "spec": spec,
    });
    let result = api
        .patch(
            node,
            &PatchParams::apply(OPERATOR_FIELD_MANAGER).force(),
            &Patch::Apply(&body),
        )
        .await
        .map_err(Error::kube(format!("apply NodeProxy {node}")))?;
    ctx.metrics.node_writes.inc();
    ctx.own
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .spec_written(node, spec.clone(), &result);
    ctx.known
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .observe(&result);
    Ok(result)
}

pub(crate) async fn publish(ctx: &Context, policy: &ProxyPolicy, event: &PlanEvent) {
    let ev = Event {
        type_: if event.warning {
            EventType::Warning
        } else {
            EventType::Normal
        },
        reason: event.reason.as_str().into(),
        note: Some(event.note.chars().take(1000).collect()),
        action: event.action.chars().take(128).collect(),
        secondary: None,
    };
    ctx.metrics
        .events
        .get_or_create(&ReasonLabel {
            reason: event.reason.as_str().into(),
        })
        .inc();
    tracing::info!(policy = %policy.name_any(), reason = event.reason.as_str(), note = %event.note, "event");
    if let Err(e) = ctx.recorder.publish(&ev, &policy.object_ref(&())).await {
        tracing::warn!(error = %e, reason = event.reason.as_str(), "could not publish event");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(uid: &str, version: &str) -> Arc<ProxyPolicy> {
        let mut p = ProxyPolicy::new(
            "p",
            serde_json::from_value(json!({"nodeSelector": {}, "mode": "nftables"})).expect("spec"),
        );
        p.metadata.uid = Some(uid.into());
        p.metadata.resource_version = Some(version.into());
        Arc::new(p)
    }

    #[test]
    fn cache_holds_only_the_same_version() {
        let cached = [policy("a", "5"), policy("b", "7")];
        assert!(cache_holds(&cached, &policy("a", "5")));
        // Behind (or ahead of) the Controller's watch, or not there yet: not current.
        assert!(!cache_holds(&cached, &policy("a", "6")));
        assert!(!cache_holds(&cached, &policy("c", "7")));
        assert!(!cache_holds(&[], &policy("a", "5")));
    }
}
