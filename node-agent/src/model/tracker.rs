//! Change tracking (kube-proxy's ServiceChangeTracker / EndpointsChangeTracker idea): keeps the
//! current Services and EndpointSlices as model values and remembers which Services changed since
//! the last sync, so a sync can touch only those.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::{core::v1::Service, discovery::v1::EndpointSlice};

use super::{Changes, DualSnapshot, Endpoint, IpFamily, Protocol, ServiceName, ServicePort, convert};

type SliceKey = (String, String);
type SliceEndpoints = Vec<((String, Protocol), Vec<Endpoint>)>;

/// The tracker. Feed it watch events; take a [`Snapshot`] and the [`Changes`] at sync time.
#[derive(Debug, Default)]
pub struct Tracker {
    proxy_name: Option<String>,
    services: BTreeMap<ServiceName, Vec<ServicePort>>,
    slices: BTreeMap<SliceKey, (ServiceName, SliceEndpoints)>,
    changed: BTreeSet<ServiceName>,
    services_synced: bool,
    slices_synced: bool,
}

impl Tracker {
    /// A tracker for a proxy with the given service-proxy-name (None: the default proxy).
    pub fn new(proxy_name: Option<String>) -> Self {
        Self {
            proxy_name,
            ..Default::default()
        }
    }

    fn mark(&mut self, name: ServiceName) {
        self.changed.insert(name);
    }

    /// A Service was added or updated. Returns whether anything this proxy programs changed.
    pub fn apply_service(&mut self, svc: &Service) -> bool {
        let (Some(namespace), Some(name)) = (svc.metadata.namespace.clone(), svc.metadata.name.clone())
        else {
            return false;
        };
        let key = ServiceName { namespace, name };
        let ports = convert::service_ports(svc, self.proxy_name.as_deref());
        let old = self.services.get(&key);
        if old.map(Vec::as_slice).unwrap_or_default() == ports.as_slice() {
            return false;
        }
        if ports.is_empty() {
            self.services.remove(&key);
        } else {
            self.services.insert(key.clone(), ports);
        }
        self.mark(key);
        true
    }

    /// A Service was deleted.
    pub fn delete_service(&mut self, namespace: &str, name: &str) -> bool {
        let key = ServiceName {
            namespace: namespace.into(),
            name: name.into(),
        };
        if self.services.remove(&key).is_some() {
            self.mark(key);
            return true;
        }
        false
    }

    /// An EndpointSlice was added or updated.
    pub fn apply_slice(&mut self, slice: &EndpointSlice) -> bool {
        let (Some(namespace), Some(name)) = (slice.metadata.namespace.clone(), slice.metadata.name.clone())
        else {
            return false;
        };
        let Some(service) = convert::slice_service(slice) else {
            return false;
        };
        let endpoints = convert::slice_endpoints(slice);
        let key = (namespace, name);
        if self
            .slices
            .get(&key)
            .is_some_and(|(s, e)| *s == service && *e == endpoints)
        {
            return false;
        }
        if let Some((old_service, _)) = self.slices.insert(key, (service.clone(), endpoints)) {
            self.mark(old_service);
        }
        self.mark(service);
        true
    }

    /// An EndpointSlice was deleted.
    pub fn delete_slice(&mut self, namespace: &str, name: &str) -> bool {
        if let Some((service, _)) = self.slices.remove(&(namespace.to_owned(), name.to_owned())) {
            self.mark(service);
            return true;
        }
        false
    }

    /// Replaces all Services (a watch relist); marks every added, changed or vanished one.
    pub fn reset_services(&mut self, all: &[Service]) {
        let before: BTreeSet<ServiceName> = self.services.keys().cloned().collect();
        let old = std::mem::take(&mut self.services);
        for svc in all {
            self.apply_service(svc);
        }
        for name in before {
            if old.get(&name) != self.services.get(&name) {
                self.mark(name);
            }
        }
        self.services_synced = true;
    }

    /// Replaces all EndpointSlices (a watch relist).
    pub fn reset_slices(&mut self, all: &[EndpointSlice]) {
        let old = std::mem::take(&mut self.slices);
        for slice in all {
            self.apply_slice(slice);
        }
        for (key, (service, eps)) in old {
            if self.slices.get(&key) != Some(&(service.clone(), eps)) {
                self.mark(service);
            }
        }
        self.slices_synced = true;
    }

    /// Both initial lists have arrived: programming before that would delete live services.
    pub fn synced(&self) -> bool {
        self.services_synced && self.slices_synced
    }

    /// Services changed since the last [`Tracker::take_changes`].
    pub fn pending(&self) -> usize {
        self.changed.len()
    }

    /// Returns and clears the changes.
    pub fn take_changes(&mut self) -> Changes {
        Changes {
            services: std::mem::take(&mut self.changed),
        }
    }

    /// The full current state, per family: a dual-stack Service's ports go to both snapshots, and
    /// each endpoint to the snapshot of its address family.
    pub fn snapshot(&self) -> DualSnapshot {
        let mut dual = DualSnapshot::default();
        for ports in self.services.values() {
            for port in ports {
                dual.get_mut(port.family())
                    .services
                    .insert(port.name.clone(), port.clone());
            }
        }
        for (service, per_port) in self.slices.values() {
            for ((port_name, protocol), eps) in per_port {
                let key = super::ServicePortName {
                    service: service.clone(),
                    port_name: port_name.clone(),
                    protocol: *protocol,
                };
                // A slice holds one family; its endpoints sort into that family's snapshot.
                let Some(family) = eps.first().map(|e| IpFamily::of(&e.ip)) else {
                    continue;
                };
                let snap = dual.get_mut(family);
                if snap.services.contains_key(&key) {
                    snap.endpoints.entry(key).or_default().extend(eps.iter().cloned());
                }
            }
        }
        for snap in [&mut dual.v4, &mut dual.v6] {
            for eps in snap.endpoints.values_mut() {
                eps.sort();
                eps.dedup_by(|a, b| a.ip == b.ip && a.port == b.port);
            }
        }
        dual
    }
}
