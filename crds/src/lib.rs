//! Custom resource types of Switchyard, shared by the operator, the node agent and the tests.
//!
//! Two cluster-scoped kinds in group `switchyard.dev`, version `v1alpha1`:
//! - [`v1alpha1::ProxyPolicy`]: a node pool, the proxy mode it should run, how to roll it out and
//!   how to judge health. Written by people (or GitOps); its status by the operator.
//! - [`v1alpha1::NodeProxy`]: one per node. Its spec is written by the operator only (desired mode and
//!   effective settings), its status by that node's agent only (capabilities, active mode, switch phase).
//!
//! The YAML in `config/crd/` and `helm/switchyard/crds/` is generated from these types by `crdgen`
//! ([`crd_yaml`]) and checked for staleness by a test.
#![cfg_attr(not(test), warn(clippy::too_many_lines))]
// kube-derive expands each `printcolumn(...)` into attributes clippy sees as duplicates.
#![allow(clippy::duplicated_attributes)]

pub mod consts;
pub mod schema;
mod tolerant;
pub mod v1alpha1;

use kube::CustomResourceExt;

/// The URL of an apiserver given as a host (name, IPv4 or IPv6 address, brackets optional) and a
/// port, as both binaries' `--apiserver-host`/`--apiserver-port` flags take it (the chart's
/// `apiServer.host`/`apiServer.port`, like Cilium's `k8sServiceHost`/`k8sServicePort`).
pub fn apiserver_url(host: &str, port: u16) -> String {
    let host = host.trim().trim_start_matches('[').trim_end_matches(']');
    if host.contains(':') {
        format!("https://[{host}]:{port}")
    } else {
        format!("https://{host}:{port}")
    }
}

/// Errors of this crate.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A CRD could not be serialised to JSON.
    #[error("cannot serialise CRD {name} to JSON: {source}")]
    Json {
        /// CRD name.
        name: String,
        /// Underlying serialiser error.
        #[source]
        source: serde_json::Error,
    },
    /// A CRD could not be serialised to YAML.
    #[error("cannot serialise CRD {name} to YAML: {source}")]
    Yaml {
        /// CRD name.
        name: String,
        /// Underlying serialiser error.
        #[source]
        source: serde_yaml::Error,
    },
}

/// Joins the hard-wrapped lines of doc comments so `kubectl explain` can wrap them itself;
/// blank lines (paragraphs) stay.
fn unwrap_descriptions(value: &mut serde_json::Value) {
    match value {
        serde_json::Value::Object(map) => {
            for (key, v) in map.iter_mut() {
                match v {
                    serde_json::Value::String(text) if key == "description" => {
                        *text = text
                            .split("\n\n")
                            .map(|p| p.split('\n').map(str::trim).collect::<Vec<_>>().join(" "))
                            .collect::<Vec<_>>()
                            .join("\n\n");
                    }
                    _ => unwrap_descriptions(v),
                }
            }
        }
        serde_json::Value::Array(items) => items.iter_mut().for_each(unwrap_descriptions),
        _ => {}
    }
}

/// Longest ProxyPolicy name: the operator labels each NodeProxy with its policy's name, and a
/// label value has at most 63 characters.
pub const MAX_POLICY_NAME: usize = 63;

/// The CEL rule (and its message) on the ProxyPolicy root that bounds the name. Checked on create
/// only (names are immutable; `optionalOldSelf`): a root rule would otherwise also refuse the
/// status writes that report an over-long name stored before the rule existed.
const POLICY_NAME_RULE: (&str, &str) = (
    "oldSelf.hasValue() || self.metadata.name.size() <= 63",
    "metadata.name of a ProxyPolicy must be at most 63 characters (the operator labels each NodeProxy with it); choose a shorter name",
);

/// Result alias of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Every CRD Switchyard installs, as `(file name, YAML text)`, in a stable order.
pub fn crd_yaml() -> Result<Vec<(String, String)>> {
    let crds = [v1alpha1::ProxyPolicy::crd(), v1alpha1::NodeProxy::crd()];
    crds.into_iter()
        .map(|crd| {
            let name = crd.metadata.name.clone().unwrap_or_default();
            let mut value = serde_json::to_value(&crd).map_err(|e| Error::Json {
                name: name.clone(),
                source: e,
            })?;
            unwrap_descriptions(&mut value);
            let root_rules: &[(&str, &str)] = if name.starts_with("proxypolicies.") {
                &[POLICY_NAME_RULE]
            } else {
                &[]
            };
            schema::harden(&mut value, root_rules);
            let body = serde_yaml::to_string(&value).map_err(|source| Error::Yaml {
                name: name.clone(),
                source,
            })?;
            Ok((
                format!("{name}.yaml"),
                format!("{}\n{body}", consts::GENERATED_HEADER),
            ))
        })
        .collect()
}

#[cfg(test)]
mod apiserver_url_tests {
    use super::apiserver_url;

    #[test]
    fn hosts_of_every_kind_make_urls() {
        assert_eq!(apiserver_url("10.0.0.1", 6443), "https://10.0.0.1:6443");
        assert_eq!(
            apiserver_url("api.example.com", 443),
            "https://api.example.com:443"
        );
        assert_eq!(apiserver_url("fd00::1", 6443), "https://[fd00::1]:6443");
        assert_eq!(apiserver_url("[fd00::1]", 6443), "https://[fd00::1]:6443");
    }
}
