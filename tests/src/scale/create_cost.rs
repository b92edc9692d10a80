//! The apiserver's own cost of creating a Service at the loaded size, with a ClusterIP and
//! headless: what bounds "+1 Service: API write → kernel" for every proxy. In upstream's IPAddress
//! allocator (`pkg/registry/core/service/ipallocator`, read on master, not at the v1.37.2 tag)
//! each ClusterIP allocation recounts the addresses in use by listing every IPAddress object, so
//! the create's round trip grows with the Services already there; a headless Service allocates
//! nothing. Measured before
//! any proxy runs: sequential creates, kinds interleaved, each Service deleted right after.

use std::time::Instant;

use super::{bench_service, cluster_ip};
use crate::{Error, Result};
use k8s_openapi::api::core::v1::Service;
use kube::{
    Api, Client,
    api::{DeleteParams, PostParams},
};

/// The first ClusterIP index the probes use: past the loaded rows (≤ 44k) and the added
/// Services (from 60,000), inside 10.96.0.0/16.
const PROBE_BASE: u32 = 64_000;

/// Create round trips, milliseconds, one per sample.
#[derive(Debug, Clone, Default)]
pub struct CreateCost {
    /// Services with a ClusterIP (explicit, as the bench's are: allocated, not searched for).
    pub with_cluster_ip: Vec<f64>,
    /// Headless Services (`clusterIP: None`: nothing allocated).
    pub headless: Vec<f64>,
}

/// Creates `service`, times the create's round trip (ms), then deletes it.
async fn timed_create(api: &Api<Service>, service: &Service) -> Result<f64> {
    let name = service.metadata.name.clone().unwrap_or_default();
    let started = Instant::now();
    api.create(&PostParams::default(), service).await?;
    let ms = started.elapsed().as_secs_f64() * 1000.0;
    api.delete(&name, &DeleteParams::default()).await?;
    Ok(ms)
}

/// `samples` creates of each kind, interleaved (ClusterIP, headless, ClusterIP, …).
pub async fn measure(client: &Client, samples: usize) -> Result<CreateCost> {
    let api: Api<Service> = Api::namespaced(client.clone(), "default");
    let mut cost = CreateCost::default();
    for k in 0..samples {
        let index =
            PROBE_BASE + u32::try_from(k).map_err(|_| Error::Prerequisite("too many samples".into()))?;
        let ip = cluster_ip(index).to_string();
        let allocated = bench_service(&format!("probe-cip-{k}"), &ip)?;
        cost.with_cluster_ip.push(timed_create(&api, &allocated).await?);
        let headless = bench_service(&format!("probe-headless-{k}"), "None")?;
        cost.headless.push(timed_create(&api, &headless).await?);
    }
    Ok(cost)
}

impl CreateCost {
    /// One line: p50 / p99 of each kind.
    pub fn describe(&self) -> String {
        let q = |v: &[f64]| format!("{:.0} / {:.0}", super::quantile(v, 0.5), super::quantile(v, 0.99));
        format!(
            "the apiserver creating one Service, round trip p50 / p99 over {} each: with a ClusterIP {} ms, \
             headless {} ms",
            self.headless.len(),
            q(&self.with_cluster_ip),
            q(&self.headless)
        )
    }
}
