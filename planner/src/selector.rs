//! Label selectors over node labels: `matchLabels` plus `matchExpressions` with the operators
//! `In`, `NotIn`, `Exists` and `DoesNotExist` (the ones the CRD admits).

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;

/// One parsed requirement of a selector.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Requirement {
    Equals(String, String),
    In(String, Vec<String>),
    NotIn(String, Vec<String>),
    Exists(String),
    DoesNotExist(String),
    /// An operator the planner does not know: matches nothing (the CRD rejects these anyway).
    Never,
}

/// A label selector compiled once and matched against many label sets.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Selector {
    requirements: Vec<Requirement>,
}

impl Selector {
    /// Compiles a Kubernetes `LabelSelector`. An empty selector matches every label set.
    pub fn new(selector: &LabelSelector) -> Self {
        let mut requirements = Vec::new();
        for (k, v) in selector.match_labels.iter().flatten() {
            requirements.push(Requirement::Equals(k.clone(), v.clone()));
        }
        for e in selector.match_expressions.iter().flatten() {
            let values = e.values.clone().unwrap_or_default();
            requirements.push(match e.operator.as_str() {
                "In" => Requirement::In(e.key.clone(), values),
                "NotIn" => Requirement::NotIn(e.key.clone(), values),
                "Exists" => Requirement::Exists(e.key.clone()),
                "DoesNotExist" => Requirement::DoesNotExist(e.key.clone()),
                _ => Requirement::Never,
            });
        }
        Self { requirements }
    }

    /// Whether `labels` satisfy every requirement.
    pub fn matches(&self, labels: &BTreeMap<String, String>) -> bool {
        self.requirements.iter().all(|r| match r {
            Requirement::Equals(k, v) => labels.get(k) == Some(v),
            Requirement::In(k, vs) => labels.get(k).is_some_and(|v| vs.contains(v)),
            Requirement::NotIn(k, vs) => labels.get(k).is_none_or(|v| !vs.contains(v)),
            Requirement::Exists(k) => labels.contains_key(k),
            Requirement::DoesNotExist(k) => !labels.contains_key(k),
            Requirement::Never => false,
        })
    }
}

#[cfg(test)]
mod tests {
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelectorRequirement;

    use super::*;

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn expr(key: &str, op: &str, values: &[&str]) -> LabelSelectorRequirement {
        LabelSelectorRequirement {
            key: key.into(),
            operator: op.into(),
            values: if values.is_empty() {
                None
            } else {
                Some(values.iter().map(|v| v.to_string()).collect())
            },
        }
    }

    #[test]
    fn selector_table() {
        let pool_a = labels(&[("pool", "a"), ("zone", "z1")]);
        let pool_b = labels(&[("pool", "b")]);
        let bare = labels(&[]);
        // (selector, [matches pool_a, pool_b, bare])
        let cases: Vec<(LabelSelector, [bool; 3])> = vec![
            (LabelSelector::default(), [true, true, true]),
            (
                LabelSelector {
                    match_labels: Some([("pool".into(), "a".into())].into()),
                    ..Default::default()
                },
                [true, false, false],
            ),
            (
                LabelSelector {
                    match_expressions: Some(vec![expr("pool", "In", &["a", "b"])]),
                    ..Default::default()
                },
                [true, true, false],
            ),
            (
                LabelSelector {
                    match_expressions: Some(vec![expr("pool", "NotIn", &["a"])]),
                    ..Default::default()
                },
                [false, true, true],
            ),
            (
                LabelSelector {
                    match_expressions: Some(vec![expr("zone", "Exists", &[])]),
                    ..Default::default()
                },
                [true, false, false],
            ),
            (
                LabelSelector {
                    match_expressions: Some(vec![expr("zone", "DoesNotExist", &[])]),
                    ..Default::default()
                },
                [false, true, true],
            ),
            (
                LabelSelector {
                    match_expressions: Some(vec![expr("zone", "Gt", &["1"])]),
                    ..Default::default()
                },
                [false, false, false],
            ),
            (
                LabelSelector {
                    match_labels: Some([("pool".into(), "a".into())].into()),
                    match_expressions: Some(vec![expr("zone", "In", &["z2"])]),
                },
                [false, false, false],
            ),
        ];
        for (i, (sel, want)) in cases.into_iter().enumerate() {
            let s = Selector::new(&sel);
            assert_eq!(
                [s.matches(&pool_a), s.matches(&pool_b), s.matches(&bare)],
                want,
                "case {i}: {sel:?}"
            );
        }
    }
}
