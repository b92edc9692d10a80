//! The apiserver's protobuf encoding of Services and EndpointSlices (what client-go's informers in
//! kube-proxy read), decoded without IO: objects, watch-stream frames and the failure statuses in
//! either (list responses: [`super::list_stream`], as they arrive). Decoded objects become the `k8s-openapi` types the rest of the model reads,
//! carrying only the fields a proxy reads ([`service`], [`endpoint_slice`]); managed fields,
//! owner references and the like are never built.
//!
//! At 10k Services the apiserver served both start-up lists in 165 ms as protobuf (4.7 + 4.0 MB)
//! against 470 ms as JSON (8.3 + 8.4 MB), medians of 5 fetches beside an `api-bench --rows 10k`
//! run; decoding the same lists took 18 + 21 ms from protobuf against 65 + 60 ms from JSON into
//! `k8s-openapi` (best of 5).
//!
//! Wire facts (apimachinery's protobuf serializer): a whole object or list is the magic
//! `k8s\0` followed by a `runtime.Unknown` whose `raw` holds the object; a watch stream is a
//! sequence of frames, each a 4-byte big-endian length and a `metav1.WatchEvent` without magic or
//! envelope, whose `object.raw` holds the object with both.

use std::collections::BTreeMap;

use k8s_openapi::{
    api::{
        core::v1 as core,
        discovery::v1::{self as discovery, EndpointSlice},
    },
    apimachinery::pkg::apis::meta::v1::ObjectMeta,
};
use k8s_pb::{
    api::{core::v1 as pb_core, discovery::v1 as pb_discovery},
    apimachinery::pkg::{apis::meta::v1 as pb_meta, runtime::Unknown},
};
use prost::Message;

use crate::{Error, Result};

/// The prefix of every whole object the apiserver encodes as protobuf.
pub const MAGIC: &[u8] = b"k8s\0";

/// The media type that asks for protobuf, for lists and single objects.
pub const PROTOBUF: &str = "application/vnd.kubernetes.protobuf";

/// The media type that asks for a protobuf watch stream.
pub const PROTOBUF_WATCH: &str = "application/vnd.kubernetes.protobuf;stream=watch";

/// Watch frames longer than this are refused (a corrupt length would otherwise make the reader
/// buffer without bound). etcd's default request limit keeps a stored object under 1.5 MiB; 64
/// MiB leaves room for any real one.
pub const MAX_FRAME: usize = 64 << 20;

/// An error decoding `what`.
fn decode_error(what: &'static str, detail: impl std::fmt::Display) -> Error {
    Error::Decode {
        what,
        detail: detail.to_string(),
    }
}

/// The object inside a whole-object encoding: the bytes after the magic, unwrapped from their
/// `runtime.Unknown`.
pub fn unwrap_object(what: &'static str, bytes: &[u8]) -> Result<Vec<u8>> {
    let Some(envelope) = bytes.strip_prefix(MAGIC) else {
        return Err(decode_error(
            what,
            format!(
                "not protobuf (starts with {:?})",
                String::from_utf8_lossy(&bytes[..bytes.len().min(16)])
            ),
        ));
    };
    let unknown = Unknown::decode(envelope).map_err(|e| decode_error(what, e))?;
    if let Some(encoding) = unknown.content_encoding.as_deref().filter(|e| !e.is_empty()) {
        return Err(decode_error(
            what,
            format!("content encoding {encoding} is not supported"),
        ));
    }
    Ok(unknown.raw.unwrap_or_default())
}

/// A failure status from the apiserver (an error response's body or a watch `ERROR` event).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    /// The HTTP-style code (410: the resource version is too old; relist).
    pub code: u16,
    /// The machine-readable reason (`Expired`, `Gone`, `Forbidden`, …).
    pub reason: String,
    /// The message.
    pub message: String,
}

/// Decodes a `metav1.Status` in its whole-object encoding; None when `bytes` are not one (an
/// error from a proxy in between, plain text or JSON).
pub fn failure(bytes: &[u8]) -> Option<Failure> {
    let raw = unwrap_object("status", bytes).ok()?;
    let status = pb_meta::Status::decode(raw.as_slice()).ok()?;
    Some(Failure {
        code: status
            .code
            .and_then(|c| u16::try_from(c).ok())
            .unwrap_or_default(),
        reason: status.reason.unwrap_or_default(),
        message: status.message.unwrap_or_default(),
    })
}

/// One event of a watch stream.
#[derive(Debug, PartialEq)]
pub enum WatchEvent<T> {
    /// Added or modified.
    Apply(T),
    /// Deleted (the object's last state).
    Delete(T),
    /// Nothing changed up to this resource version.
    Bookmark(String),
    /// The watch failed; it ends after this.
    Error(Failure),
}

/// Splits a watch stream into frames; feed it the bytes as they arrive.
#[derive(Debug, Default)]
pub struct Frames {
    buffer: Vec<u8>,
}

impl Frames {
    /// Appends received bytes.
    pub fn push(&mut self, bytes: &[u8]) {
        self.buffer.extend_from_slice(bytes);
    }

    /// The next whole frame, if one has arrived.
    pub fn next_frame(&mut self) -> Result<Option<Vec<u8>>> {
        let Some(header) = self.buffer.first_chunk::<4>() else {
            return Ok(None);
        };
        let length = u32::from_be_bytes(*header) as usize;
        if length > MAX_FRAME {
            return Err(decode_error(
                "watch frame",
                format!("length {length} is over the limit of {MAX_FRAME}"),
            ));
        }
        if self.buffer.len() < 4 + length {
            return Ok(None);
        }
        let frame = self.buffer[4..4 + length].to_vec();
        self.buffer.drain(..4 + length);
        Ok(Some(frame))
    }

    /// Bytes of an incomplete frame held back (non-zero at the end of a stream: it was cut).
    pub fn pending(&self) -> usize {
        self.buffer.len()
    }
}

/// A kind the agent lists and watches in protobuf.
pub trait WireKind: k8s_openapi::Metadata<Ty = ObjectMeta> + Sized {
    /// Its name in errors.
    const WHAT: &'static str;
    /// The collection's path (all namespaces).
    const PATH: &'static str;
    /// Decodes one object (already unwrapped from its envelope, or a list's item).
    fn decode_object(raw: &[u8]) -> Result<Self>;
    /// The object's resource version.
    fn resource_version(&self) -> Option<&str> {
        self.metadata().resource_version.as_deref()
    }
}

impl WireKind for core::Service {
    const WHAT: &'static str = "service";
    const PATH: &'static str = "/api/v1/services";
    fn decode_object(raw: &[u8]) -> Result<Self> {
        ProxyService::decode(raw)
            .map(service)
            .map_err(|e| decode_error(Self::WHAT, e))
    }
}

impl WireKind for EndpointSlice {
    const WHAT: &'static str = "endpointslice";
    const PATH: &'static str = "/apis/discovery.k8s.io/v1/endpointslices";
    fn decode_object(raw: &[u8]) -> Result<Self> {
        ProxyEndpointSlice::decode(raw)
            .map(endpoint_slice)
            .map_err(|e| decode_error(Self::WHAT, e))
    }
}

/// Decodes one watch-stream frame.
pub fn watch_event<K: WireKind>(frame: &[u8]) -> Result<WatchEvent<K>> {
    let event = pb_meta::WatchEvent::decode(frame).map_err(|e| decode_error("watch event", e))?;
    let object = event.object.and_then(|o| o.raw).unwrap_or_default();
    let kind = event.r#type.unwrap_or_default();
    if kind == "ERROR" {
        let failure = failure(&object).ok_or_else(|| decode_error("watch error event", "no status"))?;
        return Ok(WatchEvent::Error(failure));
    }
    let object = K::decode_object(&unwrap_object(K::WHAT, &object)?)?;
    match kind.as_str() {
        "ADDED" | "MODIFIED" => Ok(WatchEvent::Apply(object)),
        "DELETED" => Ok(WatchEvent::Delete(object)),
        "BOOKMARK" => Ok(WatchEvent::Bookmark(
            object.resource_version().unwrap_or_default().to_owned(),
        )),
        other => Err(decode_error("watch event", format!("unknown type {other:?}"))),
    }
}

/// `Some(v)` unless `v` is empty (a repeated field's absence in protobuf).
fn non_empty<T>(v: Vec<T>) -> Option<Vec<T>> {
    (!v.is_empty()).then_some(v)
}

/// The fields of `metav1.ObjectMeta` a proxy reads, with `ObjectMeta`'s tags: prost skips the
/// others without building them — managed fields above all, often most of an object's bytes
/// (at 10k Services the decoding of both start-up lists spent a fifth of its samples in them).
#[derive(Clone, PartialEq, prost::Message)]
struct ProxyMeta {
    #[prost(string, optional, tag = "1")]
    name: Option<String>,
    #[prost(string, optional, tag = "3")]
    namespace: Option<String>,
    #[prost(string, optional, tag = "5")]
    uid: Option<String>,
    #[prost(string, optional, tag = "6")]
    resource_version: Option<String>,
    #[prost(btree_map = "string, string", tag = "11")]
    labels: BTreeMap<String, String>,
}

/// `core/v1.Service` with [`ProxyMeta`] (tags as in `k8s-pb`).
#[derive(Clone, PartialEq, prost::Message)]
struct ProxyService {
    #[prost(message, optional, tag = "1")]
    metadata: Option<ProxyMeta>,
    #[prost(message, optional, tag = "2")]
    spec: Option<pb_core::ServiceSpec>,
    #[prost(message, optional, tag = "3")]
    status: Option<pb_core::ServiceStatus>,
}

/// `discovery/v1.EndpointSlice` with [`ProxyMeta`] (tags as in `k8s-pb`).
#[derive(Clone, PartialEq, prost::Message)]
struct ProxyEndpointSlice {
    #[prost(message, optional, tag = "1")]
    metadata: Option<ProxyMeta>,
    #[prost(message, repeated, tag = "2")]
    endpoints: Vec<pb_discovery::Endpoint>,
    #[prost(message, repeated, tag = "3")]
    ports: Vec<pb_discovery::EndpointPort>,
    #[prost(string, optional, tag = "4")]
    address_type: Option<String>,
}

/// The metadata a proxy reads: namespace, name, labels, uid and resource version.
fn metadata(meta: Option<ProxyMeta>) -> ObjectMeta {
    let meta = meta.unwrap_or_default();
    ObjectMeta {
        name: meta.name,
        namespace: meta.namespace,
        uid: meta.uid,
        resource_version: meta.resource_version,
        labels: (!meta.labels.is_empty()).then_some(meta.labels),
        ..ObjectMeta::default()
    }
}

/// A Service with the fields a proxy reads (`model::convert::service_ports`).
fn service(svc: ProxyService) -> core::Service {
    core::Service {
        metadata: metadata(svc.metadata),
        spec: svc.spec.map(service_spec),
        status: svc.status.map(|s| core::ServiceStatus {
            load_balancer: s.load_balancer.map(|lb| core::LoadBalancerStatus {
                ingress: non_empty(
                    lb.ingress
                        .into_iter()
                        .map(|i| core::LoadBalancerIngress {
                            ip: i.ip,
                            hostname: i.hostname,
                            ip_mode: i.ip_mode,
                            ports: None,
                        })
                        .collect(),
                ),
            }),
            conditions: None,
        }),
    }
}

fn service_spec(spec: pb_core::ServiceSpec) -> core::ServiceSpec {
    core::ServiceSpec {
        type_: spec.r#type,
        cluster_ip: spec.cluster_ip,
        cluster_ips: non_empty(spec.cluster_ips),
        ip_families: non_empty(spec.ip_families),
        external_ips: non_empty(spec.external_ips),
        external_name: spec.external_name,
        load_balancer_source_ranges: non_empty(spec.load_balancer_source_ranges),
        session_affinity: spec.session_affinity,
        session_affinity_config: spec.session_affinity_config.map(|c| core::SessionAffinityConfig {
            client_ip: c.client_ip.map(|ip| core::ClientIPConfig {
                timeout_seconds: ip.timeout_seconds,
            }),
        }),
        external_traffic_policy: spec.external_traffic_policy,
        internal_traffic_policy: spec.internal_traffic_policy,
        health_check_node_port: spec.health_check_node_port,
        traffic_distribution: spec.traffic_distribution,
        ports: non_empty(
            spec.ports
                .into_iter()
                .map(|p| core::ServicePort {
                    name: p.name,
                    protocol: p.protocol,
                    port: p.port.unwrap_or_default(),
                    node_port: p.node_port,
                    ..core::ServicePort::default()
                })
                .collect(),
        ),
        ..core::ServiceSpec::default()
    }
}

/// An EndpointSlice with the fields a proxy reads (`model::convert::slice_endpoints`).
fn endpoint_slice(slice: ProxyEndpointSlice) -> EndpointSlice {
    EndpointSlice {
        metadata: metadata(slice.metadata),
        address_type: slice.address_type.unwrap_or_default(),
        endpoints: slice.endpoints.into_iter().map(endpoint).collect(),
        ports: non_empty(
            slice
                .ports
                .into_iter()
                .map(|p| discovery::EndpointPort {
                    name: p.name,
                    protocol: p.protocol,
                    port: p.port,
                    app_protocol: None,
                })
                .collect(),
        ),
    }
}

fn endpoint(e: pb_discovery::Endpoint) -> discovery::Endpoint {
    discovery::Endpoint {
        addresses: e.addresses,
        conditions: e.conditions.map(|c| discovery::EndpointConditions {
            ready: c.ready,
            serving: c.serving,
            terminating: c.terminating,
        }),
        node_name: e.node_name,
        zone: e.zone,
        hints: e.hints.map(|h| discovery::EndpointHints {
            for_zones: non_empty(
                h.for_zones
                    .into_iter()
                    .map(|z| discovery::ForZone {
                        name: z.name.unwrap_or_default(),
                    })
                    .collect(),
            ),
            for_nodes: non_empty(
                h.for_nodes
                    .into_iter()
                    .map(|n| discovery::ForNode {
                        name: n.name.unwrap_or_default(),
                    })
                    .collect(),
            ),
        }),
        ..discovery::Endpoint::default()
    }
}

#[cfg(test)]
#[path = "wire_tests.rs"]
pub(crate) mod tests;
