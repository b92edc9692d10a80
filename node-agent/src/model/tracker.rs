//! Change tracking (kube-proxy's ServiceChangeTracker / EndpointsChangeTracker idea): keeps the
//! current Services and EndpointSlices as model values and remembers which Services changed since
//! the last sync, so a sync can touch only those.
//!
//! The snapshot a sync programs is kept up to date per changed Service
//! ([`Tracker::shared_snapshot`]): a round costs what changed, not the cluster's size. There is
//! one such buffer (a second cost 38 MiB at 44k Services): nothing keeps a handed-out snapshot
//! past its round, so it is updated in place; one still shared is copied first (`Arc::make_mut`),
//! so sharing stays correct, only slower. [`Tracker::snapshot`] builds the same state from
//! scratch: the oracle of the incremental one in the tests.
//!
//! The `service.kubernetes.io/service-proxy-name` filter is applied here, client-side: every
//! Service is kept with its label, and only those whose label equals the proxy's name (both absent
//! for the default proxy) are in the snapshot. [`Tracker::set_proxy_name`] changes the name
//! without a relist and marks exactly the Services that appear or disappear.

use std::{
    collections::{BTreeMap, BTreeSet},
    sync::Arc,
};

use k8s_openapi::api::{core::v1::Service, discovery::v1::EndpointSlice};

use switchyard_crds::consts::SERVICE_PROXY_NAME_LABEL;

use super::{
    Changes, DualSnapshot, Endpoint, IpFamily, ServiceName, ServicePort, ServicePortName, convert,
    convert::SliceEndpoints, remove_ports_of,
};

/// An EndpointSlice by namespace and name.
type SliceKey = (Arc<str>, Arc<str>);

/// A Service as the tracker keeps it: its service-proxy-name label and its ports as the proxy of
/// that name programs them.
#[derive(Debug, Clone, PartialEq, Eq)]
struct TrackedService {
    label: Option<String>,
    ports: Vec<ServicePort>,
}

/// One Service event converted to what the tracker keeps (the API object can then be dropped).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServiceEntry {
    key: ServiceName,
    /// None: nothing to program (headless, ExternalName, no ports): removed if kept.
    tracked: Option<TrackedService>,
}

impl ServiceEntry {
    /// The entry of `svc`; None for an object without a namespace or name.
    pub fn of(svc: &Service) -> Option<Self> {
        let (namespace, name) = (svc.metadata.namespace.as_deref()?, svc.metadata.name.as_deref()?);
        let label = svc
            .metadata
            .labels
            .as_ref()
            .and_then(|l| l.get(SERVICE_PROXY_NAME_LABEL))
            .cloned();
        let ports = convert::service_ports(svc, label.as_deref());
        // The ports' name, shared.
        let key = match ports.first() {
            Some(port) => port.name.service.clone(),
            None => ServiceName {
                namespace: namespace.into(),
                name: name.into(),
            },
        };
        let tracked = (!ports.is_empty()).then_some(TrackedService { label, ports });
        Some(Self { key, tracked })
    }
}

/// One EndpointSlice event converted to what the tracker keeps.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SliceEntry {
    key: SliceKey,
    service: ServiceName,
    endpoints: SliceEndpoints,
}

impl SliceEntry {
    /// The entry of `slice`; None for an object without a namespace, name or Service label
    /// (such a slice is not tracked).
    pub fn of(slice: &EndpointSlice) -> Option<Self> {
        let key = (
            slice.metadata.namespace.as_deref()?.into(),
            slice.metadata.name.as_deref()?.into(),
        );
        let service = convert::slice_service(slice)?;
        Some(Self {
            key,
            service,
            endpoints: convert::slice_endpoints(slice),
        })
    }
}

/// One incrementally kept snapshot and the Services changed since it was last brought up to date.
#[derive(Debug, Default)]
struct Buffer {
    snapshot: Arc<DualSnapshot>,
    dirty: BTreeSet<ServiceName>,
    /// Built once from scratch (before that, `dirty` does not cover everything).
    built: bool,
}

/// The tracker. Feed it watch events; take a [`Snapshot`] and the [`Changes`] at sync time.
#[derive(Debug, Default)]
pub struct Tracker {
    proxy_name: Option<String>,
    services: BTreeMap<ServiceName, TrackedService>,
    slices: BTreeMap<SliceKey, (ServiceName, SliceEndpoints)>,
    /// The slices of each Service (an index into `slices`), sorted: a Service has a few, and a
    /// set per Service cost a 544-byte tree node each (5.4 MiB at 10k Services).
    slices_of: BTreeMap<ServiceName, Vec<SliceKey>>,
    changed: BTreeSet<ServiceName>,
    /// The snapshot kept up to date incrementally ([`Tracker::shared_snapshot`]).
    buffer: Buffer,
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
        self.buffer.dirty.insert(name.clone());
        self.changed.insert(name);
    }

    /// Records which Service slice `key` belongs to (`None`: the slice is gone).
    fn index_slice(&mut self, key: &SliceKey, old: Option<&ServiceName>, new: Option<&ServiceName>) {
        if let Some(old) = old
            && let Some(keys) = self.slices_of.get_mut(old)
        {
            if let Ok(at) = keys.binary_search(key) {
                keys.remove(at);
            }
            if keys.is_empty() {
                self.slices_of.remove(old);
            }
        }
        if let Some(new) = new {
            let keys = self.slices_of.entry(new.clone()).or_default();
            if let Err(at) = keys.binary_search(key) {
                // Room for exactly one at first (most Services keep one slice for good), amortized
                // growth after that (no reallocation per slice of a Service with thousands).
                if keys.is_empty() {
                    keys.reserve_exact(1);
                }
                keys.insert(at, key.clone());
            }
        }
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
        ServiceEntry::of(svc).is_some_and(|e| self.put_service(e))
    }

    /// Stores one converted Service (none: removed); returns whether anything programmed changed.
    fn put_service(&mut self, ServiceEntry { key, tracked }: ServiceEntry) -> bool {
        let changed = self.visible(self.services.get(&key)) != self.visible(tracked.as_ref());
        match tracked {
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
        SliceEntry::of(slice).is_some_and(|e| self.put_slice(e))
    }

    /// Stores one converted EndpointSlice; returns whether it changed anything.
    fn put_slice(
        &mut self,
        SliceEntry {
            key,
            service,
            endpoints,
        }: SliceEntry,
    ) -> bool {
        if self
            .slices
            .get(&key)
            .is_some_and(|(s, e)| *s == service && *e == endpoints)
        {
            return false;
        }
        // The Service's name as the tracker already keeps it, shared rather than a second copy.
        let service = match self.services.get_key_value(&service) {
            Some((kept, _)) => kept.clone(),
            None => service,
        };
        let old = self.slices.insert(key.clone(), (service.clone(), endpoints));
        let old_service = old.map(|(s, _)| s);
        self.index_slice(&key, old_service.as_ref(), Some(&service));
        if let Some(old_service) = old_service {
            self.mark(old_service);
        }
        self.mark(service);
        true
    }

    /// An EndpointSlice was deleted.
    pub fn delete_slice(&mut self, namespace: &str, name: &str) -> bool {
        let key: SliceKey = (namespace.into(), name.into());
        if let Some((service, _)) = self.slices.remove(&key) {
            self.index_slice(&key, Some(&service), None);
            self.mark(service);
            return true;
        }
        false
    }

    /// Replaces all Services (a watch relist); marks every added, changed or vanished one.
    pub fn reset_services(&mut self, all: &[Service]) {
        self.reset_service_entries(all.iter().filter_map(ServiceEntry::of));
    }

    /// [`Tracker::reset_services`] from Services converted as they arrived (a relist then holds
    /// the model values, not the API objects).
    pub fn reset_service_entries(&mut self, all: impl IntoIterator<Item = ServiceEntry>) {
        let old = std::mem::take(&mut self.services);
        for entry in all {
            self.put_service(entry);
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
        self.reset_slice_entries(all.iter().filter_map(SliceEntry::of));
    }

    /// [`Tracker::reset_slices`] from EndpointSlices converted as they arrived.
    pub fn reset_slice_entries(&mut self, all: impl IntoIterator<Item = SliceEntry>) {
        let old = std::mem::take(&mut self.slices);
        self.slices_of.clear();
        for entry in all {
            self.put_slice(entry);
        }
        for (key, (service, eps)) in old {
            if self.slices.get(&key) != Some(&(service.clone(), eps)) {
                self.mark(service);
            }
        }
        self.slices_synced = true;
    }

    /// Whether Services have been listed whole once. Until then nothing reads them (nothing is
    /// programmed before both lists are in), so the first list goes straight in
    /// ([`Tracker::apply_service`]) while it arrives, instead of all at once after it.
    pub fn services_listed(&self) -> bool {
        self.services_synced
    }

    /// Whether EndpointSlices have been listed whole once ([`Tracker::services_listed`]).
    pub fn slices_listed(&self) -> bool {
        self.slices_synced
    }

    /// A first list of Services starts (again: one that failed part-way left some in).
    pub fn restart_first_service_list(&mut self) {
        for name in std::mem::take(&mut self.services).into_keys() {
            self.mark(name);
        }
    }

    /// A first list of EndpointSlices starts (again: one that failed part-way left some in).
    pub fn restart_first_slice_list(&mut self) {
        self.slices_of.clear();
        for (_, (service, _)) in std::mem::take(&mut self.slices) {
            self.mark(service);
        }
    }

    /// The first list of Services is whole.
    pub fn first_service_list_done(&mut self) {
        self.services_synced = true;
    }

    /// The first list of EndpointSlices is whole.
    pub fn first_slice_list_done(&mut self) {
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
                canonical(eps);
            }
        }
        dual
    }

    /// The same state as [`Tracker::snapshot`], kept up to date incrementally: brings the buffer
    /// up to date with the Services changed since it was last handed out, and hands it out.
    /// Nothing holds a handed-out snapshot past its round (the conntrack cleaner keeps its own
    /// UDP-only copy), so the update happens in place; were one still held, the buffer would be
    /// copied first (`Arc::make_mut`): correct, only slower. Independent of
    /// [`Tracker::take_changes`].
    pub fn shared_snapshot(&mut self) -> Arc<DualSnapshot> {
        let dirty = std::mem::take(&mut self.buffer.dirty);
        // Past half of the Services (and more than a few), one pass over everything is cheaper
        // than per-Service edits.
        if !self.buffer.built || (dirty.len() > 64 && dirty.len() > self.services.len() / 2) {
            self.buffer.snapshot = Arc::new(self.snapshot());
            self.buffer.built = true;
        } else {
            let mut snapshot = std::mem::take(&mut self.buffer.snapshot);
            let dual = Arc::make_mut(&mut snapshot);
            for name in &dirty {
                self.refresh(dual, name);
            }
            self.buffer.snapshot = snapshot;
        }
        Arc::clone(&self.buffer.snapshot)
    }

    /// Rewrites Service `name`'s ports and endpoints in `dual` from the tracked state, exactly as
    /// [`Tracker::snapshot`] would have them.
    fn refresh(&self, dual: &mut DualSnapshot, name: &ServiceName) {
        for snap in [&mut dual.v4, &mut dual.v6] {
            remove_ports_of(&mut snap.services, name);
            remove_ports_of(&mut snap.endpoints, name);
        }
        for port in self.visible(self.services.get(name)) {
            dual.get_mut(port.family())
                .services
                .insert(port.name.clone(), port.clone());
        }
        let mut touched = BTreeSet::new();
        for key in self.slices_of.get(name).into_iter().flatten() {
            let Some((service, per_port)) = self.slices.get(key).filter(|(s, _)| s == name) else {
                continue;
            };
            for ((port_name, protocol), eps) in per_port {
                let key = ServicePortName {
                    service: service.clone(),
                    port_name: port_name.clone(),
                    protocol: *protocol,
                };
                let Some(family) = eps.first().map(|e| IpFamily::of(&e.ip)) else {
                    continue;
                };
                let snap = dual.get_mut(family);
                if snap.services.contains_key(&key) {
                    snap.endpoints
                        .entry(key.clone())
                        .or_default()
                        .extend(eps.iter().cloned());
                    touched.insert((family, key));
                }
            }
        }
        for (family, key) in touched {
            if let Some(eps) = dual.get_mut(family).endpoints.get_mut(&key) {
                canonical(eps);
            }
        }
    }
}

/// Endpoints in their snapshot order: sorted, one per address and port.
fn canonical(eps: &mut Vec<Endpoint>) {
    eps.sort();
    eps.dedup_by(|a, b| a.ip == b.ip && a.port == b.port);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Protocol;

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
            .flat_map(|s| s.services.keys().map(|k| k.service.name.to_string()))
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

    /// A small deterministic generator (xorshift64*), so failures reproduce from the seed.
    struct Rng(u64);

    impl Rng {
        fn below(&mut self, n: u64) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) % n
        }
    }

    /// One of a few Service shapes: single TCP port, named TCP + UDP ports, dual-stack; with or
    /// without the proxy-name label.
    fn random_service(rng: &mut Rng, name: &str) -> Service {
        let labels = (rng.below(4) == 0).then(|| serde_json::json!({ SERVICE_PROXY_NAME_LABEL: "swy" }));
        let spec = match rng.below(3) {
            0 => serde_json::json!({"clusterIP": "10.96.0.10", "ports": [{"port": 80, "protocol": "TCP"}]}),
            1 => serde_json::json!({"clusterIP": "10.96.0.11", "ports": [
                {"name": "http", "port": 80, "protocol": "TCP"},
                {"name": "dns", "port": 53, "protocol": "UDP"}]}),
            _ => serde_json::json!({
                "clusterIP": "10.96.0.12", "clusterIPs": ["10.96.0.12", "fd00:10:96::12"],
                "ipFamilies": ["IPv4", "IPv6"], "ipFamilyPolicy": "PreferDualStack",
                "ports": [{"name": "http", "port": 80, "protocol": "TCP"}]}),
        };
        serde_json::from_value(serde_json::json!({
            "metadata": {"namespace": "ns", "name": name, "labels": labels}, "spec": spec,
        }))
        .expect("service")
    }

    /// A slice of Service `service` with a few endpoints (some shared with other slices, some
    /// not ready), for the unnamed port, `http` or `dns`.
    fn random_slice(rng: &mut Rng, name: &str, service: &str) -> EndpointSlice {
        let v6 = rng.below(3) == 0;
        let ports = match rng.below(3) {
            0 => serde_json::json!([{"port": 8080, "protocol": "TCP"}]),
            1 => serde_json::json!([{"name": "http", "port": 8080, "protocol": "TCP"}]),
            _ => serde_json::json!([{"name": "http", "port": 8080, "protocol": "TCP"},
                                    {"name": "dns", "port": 5353, "protocol": "UDP"}]),
        };
        let endpoints: Vec<serde_json::Value> = (0..rng.below(4))
            .map(|_| {
                let host = 10 + rng.below(4);
                let address = if v6 {
                    format!("fd00:10:244::{host}")
                } else {
                    format!("10.244.0.{host}")
                };
                serde_json::json!({"addresses": [address], "conditions": {"ready": rng.below(4) != 0},
                                   "nodeName": format!("n{}", rng.below(2))})
            })
            .collect();
        serde_json::from_value(serde_json::json!({
            "metadata": {"namespace": "ns", "name": name,
                         "labels": {"kubernetes.io/service-name": service}},
            "addressType": if v6 { "IPv6" } else { "IPv4" },
            "ports": ports, "endpoints": endpoints,
        }))
        .expect("slice")
    }

    /// One random watch event (or relist, or proxy-name change) applied to `t`.
    fn random_event(rng: &mut Rng, t: &mut Tracker) {
        let svc = format!("s{}", rng.below(6));
        let slice = format!("e{}", rng.below(10));
        match rng.below(20) {
            0..=5 => {
                t.apply_service(&random_service(rng, &svc));
            }
            6 => {
                t.delete_service("ns", &svc);
            }
            7..=14 => {
                t.apply_slice(&random_slice(rng, &slice, &svc));
            }
            15 | 16 => {
                t.delete_slice("ns", &slice);
            }
            17 => {
                let mut all: Vec<Service> = Vec::new();
                for i in 0..rng.below(4) {
                    all.push(random_service(rng, &format!("s{i}")));
                }
                t.reset_services(&all);
            }
            18 => {
                let mut all: Vec<EndpointSlice> = Vec::new();
                for i in 0..rng.below(6) {
                    let service = format!("s{}", rng.below(6));
                    all.push(random_slice(rng, &format!("e{i}"), &service));
                }
                t.reset_slices(&all);
            }
            _ => {
                t.set_proxy_name((rng.below(2) == 0).then(|| "swy".to_owned()));
            }
        }
    }

    #[test]
    fn the_incremental_snapshot_equals_one_built_from_scratch_after_any_events() {
        assert!(
            Protocol::Tcp < Protocol::Udp && Protocol::Tcp < Protocol::Sctp,
            "ports_of's lower bound"
        );
        let mut compared = 0;
        for seed in 1..=200u64 {
            let mut rng = Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
            let mut t = Tracker::new(None);
            // A buffer still shared (as the cleaner keeps the last one) must not be changed.
            let mut kept: Option<(Arc<DualSnapshot>, DualSnapshot)> = None;
            for step in 0..60 {
                for _ in 0..rng.below(4) {
                    random_event(&mut rng, &mut t);
                }
                let shared = t.shared_snapshot();
                assert_eq!(*shared, t.snapshot(), "seed {seed} step {step}");
                compared += 1;
                if let Some((old, copy)) = kept.take() {
                    assert_eq!(
                        *old, copy,
                        "seed {seed} step {step}: a handed-out snapshot changed"
                    );
                }
                if rng.below(2) == 0 {
                    let copy = (*shared).clone();
                    kept = Some((shared, copy));
                }
            }
        }
        assert_eq!(compared, 200 * 60);
    }

    /// A snapshot dropped at the end of its round is brought up to date in place, not copied; one
    /// still held is left as it was.
    #[test]
    fn the_snapshot_is_updated_in_place_unless_it_is_still_held() {
        let mut t = Tracker::new(None);
        assert!(t.apply_service(&service("a", None)));
        let first = t.shared_snapshot();
        let reusable = Arc::as_ptr(&first);
        drop(first);
        assert!(t.apply_service(&service("b", None)));
        let next = t.shared_snapshot();
        assert_eq!(Arc::as_ptr(&next), reusable, "updated in place, not copied");
        assert_eq!(*next, t.snapshot());
        assert!(t.apply_service(&service("c", None)));
        let after = t.shared_snapshot();
        assert_eq!(next.v4.services.len(), 2, "the held snapshot is untouched");
        assert_eq!(*after, t.snapshot());
    }
}
