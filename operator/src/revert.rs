//! `spec.onRelease: Revert` in the cluster: the finalizer, the revert rollout of a deleted
//! policy, and the revert of nodes that left a live policy's pool. The decisions are the pure
//! [`crate::planner::revert`] (which documents the outcome); this module applies them.
//!
//! - The finalizer [`REVERT_FINALIZER`] is added (server-side apply of that one list item) to a
//!   live policy that asks for Revert, and removed (a JSON patch that tests the item first) from
//!   one that no longer does; no other policy ever gets it.
//! - A deleted policy holding it is reconciled here instead of by the rollout: its revert plan's
//!   NodeProxy specs and status are applied and its Events published; once the plan is done or
//!   timed out the finalizer goes (Event `Reverted`, or Warning `RevertTimedOut` naming the
//!   nodes left as they are) and the fleet pass releases the nodes as it releases any.
//! - The fleet pass asks [`hold_back`] which ungoverned nodes are not to be released yet: those
//!   of a deleted policy still holding the finalizer, and departing nodes of a live Revert policy
//!   on their way to `revertMode` (whose specs it applies).

use std::collections::HashSet;

use kube::{
    Api, Resource, ResourceExt,
    api::{Patch, PatchParams},
    runtime::{
        controller::Action,
        events::{Event, EventType},
    },
};
use serde_json::json;
use switchyard_crds::{consts::OPERATOR_FIELD_MANAGER, v1alpha1::ProxyPolicy};

use crate::{
    Error, Result,
    context::Context,
    controller::{apply_node_proxy, publish as publish_plan_event, snapshot},
    planner::{
        NodeInput, NodeProxyInput, PolicyInput,
        revert::{self, REVERT_FINALIZER, RevertPlan},
    },
};

fn has_finalizer(policy: &ProxyPolicy) -> bool {
    policy.finalizers().iter().any(|f| f == REVERT_FINALIZER)
}

/// Handles what Revert needs of `policy` before (or instead of) its rollout reconcile: `Some`
/// when the policy is being deleted (the action to take), `None` to reconcile it as usual.
pub(crate) async fn reconcile(ctx: &Context, policy: &ProxyPolicy) -> Result<Option<Action>> {
    let wants = revert::revert_mode(&policy.spec).is_some();
    let holds = has_finalizer(policy);
    let Some(deleted_at) = policy.metadata.deletion_timestamp.as_ref().map(|t| t.0) else {
        if wants && !holds {
            add_finalizer(ctx, policy).await?;
        } else if !wants && holds {
            remove_finalizer(ctx, policy).await?;
        }
        return Ok(None);
    };
    if !holds {
        return Ok(Some(Action::await_change()));
    }
    if !wants {
        remove_finalizer(ctx, policy).await?;
        return Ok(Some(Action::await_change()));
    }
    let (live, nodes, proxies) = snapshot(ctx, policy);
    let mut input = PolicyInput::from_policy(policy);
    if let Some(status) = ctx
        .own
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .status(policy)
    {
        input.status = Some(status);
    }
    let now = jiff::Timestamp::now();
    let Some(r) = revert::plan_revert(&input, &live, &nodes, &proxies, deleted_at, now) else {
        return Ok(Some(Action::await_change()));
    };
    apply_revert(ctx, policy, &input, &r).await?;
    if r.done || r.timed_out {
        finish(ctx, policy, &r).await?;
        return Ok(Some(Action::await_change()));
    }
    Ok(Some(Action::requeue(r.plan.requeue_after)))
}

/// Applies a deleted policy's revert plan: NodeProxy specs, status, Events.
async fn apply_revert(
    ctx: &Context,
    policy: &ProxyPolicy,
    input: &PolicyInput,
    r: &RevertPlan,
) -> Result<()> {
    let name = policy.name_any();
    for write in &r.plan.writes {
        apply_node_proxy(ctx, &name, write).await?;
    }
    let started = !input.status.as_ref().is_some_and(|s| {
        s.conditions
            .iter()
            .any(|c| c.type_ == revert::REVERTING && c.observed_generation == Some(input.generation))
    });
    // The Event before the status that records the start (a cut-short pass would lose it).
    if started {
        let note = format!(
            "proxypolicy {name} was deleted with onRelease Revert: {} nodes return to {} through the rollout (waves, maxUnavailable, health gate) before it goes, at the latest at {}",
            r.remaining.len() + r.settled.len(),
            r.mode,
            r.deadline.map(|d| d.to_string()).unwrap_or_default(),
        );
        publish(ctx, policy, false, "Reverting", note).await;
    }
    if input.status.as_ref() != Some(&r.plan.status) {
        let body =
            json!({"apiVersion": "switchyard.dev/v1alpha1", "kind": "ProxyPolicy", "status": r.plan.status});
        let result = Api::<ProxyPolicy>::all(ctx.client.clone())
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
            .status_written(&policy.uid().unwrap_or_default(), r.plan.status.clone(), &result);
    }
    for event in &r.plan.events {
        publish_plan_event(ctx, policy, event).await;
    }
    ctx.health.reconciled();
    Ok(())
}

/// The revert is over: say so and let the policy go.
async fn finish(ctx: &Context, policy: &ProxyPolicy, r: &RevertPlan) -> Result<()> {
    let name = policy.name_any();
    if r.timed_out {
        let note = format!(
            "proxypolicy {name}: revertTimeoutSeconds passed with {} nodes not back on {}: {}; they keep the mode they run and are released; the policy goes",
            r.remaining.len(),
            r.mode,
            r.remaining.join(", "),
        );
        tracing::warn!(policy = %name, remaining = ?r.remaining, "revert timed out; removing the finalizer");
        publish(ctx, policy, true, "RevertTimedOut", note).await;
    } else {
        let note = format!(
            "proxypolicy {name}: every node is back on {} or left as it is ({}); the policy goes and its nodes are released",
            r.mode,
            r.settled.join(", "),
        );
        tracing::info!(policy = %name, "revert done; removing the finalizer");
        publish(ctx, policy, false, "Reverted", note).await;
    }
    remove_finalizer(ctx, policy).await
}

async fn add_finalizer(ctx: &Context, policy: &ProxyPolicy) -> Result<()> {
    let name = policy.name_any();
    let body = json!({"apiVersion": "switchyard.dev/v1alpha1", "kind": "ProxyPolicy",
        "metadata": {"name": name, "finalizers": [REVERT_FINALIZER]}});
    Api::<ProxyPolicy>::all(ctx.client.clone())
        .patch(
            &name,
            &PatchParams::apply(OPERATOR_FIELD_MANAGER).force(),
            &Patch::Apply(&body),
        )
        .await
        .map_err(Error::kube(format!("add finalizer to ProxyPolicy {name}")))?;
    tracing::info!(policy = %name, "added finalizer {REVERT_FINALIZER} (onRelease Revert)");
    Ok(())
}

/// Removes our finalizer; the others stay (a merge patch of the remaining list, guarded by the
/// resourceVersion it was read at: a concurrent change makes it fail and the next reconcile
/// retries).
async fn remove_finalizer(ctx: &Context, policy: &ProxyPolicy) -> Result<()> {
    let name = policy.name_any();
    if !has_finalizer(policy) {
        return Ok(());
    }
    let rest: Vec<&String> = policy
        .finalizers()
        .iter()
        .filter(|f| *f != REVERT_FINALIZER)
        .collect();
    let patch = json!({"metadata": {"resourceVersion": policy.resource_version(), "finalizers": rest}});
    Api::<ProxyPolicy>::all(ctx.client.clone())
        .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .map_err(Error::kube(format!("remove finalizer from ProxyPolicy {name}")))?;
    tracing::info!(policy = %name, "removed finalizer {REVERT_FINALIZER}");
    Ok(())
}

/// The ungoverned nodes the fleet pass must not release yet (see the module documentation);
/// applies the specs of departing nodes of live Revert policies.
pub(crate) async fn hold_back(
    ctx: &Context,
    live: &[PolicyInput],
    nodes: &[NodeInput],
    proxies: &[NodeProxyInput],
) -> HashSet<String> {
    let reverting: HashSet<String> = ctx
        .stores
        .policies
        .state()
        .iter()
        .filter(|p| p.metadata.deletion_timestamp.is_some() && has_finalizer(p))
        .filter_map(|p| p.uid())
        .collect();
    let mut hold: HashSet<String> = proxies
        .iter()
        .filter(|np| {
            np.spec
                .policy
                .as_ref()
                .and_then(|r| r.uid.as_ref())
                .is_some_and(|u| reverting.contains(u))
        })
        .map(|np| np.name.clone())
        .collect();
    let now = jiff::Timestamp::now();
    for p in live {
        let Some(r) = revert::plan_departing(p, live, nodes, proxies, now) else {
            continue;
        };
        for write in &r.plan.writes {
            let np = proxies.iter().find(|np| np.name == write.node);
            let first = np.is_none_or(|np| np.spec.desired_mode != write.spec.desired_mode);
            let cached = ctx
                .stores
                .proxies
                .get(&kube::runtime::reflector::ObjectRef::new(&write.node));
            // The Event before the write: a pass cut short after it would not publish it.
            if let Some(cached) = cached.filter(|_| first && write.spec.desired_mode == Some(r.mode)) {
                let note = format!(
                    "left the pool of proxypolicy {} (onRelease Revert): returns to {} under the policy's health gate, then is released",
                    p.name, r.mode
                );
                publish(ctx, cached.as_ref(), false, "Reverting", note).await;
            }
            if let Err(e) = apply_node_proxy(ctx, &p.name, write).await {
                tracing::warn!(node = %write.node, error = %e, "could not apply the revert of a departing node");
            }
        }
        hold.extend(r.remaining);
    }
    hold
}

async fn publish<K: Resource<DynamicType = ()>>(
    ctx: &Context,
    object: &K,
    warning: bool,
    reason: &str,
    note: String,
) {
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
    if let Err(e) = ctx.recorder.publish(&ev, &object.object_ref(&())).await {
        tracing::warn!(error = %e, reason, "could not publish event");
    }
}
