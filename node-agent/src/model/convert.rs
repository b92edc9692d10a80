//! Pure conversion of Kubernetes Services and EndpointSlices into model values, with kube-proxy's
//! filters: headless and ExternalName Services are skipped, the service-proxy-name label is honoured.
//! A dual-stack Service yields one [`ServicePort`] per family and port, each holding only addresses of
//! its family.

use std::{net::IpAddr, sync::Arc};

use k8s_openapi::api::{core::v1::Service, discovery::v1::EndpointSlice};
use switchyard_crds::consts::SERVICE_PROXY_NAME_LABEL;

use super::{Endpoint, IpFamily, IpNet, Protocol, ServiceName, ServicePort, ServicePortName};

/// Default ClientIP affinity timeout (3 hours), as in the Service API.
pub const DEFAULT_AFFINITY_SECONDS: u32 = 10800;

/// Whether this proxy handles `service`: a Service labelled with a service-proxy-name is handled
/// only by a proxy configured with that name; unlabelled Services only by unnamed proxies.
pub fn handled_by(
    labels: Option<&std::collections::BTreeMap<String, String>>,
    proxy_name: Option<&str>,
) -> bool {
    let label = labels
        .and_then(|l| l.get(SERVICE_PROXY_NAME_LABEL))
        .map(String::as_str);
    label == proxy_name
}

/// The service ports of `svc` this proxy programs (empty for skipped Services).
pub fn service_ports(svc: &Service, proxy_name: Option<&str>) -> Vec<ServicePort> {
    let (Some(namespace), Some(name), Some(spec)) = (&svc.metadata.namespace, &svc.metadata.name, &svc.spec)
    else {
        return Vec::new();
    };
    if !handled_by(svc.metadata.labels.as_ref(), proxy_name) || spec.type_.as_deref() == Some("ExternalName")
    {
        return Vec::new();
    }
    // `clusterIPs` lists one address per family (primary first); older objects only `clusterIP`.
    let cluster_ips: Vec<IpAddr> = match spec.cluster_ips.as_deref() {
        Some(ips) if !ips.is_empty() => ips.iter().filter_map(|ip| ip.parse().ok()).collect(),
        _ => spec.cluster_ip.iter().filter_map(|ip| ip.parse().ok()).collect(),
    };
    let parse_ips = |list: Option<&Vec<String>>| -> Vec<IpAddr> {
        list.into_iter()
            .flatten()
            .filter_map(|s| s.parse().ok())
            .collect()
    };
    let external_ips = parse_ips(spec.external_ips.as_ref());
    let is_lb = spec.type_.as_deref() == Some("LoadBalancer");
    let load_balancer_ips: Vec<IpAddr> = if is_lb {
        svc.status
            .as_ref()
            .and_then(|s| s.load_balancer.as_ref())
            .and_then(|lb| lb.ingress.as_ref())
            .into_iter()
            .flatten()
            .filter_map(|i| i.ip.as_deref()?.parse().ok())
            .collect()
    } else {
        Vec::new()
    };
    let source_ranges: Vec<IpNet> = spec
        .load_balancer_source_ranges
        .iter()
        .flatten()
        .filter_map(|r| r.trim().parse::<IpNet>().ok().map(|n| n.trunc()))
        .collect();
    let affinity = (spec.session_affinity.as_deref() == Some("ClientIP")).then(|| {
        spec.session_affinity_config
            .as_ref()
            .and_then(|c| c.client_ip.as_ref())
            .and_then(|c| c.timeout_seconds)
            .and_then(|t| u32::try_from(t).ok())
            .unwrap_or(DEFAULT_AFFINITY_SECONDS)
    });
    let service = ServiceName {
        namespace: namespace.as_str().into(),
        name: name.as_str().into(),
    };
    let mut ports = Vec::new();
    // "None" (headless) does not parse, so headless Services yield nothing.
    for cluster_ip in cluster_ips {
        let family = IpFamily::of(&cluster_ip);
        let of_family =
            |ips: &[IpAddr]| -> Vec<IpAddr> { ips.iter().copied().filter(|ip| family.holds(ip)).collect() };
        let ranges: Vec<IpNet> = source_ranges
            .iter()
            .copied()
            .filter(|n| IpFamily::of_net(n) == family)
            .collect();
        for p in spec.ports.iter().flatten() {
            let (Some(protocol), Ok(port)) =
                (Protocol::from_k8s(p.protocol.as_deref()), u16::try_from(p.port))
            else {
                continue;
            };
            ports.push(ServicePort {
                name: ServicePortName {
                    service: service.clone(),
                    port_name: p.name.as_deref().unwrap_or_default().into(),
                    protocol,
                },
                cluster_ip,
                port,
                node_port: p.node_port.and_then(|n| u16::try_from(n).ok()).filter(|n| *n > 0),
                external_ips: of_family(&external_ips),
                load_balancer_ips: of_family(&load_balancer_ips),
                load_balancer_source_ranges: ranges.clone(),
                affinity_timeout_seconds: affinity,
                external_policy_local: spec.external_traffic_policy.as_deref() == Some("Local"),
                internal_policy_local: spec.internal_traffic_policy.as_deref() == Some("Local"),
                health_check_node_port: spec
                    .health_check_node_port
                    .and_then(|n| u16::try_from(n).ok())
                    .filter(|n| *n > 0),
            });
        }
    }
    // Kept for the Service's lifetime: growth by push left room for four ports (768 bytes of a
    // one-port Service's entry, 7.5 MiB of the agent's heap at 10k Services).
    ports.shrink_to_fit();
    ports
}

/// The Service an EndpointSlice belongs to (label `kubernetes.io/service-name`).
pub fn slice_service(slice: &EndpointSlice) -> Option<ServiceName> {
    Some(ServiceName {
        namespace: slice.metadata.namespace.as_deref()?.into(),
        name: slice
            .metadata
            .labels
            .as_ref()?
            .get("kubernetes.io/service-name")?
            .as_str()
            .into(),
    })
}

/// The family of an EndpointSlice (`None` for FQDN slices, which proxies ignore).
pub fn slice_family(slice: &EndpointSlice) -> Option<IpFamily> {
    IpFamily::ALL
        .into_iter()
        .find(|f| f.k8s_name() == slice.address_type)
}

/// The endpoints of one EndpointSlice per `(port name, protocol)`.
pub type SliceEndpoints = Vec<((Arc<str>, Protocol), Vec<Endpoint>)>;

/// Endpoints of an IPv4 or IPv6 EndpointSlice per `(port name, protocol)`; addresses not of the
/// slice's family are dropped.
pub fn slice_endpoints(slice: &EndpointSlice) -> SliceEndpoints {
    let Some(family) = slice_family(slice) else {
        return Vec::new();
    };
    let ports = slice.ports.iter().flatten().filter_map(|p| {
        Some((
            (
                Arc::<str>::from(p.name.as_deref().unwrap_or_default()),
                Protocol::from_k8s(p.protocol.as_deref())?,
            ),
            u16::try_from(p.port?).ok()?,
        ))
    });
    ports
        .map(|(key, port)| {
            let mut eps: Vec<Endpoint> = slice
                .endpoints
                .iter()
                .flat_map(|e| {
                    let c = e.conditions.as_ref();
                    let ready = c.and_then(|c| c.ready).unwrap_or(true);
                    let serving = c.and_then(|c| c.serving).unwrap_or(ready);
                    let terminating = c.and_then(|c| c.terminating).unwrap_or(false);
                    let zone_hints: Vec<String> = e
                        .hints
                        .as_ref()
                        .and_then(|h| h.for_zones.as_ref())
                        .into_iter()
                        .flatten()
                        .map(|z| z.name.clone())
                        .collect();
                    e.addresses
                        .iter()
                        .filter_map(|a| a.parse::<IpAddr>().ok())
                        .filter(move |ip| family.holds(ip))
                        .map(move |ip| Endpoint {
                            ip,
                            port,
                            ready,
                            serving,
                            terminating,
                            node_name: e.node_name.as_deref().map(Into::into),
                            zone_hints: zone_hints.clone(),
                        })
                })
                .collect();
            eps.sort();
            eps.dedup_by(|a, b| a.ip == b.ip && a.port == b.port);
            (key, eps)
        })
        .collect()
}
