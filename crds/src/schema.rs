//! Hardening of the generated OpenAPI schemas, applied by [`crate::crd_yaml`] to every CRD.
//!
//! What the derive macros cannot say per field, said once for every schema of a kind:
//! - **No `nullable`**: a `null` the apiserver stores is a value no typed client can decode into a
//!   non-optional field (`maxUnavailable: null` stopped the operator). Without `nullable` the
//!   apiserver prunes a `null` before defaulting, so `null` means "not set" everywhere
//!   (`fallback: null` is accepted as absent, `maxUnavailable: null` becomes the default 1).
//! - **Integers without `int32`/`uint32` formats**, bounded by explicit `minimum`/`maximum`
//!   instead: `uint32` is a format the apiserver does not know (a warning on every install), and an
//!   `int32` overflow was reported as "Checked value must be of type integer with format int32".
//! - **Every label selector** (the policy's, each wave's, each probe's) gets the same size bounds
//!   and the same CEL rules: operators In/NotIn/Exists/DoesNotExist only, values required for
//!   In/NotIn and forbidden for Exists/DoesNotExist, valid label keys and values.
//! - **Conditions** as metav1.Condition constrains them: status True, False or Unknown; type,
//!   reason and message patterns and lengths.

use serde_json::{Map, Value, json};

/// Most `matchExpressions` (and `matchLabels` entries) of one selector.
pub const MAX_SELECTOR_TERMS: u64 = 32;
/// Most values of one selector expression.
pub const MAX_SELECTOR_VALUES: u64 = 32;
/// Longest label key: a 253-byte DNS prefix, `/`, a 63-byte name.
pub const MAX_LABEL_KEY: u64 = 317;
/// Longest label value.
pub const MAX_LABEL_VALUE: u64 = 63;

/// A label key (optional DNS-subdomain prefix and `/`, then a name of at most 63 characters).
const KEY_RE: &str = r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$";
/// A label value (empty, or at most 63 alphanumerics, `-`, `_`, `.`, alphanumeric at both ends).
const VALUE_RE: &str = r"^(([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9])?$";

/// Hardens every schema below `value` (a whole CRD); `root_rules` go on each version's root schema.
pub fn harden(value: &mut Value, root_rules: &[(&str, &str)]) {
    walk(value);
    let Some(versions) = value.pointer_mut("/spec/versions").and_then(Value::as_array_mut) else {
        return;
    };
    for version in versions {
        if let Some(Value::Object(root)) = version.pointer_mut("/schema/openAPIV3Schema") {
            for (rule, message) in root_rules {
                add_rule(root, rule, message);
                if rule.contains("oldSelf") {
                    mark_optional_old_self(root);
                }
            }
        }
    }
}

fn walk(value: &mut Value) {
    match value {
        Value::Object(map) => {
            map.remove("nullable");
            bound_integer(map);
            if is_label_selector(map) {
                harden_selector(map);
            }
            if is_condition(map) {
                restrict_condition_status(map);
            }
            map.values_mut().for_each(walk);
        }
        Value::Array(items) => items.iter_mut().for_each(walk),
        _ => {}
    }
}

/// Sets `optionalOldSelf` on the last rule of `schema` (a rule that also runs on create).
fn mark_optional_old_self(schema: &mut Map<String, Value>) {
    if let Some(Value::Object(rule)) = schema
        .get_mut("x-kubernetes-validations")
        .and_then(Value::as_array_mut)
        .and_then(|r| r.last_mut())
    {
        rule.insert("optionalOldSelf".into(), json!(true));
    }
}

fn add_rule(schema: &mut Map<String, Value>, rule: &str, message: &str) {
    let rules = schema
        .entry("x-kubernetes-validations")
        .or_insert_with(|| Value::Array(Vec::new()));
    if let Value::Array(rules) = rules {
        rules.push(json!({"rule": rule, "message": message}));
    }
}

/// Replaces `format: int32|uint32` by the range it stands for (keeping tighter bounds).
fn bound_integer(map: &mut Map<String, Value>) {
    if map.get("type").and_then(Value::as_str) != Some("integer") {
        return;
    }
    let (lo, hi) = match map.get("format").and_then(Value::as_str) {
        Some("int32") => (f64::from(i32::MIN), f64::from(i32::MAX)),
        Some("uint32") => (0.0, f64::from(u32::MAX)),
        _ => return,
    };
    map.remove("format");
    let min = map
        .get("minimum")
        .and_then(Value::as_f64)
        .map_or(lo, |m| m.max(lo));
    let max = map
        .get("maximum")
        .and_then(Value::as_f64)
        .map_or(hi, |m| m.min(hi));
    map.insert("minimum".into(), json!(min));
    map.insert("maximum".into(), json!(max));
}

fn properties(map: &Map<String, Value>) -> Option<&Map<String, Value>> {
    map.get("properties").and_then(Value::as_object)
}

fn is_label_selector(map: &Map<String, Value>) -> bool {
    properties(map).is_some_and(|p| p.contains_key("matchExpressions") && p.contains_key("matchLabels"))
}

fn is_condition(map: &Map<String, Value>) -> bool {
    properties(map).is_some_and(|p| {
        ["type", "status", "reason", "message", "lastTransitionTime"]
            .iter()
            .all(|k| p.contains_key(*k))
    })
}

/// The constraints metav1.Condition declares in Kubernetes (its kubebuilder markers).
fn restrict_condition_status(map: &mut Map<String, Value>) {
    let Some(Value::Object(props)) = map.get_mut("properties") else {
        return;
    };
    let constraints = [
        ("status", json!({"enum": ["True", "False", "Unknown"]})),
        (
            "type",
            json!({"maxLength": 316, "pattern": r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])$"}),
        ),
        (
            "reason",
            json!({"minLength": 1, "maxLength": 1024, "pattern": "^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$"}),
        ),
        ("message", json!({"maxLength": 32768})),
    ];
    for (field, extra) in constraints {
        if let (Some(Value::Object(f)), Value::Object(extra)) = (props.get_mut(field), extra) {
            f.extend(extra);
        }
    }
}

/// Size bounds and the CEL rules every label selector shares.
fn harden_selector(map: &mut Map<String, Value>) {
    if let Some(Value::Object(props)) = map.get_mut("properties") {
        if let Some(Value::Object(labels)) = props.get_mut("matchLabels") {
            labels.insert("maxProperties".into(), json!(MAX_SELECTOR_TERMS));
            if let Some(Value::Object(v)) = labels.get_mut("additionalProperties") {
                v.insert("maxLength".into(), json!(MAX_LABEL_VALUE));
            }
        }
        if let Some(Value::Object(exprs)) = props.get_mut("matchExpressions") {
            exprs.insert("maxItems".into(), json!(MAX_SELECTOR_TERMS));
            if let Some(Value::Object(item)) = exprs.get_mut("items").and_then(|i| i.get_mut("properties")) {
                for (field, max) in [("key", MAX_LABEL_KEY), ("operator", 16)] {
                    if let Some(Value::Object(f)) = item.get_mut(field) {
                        f.insert("maxLength".into(), json!(max));
                    }
                }
                if let Some(Value::Object(values)) = item.get_mut("values") {
                    values.insert("maxItems".into(), json!(MAX_SELECTOR_VALUES));
                    if let Some(Value::Object(v)) = values.get_mut("items") {
                        v.insert("maxLength".into(), json!(MAX_LABEL_VALUE));
                    }
                }
            }
        }
    }
    for (rule, message) in selector_rules() {
        add_rule(map, &rule, &message);
    }
}

/// The CEL rules of every label selector, with their messages.
pub fn selector_rules() -> Vec<(String, String)> {
    let exprs = |body: &str| format!("!has(self.matchExpressions) || self.matchExpressions.all(e, {body})");
    let labels = |body: &str| format!("!has(self.matchLabels) || self.matchLabels.all(k, {body})");
    vec![
        (
            exprs("e.operator in ['In', 'NotIn', 'Exists', 'DoesNotExist']"),
            "matchExpressions[].operator must be one of In, NotIn, Exists, DoesNotExist (case-sensitive)".into(),
        ),
        (
            exprs("e.operator in ['In', 'NotIn'] ? has(e.values) && size(e.values) > 0 : !has(e.values) || size(e.values) == 0"),
            "matchExpressions[]: In and NotIn need at least one value in values; Exists and DoesNotExist must have no values".into(),
        ),
        (
            exprs(&format!("e.key.matches('{KEY_RE}')")),
            "matchExpressions[].key must be a label key: an optional DNS prefix and '/', then at most 63 alphanumerics, '-', '_' or '.', starting and ending alphanumeric (e.g. node-role.kubernetes.io/worker)".into(),
        ),
        (
            exprs(&format!("!has(e.values) || e.values.all(v, v.matches('{VALUE_RE}'))")),
            "matchExpressions[].values must be label values: at most 63 alphanumerics, '-', '_' or '.', starting and ending alphanumeric".into(),
        ),
        (
            labels(&format!("k.matches('{KEY_RE}')")),
            "matchLabels keys must be label keys: an optional DNS prefix and '/', then at most 63 alphanumerics, '-', '_' or '.', starting and ending alphanumeric".into(),
        ),
        (
            labels(&format!("self.matchLabels[k].matches('{VALUE_RE}')")),
            "matchLabels values must be label values: at most 63 alphanumerics, '-', '_' or '.', starting and ending alphanumeric".into(),
        ),
    ]
}
