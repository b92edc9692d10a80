//! Creating Services and EndpointSlices the way the API server and the endpointslice controller
//! would (no controller-manager runs in tests), applied with server-side apply so updates are
//! idempotent.

use k8s_openapi::api::{core::v1::Service, discovery::v1::EndpointSlice};
use kube::{
    Api, Client,
    api::{DeleteParams, Patch, PatchParams},
};
use serde_json::{Value, json};

use crate::Result;

/// One endpoint of a slice.
#[derive(Debug, Clone)]
pub struct Ep {
    /// Address.
    pub ip: String,
    /// Node name.
    pub node: String,
    /// Ready.
    pub ready: bool,
    /// Serving.
    pub serving: bool,
    /// Terminating.
    pub terminating: bool,
}

impl Ep {
    /// A ready endpoint.
    pub fn ready(ip: impl ToString, node: &str) -> Self {
        Self { ip: ip.to_string(), node: node.into(), ready: true, serving: true, terminating: false }
    }

    /// A terminating endpoint that still serves.
    pub fn terminating(ip: impl ToString, node: &str) -> Self {
        Self { ip: ip.to_string(), node: node.into(), ready: false, serving: true, terminating: true }
    }
}

fn pp() -> PatchParams {
    PatchParams::apply("switchyard-e2e").force()
}

/// Applies a Service in `default` from a spec fragment (status is applied too when given).
pub async fn apply_service(client: &Client, name: &str, spec: Value, status: Option<Value>) -> Result<Service> {
    let api: Api<Service> = Api::namespaced(client.clone(), "default");
    let body = json!({"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "namespace": "default"}, "spec": spec});
    let svc = api.patch(name, &pp(), &Patch::Apply(&body)).await?;
    if let Some(status) = status {
        let body = json!({"apiVersion": "v1", "kind": "Service", "metadata": {"name": name}, "status": status});
        return Ok(api.patch_status(name, &pp(), &Patch::Apply(&body)).await?);
    }
    Ok(svc)
}

/// Applies the EndpointSlice `<service>-slice` with `ports` as `(name, port, protocol)`.
pub async fn apply_slice(client: &Client, service: &str, ports: &[(&str, u16, &str)], eps: &[Ep]) -> Result<EndpointSlice> {
    let api: Api<EndpointSlice> = Api::namespaced(client.clone(), "default");
    let name = format!("{service}-slice");
    let body = json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": name, "namespace": "default", "labels": {"kubernetes.io/service-name": service}},
        "addressType": "IPv4",
        "ports": ports.iter().map(|(n, p, proto)| json!({"name": n, "port": p, "protocol": proto})).collect::<Vec<_>>(),
        "endpoints": eps.iter().map(|e| json!({
            "addresses": [e.ip], "nodeName": e.node,
            "conditions": {"ready": e.ready, "serving": e.serving, "terminating": e.terminating},
        })).collect::<Vec<_>>(),
    });
    Ok(api.patch(&name, &pp(), &Patch::Apply(&body)).await?)
}

/// Deletes a Service and its slice.
pub async fn delete_service(client: &Client, name: &str) -> Result<()> {
    let _ = Api::<Service>::namespaced(client.clone(), "default").delete(name, &DeleteParams::default()).await?;
    let slices: Api<EndpointSlice> = Api::namespaced(client.clone(), "default");
    let _ = slices.delete(&format!("{name}-slice"), &DeleteParams::default()).await;
    Ok(())
}
