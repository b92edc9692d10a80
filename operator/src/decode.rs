//! Typed views of untyped watch streams: each object is decoded on its own, so one object the
//! typed structs cannot read never fails a list, a cache or the Controller.
//!
//! The caches and the Controller watch [`DynamicObject`]s and convert them here. An object that
//! does not decode is left out (an update that does not decode keeps the last good version in the
//! cache: releasing a policy's nodes because one write was unreadable would be worse), counted in
//! `switchyard_operator_decode_failures_total{kind}` and `switchyard_operator_undecodable_objects{kind}`,
//! and logged with its name and the decoder's message once per resourceVersion.

use std::{
    collections::BTreeMap,
    sync::{Arc, Mutex},
};

use futures::{Stream, StreamExt};
use kube::{
    Resource, ResourceExt,
    api::{ApiResource, DynamicObject},
    runtime::watcher,
};
use serde::de::DeserializeOwned;

use crate::metrics::{KindLabel, Metrics};

/// The API resource of `K`, for untyped `Api`s.
pub fn api_resource<K: Resource<DynamicType = ()>>() -> ApiResource {
    ApiResource::erase::<K>(&())
}

/// Decodes one object as `K`; the error names the object and says what did not decode.
pub fn decode<K: DeserializeOwned>(kind: &str, obj: &DynamicObject) -> Result<K, String> {
    let value = serde_json::to_value(obj).map_err(|e| format!("{kind} {}: {e}", obj.name_any()))?;
    serde_json::from_value(value).map_err(|e| format!("{kind} {} cannot be decoded: {e}", obj.name_any()))
}

/// Names of the objects of one kind that do not decode now (name → resourceVersion).
#[derive(Clone)]
pub struct Undecodable {
    kind: &'static str,
    names: Arc<Mutex<BTreeMap<String, String>>>,
    metrics: Arc<Metrics>,
}

impl Undecodable {
    /// An empty set for `kind`.
    pub fn new(kind: &'static str, metrics: Arc<Metrics>) -> Self {
        Self {
            kind,
            names: Arc::default(),
            metrics,
        }
    }

    fn label(&self) -> KindLabel {
        KindLabel {
            kind: self.kind.into(),
        }
    }

    fn update(&self, f: impl FnOnce(&mut BTreeMap<String, String>)) {
        let mut names = self
            .names
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        f(&mut names);
        let n = i64::try_from(names.len()).unwrap_or(i64::MAX);
        self.metrics
            .undecodable_objects
            .get_or_create(&self.label())
            .set(n);
    }

    /// Records that `obj` does not decode (logged once per resourceVersion).
    pub fn failed(&self, obj: &DynamicObject, error: &str) {
        let version = obj.resource_version().unwrap_or_default();
        let mut first = false;
        self.update(|names| {
            first = names.insert(obj.name_any(), version.clone()).as_deref() != Some(&version)
        });
        if first {
            self.metrics.decode_failures.get_or_create(&self.label()).inc();
            tracing::warn!(kind = self.kind, name = %obj.name_any(), resource_version = %version, error, "object cannot be decoded; left out until it is fixed");
        }
    }

    /// Records that `name` decodes (or is gone).
    pub fn cleared(&self, name: &str) {
        self.update(|names| {
            names.remove(name);
        });
    }

    fn restart(&self) {
        self.update(BTreeMap::clear);
    }

    /// Whether `name` does not decode now.
    pub fn contains(&self, name: &str) -> bool {
        self.names
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .contains_key(name)
    }
}

/// `stream` with every object decoded as `K`; objects that do not decode are left out and
/// recorded in `bad`.
pub fn typed<K, S>(
    stream: S,
    bad: Undecodable,
) -> impl Stream<Item = Result<watcher::Event<K>, watcher::Error>> + Send
where
    K: DeserializeOwned + Send + 'static,
    S: Stream<Item = Result<watcher::Event<DynamicObject>, watcher::Error>> + Send + 'static,
{
    stream.filter_map(move |r| {
        let out = match r {
            Err(e) => Some(Err(e)),
            Ok(event) => convert(event, &bad).map(Ok),
        };
        futures::future::ready(out)
    })
}

fn convert<K: DeserializeOwned>(
    event: watcher::Event<DynamicObject>,
    bad: &Undecodable,
) -> Option<watcher::Event<K>> {
    let one = |obj: &DynamicObject| match decode::<K>(bad.kind, obj) {
        Ok(k) => {
            bad.cleared(&obj.name_any());
            Some(k)
        }
        Err(e) => {
            bad.failed(obj, &e);
            None
        }
    };
    match event {
        watcher::Event::Init => {
            bad.restart();
            Some(watcher::Event::Init)
        }
        watcher::Event::InitDone => Some(watcher::Event::InitDone),
        watcher::Event::InitApply(obj) => one(&obj).map(watcher::Event::InitApply),
        watcher::Event::Apply(obj) => one(&obj).map(watcher::Event::Apply),
        watcher::Event::Delete(obj) => {
            bad.cleared(&obj.name_any());
            decode::<K>(bad.kind, &obj).ok().map(watcher::Event::Delete)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use switchyard_crds::v1alpha1::ProxyPolicy;

    fn object(name: &str, mode: serde_json::Value) -> DynamicObject {
        serde_json::from_value(json!({
            "apiVersion": "switchyard.dev/v1alpha1", "kind": "ProxyPolicy",
            "metadata": {"name": name, "resourceVersion": "1"},
            "spec": {"nodeSelector": {}, "mode": mode, "rollout": {"maxUnavailable": null}},
        }))
        .expect("object")
    }

    #[tokio::test]
    async fn one_undecodable_object_leaves_the_others_in_the_list() {
        let metrics = Arc::new(Metrics::new());
        let bad = Undecodable::new("ProxyPolicy", metrics.clone());
        let events = vec![
            Ok(watcher::Event::Init),
            Ok(watcher::Event::InitApply(object("good", json!("nftables")))),
            Ok(watcher::Event::InitApply(object("broken", json!(42)))),
            Ok(watcher::Event::InitDone),
        ];
        let out: Vec<_> = typed::<ProxyPolicy, _>(futures::stream::iter(events), bad.clone())
            .collect()
            .await;
        let names: Vec<String> = out
            .iter()
            .filter_map(|e| match e {
                Ok(watcher::Event::InitApply(p)) => Some(p.name_any()),
                _ => None,
            })
            .collect();
        assert_eq!(names, ["good"]);
        assert_eq!(out.len(), 3, "Init, the good object, InitDone");
        assert!(bad.contains("broken"));
        assert!(
            metrics
                .encode()
                .contains("switchyard_operator_undecodable_objects{kind=\"ProxyPolicy\"} 1")
        );
        bad.cleared("broken");
        assert!(
            metrics
                .encode()
                .contains("switchyard_operator_undecodable_objects{kind=\"ProxyPolicy\"} 0")
        );
    }
}
