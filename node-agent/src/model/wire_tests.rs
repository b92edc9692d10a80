use k8s_pb::apimachinery::pkg::runtime::RawExtension;
use serde_json::json;

use super::*;
use crate::model::tracker::{ServiceEntry, SliceEntry};

/// `message` in the whole-object encoding: magic, then a `runtime.Unknown` holding it.
pub(crate) fn whole(message: &impl Message) -> Vec<u8> {
    let mut out = MAGIC.to_vec();
    Unknown {
        raw: Some(message.encode_to_vec()),
        ..Unknown::default()
    }
    .encode(&mut out)
    .expect("a Vec grows");
    out
}

/// One watch frame: length, then the event.
pub(crate) fn frame(kind: &str, object: Vec<u8>) -> Vec<u8> {
    let event = pb_meta::WatchEvent {
        r#type: Some(kind.to_owned()),
        object: Some(RawExtension { raw: Some(object) }),
    }
    .encode_to_vec();
    let mut out = (event.len() as u32).to_be_bytes().to_vec();
    out.extend(event);
    out
}

pub(crate) fn meta(name: &str, version: &str, labels: &[(&str, &str)]) -> Option<pb_meta::ObjectMeta> {
    Some(pb_meta::ObjectMeta {
        name: Some(name.to_owned()),
        namespace: Some("ns".to_owned()),
        resource_version: Some(version.to_owned()),
        labels: labels
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect(),
        managed_fields: vec![pb_meta::ManagedFieldsEntry {
            manager: Some("kubectl".to_owned()),
            ..Default::default()
        }],
        ..Default::default()
    })
}

fn strings(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| (*s).to_owned()).collect()
}

#[test]
fn frames_are_split_whatever_the_chunks() {
    let a = frame("BOOKMARK", vec![1, 2, 3]);
    let b = frame("ADDED", vec![4; 300]);
    let stream: Vec<u8> = a.iter().chain(b.iter()).copied().collect();
    for chunk in [1, 3, 4, 5, 64, stream.len()] {
        let mut frames = Frames::default();
        let mut got = Vec::new();
        for piece in stream.chunks(chunk) {
            frames.push(piece);
            while let Some(f) = frames.next_frame().expect("valid lengths") {
                got.push(f);
            }
        }
        assert_eq!(got, vec![a[4..].to_vec(), b[4..].to_vec()], "chunks of {chunk}");
        assert_eq!(frames.pending(), 0);
    }
    let mut cut = Frames::default();
    cut.push(&b[..b.len() - 1]);
    assert_eq!(cut.next_frame().expect("valid length"), None);
    assert_eq!(
        cut.pending(),
        b.len() - 1,
        "a cut frame is held back, not handed out"
    );
}

#[test]
fn a_frame_over_the_limit_is_an_error_not_a_buffer() {
    let mut frames = Frames::default();
    frames.push(&u32::MAX.to_be_bytes());
    assert!(matches!(frames.next_frame(), Err(Error::Decode { .. })));
}

#[test]
fn only_the_protobuf_envelope_is_unwrapped() {
    let svc = pb_core::Service {
        metadata: meta("a", "7", &[]),
        ..Default::default()
    };
    let raw = unwrap_object("service", &whole(&svc)).expect("an envelope");
    assert_eq!(raw, svc.encode_to_vec());
    for not_protobuf in [&b"{\"kind\":\"Service\"}"[..], b"", b"k8s"] {
        assert!(
            unwrap_object("service", not_protobuf).is_err(),
            "{not_protobuf:?}"
        );
    }
    let mut gzipped = MAGIC.to_vec();
    Unknown {
        raw: Some(vec![1]),
        content_encoding: Some("gzip".to_owned()),
        ..Unknown::default()
    }
    .encode(&mut gzipped)
    .expect("a Vec grows");
    assert!(unwrap_object("service", &gzipped).is_err());
}

#[test]
fn list_items_carry_only_what_a_proxy_reads() {
    let list = pb_core::ServiceList {
        metadata: Some(pb_meta::ListMeta {
            resource_version: Some("42".to_owned()),
            ..Default::default()
        }),
        items: vec![pb_core::Service {
            metadata: meta("a", "1", &[("app", "a")]),
            ..Default::default()
        }],
    };
    let mut stream = crate::model::list_stream::ListStream::<core::Service>::default();
    stream.push(&whole(&list));
    let mut items = Vec::new();
    while let Some(part) = stream.next_part().expect("a list") {
        if let crate::model::list_stream::ListPart::Item(s) = part {
            items.push(s);
        }
    }
    stream.finish().expect("whole");
    assert_eq!(items.len(), 1);
    assert_eq!(items[0].metadata.name.as_deref(), Some("a"));
    assert_eq!(items[0].metadata.resource_version.as_deref(), Some("1"));
    assert!(
        items[0].metadata.managed_fields.is_none(),
        "managed fields are never built"
    );
}

#[test]
fn watch_events_of_every_type() {
    let svc = pb_core::Service {
        metadata: meta("a", "9", &[]),
        ..Default::default()
    };
    let event = |kind: &str, object: Vec<u8>| {
        let f = frame(kind, object);
        watch_event::<core::Service>(&f[4..])
    };
    let Ok(WatchEvent::Apply(added)) = event("ADDED", whole(&svc)) else {
        panic!("ADDED is an apply");
    };
    assert_eq!(added.metadata.resource_version.as_deref(), Some("9"));
    assert!(matches!(event("MODIFIED", whole(&svc)), Ok(WatchEvent::Apply(_))));
    assert!(matches!(event("DELETED", whole(&svc)), Ok(WatchEvent::Delete(_))));
    assert_eq!(
        event("BOOKMARK", whole(&svc)).expect("a bookmark"),
        WatchEvent::Bookmark("9".to_owned())
    );
    let status = pb_meta::Status {
        code: Some(410),
        reason: Some("Expired".to_owned()),
        message: Some("too old resource version: 5 (30)".to_owned()),
        ..Default::default()
    };
    assert_eq!(
        event("ERROR", whole(&status)).expect("an error event"),
        WatchEvent::Error(Failure {
            code: 410,
            reason: "Expired".to_owned(),
            message: "too old resource version: 5 (30)".to_owned(),
        })
    );
    assert!(
        event("ERROR", b"{}".to_vec()).is_err(),
        "an error event without a status"
    );
    assert!(event("SHRUG", whole(&svc)).is_err());
    assert!(
        event("ADDED", svc.encode_to_vec()).is_err(),
        "an object without its envelope"
    );
}

/// A Service as JSON (what the JSON path decodes) and the same Service in protobuf.
fn service_pair(
    labels: &[(&str, &str)],
    spec: serde_json::Value,
    pb_spec: pb_core::ServiceSpec,
    ingress_ips: &[&str],
) -> (core::Service, pb_core::Service) {
    let label_map: serde_json::Map<_, _> = labels.iter().map(|(k, v)| ((*k).to_owned(), json!(v))).collect();
    let ingress: Vec<_> = ingress_ips.iter().map(|ip| json!({ "ip": ip })).collect();
    let from_json = serde_json::from_value(json!({
        "metadata": { "name": "s", "namespace": "ns", "resourceVersion": "3", "labels": label_map },
        "spec": spec,
        "status": { "loadBalancer": { "ingress": ingress } },
    }))
    .expect("a valid Service");
    let pb = pb_core::Service {
        metadata: meta("s", "3", labels),
        spec: Some(pb_spec),
        status: Some(pb_core::ServiceStatus {
            load_balancer: Some(pb_core::LoadBalancerStatus {
                ingress: ingress_ips
                    .iter()
                    .map(|ip| pb_core::LoadBalancerIngress {
                        ip: Some((*ip).to_owned()),
                        ..Default::default()
                    })
                    .collect(),
            }),
            conditions: Vec::new(),
        }),
    };
    (from_json, pb)
}

fn pb_port(name: &str, protocol: &str, port: i32, node_port: Option<i32>) -> pb_core::ServicePort {
    pb_core::ServicePort {
        name: Some(name.to_owned()),
        protocol: Some(protocol.to_owned()),
        port: Some(port),
        node_port,
        ..Default::default()
    }
}

#[test]
fn a_service_in_protobuf_programs_what_it_does_in_json() {
    let cases = [
        service_pair(
            &[],
            json!({ "type": "ClusterIP", "clusterIP": "10.0.0.1", "clusterIPs": ["10.0.0.1"],
                    "ports": [{ "name": "http", "protocol": "TCP", "port": 80 }] }),
            pb_core::ServiceSpec {
                r#type: Some("ClusterIP".to_owned()),
                cluster_ip: Some("10.0.0.1".to_owned()),
                cluster_ips: strings(&["10.0.0.1"]),
                ports: vec![pb_port("http", "TCP", 80, None)],
                ..Default::default()
            },
            &[],
        ),
        service_pair(
            &[("service.kubernetes.io/service-proxy-name", "other")],
            json!({ "type": "ClusterIP", "clusterIP": "10.0.0.2",
                    "ports": [{ "protocol": "UDP", "port": 53 }] }),
            pb_core::ServiceSpec {
                r#type: Some("ClusterIP".to_owned()),
                cluster_ip: Some("10.0.0.2".to_owned()),
                ports: vec![pb_core::ServicePort {
                    protocol: Some("UDP".to_owned()),
                    port: Some(53),
                    ..Default::default()
                }],
                ..Default::default()
            },
            &[],
        ),
        service_pair(
            &[],
            json!({ "type": "LoadBalancer", "clusterIPs": ["10.0.0.3", "fd00::3"],
                    "externalIPs": ["192.0.2.1", "2001:db8::1"],
                    "loadBalancerSourceRanges": [" 203.0.113.0/24", "2001:db8::/64"],
                    "sessionAffinity": "ClientIP",
                    "sessionAffinityConfig": { "clientIP": { "timeoutSeconds": 60 } },
                    "externalTrafficPolicy": "Local", "internalTrafficPolicy": "Local",
                    "healthCheckNodePort": 30999,
                    "ports": [{ "name": "a", "protocol": "TCP", "port": 443, "nodePort": 31443 },
                              { "name": "b", "protocol": "SCTP", "port": 9, "nodePort": 0 }] }),
            pb_core::ServiceSpec {
                r#type: Some("LoadBalancer".to_owned()),
                cluster_ips: strings(&["10.0.0.3", "fd00::3"]),
                external_ips: strings(&["192.0.2.1", "2001:db8::1"]),
                load_balancer_source_ranges: strings(&[" 203.0.113.0/24", "2001:db8::/64"]),
                session_affinity: Some("ClientIP".to_owned()),
                session_affinity_config: Some(pb_core::SessionAffinityConfig {
                    client_ip: Some(pb_core::ClientIpConfig {
                        timeout_seconds: Some(60),
                    }),
                }),
                external_traffic_policy: Some("Local".to_owned()),
                internal_traffic_policy: Some("Local".to_owned()),
                health_check_node_port: Some(30999),
                ports: vec![
                    pb_port("a", "TCP", 443, Some(31443)),
                    pb_port("b", "SCTP", 9, Some(0)),
                ],
                ..Default::default()
            },
            &["198.51.100.7", "2001:db8::7"],
        ),
        service_pair(
            &[],
            json!({ "type": "ClusterIP", "clusterIP": "None",
                    "ports": [{ "protocol": "TCP", "port": 80 }] }),
            pb_core::ServiceSpec {
                r#type: Some("ClusterIP".to_owned()),
                cluster_ip: Some("None".to_owned()),
                ports: vec![pb_port("", "TCP", 80, None)],
                ..Default::default()
            },
            &[],
        ),
        service_pair(
            &[],
            json!({ "type": "ExternalName", "externalName": "example.com", "clusterIP": "10.0.0.9",
                    "ports": [{ "protocol": "TCP", "port": 80 }] }),
            pb_core::ServiceSpec {
                r#type: Some("ExternalName".to_owned()),
                external_name: Some("example.com".to_owned()),
                cluster_ip: Some("10.0.0.9".to_owned()),
                ports: vec![pb_port("", "TCP", 80, None)],
                ..Default::default()
            },
            &[],
        ),
    ];
    for (from_json, pb) in cases {
        // Encoded in full (managed fields and all) and decoded as the agent reads it.
        let from_pb = core::Service::decode_object(&pb.encode_to_vec()).expect("a Service");
        assert_eq!(
            ServiceEntry::of(&from_pb),
            ServiceEntry::of(&from_json),
            "{from_json:?}"
        );
        for proxy in [None, Some("other")] {
            assert_eq!(
                crate::model::convert::service_ports(&from_pb, proxy),
                crate::model::convert::service_ports(&from_json, proxy),
            );
        }
    }
}

#[test]
fn a_slice_in_protobuf_programs_what_it_does_in_json() {
    let from_json: EndpointSlice = serde_json::from_value(json!({
        "metadata": { "name": "s-1", "namespace": "ns", "resourceVersion": "5",
                      "labels": { "kubernetes.io/service-name": "s" } },
        "addressType": "IPv4",
        "endpoints": [
            { "addresses": ["10.1.0.1"], "nodeName": "n1", "zone": "z1",
              "conditions": { "ready": true, "serving": true, "terminating": false },
              "hints": { "forZones": [{ "name": "z1" }, { "name": "z2" }] } },
            { "addresses": ["10.1.0.2", "fd00::2"], "conditions": { "ready": false, "terminating": true } },
            { "addresses": ["10.1.0.3"] },
        ],
        "ports": [{ "name": "http", "protocol": "TCP", "port": 8080 }, { "name": "dns", "protocol": "UDP", "port": 53 }],
    }))
    .expect("a valid slice");
    let pb = pb_discovery::EndpointSlice {
        metadata: meta("s-1", "5", &[("kubernetes.io/service-name", "s")]),
        address_type: Some("IPv4".to_owned()),
        endpoints: vec![
            pb_discovery::Endpoint {
                addresses: strings(&["10.1.0.1"]),
                node_name: Some("n1".to_owned()),
                zone: Some("z1".to_owned()),
                conditions: Some(pb_discovery::EndpointConditions {
                    ready: Some(true),
                    serving: Some(true),
                    terminating: Some(false),
                }),
                hints: Some(pb_discovery::EndpointHints {
                    for_zones: ["z1", "z2"]
                        .iter()
                        .map(|z| pb_discovery::ForZone {
                            name: Some((*z).to_owned()),
                        })
                        .collect(),
                    for_nodes: Vec::new(),
                }),
                ..Default::default()
            },
            pb_discovery::Endpoint {
                addresses: strings(&["10.1.0.2", "fd00::2"]),
                conditions: Some(pb_discovery::EndpointConditions {
                    ready: Some(false),
                    serving: None,
                    terminating: Some(true),
                }),
                ..Default::default()
            },
            pb_discovery::Endpoint {
                addresses: strings(&["10.1.0.3"]),
                ..Default::default()
            },
        ],
        ports: vec![
            pb_discovery::EndpointPort {
                name: Some("http".to_owned()),
                protocol: Some("TCP".to_owned()),
                port: Some(8080),
                app_protocol: None,
            },
            pb_discovery::EndpointPort {
                name: Some("dns".to_owned()),
                protocol: Some("UDP".to_owned()),
                port: Some(53),
                app_protocol: None,
            },
        ],
    };
    let from_pb = EndpointSlice::decode_object(&pb.encode_to_vec()).expect("an EndpointSlice");
    let entry = SliceEntry::of(&from_pb).expect("a tracked slice");
    assert_eq!(Some(&entry), SliceEntry::of(&from_json).as_ref());
    assert_eq!(
        crate::model::convert::slice_endpoints(&from_pb),
        crate::model::convert::slice_endpoints(&from_json)
    );
    assert_eq!(
        crate::model::convert::slice_endpoints(&from_pb).len(),
        2,
        "both ports"
    );
}
