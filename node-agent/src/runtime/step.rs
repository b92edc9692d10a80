//! The switch step after a sync: resolves the health gate's probe targets (during a switch) and
//! runs one driver step on a blocking thread (its effects program the kernel).

use std::sync::Arc;

use k8s_openapi::api::core::v1::Service;
use kube::{Api, Client};
use switchyard_crds::v1alpha1::{ProbeTarget, ProxyMode};

use super::{intake::Wish, on_blocking_thread};
use crate::{
    Result, conntrack::UnnatedServiceFlows, driver::Driver, model::DualSnapshot, model::ServiceName,
};

/// Runs one step of the switch; the driver comes back with whether another step should follow
/// at once. `named`: a service-proxy-name filter is in force.
pub(super) async fn step(
    client: &Client,
    driver: Driver,
    supported: &[ProxyMode],
    wish: &Wish,
    snapshot: &Arc<DualSnapshot>,
    named: bool,
) -> Result<(Driver, bool)> {
    let targets = if driver.switching() {
        probe_targets(client, &wish.probes, implicit_target(snapshot, named)).await
    } else {
        Vec::new()
    };
    let (supported, desired, gate, snap) = (
        supported.to_vec(),
        wish.desired.clone(),
        wish.gate.clone(),
        Arc::clone(snapshot),
    );
    on_blocking_thread("switch", driver, move |d| {
        let swaps = d.entry_point_swaps();
        let stepped = d.step(desired.as_ref(), &supported, &gate, &snap, &targets);
        if d.entry_point_swaps() != swaps {
            forget_unnated_service_flows(&snap);
        }
        stepped
    })
    .await
}

/// Deletes the conntrack entries to service addresses that no rules NATed, after the serving
/// entry points changed hands (see [`UnnatedServiceFlows`]). Best effort: such entries also
/// expire by themselves, so a failure is logged, not retried.
fn forget_unnated_service_flows(snapshot: &DualSnapshot) {
    for s in snapshot.families() {
        let unnated = UnnatedServiceFlows::of(s);
        if unnated.is_empty() {
            continue;
        }
        match crate::sys::conntrack::delete_stale(s.family, &|flow| unnated.matches(flow)) {
            Ok(0) => {}
            Ok(deleted) => {
                tracing::info!(family = %s.family, deleted, "deleted conntrack entries to Services that no rules NATed")
            }
            Err(e) => {
                tracing::warn!(family = %s.family, error = %e, "deleting conntrack entries to Services that no rules NATed failed")
            }
        }
    }
}

/// A label selector's query string (`matchLabels` and `matchExpressions`).
fn selector_query(sel: &k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector) -> String {
    let exprs = sel.match_expressions.iter().flatten().map(|e| {
        let values = e.values.as_deref().unwrap_or_default().join(",");
        match e.operator.as_str() {
            "In" => format!("{} in ({values})", e.key),
            "NotIn" => format!("{} notin ({values})", e.key),
            "Exists" => e.key.clone(),
            _ => format!("!{}", e.key), // DoesNotExist: the schema admits no other operator
        }
    });
    sel.match_labels
        .iter()
        .flatten()
        .map(|(k, v)| format!("{k}={v}"))
        .chain(exprs)
        .collect::<Vec<_>>()
        .join(",")
}

/// The target every gate probes, `default/kubernetes`, unless a service-proxy-name filter leaves
/// it to another proxy (this one does not serve it, so it could never pass through it; a switch
/// to settings with `serviceProxyName` would always fail).
fn implicit_target(snapshot: &DualSnapshot, named: bool) -> Option<ServiceName> {
    let kubernetes = ServiceName {
        namespace: "default".into(),
        name: "kubernetes".into(),
    };
    let served = || {
        snapshot
            .families()
            .into_iter()
            .flat_map(|s| s.services.values())
            .any(|p| p.name.service == kubernetes)
    };
    (!named || served()).then_some(kubernetes)
}

/// Resolves the gate's probe targets to Service names: `implicit` (`default/kubernetes`), named
/// ones, and label-selected ones (listed from the API).
async fn probe_targets(
    client: &Client,
    probes: &[ProbeTarget],
    implicit: Option<ServiceName>,
) -> Vec<ServiceName> {
    let mut out: Vec<ServiceName> = implicit.into_iter().collect();
    for p in probes {
        if let Some(name) = &p.name {
            out.push(ServiceName {
                namespace: p.namespace.as_str().into(),
                name: name.as_str().into(),
            });
        } else if let Some(sel) = &p.selector {
            let api: Api<Service> = Api::namespaced(client.clone(), &p.namespace);
            let params = kube::api::ListParams::default().labels(&selector_query(sel));
            if let Ok(list) = api.list(&params).await {
                out.extend(list.items.into_iter().filter_map(|s| {
                    Some(ServiceName {
                        namespace: p.namespace.as_str().into(),
                        name: s.metadata.name?.into(),
                    })
                }));
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_implicit_target_is_left_out_only_when_a_proxy_name_filters_it() {
        let empty = DualSnapshot::default();
        let kubernetes = implicit_target(&empty, false).map(|t| t.to_string());
        assert_eq!(kubernetes.as_deref(), Some("default/kubernetes"));
        assert_eq!(implicit_target(&empty, true), None);
    }

    #[test]
    fn selectors_become_label_queries() {
        let sel = serde_json::from_value(serde_json::json!({
            "matchLabels": {"app": "web"},
            "matchExpressions": [
                {"key": "tier", "operator": "In", "values": ["a", "b"]},
                {"key": "canary", "operator": "NotIn", "values": ["yes"]},
                {"key": "probe", "operator": "Exists"},
                {"key": "skip", "operator": "DoesNotExist"},
            ],
        }))
        .expect("selector");
        assert_eq!(
            selector_query(&sel),
            "app=web,tier in (a,b),canary notin (yes),probe,!skip"
        );
    }
}
