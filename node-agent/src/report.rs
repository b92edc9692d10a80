//! Reports the agent's view to the API: registers the node's NodeProxy (owned by the Node) and
//! writes its status with server-side apply under the agent's field manager. Never writes spec.

use k8s_openapi::api::core::v1::Node;
use kube::{
    Api, Client, Resource, ResourceExt,
    api::{Patch, PatchParams, PostParams},
};
use serde_json::json;
use switchyard_crds::{
    consts::AGENT_FIELD_MANAGER,
    v1alpha1::{NodeProxy, NodeProxySpec, NodeProxyStatus},
};

use crate::{Error, Result};

fn kube_err(action: impl Into<String>) -> impl FnOnce(kube::Error) -> Error {
    let action = action.into();
    move |source| Error::Kube { action, source }
}

/// Creates the node's NodeProxy (empty spec, owner reference to the Node) unless it exists.
pub async fn ensure_registered(client: &Client, node_name: &str) -> Result<()> {
    let proxies: Api<NodeProxy> = Api::all(client.clone());
    if proxies
        .get_opt(node_name)
        .await
        .map_err(kube_err(format!("get nodeproxy {node_name}")))?
        .is_some()
    {
        return Ok(());
    }
    let node = Api::<Node>::all(client.clone())
        .get(node_name)
        .await
        .map_err(kube_err(format!("get node {node_name}")))?;
    let mut proxy = NodeProxy::new(node_name, NodeProxySpec::default());
    proxy.metadata.owner_references = node.controller_owner_ref(&()).map(|mut r| {
        // The Node owns it for garbage collection only; it does not control it.
        r.controller = None;
        r.block_owner_deletion = None;
        vec![r]
    });
    match proxies
        .create(
            &PostParams {
                field_manager: Some(AGENT_FIELD_MANAGER.into()),
                ..Default::default()
            },
            &proxy,
        )
        .await
    {
        Ok(created) => {
            tracing::info!(node = node_name, uid = ?created.uid(), "registered NodeProxy");
            Ok(())
        }
        Err(kube::Error::Api(status)) if status.code == 409 => Ok(()),
        Err(e) => Err(kube_err(format!("create nodeproxy {node_name}"))(e)),
    }
}

/// Applies `status` as the agent's whole view of the NodeProxy status.
pub async fn apply_status(client: &Client, node_name: &str, status: &NodeProxyStatus) -> Result<()> {
    let proxies: Api<NodeProxy> = Api::all(client.clone());
    let patch = json!({
        "apiVersion": NodeProxy::api_version(&()),
        "kind": NodeProxy::kind(&()),
        "status": status,
    });
    proxies
        .patch_status(
            node_name,
            &PatchParams::apply(AGENT_FIELD_MANAGER).force(),
            &Patch::Apply(&patch),
        )
        .await
        .map_err(kube_err(format!("apply nodeproxy {node_name} status")))?;
    Ok(())
}

/// Publishes a Warning Event about the node's NodeProxy (reason in CamelCase, a note saying what
/// happened and what the agent does).
pub async fn publish_warning(client: &Client, node_name: &str, reason: &str, note: &str) -> Result<()> {
    use kube::runtime::events::{Event, EventType, Recorder, Reporter};
    let reporter = Reporter {
        controller: AGENT_FIELD_MANAGER.into(),
        instance: Some(node_name.to_owned()),
    };
    let reference = k8s_openapi::api::core::v1::ObjectReference {
        api_version: Some(NodeProxy::api_version(&()).into_owned()),
        kind: Some(NodeProxy::kind(&()).into_owned()),
        name: Some(node_name.to_owned()),
        ..Default::default()
    };
    Recorder::new(client.clone(), reporter)
        .publish(
            &Event {
                type_: EventType::Warning,
                reason: reason.into(),
                note: Some(note.chars().take(1024).collect()),
                action: "Start".into(),
                secondary: None,
            },
            &reference,
        )
        .await
        .map_err(kube_err(format!("publish event for nodeproxy {node_name}")))
}
