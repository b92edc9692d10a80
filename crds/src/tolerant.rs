//! Deserialisers that accept everything the apiserver may have stored for a field, so one odd
//! object never fails a typed list or watch (which would stop a whole cache).
//!
//! Objects stored before the schema was hardened (see [`crate::schema`]) may hold `null` in an
//! int-or-string field, or an integer that does not fit `i32`. Here `null` reads as "not set" and
//! an out-of-range integer reads as its decimal string, which no validation accepts: the operator
//! then reports the field in a condition instead of failing to decode the object.

use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use serde::{Deserialize, Deserializer};

/// Any JSON value an int-or-string field may hold.
#[derive(Deserialize)]
#[serde(untagged)]
enum Raw {
    Int(i64),
    Float(f64),
    Text(String),
}

fn convert(raw: Raw) -> IntOrString {
    match raw {
        Raw::Int(n) => i32::try_from(n).map_or_else(|_| IntOrString::String(n.to_string()), IntOrString::Int),
        Raw::Float(f) => IntOrString::String(f.to_string()),
        Raw::Text(s) => IntOrString::String(s),
    }
}

/// An optional int-or-string: `null` is `None`, an integer outside `i32` its decimal string.
pub fn opt_int_or_string<'de, D: Deserializer<'de>>(d: D) -> Result<Option<IntOrString>, D::Error> {
    Ok(Option::<Raw>::deserialize(d)?.map(convert))
}

/// An int-or-string defaulting to 1 (`maxUnavailable`): `null` is 1.
pub fn int_or_string_or_default_one<'de, D: Deserializer<'de>>(d: D) -> Result<IntOrString, D::Error> {
    Ok(opt_int_or_string(d)?.unwrap_or(IntOrString::Int(1)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Deserialize)]
    struct T {
        #[serde(default, deserialize_with = "opt_int_or_string")]
        v: Option<IntOrString>,
        #[serde(default = "one", deserialize_with = "int_or_string_or_default_one")]
        m: IntOrString,
    }

    fn one() -> IntOrString {
        IntOrString::Int(1)
    }

    fn parse(json: &str) -> T {
        serde_json::from_str(json).expect("decodes")
    }

    #[test]
    fn nulls_and_overflows_decode() {
        let t = parse(r#"{"v": null, "m": null}"#);
        assert_eq!((t.v, t.m), (None, IntOrString::Int(1)));
        let t = parse(r#"{"v": 3000000000, "m": 2147483648}"#);
        assert_eq!(t.v, Some(IntOrString::String("3000000000".into())));
        assert_eq!(t.m, IntOrString::String("2147483648".into()));
        let t = parse(r#"{"v": "25%", "m": 7}"#);
        assert_eq!(
            (t.v, t.m),
            (Some(IntOrString::String("25%".into())), IntOrString::Int(7))
        );
        let t = parse("{}");
        assert_eq!((t.v, t.m), (None, IntOrString::Int(1)));
    }
}
