//! Golden files in `node-agent/src/backend/<backend>/testdata/`: compared byte for byte, rewritten
//! with `SWITCHYARD_UPDATE_GOLDEN=1`.

use std::path::PathBuf;

/// The path of golden `file` of `backend` (`nftables`, `iptables`, `ipvs`).
pub fn path(backend: &str, file: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("src/backend")
        .join(backend)
        .join("testdata")
        .join(file)
}

/// The contents of golden `file` of `backend`.
pub fn read(backend: &str, file: &str) -> String {
    let path = path(backend, file);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("read golden {}: {e}", path.display()))
}

/// Asserts that `actual` equals golden `file` of `backend`, showing the lines that differ;
/// `SWITCHYARD_UPDATE_GOLDEN=1` rewrites the golden instead.
pub fn check(backend: &str, file: &str, actual: &str) {
    let path = path(backend, file);
    if std::env::var("SWITCHYARD_UPDATE_GOLDEN").as_deref() == Ok("1") {
        std::fs::write(&path, actual).unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
        return;
    }
    let expected = read(backend, file);
    if expected != actual {
        let diff: Vec<String> = expected
            .lines()
            .filter(|l| !actual.lines().any(|a| a == *l))
            .map(|l| format!("- {l}"))
            .chain(
                actual
                    .lines()
                    .filter(|l| !expected.lines().any(|e| e == *l))
                    .map(|l| format!("+ {l}")),
            )
            .collect();
        panic!(
            "{} differs (SWITCHYARD_UPDATE_GOLDEN=1 rewrites it); lines only in one of them:\n{}\n\nactual:\n{actual}",
            path.display(),
            diff.join("\n")
        );
    }
}
