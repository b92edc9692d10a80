//! The mode advisor: which proxy mode a node should run, from what its agent measured. Pure: the
//! agent runs [`node_advice`] on its own figures (and writes the result in its NodeProxy status),
//! the planner sums a policy's nodes with [`pool_advice`] (the operator writes that in the
//! ProxyPolicy status), and `kubectl switchyard advise` shows both.
//!
//! The rules, from the seed articles and kube-proxy's own measurements:
//! - **IPVS → nftables**, or **iptables on kernels below 5.13** (nftables mode needs 5.13):
//!   IPVS is deprecated upstream since v1.35 (off by default in v1.40, removed in v1.43), and
//!   "old kernels use iptables, not IPVS".
//! - **iptables → nftables** when its syncs average well above 1 s ("若
//!   sync_proxy_rules_duration_seconds 指标的均值远高于 1 秒 … 应考虑切换到 nftables"); "well
//!   above" is read as [`SYNC_AVERAGE_LIMIT_MILLIS`] over at least [`MIN_SYNCS`] syncs.
//! - **iptables → nftables** from [`MANY_SERVICES`] service ports: iptables matches a new
//!   connection against one rule per service port in turn ("万级 Service 时下降"), and at 5,000
//!   and 10,000 Services nftables' median latency equals iptables' best case (kube-proxy's
//!   nftables blog post). On a node that cannot run nftables, iptables stays.
//! - **nftables stays**: the successor of both other modes. Small iptables nodes stay too.

use std::collections::{BTreeMap, BTreeSet};

use switchyard_crds::v1alpha1::{
    AdviceAction, AdviceFigures, Capabilities, ModeAdvice, PoolAdvice, PoolFigures, PoolRecommendation,
    ProxyMode, SyncMeasurements, advice_reasons as reasons,
};

/// iptables syncs averaging above this (milliseconds) are "well above 1 s".
pub const SYNC_AVERAGE_LIMIT_MILLIS: i64 = 1500;
/// Fewest syncs in the window before the sync-duration rule judges their average (the first
/// sync after a start is a full one and says little about the steady state alone).
pub const MIN_SYNCS: i64 = 5;
/// Service ports from which iptables mode's linear match costs every new connection.
pub const MANY_SERVICES: i64 = 5000;
/// The oldest kernel nftables mode runs on (major, minor).
pub const NFTABLES_MIN_KERNEL: (u32, u32) = (5, 13);

/// The figures the advisor uses: the agent's measurements and what its kernel can do.
pub fn figures(measurements: &SyncMeasurements, capabilities: &Capabilities) -> AdviceFigures {
    AdviceFigures {
        mode: measurements.mode,
        kernel_version: capabilities.kernel_version.clone(),
        nftables_usable: capabilities.nftables.usable,
        syncs: measurements.syncs,
        sync_average_millis: measurements.average_millis,
        sync_p90_millis: measurements.p90_millis,
        services: measurements.services,
        endpoints: measurements.endpoints,
        rules: measurements.rules,
    }
}

/// The recommendation for a node with these measurements and capabilities.
pub fn node_advice(measurements: &SyncMeasurements, capabilities: &Capabilities) -> ModeAdvice {
    advise(figures(measurements, capabilities))
}

/// The leading `major.minor` of a kernel release such as `6.18.44-fc-v657`.
fn kernel_major_minor(release: &str) -> Option<(u32, u32)> {
    let mut parts = release.split(|c: char| !c.is_ascii_digit());
    let major = parts.next()?.parse().ok()?;
    let minor = parts.next()?.parse().ok()?;
    Some((major, minor))
}

/// Why nftables cannot run here, in words.
fn no_nftables(f: &AdviceFigures) -> String {
    match kernel_major_minor(&f.kernel_version) {
        Some(v) if v < NFTABLES_MIN_KERNEL => format!(
            "kernel {} is below {}.{}, which nftables mode needs",
            f.kernel_version, NFTABLES_MIN_KERNEL.0, NFTABLES_MIN_KERNEL.1
        ),
        _ => format!("nf_tables is not usable on kernel {}", f.kernel_version),
    }
}

/// The measured figures, in words.
fn measured(f: &AdviceFigures) -> String {
    format!(
        "{} service ports, {} endpoints, {} rules; syncs average {} ms (p90 {} ms) over {} syncs; kernel {}",
        f.services, f.endpoints, f.rules, f.sync_average_millis, f.sync_p90_millis, f.syncs, f.kernel_version
    )
}

fn advice(
    action: AdviceAction,
    mode: ProxyMode,
    codes: &[&str],
    why: String,
    f: AdviceFigures,
) -> ModeAdvice {
    let verdict = match action {
        AdviceAction::Switch => format!("switch to {mode}"),
        AdviceAction::Stay => format!("stay on {mode}"),
    };
    ModeAdvice {
        action,
        recommended_mode: mode,
        reasons: codes.iter().map(|c| (*c).to_owned()).collect(),
        message: format!("{verdict}: {why}. Measured: {}", measured(&f)),
        figures: f,
    }
}

/// The recommendation for a node with these figures (see the module doc for the rules).
pub fn advise(f: AdviceFigures) -> ModeAdvice {
    match f.mode {
        ProxyMode::External => advice(
            AdviceAction::Stay,
            ProxyMode::External,
            &[reasons::EXTERNAL],
            "another service proxy serves this node; Switchyard measures nothing there".into(),
            f,
        ),
        ProxyMode::Nftables => advice(
            AdviceAction::Stay,
            ProxyMode::Nftables,
            &[reasons::NFTABLES],
            "nftables is the upstream successor of iptables and IPVS".into(),
            f,
        ),
        ProxyMode::Ipvs if f.nftables_usable => advice(
            AdviceAction::Switch,
            ProxyMode::Nftables,
            &[reasons::IPVS_DEPRECATED],
            "IPVS is deprecated since Kubernetes v1.35 (off by default in v1.40, removed in v1.43)".into(),
            f,
        ),
        ProxyMode::Ipvs => {
            let why = format!(
                "IPVS is deprecated since Kubernetes v1.35 (off by default in v1.40, removed in v1.43) and {}: iptables is the mode for such nodes",
                no_nftables(&f)
            );
            advice(
                AdviceAction::Switch,
                ProxyMode::Iptables,
                &[reasons::IPVS_DEPRECATED, reasons::NFTABLES_UNAVAILABLE],
                why,
                f,
            )
        }
        ProxyMode::Iptables => advise_iptables(f),
    }
}

/// iptables mode: the sync-duration and service-count rules.
fn advise_iptables(f: AdviceFigures) -> ModeAdvice {
    let mut codes = Vec::new();
    let mut why = Vec::new();
    let judged = f.syncs >= MIN_SYNCS;
    if judged && f.sync_average_millis > SYNC_AVERAGE_LIMIT_MILLIS {
        codes.push(reasons::SYNC_SLOW);
        why.push(format!(
            "syncs average {} ms over {} syncs, above {SYNC_AVERAGE_LIMIT_MILLIS} ms",
            f.sync_average_millis, f.syncs
        ));
    }
    if f.services >= MANY_SERVICES {
        codes.push(reasons::MANY_SERVICES);
        why.push(format!(
            "{} service ports (from {MANY_SERVICES} a new connection's linear walk through iptables' service rules costs more than nftables' map lookup)",
            f.services
        ));
    }
    let few = (!judged).then(|| {
        format!(
            "the sync-duration rule waits for {MIN_SYNCS} syncs ({} so far)",
            f.syncs
        )
    });
    if codes.is_empty() {
        codes.push(reasons::WITHIN_LIMITS);
        why.push(format!(
            "within the limits (syncs average at most {SYNC_AVERAGE_LIMIT_MILLIS} ms, fewer than {MANY_SERVICES} service ports)"
        ));
        codes.extend(few.is_some().then_some(reasons::FEW_SYNCS));
        why.extend(few);
        return advice(AdviceAction::Stay, ProxyMode::Iptables, &codes, why.join("; "), f);
    }
    codes.extend(few.is_some().then_some(reasons::FEW_SYNCS));
    why.extend(few);
    if f.nftables_usable {
        return advice(
            AdviceAction::Switch,
            ProxyMode::Nftables,
            &codes,
            why.join("; "),
            f,
        );
    }
    codes.push(reasons::NFTABLES_UNAVAILABLE);
    why.push(format!("but {}: iptables stays", no_nftables(&f)));
    advice(AdviceAction::Stay, ProxyMode::Iptables, &codes, why.join("; "), f)
}

/// The summary over a pool: `advice` has one entry per governed node (`None`: no recommendation
/// reported yet).
pub fn pool_advice<'a>(advice: impl IntoIterator<Item = Option<&'a ModeAdvice>>) -> PoolAdvice {
    let mut groups: BTreeMap<(AdviceAction, ProxyMode), (i32, BTreeSet<String>)> = BTreeMap::new();
    let (mut advised, mut unadvised) = (0, 0);
    let mut figures = PoolFigures::default();
    for a in advice {
        let Some(a) = a else {
            unadvised += 1;
            continue;
        };
        advised += 1;
        let group = groups.entry((a.action, a.recommended_mode)).or_default();
        group.0 += 1;
        group.1.extend(a.reasons.iter().cloned());
        let f = &a.figures;
        figures.max_sync_average_millis = figures.max_sync_average_millis.max(f.sync_average_millis);
        figures.max_sync_p90_millis = figures.max_sync_p90_millis.max(f.sync_p90_millis);
        figures.max_services = figures.max_services.max(f.services);
        figures.max_endpoints = figures.max_endpoints.max(f.endpoints);
        figures.max_rules = figures.max_rules.max(f.rules);
        figures.nodes_without_nftables += i32::from(!f.nftables_usable);
    }
    // Switches first, then by mode.
    let recommendations: Vec<PoolRecommendation> = groups
        .into_iter()
        .rev()
        .map(|((action, mode), (nodes, reasons))| PoolRecommendation {
            action,
            mode,
            nodes,
            reasons: reasons.into_iter().collect(),
        })
        .collect();
    let message = pool_message(&recommendations, advised, unadvised, &figures);
    PoolAdvice {
        advised_nodes: advised,
        unadvised_nodes: unadvised,
        recommendations,
        figures,
        message,
    }
}

fn pool_message(recs: &[PoolRecommendation], advised: i32, unadvised: i32, f: &PoolFigures) -> String {
    if advised == 0 {
        return format!("no recommendation yet ({unadvised} nodes without measurements)");
    }
    let parts: Vec<String> = recs
        .iter()
        .map(|r| {
            let verb = match r.action {
                AdviceAction::Switch => "switch to",
                AdviceAction::Stay => "stay on",
            };
            format!("{} {verb} {} ({})", r.nodes, r.mode, r.reasons.join(", "))
        })
        .collect();
    format!(
        "{}; {unadvised} without advice; largest figures: syncs average {} ms (p90 {} ms), {} service ports, {} endpoints, {} rules; {} nodes cannot run nftables",
        parts.join(", "),
        f.max_sync_average_millis,
        f.max_sync_p90_millis,
        f.max_services,
        f.max_endpoints,
        f.max_rules,
        f.nodes_without_nftables
    )
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn figures(
        mode: ProxyMode,
        kernel: &str,
        nft: bool,
        syncs: i64,
        avg: i64,
        services: i64,
    ) -> AdviceFigures {
        AdviceFigures {
            mode,
            kernel_version: kernel.into(),
            nftables_usable: nft,
            syncs,
            sync_average_millis: avg,
            sync_p90_millis: avg * 2,
            services,
            endpoints: services * 2,
            rules: services * 8,
        }
    }

    use AdviceAction::{Stay, Switch};
    use ProxyMode::{External, Iptables, Ipvs, Nftables};

    #[test]
    fn every_rule_by_table() {
        // (case, figures, action, mode, reasons)
        let cases: Vec<(&str, AdviceFigures, AdviceAction, ProxyMode, &[&str])> = vec![
            (
                "small iptables node",
                figures(Iptables, "6.18.0", true, 40, 12, 50),
                Stay,
                Iptables,
                &["WithinLimits"],
            ),
            (
                "iptables, sync average at the limit",
                figures(Iptables, "6.18.0", true, 40, 1500, 100),
                Stay,
                Iptables,
                &["WithinLimits"],
            ),
            (
                "iptables, syncs average above 1.5 s",
                figures(Iptables, "6.18.0", true, 40, 1501, 100),
                Switch,
                Nftables,
                &["SyncSlow"],
            ),
            (
                "slow syncs but too few to judge",
                figures(Iptables, "6.18.0", true, 4, 9000, 100),
                Stay,
                Iptables,
                &["WithinLimits", "FewSyncs"],
            ),
            (
                "5 syncs are enough",
                figures(Iptables, "6.18.0", true, 5, 9000, 100),
                Switch,
                Nftables,
                &["SyncSlow"],
            ),
            (
                "4999 service ports",
                figures(Iptables, "6.18.0", true, 40, 10, 4999),
                Stay,
                Iptables,
                &["WithinLimits"],
            ),
            (
                "5000 service ports",
                figures(Iptables, "6.18.0", true, 40, 10, 5000),
                Switch,
                Nftables,
                &["ManyServices"],
            ),
            (
                "10k services after one sync",
                figures(Iptables, "6.18.0", true, 1, 850, 10_000),
                Switch,
                Nftables,
                &["ManyServices", "FewSyncs"],
            ),
            (
                "slow and many",
                figures(Iptables, "6.18.0", true, 40, 2000, 10_000),
                Switch,
                Nftables,
                &["SyncSlow", "ManyServices"],
            ),
            (
                "many services, kernel 5.10",
                figures(Iptables, "5.10.0-28-amd64", false, 40, 2000, 10_000),
                Stay,
                Iptables,
                &["SyncSlow", "ManyServices", "NftablesUnavailable"],
            ),
            (
                "ipvs, new kernel",
                figures(Ipvs, "6.1.0", true, 40, 5, 10),
                Switch,
                Nftables,
                &["IPVSDeprecated"],
            ),
            (
                "ipvs, kernel 4.19",
                figures(Ipvs, "4.19.0", false, 40, 5, 10),
                Switch,
                Iptables,
                &["IPVSDeprecated", "NftablesUnavailable"],
            ),
            (
                "ipvs, kernel 5.13 without nf_tables",
                figures(Ipvs, "5.13.0", false, 40, 5, 10),
                Switch,
                Iptables,
                &["IPVSDeprecated", "NftablesUnavailable"],
            ),
            (
                "nftables stays however big",
                figures(Nftables, "6.18.0", true, 40, 3000, 50_000),
                Stay,
                Nftables,
                &["Nftables"],
            ),
            (
                "external",
                figures(External, "6.18.0", true, 0, 0, 0),
                Stay,
                External,
                &["External"],
            ),
        ];
        for (case, f, action, mode, codes) in cases {
            let a = advise(f.clone());
            assert_eq!(
                (a.action, a.recommended_mode),
                (action, mode),
                "{case}: {}",
                a.message
            );
            assert_eq!(
                a.reasons,
                codes.iter().map(|c| c.to_string()).collect::<Vec<_>>(),
                "{case}"
            );
            assert_eq!(a.figures, f, "{case}: the figures used are reported");
        }
    }

    #[test]
    fn messages_carry_the_figures_and_limits() {
        let a = advise(figures(Iptables, "6.18.0", true, 12, 2100, 10_000));
        assert!(a.message.starts_with("switch to nftables: "), "{}", a.message);
        for part in [
            "2100 ms over 12 syncs",
            "above 1500 ms",
            "10000 service ports",
            "80000 rules",
            "kernel 6.18.0",
        ] {
            assert!(a.message.contains(part), "{part:?} in {}", a.message);
        }
        let old = advise(figures(Ipvs, "4.19.0-27", false, 3, 5, 10));
        assert!(
            old.message.contains("kernel 4.19.0-27 is below 5.13"),
            "{}",
            old.message
        );
        let no_nft = advise(figures(Ipvs, "6.1.0", false, 3, 5, 10));
        assert!(
            no_nft.message.contains("nf_tables is not usable"),
            "{}",
            no_nft.message
        );
    }

    #[test]
    fn kernel_releases_parse() {
        assert_eq!(kernel_major_minor("6.18.44-fc-v657"), Some((6, 18)));
        assert_eq!(kernel_major_minor("5.4"), Some((5, 4)));
        assert_eq!(kernel_major_minor("4.19.0-27-amd64"), Some((4, 19)));
        assert_eq!(kernel_major_minor("weird"), None);
        // 5.9 < 5.13 numerically, not as text.
        assert!(kernel_major_minor("5.9.0").unwrap() < NFTABLES_MIN_KERNEL);
    }

    #[test]
    fn node_advice_reads_measurements_and_capabilities() {
        let m = SyncMeasurements {
            mode: Iptables,
            measured_at: None,
            window_seconds: 60,
            syncs: 7,
            full_syncs: 2,
            average_millis: 700,
            p90_millis: 900,
            max_millis: 950,
            services: 10_001,
            endpoints: 20_000,
            rules: 80_028,
        };
        let mut caps = Capabilities {
            kernel_version: "6.18.0".into(),
            ..Capabilities::default()
        };
        caps.nftables.usable = true;
        let a = node_advice(&m, &caps);
        assert_eq!((a.action, a.recommended_mode), (Switch, Nftables));
        assert_eq!(
            (
                a.figures.syncs,
                a.figures.sync_average_millis,
                a.figures.sync_p90_millis,
                a.figures.rules
            ),
            (7, 700, 900, 80_028)
        );
        caps.nftables.usable = false;
        assert_eq!(node_advice(&m, &caps).action, Stay);
    }

    #[test]
    fn pool_counts_each_recommendation_and_keeps_the_largest_figures() {
        let big = advise(figures(Iptables, "6.18.0", true, 12, 2100, 10_000));
        let big2 = advise(figures(Iptables, "6.18.0", true, 12, 900, 6000));
        let small = advise(figures(Iptables, "6.18.0", true, 40, 12, 50));
        let old = advise(figures(Ipvs, "4.19.0", false, 40, 5, 10));
        let pool = pool_advice([Some(&small), Some(&big), None, Some(&old), Some(&big2)]);
        assert_eq!((pool.advised_nodes, pool.unadvised_nodes), (4, 1));
        let got: Vec<(AdviceAction, ProxyMode, i32, Vec<String>)> = pool
            .recommendations
            .iter()
            .map(|r| (r.action, r.mode, r.nodes, r.reasons.clone()))
            .collect();
        let s = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>();
        assert_eq!(
            got,
            vec![
                (Switch, Nftables, 2, s(&["ManyServices", "SyncSlow"])),
                (Switch, Iptables, 1, s(&["IPVSDeprecated", "NftablesUnavailable"])),
                (Stay, Iptables, 1, s(&["WithinLimits"])),
            ]
        );
        assert_eq!(
            pool.figures,
            PoolFigures {
                max_sync_average_millis: 2100,
                max_sync_p90_millis: 4200,
                max_services: 10_000,
                max_endpoints: 20_000,
                max_rules: 80_000,
                nodes_without_nftables: 1,
            }
        );
        assert!(
            pool.message
                .starts_with("2 switch to nftables (ManyServices, SyncSlow), 1 switch to iptables"),
            "{}",
            pool.message
        );
        let empty = pool_advice([None, None]);
        assert_eq!(
            (
                empty.advised_nodes,
                empty.unadvised_nodes,
                empty.recommendations.len()
            ),
            (0, 2, 0)
        );
        assert_eq!(
            empty.message,
            "no recommendation yet (2 nodes without measurements)"
        );
    }
}
