//! The committed CRD YAML must be exactly what `crdgen` generates.

use std::path::PathBuf;

#[test]
fn committed_crd_yaml_is_current() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let files = switchyard_crds::crd_yaml().expect("CRDs serialise");
    assert_eq!(files.len(), 2);
    for dir in ["config/crd", "helm/switchyard/crds"] {
        for (name, body) in &files {
            let path = root.join(dir).join(name);
            let committed = std::fs::read_to_string(&path).unwrap_or_default();
            assert!(
                committed == *body,
                "{} is stale or missing: run `cargo run -p switchyard-crds --features crdgen --bin crdgen`",
                path.display()
            );
        }
    }
}
