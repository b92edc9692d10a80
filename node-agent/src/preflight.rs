//! Migration preflight facts: what this node measures for the planner to judge a switch to
//! another mode by (`NodeProxy.status.preflightFacts`), and kube-proxy's two iptables-mode
//! metrics read from the same kernel counters at scrape time.
//!
//! iptables mode counts, as kube-proxy does with nfacct objects (kept by the kernel across every
//! `iptables-restore`), the packets of its conntrack-invalid drop rule
//! (`ct_state_invalid_dropped_pkts`) and of the packets of NodePort connections made to
//! `127.0.0.1` (`localhost_nps_accepted_pkts`, counted in `SWY-FIREWALL`). The facts add the
//! kernel release, `nf_conntrack_tcp_be_liberal` as read now, the NodePort addresses and localhost
//! NodePorts in effect, and the node's primary and other (IPv4) addresses. Measuring is only
//! reads; the pure part ([`facts`]) is table-tested.

use std::net::IpAddr;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use prometheus_client::{
    collector::Collector,
    encoding::{DescriptorEncoder, EncodeMetric},
    metrics::counter::ConstCounter,
};
use switchyard_crds::v1alpha1::{PreflightFacts, ProxyMode};

use crate::{
    backend::{Settings, iptables::render},
    model::IpFamily,
    sys::{self, nfacct},
};

/// `nf_conntrack_tcp_be_liberal`, per network namespace.
const TCP_BE_LIBERAL: &str = "net/netfilter/nf_conntrack_tcp_be_liberal";

/// What the kernel said, for [`facts`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Readings {
    /// Kernel release.
    pub kernel: String,
    /// `localhost_nps_accepted_pkts`, if the counter exists.
    pub localhost_packets: Option<u64>,
    /// `ct_state_invalid_dropped_pkts`, if the counter exists.
    pub invalid_packets: Option<u64>,
    /// `nf_conntrack_tcp_be_liberal`, if readable.
    pub tcp_be_liberal: Option<bool>,
    /// Addresses on the node's interfaces.
    pub interface_addresses: Vec<IpAddr>,
}

impl Readings {
    /// Reads the kernel (this network namespace).
    pub fn read(kernel: &str) -> Self {
        let counter = |name| match nfacct::packets(name) {
            Ok(n) => Some(n),
            Err(e) => {
                if !e.is_not_found() {
                    tracing::debug!(counter = name, error = %e, "cannot read nfacct counter");
                }
                None
            }
        };
        Self {
            kernel: kernel.to_owned(),
            localhost_packets: counter(nfacct::LOCALHOST_NODEPORTS_ACCEPTED),
            invalid_packets: counter(nfacct::CT_STATE_INVALID_DROPPED),
            tcp_be_liberal: sys::host::sysctl_i64(TCP_BE_LIBERAL).map(|v| v != 0),
            interface_addresses: sys::link::all_addresses()
                .map(|a| a.into_iter().map(|(_, ip)| IpAddr::V4(ip)).collect())
                .unwrap_or_default(),
        }
    }
}

/// The NodePort addresses in effect, per family: `all` when every local address serves them.
fn node_port_addresses(settings: &Settings) -> Vec<String> {
    let families: Vec<(IpFamily, Option<&[IpAddr]>)> = IpFamily::ALL
        .iter()
        .map(|f| (*f, settings.node_port_addresses.of(*f)))
        .collect();
    if families.iter().all(|(_, a)| a.is_none()) {
        return vec!["all".to_owned()];
    }
    families
        .into_iter()
        .flat_map(|(family, addresses)| match addresses {
            Some(list) => list.iter().map(IpAddr::to_string).collect::<Vec<_>>(),
            None => vec![format!("all ({family:?})")],
        })
        .collect()
}

/// The facts of a node running `mode` with `settings`, from `readings`. The counters are
/// iptables mode's: in another mode they are not measured.
pub fn facts(mode: ProxyMode, settings: &Settings, readings: &Readings, now: Time) -> PreflightFacts {
    let iptables = mode == ProxyMode::Iptables;
    let count = |n: Option<u64>| {
        n.filter(|_| iptables)
            .map(|n| i64::try_from(n).unwrap_or(i64::MAX))
    };
    let localhost = match mode {
        ProxyMode::Iptables => render::serves_localhost_node_ports(settings, IpFamily::V4),
        ProxyMode::Nftables => settings.nftables_localhost_node_ports,
        ProxyMode::Ipvs | ProxyMode::External => false,
    };
    let primary = &settings.node.addresses;
    let others: Vec<String> = readings
        .interface_addresses
        .iter()
        .filter(|a| !a.is_loopback() && !primary.contains(a))
        .map(IpAddr::to_string)
        .collect();
    PreflightFacts {
        mode: Some(mode),
        measured_at: Some(now),
        kernel_version: readings.kernel.clone(),
        localhost_node_ports_accepted_packets: count(readings.localhost_packets),
        ct_state_invalid_dropped_packets: count(readings.invalid_packets),
        tcp_be_liberal: readings.tcp_be_liberal,
        node_port_addresses: node_port_addresses(settings),
        localhost_node_ports: localhost,
        primary_addresses: primary.iter().map(IpAddr::to_string).collect(),
        other_addresses: others,
    }
}

/// kube-proxy's `kubeproxy_iptables_ct_state_invalid_dropped_packets_total` and
/// `kubeproxy_iptables_localhost_nodeports_accepted_packets_total`, read from the nfacct counters
/// at each scrape (as kube-proxy's collector does); absent while a counter does not exist.
#[derive(Debug, Default)]
pub struct NfacctCollector;

impl Collector for NfacctCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let metrics = [
            (
                "kubeproxy_iptables_ct_state_invalid_dropped_packets",
                "packets dropped by iptables to work around conntrack problems",
                nfacct::CT_STATE_INVALID_DROPPED,
            ),
            (
                "kubeproxy_iptables_localhost_nodeports_accepted_packets",
                "Number of packets accepted on nodeports of loopback interface",
                nfacct::LOCALHOST_NODEPORTS_ACCEPTED,
            ),
        ];
        for (name, help, counter) in metrics {
            let Ok(packets) = nfacct::packets(counter) else {
                continue;
            };
            let value = ConstCounter::new(packets);
            let metric = encoder.encode_descriptor(name, help, None, value.metric_type())?;
            value.encode(metric)?;
        }
        Ok(())
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::backend::NodePortIps;

    fn settings(node_ports: NodePortIps, localhost: bool) -> Settings {
        let mut s = Settings {
            node_port_addresses: node_ports,
            localhost_node_ports: localhost,
            ..Settings::default()
        };
        s.node.addresses = vec!["10.0.0.1".parse().unwrap()];
        s
    }

    fn readings() -> Readings {
        Readings {
            kernel: "6.18.44".into(),
            localhost_packets: Some(12),
            invalid_packets: Some(3),
            tcp_be_liberal: Some(false),
            interface_addresses: ["127.0.0.1", "10.0.0.1", "10.244.1.1"]
                .iter()
                .map(|a| a.parse().unwrap())
                .collect(),
        }
    }

    /// (case, mode, settings, localhost packets, invalid packets, node port addresses, localhost served)
    type Case = (
        &'static str,
        ProxyMode,
        Settings,
        Option<i64>,
        Option<i64>,
        Vec<&'static str>,
        bool,
    );

    #[test]
    fn facts_table() {
        let now = Time(k8s_openapi::jiff::Timestamp::UNIX_EPOCH);
        let primary = NodePortIps::of_addresses(&["10.0.0.1".parse().unwrap()]);
        let cases: Vec<Case> = vec![
            (
                "iptables, every address, localhost on",
                ProxyMode::Iptables,
                settings(NodePortIps::default(), true),
                Some(12),
                Some(3),
                vec!["all"],
                true,
            ),
            (
                "iptables, primary only: no localhost NodePorts",
                ProxyMode::Iptables,
                settings(primary.clone(), true),
                Some(12),
                Some(3),
                vec!["10.0.0.1", "all (V6)"],
                false,
            ),
            (
                "nftables: counters not measured",
                ProxyMode::Nftables,
                settings(primary, true),
                None,
                None,
                vec!["10.0.0.1", "all (V6)"],
                false,
            ),
        ];
        for (name, mode, s, localhost, invalid, addresses, served) in cases {
            let f = facts(mode, &s, &readings(), now.clone());
            assert_eq!(
                (
                    f.localhost_node_ports_accepted_packets,
                    f.ct_state_invalid_dropped_packets,
                    f.node_port_addresses
                        .iter()
                        .map(String::as_str)
                        .collect::<Vec<_>>(),
                    f.localhost_node_ports
                ),
                (localhost, invalid, addresses, served),
                "{name}"
            );
            assert_eq!(f.primary_addresses, ["10.0.0.1"], "{name}");
            assert_eq!(
                f.other_addresses,
                ["10.244.1.1"],
                "{name}: loopback and primary left out"
            );
            assert_eq!(
                (f.tcp_be_liberal, f.kernel_version.as_str()),
                (Some(false), "6.18.44")
            );
        }
    }
}
