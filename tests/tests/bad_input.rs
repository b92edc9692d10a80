//! Bad input against the real apiserver and the real operator.
//!
//! 1. The CRDs install from every documented path (`-f config/crd/`, `-k config/crd/`, the chart's
//!    `crds/`) without an error or a warning.
//! 2. Objects stored before the schema was hardened (written through a permissive copy of the CRD,
//!    then the real CRD applied again): `maxUnavailable: null`, `maxUnavailable: 2147483648`,
//!    `waves[].nodes: 3000000000`, a wave selector with operator `Gt`, an unknown time zone, a
//!    64-character name, `switchyard.dev/rollback: now`, and a policy whose `mode` no typed client
//!    can decode. With the operator running, a valid policy rolls out over 3 nodes while they are
//!    present; each broken one shows an InvalidSpec/UnknownAnnotations condition and Event saying
//!    what to fix, and the undecodable one an `Undecodable` Event, a metric and a log line.
//! 3. Mutations generated from the schema (nulls, boundaries, huge numbers, wrong types, unknown
//!    fields, unicode, oversized strings and lists) of a valid ProxyPolicy spec and NodeProxy
//!    status, each written with kubectl: it must be rejected with a message naming the field, or
//!    accepted and then — for an input the generator knows to be bad — reported by the operator in
//!    a condition, while the valid policy keeps rolling out and the operator never exits.

use std::time::Duration;

use k8s_openapi::api::{core::v1::Node, events::v1::Event};
use kube::{
    Api, Client,
    api::{ListParams, PostParams},
};
use serde_json::{Value, json};
use switchyard_crds::v1alpha1::{NodeProxy, ProxyPolicy, ProxyPolicyStatus};
use switchyard_e2e::{
    agent::{install_switchyard, register_node_proxy, write_agent_status},
    binaries::workspace_root,
    controlplane::ControlPlane,
    eventually,
    operator::Operator,
};

const LIMIT: Duration = Duration::from_secs(90);
const NODES: [&str; 3] = ["n1", "n2", "n3"];

fn agent_status(active: &str, last: Option<Value>) -> Value {
    let mut s = json!({
        "agentVersion": "test",
        "capabilities": {
            "kernelVersion": "6.18.0-test", "supportedModes": ["iptables", "nftables"],
            "nftables": {"usable": true}, "iptablesLegacy": {"usable": true}, "iptablesNft": {"usable": true},
            "ipvs": {"usable": false, "detail": "no module"}, "ipset": {"usable": true},
        },
        "activeMode": active,
        "phase": "Active",
        "sync": {"lastSyncMillis": 3, "services": 2, "endpoints": 4, "rules": 40},
        "probes": [{"target": "default/kubernetes:443", "ok": true, "detail": "10.0.0.1:6443"}],
        "conditions": [{"type": "Healthy", "status": "True", "reason": "GatePassed", "message": "ok", "lastTransitionTime": "2025-01-01T00:00:00Z"}],
    });
    if let Some(l) = last {
        s["lastSwitch"] = l;
    }
    s
}

/// Plays every agent once: a node asked for a mode under a token it has not answered switches.
async fn play_agents(client: &Client) {
    let proxies: Api<NodeProxy> = Api::all(client.clone());
    for np in proxies.list(&ListParams::default()).await.expect("list").items {
        let name = np.metadata.name.clone().unwrap_or_default();
        let (Some(desired), Some(token)) = (np.spec.desired_mode, np.spec.rollout_token.clone()) else {
            continue;
        };
        let Some(st) = np.status.clone() else { continue };
        let answered = st.last_switch.as_ref().and_then(|l| l.rollout_token.clone()) == Some(token.clone());
        if answered || st.active_mode == Some(desired) {
            continue;
        }
        let last = json!({
            "from": "iptables", "to": desired.as_str(), "result": "Succeeded", "reason": "switched",
            "rolloutToken": token, "startedAt": "2025-01-01T00:00:00Z", "finishedAt": "2025-01-01T00:00:01Z",
        });
        write_agent_status(client, &name, agent_status(desired.as_str(), Some(last)))
            .await
            .expect("agent status");
    }
}

async fn status(client: &Client, name: &str) -> Option<ProxyPolicyStatus> {
    Api::<ProxyPolicy>::all(client.clone())
        .get(name)
        .await
        .ok()
        .and_then(|p| p.status)
}

fn condition_true<'a>(s: &'a ProxyPolicyStatus, t: &str) -> Option<&'a str> {
    s.conditions
        .iter()
        .find(|c| c.type_ == t && c.status == "True")
        .map(|c| c.message.as_str())
}

async fn event_notes(client: &Client, policy: &str) -> Vec<(String, String)> {
    Api::<Event>::all(client.clone())
        .list(&ListParams::default())
        .await
        .map(|l| l.items)
        .unwrap_or_default()
        .into_iter()
        .filter(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(policy))
        .map(|e| (e.reason.unwrap_or_default(), e.note.unwrap_or_default()))
        .collect()
}

// ---------------------------------------------------------------------------------------------
// Install paths.

fn install_without_warnings(cp: &ControlPlane) {
    let root = workspace_root();
    let paths = [
        ("-f", root.join("config/crd")),
        ("-k", root.join("config/crd")),
        ("-f", root.join("helm/switchyard/crds")),
    ];
    for (flag, path) in &paths {
        let p = path.display().to_string();
        let (ok, _, stderr) = cp
            .kubectl(&["apply", "--server-side", "--force-conflicts", flag, &p], None)
            .expect("kubectl runs");
        assert!(ok, "kubectl apply --server-side {flag} {p} failed: {stderr}");
        assert!(
            !stderr.to_lowercase().contains("warning"),
            "kubectl apply --server-side {flag} {p} warned: {stderr}"
        );
        println!("install: kubectl apply --server-side {flag} {p}: ok, no warning");
    }
}

// ---------------------------------------------------------------------------------------------
// Objects stored before the schema was hardened.

/// The ProxyPolicy CRD with a spec schema that accepts anything (what an older, laxer schema let
/// through), as JSON for kubectl.
fn permissive_crd() -> String {
    let path = workspace_root().join("config/crd/proxypolicies.switchyard.dev.yaml");
    let text = std::fs::read_to_string(&path).expect("CRD file");
    let mut crd: Value = serde_yaml::from_str(&text).expect("CRD YAML");
    let schema = crd
        .pointer_mut("/spec/versions/0/schema/openAPIV3Schema")
        .expect("schema");
    schema["properties"]["spec"] = json!({"type": "object", "x-kubernetes-preserve-unknown-fields": true});
    schema
        .as_object_mut()
        .expect("object")
        .remove("x-kubernetes-validations");
    crd.to_string()
}

fn legacy_policy(name: &str, spec: Value, annotations: Value) -> String {
    json!({
        "apiVersion": "switchyard.dev/v1alpha1", "kind": "ProxyPolicy",
        "metadata": {"name": name, "annotations": annotations}, "spec": spec,
    })
    .to_string()
}

/// (name, spec, annotations, condition type expected True, text its message must contain)
fn legacy_cases() -> Vec<(String, Value, Value, &'static str, &'static str)> {
    let base = |rollout: Value| json!({"nodeSelector": {"matchLabels": {"pool": "legacy"}}, "mode": "nftables", "rollout": rollout});
    vec![
        (
            "legacy-huge-max-unavailable".into(),
            base(json!({"maxUnavailable": 2_147_483_648_i64})),
            json!({}),
            "InvalidSpec",
            "spec.rollout.maxUnavailable is \"2147483648\": set a count from 1 to 100000",
        ),
        (
            "legacy-huge-wave".into(),
            base(json!({"waves": [{"name": "a", "nodes": 3_000_000_000_i64}]})),
            json!({}),
            "InvalidSpec",
            "spec.rollout.waves[0].nodes is \"3000000000\"",
        ),
        (
            "legacy-gt-selector".into(),
            base(
                json!({"waves": [{"name": "a", "nodeSelector": {"matchExpressions": [{"key": "zone", "operator": "Gt", "values": ["1"]}]}}]}),
            ),
            json!({}),
            "InvalidSpec",
            "spec.rollout.waves[0].nodeSelector.matchExpressions[0].operator \"Gt\" is not one of In, NotIn, Exists, DoesNotExist",
        ),
        (
            "legacy-time-zone".into(),
            base(json!({"window": {"start": "01:00", "end": "02:00", "timeZone": "Mars/Olympus"}})),
            json!({}),
            "InvalidSpec",
            "spec.rollout.window.timeZone \"Mars/Olympus\" is not a known IANA time zone",
        ),
        (
            format!("legacy-long-name-{}", "x".repeat(47)),
            base(json!({})),
            json!({}),
            "InvalidSpec",
            "metadata.name is 64 characters",
        ),
        (
            "legacy-annotations".into(),
            base(json!({"maxUnavailable": null})),
            json!({"switchyard.dev/rollback": "now", "approve.switchyard.dev/nope": "1"}),
            "UnknownAnnotations",
            "switchyard.dev/rollback=\"now\" is not a generation",
        ),
    ]
}

const UNDECODABLE: &str = "legacy-undecodable";

/// Stores the legacy objects through the permissive CRD, then restores the real one.
fn store_legacy(cp: &ControlPlane) {
    cp.kubectl_ok(
        &["apply", "--server-side", "--force-conflicts", "-f", "-"],
        Some(&permissive_crd()),
    )
    .expect("permissive CRD");
    cp.wait_crds_established().expect("established");
    let mut docs: Vec<String> = legacy_cases()
        .into_iter()
        .map(|(name, spec, ann, _, _)| legacy_policy(&name, spec, ann))
        .collect();
    docs.push(legacy_policy(
        UNDECODABLE,
        json!({"nodeSelector": {"matchLabels": {"pool": "legacy"}}, "mode": 42}),
        json!({}),
    ));
    for doc in &docs {
        // The permissive schema may lag a moment behind the CRD update: retry briefly.
        let mut last = String::new();
        let stored = (0..50).any(|_| match cp.kubectl(&["create", "-f", "-"], Some(doc)) {
            Ok((true, _, _)) => true,
            Ok((false, _, e)) => {
                last = e;
                std::thread::sleep(Duration::from_millis(100));
                false
            }
            Err(e) => panic!("kubectl: {e}"),
        });
        assert!(stored, "legacy object not stored: {last}\n{doc}");
    }
    cp.install_crds().expect("the real CRD again");
}

// ---------------------------------------------------------------------------------------------
// Mutations generated from the schema.

/// Whether the generator knows the value to be bad (it must be rejected or reported).
#[derive(Clone, Copy, PartialEq, Debug)]
enum Expect {
    Bad,
    Fine,
}

#[derive(Clone, Debug)]
struct Mutation {
    what: String,
    /// The key the message must name.
    field: String,
    doc: Value,
    expect: Expect,
}

#[derive(Clone, Debug)]
enum Seg {
    Key(String),
    Index(usize),
}

fn set(doc: &mut Value, path: &[Seg], value: Option<Value>) {
    let Some((last, parents)) = path.split_last() else {
        return;
    };
    let mut cur = doc;
    for seg in parents {
        cur = match seg {
            Seg::Key(k) => &mut cur[k.as_str()],
            Seg::Index(i) => &mut cur[*i],
        };
    }
    match (last, value) {
        (Seg::Key(k), Some(v)) => cur[k.as_str()] = v,
        (Seg::Key(k), None) => {
            cur.as_object_mut().map(|o| o.remove(k));
        }
        (Seg::Index(i), Some(v)) => cur[*i] = v,
        (Seg::Index(_), None) => {}
    }
}

fn path_text(path: &[Seg]) -> String {
    path.iter()
        .map(|s| match s {
            Seg::Key(k) => format!(".{k}"),
            Seg::Index(i) => format!("[{i}]"),
        })
        .collect()
}

/// The last key of `path` (the field a message must name).
fn field_of(path: &[Seg]) -> String {
    path.iter()
        .rev()
        .find_map(|s| match s {
            Seg::Key(k) => Some(k.clone()),
            Seg::Index(_) => None,
        })
        .unwrap_or_default()
}

struct Gen<'a> {
    base: &'a Value,
    root: &'a str,
    /// Free-text strings (unicode is fine there).
    free_text: &'a [&'a str],
    /// Whether a null optional field reads as "not set" (the apiserver prunes it).
    null_is_unset: bool,
    out: Vec<Mutation>,
}

impl Gen<'_> {
    fn push(&mut self, path: &[Seg], what: &str, value: Option<Value>, expect: Expect) {
        let mut doc = self.base.clone();
        set(&mut doc, path, value);
        self.out.push(Mutation {
            what: format!("{}{} {what}", self.root, path_text(path)),
            field: field_of(path),
            doc,
            expect,
        });
    }

    fn walk(&mut self, schema: &Value, path: &mut Vec<Seg>, value: &Value, required: bool) {
        if !path.is_empty() {
            self.leaf(schema, path, value, required);
        }
        if let (Some(props), Some(obj)) = (schema["properties"].as_object(), value.as_object()) {
            let req: Vec<&str> = schema["required"]
                .as_array()
                .map(|r| r.iter().filter_map(Value::as_str).collect())
                .unwrap_or_default();
            let mut unknown = path.clone();
            unknown.push(Seg::Key("bogusField".into()));
            self.push(&unknown, "unknown field", Some(json!(1)), Expect::Bad);
            for (key, sub) in props {
                if let Some(v) = obj.get(key) {
                    path.push(Seg::Key(key.clone()));
                    self.walk(sub, path, v, req.contains(&key.as_str()));
                    path.pop();
                }
            }
        }
        if let (Some(items), Some(first)) = (schema.get("items"), value.as_array().and_then(|a| a.first())) {
            path.push(Seg::Index(0));
            self.walk(items, path, first, false);
            path.pop();
        }
    }

    fn leaf(&mut self, schema: &Value, path: &[Seg], value: &Value, required: bool) {
        // A null optional field is "not set" (kubectl create; in an apply of status only where the
        // field has a default); a null list item or a required field must be refused.
        let in_list = matches!(path.last(), Some(Seg::Index(_)));
        let defaulted = schema.get("default").is_some();
        let null_expect = if required || in_list || !(self.null_is_unset || defaulted) {
            Expect::Bad
        } else {
            Expect::Fine
        };
        self.push(path, "= null", Some(Value::Null), null_expect);
        let ty = schema["type"].as_str().unwrap_or("");
        let int_or_string = schema["x-kubernetes-int-or-string"].as_bool() == Some(true);
        if int_or_string {
            for v in [
                json!(0),
                json!(100_001),
                json!(2_147_483_648_i64),
                json!(-1),
                json!("0%"),
                json!("101%"),
                json!("50.5%"),
                json!("ten%"),
                json!(""),
                json!(1e30),
                json!(true),
            ] {
                self.push(path, &format!("= {v}"), Some(v), Expect::Bad);
            }
            for v in [json!(100_000), json!("100%"), json!("1%")] {
                self.push(path, &format!("= {v}"), Some(v), Expect::Fine);
            }
            return;
        }
        match ty {
            "integer" => {
                let min = schema["minimum"].as_f64();
                let max = schema["maximum"].as_f64();
                if let Some(m) = min {
                    self.push(path, "= minimum - 1", Some(json!(m as i64 - 1)), Expect::Bad);
                }
                if let Some(m) = max {
                    self.push(path, "= maximum + 1", Some(json!(m as i64 + 1)), Expect::Bad);
                }
                let bounded = max.is_some_and(|m| m < 2_147_483_648.0);
                let huge = if bounded { Expect::Bad } else { Expect::Fine };
                self.push(path, "= 2147483648", Some(json!(2_147_483_648_i64)), huge);
                self.push(path, "= 3000000000", Some(json!(3_000_000_000_i64)), huge);
                self.push(path, "= 1e30", Some(json!(1e30)), Expect::Bad);
                self.push(path, "= 1.5", Some(json!(1.5)), Expect::Bad);
                self.push(path, "= \"7\"", Some(json!("7")), Expect::Bad);
            }
            "string" => {
                self.push(path, "= 7", Some(json!(7)), Expect::Bad);
                self.push(path, "= [\"x\"]", Some(json!(["x"])), Expect::Bad);
                if schema["enum"].is_array() {
                    self.push(path, "= \"Bogus\"", Some(json!("Bogus")), Expect::Bad);
                }
                let free = self.free_text.contains(&field_of(path).as_str());
                let unicode = if free { Expect::Fine } else { Expect::Bad };
                self.push(path, "= unicode", Some(json!("ünïcødé-☃")), unicode);
                if let Some(max) = schema["maxLength"].as_u64() {
                    let long = "a".repeat(usize::try_from(max + 1).unwrap_or(64));
                    self.push(path, "= maxLength + 1 characters", Some(json!(long)), Expect::Bad);
                }
                // An empty label value is a valid one.
                if !free && field_of(path) != "values" {
                    self.push(path, "= \"\"", Some(json!("")), Expect::Bad);
                }
            }
            "boolean" => {
                self.push(path, "= \"yes\"", Some(json!("yes")), Expect::Bad);
                self.push(path, "= 1", Some(json!(1)), Expect::Bad);
            }
            "array" => {
                self.push(path, "= \"x\"", Some(json!("x")), Expect::Bad);
                if let (Some(max), Some(first)) = (
                    schema["maxItems"].as_u64(),
                    value.as_array().and_then(|a| a.first()),
                ) {
                    let many = vec![first.clone(); usize::try_from(max + 1).unwrap_or(1)];
                    self.push(path, "= maxItems + 1 items", Some(json!(many)), Expect::Bad);
                }
            }
            "object" => {
                self.push(path, "= 7", Some(json!(7)), Expect::Bad);
                if let Some(max) = schema["maxProperties"].as_u64() {
                    let many: serde_json::Map<String, Value> =
                        (0..=max).map(|i| (format!("k{i}"), json!("v"))).collect();
                    self.push(
                        path,
                        "= maxProperties + 1 entries",
                        Some(Value::Object(many)),
                        Expect::Bad,
                    );
                }
            }
            _ => {}
        }
    }
}

fn schema_of(file: &str, pointer: &str) -> Value {
    let text = std::fs::read_to_string(workspace_root().join("config/crd").join(file)).expect("CRD");
    let crd: Value = serde_yaml::from_str(&text).expect("YAML");
    crd.pointer(&format!("/spec/versions/0/schema/openAPIV3Schema{pointer}"))
        .cloned()
        .expect("schema")
}

fn valid_spec() -> Value {
    json!({
        "nodeSelector": {"matchLabels": {"pool": "fuzz"}, "matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]},
        "priority": 0, "mode": "iptables", "fallback": "skip",
        "rollout": {
            "waves": [{"name": "canary", "nodes": 1, "nodeSelector": {"matchLabels": {"canary": "true"}}, "soakSeconds": 0, "requireApproval": false}, {"name": "rest", "nodes": "100%"}],
            "maxUnavailable": 1, "paused": false, "failurePolicy": "pause", "maxFailures": 0,
            "window": {"days": ["Mon"], "start": "01:00", "end": "02:00", "timeZone": "UTC"},
        },
        "healthGate": {
            "probes": [{"namespace": "default", "name": "kubernetes"}, {"namespace": "default", "selector": {"matchLabels": {"app": "web"}}}],
            "minHealthySeconds": 10, "timeoutSeconds": 300, "failureThreshold": 3,
        },
        "proxy": {
            "clusterCIDR": "10.244.0.0/16", "nodePortAddresses": ["10.0.0.0/8"], "masqueradeAll": false,
            "minSyncPeriodSeconds": 1, "syncPeriodSeconds": 30, "localhostNodePorts": false, "serviceProxyName": "sy",
            "conntrack": {"maxPerCore": 32768, "min": 131072, "tcpEstablishedTimeoutSeconds": 86400, "tcpCloseWaitTimeoutSeconds": 3600, "tcpBeLiberal": false, "udpTimeoutSeconds": 30, "udpStreamTimeoutSeconds": 120},
            "ipvs": {"scheduler": "rr", "strictArp": false, "excludeCIDRs": ["10.1.0.0/16"], "tcpTimeoutSeconds": 0, "tcpFinTimeoutSeconds": 0, "udpTimeoutSeconds": 0},
        },
    })
}

fn valid_np_status() -> Value {
    agent_status(
        "iptables",
        Some(json!({
            "from": "iptables", "to": "nftables", "result": "RolledBack", "reason": "gate",
            "rolloutToken": "t", "startedAt": "2025-01-01T00:00:00Z", "finishedAt": "2025-01-01T00:00:01Z",
        })),
    )
}

#[derive(Default, Debug)]
struct Counts {
    tried: usize,
    rejected: usize,
    rejected_unclear: Vec<String>,
    accepted_reported: usize,
    accepted_fine: usize,
    fine_refused: Vec<String>,
    accepted_silent: Vec<String>,
}

/// Writes every ProxyPolicy mutation (as `fz-N`); returns the accepted bad ones to check later.
fn try_policies(cp: &ControlPlane, counts: &mut Counts) -> Vec<(String, Mutation)> {
    let base = valid_spec();
    let schema = schema_of("proxypolicies.switchyard.dev.yaml", "/properties/spec");
    let mut g = Gen {
        base: &base,
        root: "spec",
        free_text: &[],
        null_is_unset: true,
        out: Vec::new(),
    };
    g.walk(&schema, &mut Vec::new(), &base, true);
    let mut accepted = Vec::new();
    for (i, m) in g.out.into_iter().enumerate() {
        let name = format!("fz-{i}");
        let doc = json!({"apiVersion": "switchyard.dev/v1alpha1", "kind": "ProxyPolicy", "metadata": {"name": name}, "spec": m.doc});
        counts.tried += 1;
        let (ok, _, stderr) = cp
            .kubectl(&["create", "-f", "-"], Some(&doc.to_string()))
            .expect("kubectl runs");
        if ok {
            accepted.push((name, m));
            continue;
        }
        judge_rejection(&m, &stderr, counts);
    }
    accepted
}

fn judge_rejection(m: &Mutation, stderr: &str, counts: &mut Counts) {
    counts.rejected += 1;
    if m.expect == Expect::Fine {
        counts.fine_refused.push(format!("{}: {}", m.what, stderr.trim()));
    }
    if !stderr.contains(&m.field) {
        counts
            .rejected_unclear
            .push(format!("{} (field {}): {}", m.what, m.field, stderr.trim()));
    }
}

/// Writes every NodeProxy status mutation onto NodeProxy `fz-np` (status subresource, as the agent).
fn try_node_proxy(cp: &ControlPlane, counts: &mut Counts) {
    let base = valid_np_status();
    let schema = schema_of("nodeproxies.switchyard.dev.yaml", "/properties/status");
    let free = [
        "agentVersion",
        "kernelVersion",
        "detail",
        "reason",
        "message",
        "rolloutToken",
        "target",
        "iptablesVariant",
        "ipvsSchedulers",
    ];
    let mut g = Gen {
        base: &base,
        root: "status",
        free_text: &free,
        null_is_unset: false,
        out: Vec::new(),
    };
    g.walk(&schema, &mut Vec::new(), &base, true);
    for m in g.out {
        counts.tried += 1;
        let doc = json!({"apiVersion": "switchyard.dev/v1alpha1", "kind": "NodeProxy", "metadata": {"name": "fz-np"}, "status": m.doc});
        let (ok, _, stderr) = cp
            .kubectl(
                &[
                    "apply",
                    "--server-side",
                    "--force-conflicts",
                    "--field-manager=fuzz",
                    "--subresource=status",
                    "-f",
                    "-",
                ],
                Some(&doc.to_string()),
            )
            .expect("kubectl runs");
        if !ok {
            judge_rejection(&m, &stderr, counts);
        } else if m.expect == Expect::Bad {
            counts.accepted_silent.push(m.what.clone());
        } else {
            counts.accepted_fine += 1;
        }
    }
}

async fn judge_accepted(client: &Client, accepted: &[(String, Mutation)], counts: &mut Counts) {
    for (name, m) in accepted {
        let reconciled = eventually(LIMIT, &format!("status of {name} ({})", m.what), || async move {
            let p = Api::<ProxyPolicy>::all(client.clone()).get(name).await.ok()?;
            let s = p.status?;
            (s.observed_generation == p.metadata.generation).then_some(s)
        })
        .await
        .unwrap_or_else(|e| panic!("the operator never reconciled accepted {name} ({}): {e}", m.what));
        let reported = condition_true(&reconciled, "InvalidSpec").is_some()
            || condition_true(&reconciled, "UnknownAnnotations").is_some();
        match (m.expect, reported) {
            (_, true) => counts.accepted_reported += 1,
            (Expect::Fine, false) => counts.accepted_fine += 1,
            (Expect::Bad, false) => counts.accepted_silent.push(format!("{name}: {}", m.what)),
        }
    }
}

// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_is_rejected_or_reported_and_never_stops_the_operator() {
    let started = std::time::Instant::now();
    let cp = ControlPlane::start().await.expect("control plane");
    install_switchyard(&cp).expect("install");
    install_without_warnings(&cp);
    let client = cp.admin_client().await.expect("admin client");
    let nodes: Api<Node> = Api::all(client.clone());
    for n in NODES {
        let node: Node = serde_json::from_value(json!({"metadata": {"name": n, "labels": {"pool": "good"}}}))
            .expect("node");
        let node = nodes.create(&PostParams::default(), &node).await.expect("node");
        register_node_proxy(&client, n, &node.metadata.uid.unwrap_or_default())
            .await
            .expect("NodeProxy");
        write_agent_status(&client, n, agent_status("iptables", None))
            .await
            .expect("status");
    }
    // A NodeProxy without a Node, for the status mutations.
    let fz_node: Node = serde_json::from_value(json!({"metadata": {"name": "fz-np"}})).expect("node");
    let fz_node = nodes
        .create(&PostParams::default(), &fz_node)
        .await
        .expect("node");
    register_node_proxy(&client, "fz-np", &fz_node.metadata.uid.unwrap_or_default())
        .await
        .expect("NodeProxy");
    store_legacy(&cp);

    let mut op = Operator::start(&cp, "op-bad", &[]).await.expect("operator");
    let good = json!({"apiVersion": "switchyard.dev/v1alpha1", "kind": "ProxyPolicy", "metadata": {"name": "aaa-good"},
        "spec": {"nodeSelector": {"matchLabels": {"pool": "good"}}, "priority": 1000, "mode": "nftables",
                 "rollout": {"waves": [{"name": "one", "nodes": 1}, {"name": "rest", "nodes": "100%"}]},
                 "healthGate": {"minHealthySeconds": 0, "timeoutSeconds": 60}}});
    cp.kubectl_ok(&["create", "-f", "-"], Some(&good.to_string()))
        .expect("valid policy");

    // The first wave starts although broken and undecodable policies are stored.
    eventually(LIMIT, "wave one of aaa-good starts", || async {
        status(&client, "aaa-good")
            .await
            .filter(|s| s.current_wave.as_deref() == Some("one") || s.updated_nodes > 0)
    })
    .await
    .expect("the valid policy progresses");
    for (name, _, _, cond, needle) in legacy_cases() {
        let s = eventually(LIMIT, &format!("{cond} on {name}"), || async {
            status(&client, &name)
                .await
                .filter(|s| condition_true(s, cond).is_some())
        })
        .await
        .unwrap_or_else(|e| panic!("{name}: {e}"));
        let msg = condition_true(&s, cond).unwrap_or_default().to_owned();
        assert!(
            msg.contains(needle),
            "{name}: {cond} says {msg:?}, want {needle:?}"
        );
        let ev = eventually(LIMIT, &format!("{cond} Event on {name}"), || async {
            event_notes(&client, &name)
                .await
                .into_iter()
                .find(|(reason, _)| reason == cond)
        })
        .await
        .unwrap_or_else(|e| panic!("{name}: {e}"));
        println!(
            "broken policy {name}: condition {cond}: {msg}\n  Event {}: {}",
            ev.0, ev.1
        );
    }
    let (_, note) = eventually(LIMIT, "Undecodable Event", || async {
        event_notes(&client, UNDECODABLE)
            .await
            .into_iter()
            .find(|(reason, _)| reason == "Undecodable")
    })
    .await
    .expect("an Event names the undecodable policy");
    assert!(
        note.contains("ProxyPolicy legacy-undecodable cannot be decoded"),
        "{note}"
    );
    println!("undecodable policy: Event Undecodable: {note}");
    let metrics = eventually(LIMIT, "undecodable metric", || async {
        op.get("/metrics")
            .map(|(_, body)| body)
            .filter(|b| b.contains("switchyard_operator_undecodable_objects{kind=\"ProxyPolicy\"} 1"))
    })
    .await
    .expect("metric");
    assert!(metrics.contains("switchyard_operator_decode_failures_total{kind=\"ProxyPolicy\"}"));
    assert!(
        op.log_text().contains("legacy-undecodable"),
        "the log names the object"
    );

    // Mutations, while the valid policy keeps rolling out.
    let mut counts = Counts::default();
    let accepted = try_policies(&cp, &mut counts);
    try_node_proxy(&cp, &mut counts);
    play_agents(&client).await;
    judge_accepted(&client, &accepted, &mut counts).await;
    eventually(LIMIT, "aaa-good Ready", || async {
        play_agents(&client).await;
        status(&client, "aaa-good")
            .await
            .filter(|s| s.healthy_nodes == 3 && condition_true(s, "Ready").is_some())
    })
    .await
    .unwrap_or_else(|e| {
        panic!(
            "{e}: {:#?}",
            futures::executor::block_on(status(&client, "aaa-good"))
        )
    });
    let exits = usize::from(!op.running());

    println!(
        "bad input: tried {}, rejected {} (unclear {}), accepted-and-reported {}, accepted-fine {}, accepted-and-silent {}, fine-refused {}, operator exits {exits}; {:.1}s",
        counts.tried,
        counts.rejected,
        counts.rejected_unclear.len(),
        counts.accepted_reported,
        counts.accepted_fine,
        counts.accepted_silent.len(),
        counts.fine_refused.len(),
        started.elapsed().as_secs_f64()
    );
    for f in &counts.fine_refused {
        println!("  fine input refused (a cross-field rule, or too strict?): {f}");
    }
    assert!(
        counts.accepted_silent.is_empty(),
        "accepted and silent:\n{}",
        counts.accepted_silent.join("\n")
    );
    assert!(
        counts.rejected_unclear.is_empty(),
        "rejected without naming the field:\n{}",
        counts.rejected_unclear.join("\n")
    );
    assert_eq!(exits, 0, "the operator exited:\n{}", op.log_text());
}
