//! Change tracking (kube-proxy's ServiceChangeTracker / EndpointsChangeTracker idea): keeps the
//! current Services and EndpointSlices as model values and remembers which Services changed since
//! the last sync, so a sync can touch only those.
//!
//! The `service.kubernetes.io/service-proxy-name` filter is applied here, client-side: every
//! Service is kept with its label, and only those whose label equals the proxy's name (both absent
//! for the default proxy) are in the snapshot. [`Tracker::set_proxy_name`] changes the name
//! without a relist and marks exactly the Services that appear or disappear.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::{core::v1::Service, discovery::v1::EndpointSlice};

use switchyard_crds::consts::SERVICE_PROXY_NAME_LABEL;

use super::{Changes, DualSnapshot, Endpoint, IpFamily, Protocol, ServiceName, ServicePort, convert};

type SliceKey = (String, String);
type SliceEndpoints = Vec<((String, Protocol), Vec<Endpoint>)>;

/// A Service as the tracker keeps it: its service-proxy-name label and its ports as the proxy of
/// that name programs them.
#[derive(Debug, Clone, PartialEq, Eq)]
struct TrackedService {
    label: Option<String>,
    ports: Vec<ServicePort>,
}

/// The tracker. Feed it watch events; take a [`Snapshot`] and the [`Changes`] at sync time.
#[derive(Debug, Default)]
pub struct Tracker {
    proxy_name: Option<String>,
    services: BTreeMap<ServiceName, TrackedService>,
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

    /// The ports of `entry` this proxy programs: none for a Service of another proxy.
    fn visible<'a>(&self, entry: Option<&'a TrackedService>) -> &'a [ServicePort] {
        match entry {
            Some(e) if e.label == self.proxy_name => &e.ports,
            _ => &[],
        }
    }

    /// The service-proxy-name this tracker programs Services of (None: the default proxy).
    pub fn proxy_name(&self) -> Option<&str> {
        self.proxy_name.as_deref()
    }

    /// Changes the service-proxy-name (the policy's `serviceProxyName`); marks every Service that
    /// appears or disappears with it. Returns whether any did.
    pub fn set_proxy_name(&mut self, proxy_name: Option<String>) -> bool {
        if proxy_name == self.proxy_name {
            return false;
        }
        let old = std::mem::replace(&mut self.proxy_name, proxy_name);
        let flipped: Vec<ServiceName> = self
            .services
            .iter()
            .filter(|(_, e)| e.label == old || e.label == self.proxy_name)
            .map(|(k, _)| k.clone())
            .collect();
        let any = !flipped.is_empty();
        for name in flipped {
            self.mark(name);
        }
        any
    }

    /// A Service was added or updated. Returns whether anything this proxy programs changed.
    pub fn apply_service(&mut self, svc: &Service) -> bool {
        let (Some(namespace), Some(name)) = (svc.metadata.namespace.clone(), svc.metadata.name.clone())
        else {
            return false;
        };
        let key = ServiceName { namespace, name };
        let label = svc
            .metadata
            .labels
            .as_ref()
            .and_then(|l| l.get(SERVICE_PROXY_NAME_LABEL))
            .cloned();
        let ports = convert::service_ports(svc, label.as_deref());
        let entry = (!ports.is_empty()).then_some(TrackedService { label, ports });
        let changed = self.visible(self.services.get(&key)) != self.visible(entry.as_ref());
        match entry {
            Some(e) => self.services.insert(key.clone(), e),
            None => self.services.remove(&key),
        };
        if changed {
            self.mark(key);
        }
        changed
    }

    /// A Service was deleted.
    pub fn delete_service(&mut self, namespace: &str, name: &str) -> bool {
        let key = ServiceName {
            namespace: namespace.into(),
            name: name.into(),
        };
        let old = self.services.remove(&key);
        let changed = !self.visible(old.as_ref()).is_empty();
        if changed {
            self.mark(key);
        }
        changed
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
        let old = std::mem::take(&mut self.services);
        for svc in all {
            self.apply_service(svc);
        }
        for (name, entry) in &old {
            if self.visible(Some(entry)) != self.visible(self.services.get(name)) {
                self.mark(name.clone());
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
        for entry in self.services.values() {
            for port in self.visible(Some(entry)) {
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

#[cfg(test)]
mod tests {
    use super::*;

    fn service(name: &str, proxy: Option<&str>) -> Service {
        let labels = proxy.map(|p| serde_json::json!({ SERVICE_PROXY_NAME_LABEL: p }));
        serde_json::from_value(serde_json::json!({
            "metadata": {"namespace": "ns", "name": name, "labels": labels},
            "spec": {"clusterIP": "10.96.0.10", "ports": [{"port": 80, "protocol": "TCP"}]},
        }))
        .expect("service")
    }

    fn programmed(t: &Tracker) -> Vec<String> {
        t.snapshot()
            .families()
            .iter()
            .flat_map(|s| s.services.keys().map(|k| k.service.name.clone()))
            .collect()
    }

    fn key(name: &str) -> ServiceName {
        ServiceName {
            namespace: "ns".into(),
            name: name.into(),
        }
    }

    #[test]
    fn the_proxy_name_filters_services_and_a_new_name_refilters_without_a_relist() {
        let mut t = Tracker::new(None);
        t.reset_services(&[service("plain", None), service("named", Some("swy"))]);
        assert_eq!(
            programmed(&t),
            ["plain"],
            "unnamed proxy: only unlabelled Services"
        );
        t.take_changes();

        assert!(t.set_proxy_name(Some("swy".into())));
        assert_eq!(
            programmed(&t),
            ["named"],
            "named proxy: only Services with its name"
        );
        let changed = t.take_changes().services;
        assert_eq!(changed, [key("plain"), key("named")].into_iter().collect());
        assert!(
            !t.set_proxy_name(Some("swy".into())),
            "the same name changes nothing"
        );

        // A Service of another proxy comes and goes unseen; one of ours is marked.
        assert!(!t.apply_service(&service("other", Some("elsewhere"))));
        assert!(!t.delete_service("ns", "other"));
        assert!(t.apply_service(&service("second", Some("swy"))));
        assert_eq!(programmed(&t), ["named", "second"]);
        // Relabelling away from us removes it.
        assert!(t.apply_service(&service("second", None)));
        assert_eq!(programmed(&t), ["named"]);

        assert!(t.set_proxy_name(None));
        assert_eq!(programmed(&t), ["plain", "second"], "back to the default proxy");
        assert_eq!(t.proxy_name(), None);
    }
}
