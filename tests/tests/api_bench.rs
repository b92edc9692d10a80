//! Smoke check of the API scale benchmark (`src/bin/api-bench.rs`, issue 16) at its quick row:
//! 1,000 Services with 1–4 endpoints loaded into the real apiserver, then Switchyard (nftables and
//! iptables mode) and the real kube-proxy (both modes) each started in a fresh node namespace.
//! It asserts correctness only — every ClusterIP and endpoint reached the kernel's own listing,
//! every latency sample (new Service, endpoint changed) was observed in the kernel, the sync
//! metric was read, new flows met no rules before the proxy and were all DNATed by its rules —
//! and prints the measured figures without judging them (no timing bounds beyond generous waits).

use std::time::Duration;

use switchyard_e2e::{
    agent::install_switchyard,
    controlplane::ControlPlane,
    kube_proxy::Mode,
    scale::{
        self, Model, Proxy, RunOpts,
        lists::{self, Encoding},
    },
};

const SAMPLES: usize = 5;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_bench_1k_every_rule_and_change_reaches_the_kernel() {
    let cp = ControlPlane::start().await.expect("control plane");
    install_switchyard(&cp).expect("install Switchyard");
    let client = cp.admin_client().await.expect("client");
    // Endpoint counts 1–4 in turn: four endpoint maps and a two-level dispatch in our nftables
    // table, each count's first packets checked to be DNATed.
    let mut model = Model::with_counts(1000, 1, 4);
    scale::bulk_load(&client, &model.services, 32)
        .await
        .expect("load 1k Services and slices");
    // The floor the bench prints: both lists fetched in each encoding, protobuf the smaller.
    let mut sizes = Vec::new();
    for encoding in [Encoding::Json, Encoding::Protobuf] {
        let fetches = lists::fetch_both(&client, encoding, 1)
            .await
            .unwrap_or_else(|e| panic!("both lists as {}: {e}", encoding.name()));
        println!("lists: {}", lists::describe(encoding, &fetches));
        sizes.push(fetches[0].bytes);
    }
    for kind in 0..2 {
        assert!(
            sizes[1][kind] > 0 && sizes[1][kind] < sizes[0][kind],
            "protobuf list smaller than JSON: {sizes:?}"
        );
    }
    // The apiserver's own create of each kind: every sample timed, each probe Service deleted
    // again (the proxies below must see the loaded 1k only).
    let cost = scale::create_cost::measure(&client, 3)
        .await
        .expect("time Service creates");
    println!("{}", cost.describe());
    assert_eq!((cost.with_cluster_ip.len(), cost.headless.len()), (3, 3));
    assert!(
        cost.with_cluster_ip
            .iter()
            .chain(&cost.headless)
            .all(|ms| *ms > 0.0),
        "every create timed: {cost:?}"
    );
    let opts = RunOpts {
        samples: SAMPLES,
        gap: Duration::from_millis(1100),
        limit: Duration::from_secs(600),
        period: Duration::from_millis(10),
        idle: Duration::ZERO,
        // A small first-packet run: its checks (no DNAT before the proxy, every flow DNATed with
        // its rules) hold for every proxy; the figures come from `api-bench --first-packet`.
        first_packet: Some(scale::first_packet::FlowOpts {
            flows: 2000,
            batches: 1,
        }),
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
        assert_eq!(r.found.1, (1000, 2500), "{label}: expected objects");
        assert_eq!(r.add_ms.len(), SAMPLES, "{label}: new-Service samples");
        assert_eq!(r.change_ms.len(), SAMPLES, "{label}: endpoint-change samples");
        assert!(r.first_sync.is_some(), "{label}: its sync-duration metric");
        // Each timed write's event reached the bare watcher, after the write began.
        assert_eq!(r.event_ms.len(), 2 * SAMPLES, "{label}: bare watcher events");
        assert!(
            r.event_ms.iter().all(|&ms| ms > 0.0 && ms.is_finite()),
            "{label}: bare watcher events {:?}",
            r.event_ms
        );
        if let Proxy::Switchyard(_) = proxy {
            // The agent logs both lists and its first full sync (the bench's start-up breakdown).
            let t = r
                .timeline
                .unwrap_or_else(|| panic!("{label}: no start-up timeline in its log"));
            assert!(t.0 >= 0.0 && t.1 >= 0.0 && t.2 >= 0.0, "{label}: {t:?}");
        }
        assert!(r.counts.rules > 0, "{label}: rules counted: {:?}", r.counts);
        if proxy == Proxy::Switchyard(Mode::Iptables("nft")) {
            // 2,500 endpoints: large-cluster mode, as kube-proxy's. Only the jump per ClusterIP and
            // the SVC chain's masquerade rule keep comments (2 per Service, plus a few fixed), not
            // the 7,500 rules to and in the SEP chains.
            assert!(
                r.counts.comments < 2 * 1000 + 100,
                "{label}: per-endpoint rules uncommented in the kernel: {:?}",
                r.counts
            );
        }
        let counts: Vec<usize> = r.first_packet.iter().map(|c| c.endpoints).collect();
        assert_eq!(
            counts,
            [1, 4],
            "{label}: first packets to the fewest and most endpoints"
        );
        for fp in &r.first_packet {
            assert!(
                fp.baseline_us > 0.0 && fp.with_rules_us > 0.0,
                "{label}: first-packet CPU measured: {fp:?}"
            );
        }
        println!(
            "{label}: all rules {:.2} s (resolution {} ms), first sync {:?}, timeline {:?}, add p50 {:.0} ms, change p50 {:.0} ms, RSS {:.0} MiB, CPU {:.2} s, {:?}, first packet {:?}",
            r.to_rules.as_secs_f64(),
            r.listing_cost.as_millis(),
            r.first_sync,
            r.timeline,
            scale::quantile(&r.add_ms, 0.5),
            scale::quantile(&r.change_ms, 0.5),
            r.at_sync.rss_mib,
            r.at_sync.cpu_s,
            r.counts,
            r.first_packet
        );
    }
}
