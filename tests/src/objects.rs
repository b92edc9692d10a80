//! Creating Services and EndpointSlices the way the API server and the endpointslice controller
//! would (no controller-manager runs in tests), applied with server-side apply so updates are
//! idempotent. EndpointSlices carry one address family each, as the controller makes them: a
//! dual-stack Service has an IPv4 slice `<service>-slice` and an IPv6 slice `<service>-slice6`.

use k8s_openapi::api::{core::v1::Service, discovery::v1::EndpointSlice};
use kube::{
    Api, Client,
    api::{DeleteParams, Patch, PatchParams},
};
use serde_json::{Value, json};

use crate::{Error, Family, Result};

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
    /// Topology hint: the zone this endpoint is meant for (`hints.forZones`).
    pub zone_hint: Option<String>,
}

impl Ep {
    /// A ready endpoint.
    pub fn ready(ip: impl ToString, node: &str) -> Self {
        Self {
            ip: ip.to_string(),
            node: node.into(),
            ready: true,
            serving: true,
            terminating: false,
            zone_hint: None,
        }
    }

    /// The same endpoint, hinted for `zone` (topology-aware routing).
    pub fn for_zone(mut self, zone: &str) -> Self {
        self.zone_hint = Some(zone.into());
        self
    }

    /// A terminating endpoint that still serves.
    pub fn terminating(ip: impl ToString, node: &str) -> Self {
        Self {
            ip: ip.to_string(),
            node: node.into(),
            ready: false,
            serving: true,
            terminating: true,
            zone_hint: None,
        }
    }
}

fn pp() -> PatchParams {
    PatchParams::apply("switchyard-e2e").force()
}

/// Applies a Service in `default` from a spec fragment (status is applied too when given).
pub async fn apply_service(
    client: &Client,
    name: &str,
    spec: Value,
    status: Option<Value>,
) -> Result<Service> {
    let api: Api<Service> = Api::namespaced(client.clone(), "default");
    let body = json!({"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "namespace": "default"}, "spec": spec});
    let svc = api.patch(name, &pp(), &Patch::Apply(&body)).await?;
    if let Some(status) = status {
        let body =
            json!({"apiVersion": "v1", "kind": "Service", "metadata": {"name": name}, "status": status});
        return Ok(api.patch_status(name, &pp(), &Patch::Apply(&body)).await?);
    }
    Ok(svc)
}

/// Name of `service`'s EndpointSlice of `family`.
pub fn slice_name(service: &str, family: Family) -> String {
    match family {
        Family::V4 => format!("{service}-slice"),
        Family::V6 => format!("{service}-slice6"),
    }
}

/// Family of the endpoints' addresses; an error for unparsable or mixed addresses. `None` for no
/// endpoints.
fn family_of(eps: &[Ep]) -> Result<Option<Family>> {
    let mut family: Option<Family> = None;
    for e in eps {
        let ip: std::net::IpAddr =
            e.ip.parse()
                .map_err(|_| Error::Prerequisite(format!("endpoint address {:?} is not an IP", e.ip)))?;
        match family {
            Some(f) if f != Family::of(ip) => {
                return Err(Error::Prerequisite(format!(
                    "an EndpointSlice holds one address family; {} is not {}",
                    e.ip,
                    f.k8s_name()
                )));
            }
            _ => family = Some(Family::of(ip)),
        }
    }
    Ok(family)
}

/// Applies the EndpointSlice `<service>-slice` with `ports` as `(name, port, protocol)`; its
/// `addressType` is the endpoints' family (IPv4 when there are none).
pub async fn apply_slice(
    client: &Client,
    service: &str,
    ports: &[(&str, u16, &str)],
    eps: &[Ep],
) -> Result<EndpointSlice> {
    let family = family_of(eps)?.unwrap_or(Family::V4);
    put_slice(client, service, &format!("{service}-slice"), family, ports, eps).await
}

/// Applies `service`'s EndpointSlice of `family` ([`slice_name`]): with [`apply_slice`] for IPv4,
/// the two slices of a dual-stack Service. Endpoints of the other family are an error.
pub async fn apply_slice_family(
    client: &Client,
    service: &str,
    family: Family,
    ports: &[(&str, u16, &str)],
    eps: &[Ep],
) -> Result<EndpointSlice> {
    if let Some(other) = family_of(eps)?.filter(|f| *f != family) {
        return Err(Error::Prerequisite(format!(
            "{} endpoints for the {} slice of {service}",
            other.k8s_name(),
            family.k8s_name()
        )));
    }
    put_slice(client, service, &slice_name(service, family), family, ports, eps).await
}

async fn put_slice(
    client: &Client,
    service: &str,
    name: &str,
    family: Family,
    ports: &[(&str, u16, &str)],
    eps: &[Ep],
) -> Result<EndpointSlice> {
    let api: Api<EndpointSlice> = Api::namespaced(client.clone(), "default");
    let body = json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": name, "namespace": "default", "labels": {"kubernetes.io/service-name": service}},
        "addressType": family.k8s_name(),
        "ports": ports.iter().map(|(n, p, proto)| json!({"name": n, "port": p, "protocol": proto})).collect::<Vec<_>>(),
        "endpoints": eps.iter().map(|e| {
            let mut ep = json!({
                "addresses": [e.ip], "nodeName": e.node,
                "conditions": {"ready": e.ready, "serving": e.serving, "terminating": e.terminating},
            });
            if let Some(zone) = &e.zone_hint {
                ep["hints"] = json!({"forZones": [{"name": zone}]});
            }
            ep
        }).collect::<Vec<_>>(),
    });
    Ok(api.patch(name, &pp(), &Patch::Apply(&body)).await?)
}

/// Deletes a Service and its slices (of both families, where they exist).
pub async fn delete_service(client: &Client, name: &str) -> Result<()> {
    let _ = Api::<Service>::namespaced(client.clone(), "default")
        .delete(name, &DeleteParams::default())
        .await?;
    let slices: Api<EndpointSlice> = Api::namespaced(client.clone(), "default");
    for family in Family::BOTH {
        let _ = slices
            .delete(&slice_name(name, family), &DeleteParams::default())
            .await;
    }
    Ok(())
}
