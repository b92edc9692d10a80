//! Smoke check of the API scale benchmark (`src/bin/api-bench.rs`, issue 16) at its quick row:
//! 1,000 Services × 2 endpoints loaded into the real apiserver, then Switchyard (nftables and
//! iptables mode) and the real kube-proxy (both modes) each started in a fresh node namespace.
//! It asserts correctness only — every ClusterIP and endpoint reached the kernel's own listing,
//! every latency sample (new Service, endpoint changed) was observed in the kernel, the sync
//! metric was read — and prints the measured figures without judging them (no timing bounds
//! beyond generous waits).

use std::time::Duration;

use switchyard_e2e::{
    agent::install_switchyard,
    controlplane::ControlPlane,
    kube_proxy::Mode,
    scale::{self, Model, Proxy, RunOpts},
};

const SAMPLES: usize = 5;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_bench_1k_every_rule_and_change_reaches_the_kernel() {
    let cp = ControlPlane::start().await.expect("control plane");
    install_switchyard(&cp).expect("install Switchyard");
    let client = cp.admin_client().await.expect("client");
    let mut model = Model::new(1000, 2);
    scale::bulk_load(&client, &model.services, 32)
        .await
        .expect("load 1k Services and slices");
    let opts = RunOpts {
        samples: SAMPLES,
        gap: Duration::from_millis(1100),
        limit: Duration::from_secs(600),
        period: Duration::from_millis(10),
        idle: Duration::ZERO,
    };
    for proxy in [
        Proxy::Switchyard(Mode::Nftables),
        Proxy::Switchyard(Mode::Iptables("nft")),
        Proxy::KubeProxy(Mode::Nftables),
        Proxy::KubeProxy(Mode::Iptables("nft")),
    ] {
        let label = proxy.label();
        let r = scale::run_proxy(&cp, &client, &mut model, proxy, &opts)
            .await
            .unwrap_or_else(|e| panic!("{label}: {e}"));
        assert_eq!(
            r.found.0, r.found.1,
            "{label}: ClusterIPs and endpoints in the kernel"
        );
        assert_eq!(r.found.1, (1000, 2000), "{label}: expected objects");
        assert_eq!(r.add_ms.len(), SAMPLES, "{label}: new-Service samples");
        assert_eq!(r.change_ms.len(), SAMPLES, "{label}: endpoint-change samples");
        assert!(r.first_sync.is_some(), "{label}: its sync-duration metric");
        assert!(r.counts.rules > 0, "{label}: rules counted: {:?}", r.counts);
        println!(
            "{label}: all rules {:.2} s, first sync {:?}, add p50 {:.0} ms, change p50 {:.0} ms, RSS {:.0} MiB, CPU {:.2} s, {:?}",
            r.to_rules.as_secs_f64(),
            r.first_sync,
            scale::quantile(&r.add_ms, 0.5),
            scale::quantile(&r.change_ms, 0.5),
            r.at_sync.rss_mib,
            r.at_sync.cpu_s,
            r.counts
        );
    }
}
