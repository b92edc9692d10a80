//! Table tests for the capability decisions.

use super::*;

fn facts() -> HostFacts {
    HostFacts {
        kernel_release: "6.18.44-fc-v657".into(),
        nf_tables: Ok(()),
        iptables_legacy: Ok(0),
        iptables_nft: Ok(0),
        kubelet_chains_legacy: false,
        kubelet_chains_nft: false,
        ipvs_family: Err("generic netlink family IPVS: No such file or directory".into()),
        ipvs_modules: vec![],
        ipset: Ok(()),
        conntrack: ConntrackFacts::default(),
    }
}

#[test]
fn kernel_versions_parse_and_compare_numerically() {
    let cases: &[(&str, Option<KernelVersion>)] = &[
        ("6.18.44-fc-v657", Some(KernelVersion(6, 18, 44))),
        ("5.13", Some(KernelVersion(5, 13, 0))),
        ("5.4.0-150-generic", Some(KernelVersion(5, 4, 0))),
        ("10.0.1", Some(KernelVersion(10, 0, 1))),
        ("4.19.0+", Some(KernelVersion(4, 19, 0))),
        ("6", None),
        ("", None),
        ("linux", None),
    ];
    for (release, want) in cases {
        assert_eq!(KernelVersion::parse(release), *want, "{release}");
    }
    // Lexicographic comparison would get these wrong.
    assert!(KernelVersion(10, 0, 0) > NFTABLES_MIN_KERNEL);
    assert!(KernelVersion(5, 9, 0) < NFTABLES_MIN_KERNEL);
}

#[test]
fn nftables_mode_needs_the_table_and_kernel_5_13() {
    let cases: &[(&str, Result<(), String>, bool)] = &[
        ("6.18.44", Ok(()), true),
        ("5.13.0", Ok(()), true),
        ("5.12.19", Ok(()), false),
        ("5.4.0", Ok(()), false),
        ("10.1.0", Ok(()), true),
        (
            "6.1.0",
            Err("create table: Operation not supported".into()),
            false,
        ),
        ("garbage", Ok(()), false),
    ];
    for (release, table, want) in cases {
        let caps = decide(&HostFacts {
            kernel_release: (*release).into(),
            nf_tables: table.clone(),
            ..facts()
        });
        assert_eq!(caps.nftables.usable, *want, "{release} {table:?}");
        assert_eq!(
            caps.supported_modes.contains(&ProxyMode::Nftables),
            *want,
            "{release}"
        );
        if !want {
            assert!(caps.nftables.detail.is_some(), "a refusal carries its reason");
        }
    }
}

#[test]
fn ipvs_mode_needs_family_ipset_iptables_and_a_scheduler() {
    let ipvs = || HostFacts {
        ipvs_family: Ok(33),
        ipvs_modules: vec![
            "ip_vs_rr.ko.xz".into(),
            "ip_vs_sh.ko".into(),
            "ip_vs_ftp.ko".into(),
        ],
        ..facts()
    };
    let caps = decide(&ipvs());
    assert!(caps.supported_modes.contains(&ProxyMode::Ipvs));
    assert_eq!(caps.ipvs_schedulers, vec!["rr", "sh"]);

    let no_ipset = decide(&HostFacts {
        ipset: Err("ipset: not found".into()),
        ..ipvs()
    });
    assert!(!no_ipset.supported_modes.contains(&ProxyMode::Ipvs));
    let no_sched = decide(&HostFacts {
        ipvs_modules: vec![],
        ..ipvs()
    });
    assert!(!no_sched.supported_modes.contains(&ProxyMode::Ipvs));
    let no_family = decide(&facts());
    assert!(!no_family.ipvs.usable);
    assert!(no_family.ipvs_schedulers.is_empty());
    assert_eq!(
        no_family.supported_modes,
        vec![ProxyMode::Iptables, ProxyMode::Nftables, ProxyMode::External]
    );
}

#[test]
fn iptables_variant_follows_kubelets_markers_then_rules_then_prefers_nft() {
    let err = || Err::<usize, String>("missing".into());
    // (legacy rule count, nft rule count, kubelet's chains in legacy, in nft, chosen variant)
    type Case<'a> = (
        Result<usize, String>,
        Result<usize, String>,
        bool,
        bool,
        Option<&'a str>,
    );
    let cases: &[Case] = &[
        // No markers: more rules win, a tie (the empty node) is nft, as iptables-wrapper.
        (Ok(0), Ok(0), false, false, Some("nft")),
        (Ok(3), Ok(40), false, false, Some("nft")),
        (Ok(40), Ok(3), false, false, Some("legacy")),
        (Ok(5), Ok(5), false, false, Some("nft")),
        // kubelet's markers decide before rule counts: nft first, then legacy.
        (Ok(40), Ok(0), false, true, Some("nft")),
        (Ok(0), Ok(40), true, false, Some("legacy")),
        (Ok(40), Ok(40), true, true, Some("nft")),
        // A marker in a variant whose tools fail does not count.
        (Ok(0), err(), false, true, Some("legacy")),
        (err(), Ok(0), true, false, Some("nft")),
        (err(), Ok(0), false, false, Some("nft")),
        (Ok(0), err(), false, false, Some("legacy")),
        (err(), err(), true, true, None),
    ];
    for (legacy, nft, marked_legacy, marked_nft, want) in cases {
        let f = HostFacts {
            iptables_legacy: legacy.clone(),
            iptables_nft: nft.clone(),
            kubelet_chains_legacy: *marked_legacy,
            kubelet_chains_nft: *marked_nft,
            ..facts()
        };
        assert_eq!(
            iptables_variant(&f),
            *want,
            "{legacy:?} {nft:?} {marked_legacy} {marked_nft}"
        );
        assert_eq!(decide(&f).iptables_variant.as_deref(), *want);
    }
    let none = decide(&HostFacts {
        iptables_legacy: err(),
        iptables_nft: err(),
        ..facts()
    });
    assert!(!none.supported_modes.contains(&ProxyMode::Iptables));
    assert!(
        none.supported_modes.contains(&ProxyMode::External),
        "handing over to another proxy is always possible"
    );
}

#[test]
fn kubelet_marker_chains_are_read_from_chain_declarations() {
    let kubelet = "*mangle\n:PREROUTING ACCEPT [0:0]\n:KUBE-IPTABLES-HINT - [0:0]\n:KUBE-KUBELET-CANARY - [0:0]\nCOMMIT\n";
    assert!(has_kubelet_chains(kubelet));
    assert!(has_kubelet_chains(
        "*mangle\n:KUBE-KUBELET-CANARY - [0:0]\nCOMMIT\n"
    ));
    // kube-proxy's canary, or a rule mentioning the name, is no marker.
    assert!(!has_kubelet_chains(
        "*mangle\n:KUBE-PROXY-CANARY - [0:0]\nCOMMIT\n"
    ));
    assert!(!has_kubelet_chains(
        "*mangle\n-A X -m comment --comment KUBE-IPTABLES-HINT -j RETURN\n"
    ));
    assert!(!has_kubelet_chains(""));
}
