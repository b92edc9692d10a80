//! The CRDs on a real kube-apiserver: install, accept a valid policy, reject invalid ones with the
//! exact message a user sees, print the documented columns, explain the fields.

use switchyard_e2e::{binaries::workspace_root, controlplane::ControlPlane};

const BASE: &str = r#"apiVersion: switchyard.dev/v1alpha1
kind: ProxyPolicy
metadata:
  name: NAME
spec:
  nodeSelector:
    matchLabels:
      pool: general
  mode: nftables
  rollout:
    waves:
    - name: canary
      nodes: 1
    - name: rest
      nodes: 100%
"#;

/// Builds a policy named `name` from BASE with `from` replaced by `to`.
fn variant(name: &str, from: &str, to: &str) -> String {
    let base = BASE.replace("NAME", name);
    assert!(base.contains(from), "test bug: {from:?} not in the base policy");
    base.replacen(from, to, 1)
}

/// (policy name, mistake: replace this, with this, exact message kubectl prints)
fn invalid_cases() -> Vec<(&'static str, String, &'static str)> {
    let waves =
        "  rollout:\n    waves:\n    - name: canary\n      nodes: 1\n    - name: rest\n      nodes: 100%\n";
    vec![
        (
            "unknown-mode",
            variant("unknown-mode", "mode: nftables", "mode: userspace"),
            r#"spec.mode: Unsupported value: "userspace": supported values: "iptables", "ipvs", "nftables", "external""#,
        ),
        (
            "zero-percent-wave",
            variant("zero-percent-wave", "nodes: 1\n", "nodes: 0%\n"),
            r#"spec.rollout.waves[0].nodes: Invalid value: "0%": wave nodes must be a count from 1 to 100000 or a whole percentage from 1% to 100% (e.g. 25%)"#,
        ),
        (
            "zero-count-wave",
            variant("zero-count-wave", "nodes: 1\n", "nodes: 0\n"),
            r#"spec.rollout.waves[0].nodes: Invalid value: 0: wave nodes must be a count from 1 to 100000 or a whole percentage from 1% to 100% (e.g. 25%)"#,
        ),
        (
            "percent-over-100",
            variant("percent-over-100", "nodes: 100%", "nodes: 150%"),
            r#"spec.rollout.waves[1].nodes: Invalid value: "150%": wave nodes must be a count from 1 to 100000 or a whole percentage from 1% to 100% (e.g. 25%)"#,
        ),
        (
            "max-unavailable-zero",
            variant(
                "max-unavailable-zero",
                "  rollout:\n",
                "  rollout:\n    maxUnavailable: 0\n",
            ),
            r#"spec.rollout.maxUnavailable: Invalid value: 0: rollout.maxUnavailable must be a count from 1 to 100000 or a whole percentage from 1% to 100% (e.g. 25%)"#,
        ),
        (
            "max-unavailable-bad-percent",
            variant(
                "max-unavailable-bad-percent",
                "  rollout:\n",
                "  rollout:\n    maxUnavailable: \"ten%\"\n",
            ),
            r#"spec.rollout.maxUnavailable: Invalid value: "ten%": rollout.maxUnavailable must be a count from 1 to 100000 or a whole percentage from 1% to 100% (e.g. 25%)"#,
        ),
        (
            "max-unavailable-int32-overflow",
            variant(
                "max-unavailable-int32-overflow",
                "  rollout:\n",
                "  rollout:\n    maxUnavailable: 2147483648\n",
            ),
            r#"spec.rollout.maxUnavailable: Invalid value: 2147483648: rollout.maxUnavailable must be a count from 1 to 100000 or a whole percentage from 1% to 100% (e.g. 25%)"#,
        ),
        (
            "max-unavailable-fraction",
            variant(
                "max-unavailable-fraction",
                "  rollout:\n",
                "  rollout:\n    maxUnavailable: \"50.5%\"\n",
            ),
            r#"spec.rollout.maxUnavailable: Invalid value: "50.5%": rollout.maxUnavailable must be a count from 1 to 100000 or a whole percentage from 1% to 100% (e.g. 25%)"#,
        ),
        (
            "wave-nodes-huge",
            variant("wave-nodes-huge", "nodes: 1\n", "nodes: 3000000000\n"),
            r#"spec.rollout.waves[0].nodes: Invalid value: 3000000000: wave nodes must be a count from 1 to 100000 or a whole percentage from 1% to 100% (e.g. 25%)"#,
        ),
        (
            "wave-selector-gt",
            variant(
                "wave-selector-gt",
                "nodes: 1\n",
                "nodeSelector:\n        matchExpressions:\n        - key: zone\n          operator: Gt\n          values: [\"1\"]\n",
            ),
            r#"spec.rollout.waves[0].nodeSelector: Invalid value: matchExpressions[].operator must be one of In, NotIn, Exists, DoesNotExist (case-sensitive)"#,
        ),
        (
            "wave-selector-in-without-values",
            variant(
                "wave-selector-in-without-values",
                "nodes: 1\n",
                "nodeSelector:\n        matchExpressions:\n        - key: zone\n          operator: In\n",
            ),
            r#"spec.rollout.waves[0].nodeSelector: Invalid value: matchExpressions[]: In and NotIn need at least one value in values; Exists and DoesNotExist must have no values"#,
        ),
        (
            "bad-label-key",
            variant(
                "bad-label-key",
                "      pool: general\n",
                "      \"pool name\": general\n",
            ),
            r#"spec.nodeSelector: Invalid value: matchLabels keys must be label keys"#,
        ),
        (
            "bad-label-value",
            variant(
                "bad-label-value",
                "      pool: general\n",
                "      pool: \"-general\"\n",
            ),
            r#"spec.nodeSelector: Invalid value: matchLabels values must be label values"#,
        ),
        (
            "localhost-nodeports-ipvs",
            variant(
                "localhost-nodeports-ipvs",
                "mode: nftables\n",
                "mode: ipvs\n  proxy:\n    localhostNodePorts: true\n",
            ),
            r#"spec: Invalid value: proxy.localhostNodePorts works in iptables and nftables mode only"#,
        ),
        (
            "localhost-nodeports-ipvs-fallback",
            variant(
                "localhost-nodeports-ipvs-fallback",
                "mode: nftables\n",
                "mode: iptables\n  fallback: ipvs\n  proxy:\n    localhostNodePorts: true\n",
            ),
            r#"spec: Invalid value: proxy.localhostNodePorts works in iptables and nftables mode only"#,
        ),
        (
            "primary-with-cidr",
            variant(
                "primary-with-cidr",
                "mode: nftables\n",
                "mode: nftables\n  proxy:\n    nodePortAddresses: [primary, 10.0.0.0/8]\n",
            ),
            r#"spec.proxy.nodePortAddresses: Invalid value: proxy.nodePortAddresses: 'primary' cannot be combined with CIDRs"#,
        ),
        (
            "bad-probe-name",
            variant(
                "bad-probe-name",
                "mode: nftables\n",
                "mode: nftables\n  healthGate:\n    probes:\n    - namespace: default\n      name: My_Service\n",
            ),
            r#"spec.healthGate.probes[0].name: Invalid value: "My_Service": probe name must be a Service name"#,
        ),
        (
            "name-64-characters-long-aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
            BASE.replace(
                "NAME",
                "name-64-characters-long-aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
            ),
            r#"metadata.name of a ProxyPolicy must be at most 63 characters"#,
        ),
        (
            "duplicate-wave-names",
            variant("duplicate-wave-names", "name: rest", "name: canary"),
            r#"spec.rollout: Invalid value: rollout.waves names must be unique"#,
        ),
        (
            "bad-selector-operator",
            variant(
                "bad-selector-operator",
                "    matchLabels:\n      pool: general\n",
                "    matchExpressions:\n    - key: pool\n      operator: Like\n      values: [general]\n",
            ),
            r#"spec.nodeSelector: Invalid value: matchExpressions[].operator must be one of In, NotIn, Exists, DoesNotExist (case-sensitive)"#,
        ),
        (
            "selector-in-without-values",
            variant(
                "selector-in-without-values",
                "    matchLabels:\n      pool: general\n",
                "    matchExpressions:\n    - key: pool\n      operator: In\n",
            ),
            r#"spec.nodeSelector: Invalid value: matchExpressions[]: In and NotIn need at least one value in values; Exists and DoesNotExist must have no values"#,
        ),
        (
            "negative-soak",
            variant("negative-soak", "nodes: 1\n", "nodes: 1\n      soakSeconds: -5\n"),
            r#"spec.rollout.waves[0].soakSeconds: Invalid value: -5: spec.rollout.waves[0].soakSeconds in body should be greater than or equal to 0"#,
        ),
        (
            "bad-wave-name",
            variant("bad-wave-name", "name: canary", "name: Canary_1"),
            r#"spec.rollout.waves[0].name: Invalid value: "Canary_1": spec.rollout.waves[0].name in body should match '^[a-z0-9]([-a-z0-9]*[a-z0-9])?$'"#,
        ),
        (
            "wave-without-nodes",
            variant("wave-without-nodes", "      nodes: 1\n", ""),
            r#"spec.rollout.waves[0]: Invalid value: a wave must set nodes, nodeSelector, or both"#,
        ),
        (
            "external-with-fallback",
            variant(
                "external-with-fallback",
                "mode: nftables",
                "mode: external\n  fallback: iptables",
            ),
            r#"spec: Invalid value: spec.fallback has no meaning with mode external (every node can hand over to another proxy): remove spec.fallback"#,
        ),
        (
            "external-with-proxy-settings",
            variant(
                "external-with-proxy-settings",
                "mode: nftables\n",
                "mode: external\n  proxy:\n    masqueradeAll: true\n",
            ),
            r#"spec: Invalid value: spec.proxy configures Switchyard's own data planes; with mode external another proxy serves the pool and is configured its own way: remove spec.proxy"#,
        ),
        (
            "fallback-equals-mode",
            variant(
                "fallback-equals-mode",
                "mode: nftables",
                "mode: nftables\n  fallback: nftables",
            ),
            r#"spec: Invalid value: spec.fallback must differ from spec.mode (use 'skip' to leave incompatible nodes alone)"#,
        ),
        (
            "unknown-fallback",
            variant(
                "unknown-fallback",
                "mode: nftables",
                "mode: nftables\n  fallback: userspace",
            ),
            r#"spec.fallback: Unsupported value: "userspace": supported values: "skip", "iptables", "ipvs", "nftables", "external""#,
        ),
        (
            "localhost-nodeports-nftables-ipvs-fallback",
            variant(
                "localhost-nodeports-nftables-ipvs-fallback",
                waves,
                &format!("  fallback: ipvs\n{waves}  proxy:\n    localhostNodePorts: true\n"),
            ),
            r#"spec: Invalid value: proxy.localhostNodePorts works in iptables and nftables mode only (IPVS does not serve NodePorts on 127.0.0.1, nor does kube-proxy's IPVS mode): set spec.mode (and spec.fallback, if any) to iptables or nftables, or remove proxy.localhostNodePorts"#,
        ),
        (
            "min-sync-above-sync",
            variant(
                "min-sync-above-sync",
                waves,
                &format!("{waves}  proxy:\n    minSyncPeriodSeconds: 60\n    syncPeriodSeconds: 30\n"),
            ),
            r#"spec.proxy: Invalid value: proxy.minSyncPeriodSeconds must not exceed proxy.syncPeriodSeconds"#,
        ),
        (
            "bad-cluster-cidr",
            variant(
                "bad-cluster-cidr",
                waves,
                &format!("{waves}  proxy:\n    clusterCIDR: 10.244.0.0/33\n"),
            ),
            r#"spec.proxy.clusterCIDR: Invalid value: "10.244.0.0/33": proxy.clusterCIDR must be a CIDR, or an IPv4 and an IPv6 CIDR separated by a comma, such as 10.244.0.0/16,fd00:10:244::/56"#,
        ),
        (
            "two-ipv4-cluster-cidrs",
            variant(
                "two-ipv4-cluster-cidrs",
                waves,
                &format!("{waves}  proxy:\n    clusterCIDR: 10.244.0.0/16,10.245.0.0/16\n"),
            ),
            r#"spec.proxy.clusterCIDR: Invalid value: "10.244.0.0/16,10.245.0.0/16": proxy.clusterCIDR must be a CIDR, or an IPv4 and an IPv6 CIDR separated by a comma, such as 10.244.0.0/16,fd00:10:244::/56"#,
        ),
        (
            "bad-nodeport-address",
            variant(
                "bad-nodeport-address",
                waves,
                &format!("{waves}  proxy:\n    nodePortAddresses: [secondary]\n"),
            ),
            r#"spec.proxy.nodePortAddresses: Invalid value: proxy.nodePortAddresses entries must be CIDRs or 'primary'"#,
        ),
        (
            "unknown-ipvs-scheduler",
            variant(
                "unknown-ipvs-scheduler",
                waves,
                &format!("{waves}  proxy:\n    ipvs:\n      scheduler: fastest\n"),
            ),
            r#"spec.proxy.ipvs.scheduler: Unsupported value: "fastest": supported values: "rr", "wrr", "lc", "wlc", "lblc", "lblcr", "sh", "dh", "sed", "nq", "fo", "ovf", "mh", "twos""#,
        ),
        (
            "bad-window-time",
            variant(
                "bad-window-time",
                waves,
                &format!("{waves}    window:\n      start: \"25:00\"\n      end: \"06:00\"\n"),
            ),
            r#"spec.rollout.window.start: Invalid value: "25:00": spec.rollout.window.start in body should match '^([01][0-9]|2[0-3]):[0-5][0-9]$'"#,
        ),
        (
            "empty-window",
            variant(
                "empty-window",
                waves,
                &format!("{waves}    window:\n      start: \"06:00\"\n      end: \"06:00\"\n"),
            ),
            r#"spec.rollout.window: Invalid value: window.start and window.end must differ"#,
        ),
        (
            "gate-min-above-timeout",
            variant(
                "gate-min-above-timeout",
                waves,
                &format!("{waves}  healthGate:\n    minHealthySeconds: 600\n    timeoutSeconds: 300\n"),
            ),
            r#"spec.healthGate: Invalid value: healthGate.minHealthySeconds must be less than healthGate.timeoutSeconds"#,
        ),
        (
            "probe-name-and-selector",
            variant(
                "probe-name-and-selector",
                waves,
                &format!(
                    "{waves}  healthGate:\n    probes:\n    - namespace: default\n      name: web\n      selector: {{matchLabels: {{app: web}}}}\n"
                ),
            ),
            r#"spec.healthGate.probes[0]: Invalid value: a probe target sets exactly one of name and selector"#,
        ),
        (
            "bad-failure-policy",
            variant(
                "bad-failure-policy",
                waves,
                &format!("{waves}    failurePolicy: retry\n"),
            ),
            r#"spec.rollout.failurePolicy: Unsupported value: "retry": supported values: "pause", "rollback""#,
        ),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crds_install_validate_print_and_explain() {
    let cp = ControlPlane::start().await.expect("test control plane starts");
    cp.install_crds().expect("CRDs install and become established");

    // A valid sample is accepted, and the defaults are filled in by the apiserver.
    let sample = workspace_root().join("config/samples/canary-iptables-to-nftables.yaml");
    cp.kubectl_ok(&["apply", "-f", &sample.display().to_string()], None)
        .expect("sample policy is accepted");
    let base = BASE.replace("NAME", "minimal");
    cp.kubectl_ok(&["apply", "-f", "-"], Some(&base))
        .expect("minimal policy is accepted");
    let defaults = cp
        .kubectl_ok(&["get", "proxypolicy", "minimal", "-o", "jsonpath={.spec.rollout.maxUnavailable} {.spec.rollout.failurePolicy} {.spec.healthGate.timeoutSeconds}"], None)
        .expect("get minimal");
    assert_eq!(defaults, "1 pause 300");

    // Mode external (hand the pool to another proxy), and external as a fallback, are accepted.
    for (name, from, to) in [
        ("hand-over", "mode: nftables\n", "mode: external\n"),
        (
            "hand-over-fallback",
            "mode: nftables\n",
            "mode: ipvs\n  fallback: external\n",
        ),
    ] {
        cp.kubectl_ok(&["apply", "-f", "-"], Some(&variant(name, from, to)))
            .unwrap_or_else(|e| panic!("{name} is accepted: {e}"));
    }

    // A null is "not set": `fallback: null` is accepted, `maxUnavailable: null` gets the default.
    let nulls = variant("nulls", "mode: nftables\n", "mode: nftables\n  fallback: null\n")
        .replace("  rollout:\n", "  rollout:\n    maxUnavailable: null\n");
    cp.kubectl_ok(&["create", "-f", "-"], Some(&nulls))
        .expect("a policy with null fields is accepted");
    let stored = cp
        .kubectl_ok(
            &[
                "get",
                "proxypolicy",
                "nulls",
                "-o",
                "jsonpath={.spec.rollout.maxUnavailable}|{.spec.fallback}",
            ],
            None,
        )
        .expect("get nulls");
    assert_eq!(stored, "1|");

    // Every invalid policy is rejected with its exact message, and nothing is stored.
    let cases = invalid_cases();
    assert!(cases.len() >= 15);
    let mut mismatches = Vec::new();
    for (name, yaml, message) in &cases {
        let (ok, _, stderr) = cp
            .kubectl(&["apply", "-f", "-"], Some(yaml))
            .expect("kubectl runs");
        assert!(!ok, "{name}: an invalid policy was accepted:\n{yaml}");
        let want = format!(r#"The ProxyPolicy "{name}" is invalid: "#);
        if !(stderr.contains(&want) && stderr.contains(message)) {
            mismatches.push(format!("{name}:\n  want: {message}\n  got:  {}", stderr.trim()));
        }
        let (exists, _, _) = cp
            .kubectl(&["get", "proxypolicy", name], None)
            .expect("kubectl runs");
        assert!(!exists, "{name} was stored");
    }
    assert!(
        mismatches.is_empty(),
        "messages differ:\n{}",
        mismatches.join("\n")
    );

    // Printer columns.
    let table = cp
        .kubectl_ok(&["get", "proxypolicies"], None)
        .expect("get proxypolicies");
    let header: Vec<&str> = table
        .lines()
        .next()
        .unwrap_or_default()
        .split_whitespace()
        .collect();
    assert_eq!(
        header,
        [
            "NAME", "MODE", "NODES", "UPDATED", "HEALTHY", "WAVE", "STATUS", "AGE"
        ]
    );
    assert!(
        table
            .lines()
            .any(|l| l.starts_with("general-to-nftables") && l.contains("nftables")),
        "{table}"
    );
    let short = cp
        .kubectl_ok(&["get", "pp", "-o", "name"], None)
        .expect("short name pp");
    assert!(short.contains("proxypolicy.switchyard.dev/minimal"), "{short}");
    let wide = cp
        .kubectl_ok(&["get", "nodeproxies", "-o", "wide"], Some(""))
        .expect("get nodeproxies");
    let _ = wide; // no NodeProxy yet: kubectl prints "No resources found" on stderr; columns are checked in agents.rs

    // kubectl explain shows the field docs.
    let explain = cp
        .kubectl_ok(&["explain", "proxypolicy.spec.rollout"], None)
        .expect("explain");
    for needle in [
        "How the change reaches the pool: waves, pacing, pause, window and failure",
        "maxUnavailable",
        "Nodes that may be switching or unhealthy at once: a count, or a percent of",
        "failurePolicy",
        "waves",
    ] {
        assert!(explain.contains(needle), "explain lacks {needle:?}:\n{explain}");
    }
    let explain_wave = cp
        .kubectl_ok(
            &["explain", "proxypolicy.spec.rollout.waves.requireApproval"],
            None,
        )
        .expect("explain");
    assert!(
        explain_wave.contains("kubectl annotate proxypolicy NAME approve.switchyard.dev/WAVE=GENERATION"),
        "{explain_wave}"
    );
}
