//! Writes the generated CRD YAML into `config/crd/` and `helm/switchyard/crds/`.
//!
//! `crdgen` (no arguments) writes the files under the workspace root; `crdgen --stdout` prints them.
#![cfg_attr(not(test), warn(clippy::too_many_lines))]

use std::{path::PathBuf, process::ExitCode};

fn main() -> ExitCode {
    let files = match switchyard_crds::crd_yaml() {
        Ok(files) => files,
        Err(e) => {
            eprintln!("crdgen: {e}");
            return ExitCode::FAILURE;
        }
    };
    if std::env::args().any(|a| a == "--stdout") {
        for (_, body) in &files {
            print!("---\n{body}");
        }
        return ExitCode::SUCCESS;
    }
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    for dir in ["config/crd", "helm/switchyard/crds"] {
        for (name, body) in &files {
            let path = root.join(dir).join(name);
            if let Err(e) = std::fs::create_dir_all(root.join(dir)).and_then(|()| std::fs::write(&path, body))
            {
                eprintln!("crdgen: cannot write {}: {e}", path.display());
                return ExitCode::FAILURE;
            }
            println!("wrote {dir}/{name}");
        }
    }
    ExitCode::SUCCESS
}
