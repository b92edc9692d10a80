//! The Node label steering another service proxy's DaemonSet (`switchyard.dev/service-proxy`):
//! applies what [`crate::planner::labels`] decides after each reconcile's NodeProxy writes.

use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, Patch, PatchParams};
use serde_json::json;
use switchyard_crds::consts::{SERVICE_PROXY_EXTERNAL, SERVICE_PROXY_LABEL};

use crate::{
    Error, Result,
    context::Context,
    planner::{NodeInput, NodeProxyInput, NodeWrite, labels},
};

/// Labels (or unlabels) every Node whose NodeProxy, with this reconcile's `writes` laid over it,
/// asks for it; returns how many Nodes were patched. A JSON merge patch touches only this label.
pub(crate) async fn apply(
    ctx: &Context,
    nodes: &[NodeInput],
    proxies: &[NodeProxyInput],
    writes: &[NodeWrite],
) -> Result<usize> {
    let mut after: Vec<NodeProxyInput> = proxies.to_vec();
    for w in writes {
        match after.iter_mut().find(|p| p.name == w.node) {
            Some(p) => p.spec = w.spec.clone(),
            None => after.push(NodeProxyInput {
                name: w.node.clone(),
                spec: w.spec.clone(),
                status: None,
            }),
        }
    }
    let changes = labels::label_changes(nodes, &after);
    let api: Api<Node> = Api::all(ctx.client.clone());
    for change in &changes {
        let value = change.external.then_some(SERVICE_PROXY_EXTERNAL);
        let body = json!({"metadata": {"labels": {SERVICE_PROXY_LABEL: value}}});
        api.patch(&change.node, &PatchParams::default(), &Patch::Merge(&body))
            .await
            .map_err(Error::kube(format!("label Node {}", change.node)))?;
        tracing::info!(node = %change.node, label = SERVICE_PROXY_LABEL, external = change.external, "service-proxy label");
    }
    Ok(changes.len())
}
