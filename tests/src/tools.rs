//! Tools the install and GitOps tests run besides kubectl: `helm` (built with Go by
//! `scripts/build-control-plane.sh` next to kubectl), Debian's `lua5.1` (runs the Argo CD health
//! checks the way Argo CD does: base functions only), and the `kubectl-switchyard` plugin.

use std::{
    io::Write,
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

use serde_json::Value;

use crate::{Error, Result, binaries, io_err};

/// Output of a finished command: (success, stdout, stderr).
pub type Output = (bool, String, String);

fn run_with(program: &Path, args: &[&str], stdin: Option<&str>, env: &[(&str, &str)]) -> Result<Output> {
    let mut child = Command::new(program)
        .args(args)
        .envs(env.iter().copied())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(io_err(format!("start {}", program.display())))?;
    if let Some(mut input) = child.stdin.take() {
        input
            .write_all(stdin.unwrap_or_default().as_bytes())
            .map_err(io_err(format!("{} stdin", program.display())))?;
    }
    let out = child
        .wait_with_output()
        .map_err(io_err(format!("{}", program.display())))?;
    Ok((
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    ))
}

/// Path of `helm`, built (and cached) with the control plane.
pub fn helm() -> Result<PathBuf> {
    let path = binaries::control_plane_bin()?.join("helm");
    if path.exists() {
        Ok(path)
    } else {
        Err(Error::Prerequisite(format!(
            "{} is missing: run scripts/build-control-plane.sh (it builds helm with Go)",
            path.display()
        )))
    }
}

/// Runs helm with `args` (helm's caches kept in a private temporary home).
pub fn helm_run(args: &[&str]) -> Result<Output> {
    let home = std::env::temp_dir().join("switchyard-helm-home");
    let h = home.display().to_string();
    let (cache, config, data) = (format!("{h}/cache"), format!("{h}/config"), format!("{h}/data"));
    run_with(
        &helm()?,
        args,
        None,
        &[
            ("HELM_CACHE_HOME", &cache),
            ("HELM_CONFIG_HOME", &config),
            ("HELM_DATA_HOME", &data),
        ],
    )
}

/// Runs helm and returns stdout, or the failure with stderr.
pub fn helm_ok(args: &[&str]) -> Result<String> {
    let (ok, out, err) = helm_run(args)?;
    if ok {
        Ok(out)
    } else {
        Err(Error::Command {
            command: format!("helm {}", args.join(" ")),
            detail: err,
        })
    }
}

/// Runs `kubectl-switchyard` with a kubeconfig.
pub fn plugin(kubeconfig: &Path, args: &[&str]) -> Result<Output> {
    let mut all = vec!["--kubeconfig", kubeconfig.to_str().unwrap_or_default()];
    all.extend_from_slice(args);
    run_with(&binaries::workspace_bin("kubectl-switchyard")?, &all, None, &[])
}

/// A Lua string literal holding `s` (bytes below 32, quotes and backslashes escaped).
pub fn lua_string(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for ch in s.chars() {
        match ch {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c if (c as u32) < 32 || c as u32 == 127 => out.push_str(&format!("\\{:03}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// A JSON value as a Lua table constructor, the way Argo CD hands `obj` to a health script (JSON
/// null becomes an absent key).
pub fn lua_value(v: &Value) -> String {
    match v {
        Value::Null => "nil".into(),
        Value::Bool(b) => b.to_string(),
        Value::Number(n) => n.to_string(),
        Value::String(s) => lua_string(s),
        Value::Array(items) => {
            let parts: Vec<String> = items.iter().map(lua_value).collect();
            format!("{{{}}}", parts.join(", "))
        }
        Value::Object(map) => {
            let parts: Vec<String> = map
                .iter()
                .filter(|(_, v)| !v.is_null())
                .map(|(k, v)| format!("[{}] = {}", lua_string(k), lua_value(v)))
                .collect();
            format!("{{{}}}", parts.join(", "))
        }
    }
}

/// Runs the health script `script` on `obj` in lua5.1 with only Lua's base functions in scope (as
/// Argo CD does without `useOpenLibs`); returns (status, message).
pub fn health(script: &Path, obj: &Value) -> Result<(String, String)> {
    let program = format!(
        r#"local obj = {obj}
local env = {{ obj = obj, ipairs = ipairs, pairs = pairs, next = next, tostring = tostring,
  tonumber = tonumber, type = type, error = error, select = select, unpack = unpack, pcall = pcall }}
local chunk, err = loadfile({path})
if not chunk then io.stderr:write(tostring(err)) os.exit(2) end
setfenv(chunk, env)
local ok, hs = pcall(chunk)
if not ok then io.stderr:write(tostring(hs)) os.exit(3) end
if type(hs) ~= "table" then io.stderr:write("the script returned no table") os.exit(4) end
io.write(tostring(hs.status), "\n", tostring(hs.message))
"#,
        obj = lua_value(obj),
        path = lua_string(&script.display().to_string()),
    );
    let (ok, out, err) = run_with(Path::new("lua5.1"), &["-"], Some(&program), &[]).map_err(|e| {
        Error::Prerequisite(format!(
            "lua5.1 is needed to run the Argo CD health checks (scripts/install-deps.sh installs it): {e}"
        ))
    })?;
    if !ok {
        return Err(Error::Command {
            command: format!("lua5.1 {}", script.display()),
            detail: err,
        });
    }
    let (status, message) = out.split_once('\n').unwrap_or((out.as_str(), ""));
    Ok((status.to_owned(), message.to_owned()))
}
