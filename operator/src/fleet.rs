//! The fleet pass of a leader term: what no single policy's reconcile sees.
//!
//! - **Released nodes**: NodeProxies whose policy was deleted, or whose policy no longer selects
//!   them, are released as [`crate::planner::lifecycle`] documents (they keep their current mode, the spec
//!   stops naming the policy, an annotation and an Event say so). A policy missing from the cache is
//!   confirmed gone with a GET before anything is released (the cache may lag a new policy).
//!   Nodes of a policy with `onRelease: Revert` return to its `revertMode` first
//!   ([`crate::revert`]).
//! - **Re-created NodeProxies**: a NodeProxy deleted and re-created (its agent registers it again
//!   with an empty spec) gets the last spec the operator wrote for its node back at once,
//!   including the health gate of a switch in progress ([`restore_recreated`], also run first in
//!   every reconcile).
//!
//! It runs on every cache change (debounced) and every 30 s.

use std::{collections::BTreeMap, sync::Arc, time::Duration};

use futures::{FutureExt, Stream, StreamExt};
use kube::{
    Api, Resource, ResourceExt,
    runtime::events::{Event, EventType},
};
use serde_json::json;
use switchyard_crds::{
    consts::POLICY_LABEL,
    v1alpha1::{NodeProxy, ProxyPolicy},
};

use crate::{
    context::Context,
    controller::apply_spec,
    planner::{
        NodeInput, NodeProxyInput, PolicyInput,
        lifecycle::{self, RELEASED_ANNOTATION, Release},
    },
};

/// Periodic pass even without changes.
const PERIOD: Duration = Duration::from_secs(30);
/// Changes arriving within this window are handled by one pass.
const DEBOUNCE: Duration = Duration::from_millis(300);

/// Runs passes until dropped.
pub async fn run(ctx: Arc<Context>, triggers: impl Stream<Item = ()> + Send + 'static) {
    let mut triggers = Box::pin(triggers);
    loop {
        pass(&ctx).await;
        tokio::select! {
            t = triggers.next() => if t.is_none() {
                futures::future::pending::<()>().await;
            },
            () = tokio::time::sleep(PERIOD) => {}
        }
        tokio::time::sleep(DEBOUNCE).await;
        while let Some(Some(())) = triggers.next().now_or_never() {}
    }
}

async fn pass(ctx: &Context) {
    restore_recreated(ctx).await;
    release_ungoverned(ctx).await;
}

fn node_uid(ctx: &Context, np: &NodeProxy) -> Option<String> {
    let name = np.name_any();
    ctx.stores
        .nodes
        .state()
        .iter()
        .find(|n| n.name_any() == name)
        .and_then(|n| n.uid())
        .or_else(|| {
            np.owner_references()
                .iter()
                .find(|o| o.kind == "Node")
                .map(|o| o.uid.clone())
        })
}

async fn publish(ctx: &Context, np: &NodeProxy, warning: bool, reason: &str, note: String) {
    let ev = Event {
        type_: if warning {
            EventType::Warning
        } else {
            EventType::Normal
        },
        reason: reason.into(),
        note: Some(note.chars().take(1000).collect()),
        action: reason.into(),
        secondary: None,
    };
    ctx.metrics
        .events
        .get_or_create(&crate::metrics::ReasonLabel {
            reason: reason.into(),
        })
        .inc();
    if let Err(e) = ctx.recorder.publish(&ev, &np.object_ref(&())).await {
        tracing::warn!(error = %e, reason, node = %np.name_any(), "could not publish event");
    }
}

/// Re-applies the last operator spec to every NodeProxy that was re-created with an empty spec
/// while its policy still exists.
pub async fn restore_recreated(ctx: &Context) {
    let policies = ctx.stores.policies.state();
    let candidates: Vec<_> = {
        let mut known = ctx
            .known
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        ctx.stores
            .proxies
            .state()
            .into_iter()
            .filter_map(|np| known.observe(&np).map(|k| (np, k)))
            .collect()
    };
    for (np, known) in candidates {
        let Some(policy) = known.spec.policy.as_ref() else {
            continue;
        };
        let alive = policies
            .iter()
            .any(|p| p.uid().as_deref() == policy.uid.as_deref() && p.metadata.deletion_timestamp.is_none());
        let (Some(uid), true) = (node_uid(ctx, &np), alive) else {
            continue;
        };
        let name = np.name_any();
        match apply_spec(
            ctx,
            &name,
            &uid,
            json!({POLICY_LABEL: policy.name}),
            json!({}),
            &known.spec,
        )
        .await
        {
            Ok(_) => {
                tracing::warn!(node = %name, policy = %policy.name, desired = ?known.spec.desired_mode, token = ?known.spec.rollout_token, "NodeProxy was re-created with an empty spec; restored its spec");
                let gate = known
                    .spec
                    .health_gate
                    .as_ref()
                    .and_then(|g| serde_json::to_string(g).ok())
                    .unwrap_or_else(|| "none".into());
                let note = format!(
                    "this NodeProxy was deleted and re-created with an empty spec; the operator restored proxypolicy {}'s spec: desiredMode {}, rolloutToken {}, healthGate {gate}",
                    policy.name,
                    known.spec.desired_mode.map(|m| m.as_str()).unwrap_or("unset"),
                    known.spec.rollout_token.as_deref().unwrap_or("none"),
                );
                publish(ctx, &np, true, "SpecRestored", note).await;
            }
            Err(e) => {
                tracing::warn!(node = %name, error = %e, "could not restore the spec of a re-created NodeProxy")
            }
        }
    }
}

fn inputs(ctx: &Context) -> (Vec<PolicyInput>, Vec<NodeInput>, Vec<NodeProxyInput>) {
    let policies = ctx
        .stores
        .policies
        .state()
        .iter()
        .filter(|p| p.metadata.deletion_timestamp.is_none())
        .map(|p| PolicyInput::from_policy(p))
        .collect();
    let nodes = ctx
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
    let own = ctx.own.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let proxies = ctx
        .stores
        .proxies
        .state()
        .iter()
        .map(|np| {
            let mut input = NodeProxyInput::from_node_proxy(np);
            if let Some(spec) = own.spec(&input.name, Some(np)) {
                input.spec = spec;
            }
            input
        })
        .collect();
    (policies, nodes, proxies)
}

/// Why `r`'s policy no longer governs the node; `None` when that cannot be told yet (the policy
/// may be new and not cached, or the API fails).
async fn why_released(ctx: &Context, r: &Release) -> Option<String> {
    let policy = r.policy.as_ref()?;
    if r.policy_exists {
        return Some("no longer selects this node (its nodeSelector)".into());
    }
    match Api::<ProxyPolicy>::all(ctx.client.clone())
        .get_opt(&policy.name)
        .await
    {
        Ok(Some(p)) if p.uid() == policy.uid && p.metadata.deletion_timestamp.is_none() => None,
        Ok(_) => Some("was deleted".into()),
        Err(e) => {
            ctx.health.api.failed("get ProxyPolicy", &e);
            None
        }
    }
}

async fn release_ungoverned(ctx: &Context) {
    let (policies, nodes, proxies) = inputs(ctx);
    let releases = lifecycle::releases(&policies, &nodes, &proxies);
    // onRelease Revert: those nodes return to revertMode first.
    let hold = crate::revert::hold_back(ctx, &policies, &nodes, &proxies).await;
    let cached: BTreeMap<String, Arc<NodeProxy>> = ctx
        .stores
        .proxies
        .state()
        .into_iter()
        .map(|np| (np.name_any(), np))
        .collect();
    let mut released: BTreeMap<String, Vec<String>> = BTreeMap::new();
    // One answer per policy and pass (a deleted policy may have released thousands of nodes).
    let mut verdicts: BTreeMap<(Option<String>, bool), Option<String>> = BTreeMap::new();
    for r in &releases {
        let Some(np) = cached.get(&r.node).filter(|_| !hold.contains(&r.node)) else {
            continue;
        };
        let annotation = match &r.policy {
            // Released before: settle the spec, keep the annotation.
            None => np
                .annotations()
                .get(RELEASED_ANNOTATION)
                .cloned()
                .unwrap_or_default(),
            Some(p) => {
                let key = (p.uid.clone(), r.policy_exists);
                let verdict = match verdicts.get(&key) {
                    Some(v) => v.clone(),
                    None => {
                        let v = why_released(ctx, r).await;
                        verdicts.insert(key, v.clone());
                        v
                    }
                };
                match verdict {
                    Some(why) => lifecycle::describe(r, &why),
                    None => continue,
                }
            }
        };
        // The Event goes first: a pass cut short after the write (leadership lost) would never
        // publish it, as the next pass finds the node released. A failed write publishes again.
        if r.policy.is_some() {
            publish(ctx, np, true, "Released", annotation.clone()).await;
        }
        let annotations = json!({RELEASED_ANNOTATION: annotation});
        match apply_spec(ctx, &r.node, &r.node_uid, json!({}), annotations, &r.spec).await {
            Ok(_) => {
                ctx.known
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .forget(&r.node);
                if let Some(p) = &r.policy {
                    tracing::warn!(node = %r.node, policy = %p.name, keeps = ?r.keeps, switching = r.switching, "released a NodeProxy no policy governs: {annotation}");
                    released.entry(p.name.clone()).or_default().push(format!(
                        "{}={}",
                        r.node,
                        r.keeps.map(|m| m.as_str()).unwrap_or("unknown")
                    ));
                }
            }
            Err(e) => tracing::warn!(node = %r.node, error = %e, "could not release a NodeProxy"),
        }
    }
    for (policy, nodes) in released {
        tracing::warn!(policy, nodes = %nodes.join(", "), "proxypolicy no longer governs these nodes; they keep their modes (node=mode)");
    }
    let ungoverned = cached
        .values()
        .filter(|np| np.annotations().contains_key(RELEASED_ANNOTATION))
        .count();
    ctx.metrics
        .ungoverned_nodes
        .set(i64::try_from(ungoverned).unwrap_or(i64::MAX));
    let existing = policies.iter().map(|p| p.name.clone()).collect();
    ctx.metrics.retain_policies(&existing);
}
