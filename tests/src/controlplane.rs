//! A real control plane for tests: etcd and kube-apiserver on free loopback ports, generated
//! certificates, RBAC on, service-account token signing, dual-stack Service CIDRs (IPv4 primary).
//! Clients for an admin and for any service account. Stopped and removed on drop.

use std::{
    net::{IpAddr, Ipv4Addr},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::Duration,
};

use k8s_openapi::api::{
    authentication::v1::{BoundObjectReference, TokenRequest, TokenRequestSpec},
    core::v1::ServiceAccount,
};
use kube::{
    Api, Client, Config,
    api::PostParams,
    config::{KubeConfigOptions, Kubeconfig},
};

use crate::{Error, Result, binaries, io_err, pki::Pki, sweep};

mod outage;
pub use outage::Killed;

/// Address the `default/kubernetes` Service points at, reachable from node namespaces through the
/// fabric (see [`crate::netns`]). The apiserver itself listens on 127.0.0.1 in the root namespace.
pub const ADVERTISE_ADDRESS: Ipv4Addr = Ipv4Addr::new(10, 250, 0, 1);
/// Service CIDR of the test cluster (its primary family: Services without `ipFamilies` are IPv4).
pub const SERVICE_CIDR: &str = "10.96.0.0/16";
/// IPv6 Service CIDR of the (dual-stack) test cluster.
pub const SERVICE_CIDR6: &str = "fd00:10:96::/112";

/// A running etcd + kube-apiserver.
pub struct ControlPlane {
    dir: PathBuf,
    processes: Vec<Child>,
    pki: Pki,
    /// Loopback port of the apiserver.
    pub port: u16,
    /// Directory holding kubectl and the control-plane binaries.
    pub bin: PathBuf,
}

impl ControlPlane {
    /// Builds (if needed) and starts etcd and kube-apiserver, and waits until the apiserver is ready.
    pub async fn start() -> Result<Self> {
        Self::start_with(&[]).await
    }

    /// Like [`ControlPlane::start`], with extra kube-apiserver flags (later flags win, so these
    /// can also override the defaults).
    ///
    /// A start that fails because a port was taken meanwhile (by a process outside this test) is
    /// tried again on fresh ports, up to three times.
    pub async fn start_with(extra_apiserver_args: &[String]) -> Result<Self> {
        const ATTEMPTS: usize = 3;
        let mut attempt = 1;
        loop {
            match Self::start_once(extra_apiserver_args).await {
                Err(Error::Prerequisite(why))
                    if why.contains("address already in use") && attempt < ATTEMPTS =>
                {
                    eprintln!("control plane start {attempt}/{ATTEMPTS} lost a port, again: {why}");
                    attempt += 1;
                }
                other => return other,
            }
        }
    }

    async fn start_once(extra_apiserver_args: &[String]) -> Result<Self> {
        sweep::sweep_leftovers();
        let bin = binaries::control_plane_bin()?;
        let (pid, seq) = sweep::next_id();
        let dir = std::env::temp_dir().join(format!("{}-{pid}-{seq}", sweep::PREFIX));
        std::fs::create_dir_all(&dir).map_err(io_err("create run dir"))?;
        let pki = Pki::generate(&[
            IpAddr::V4(Ipv4Addr::LOCALHOST),
            IpAddr::V4(ADVERTISE_ADDRESS),
            "10.96.0.1"
                .parse()
                .map_err(|_| Error::Prerequisite("ip".into()))?,
        ])?;
        let mut cp = Self {
            dir,
            processes: Vec::new(),
            pki,
            port: 0,
            bin,
        };
        let pki = &cp.pki;
        for (name, body) in [
            ("ca.crt", &pki.ca_cert),
            ("apiserver.crt", &pki.serving_cert),
            ("apiserver.key", &pki.serving_key),
            ("admin.crt", &pki.admin_cert),
            ("admin.key", &pki.admin_key),
            ("sa.key", &pki.service_account_key),
            ("sa.pub", &pki.service_account_public_key),
        ] {
            std::fs::write(cp.dir.join(name), body).map_err(io_err(format!("write {name}")))?;
        }
        let (client_port, peer_port) = (
            crate::ports::free_loopback_port()?,
            crate::ports::free_loopback_port()?,
        );
        let d = cp.dir.display().to_string();
        cp.spawn(
            "etcd",
            &[
                &format!("--data-dir={d}/etcd"),
                "--name=default",
                &format!("--listen-client-urls=http://127.0.0.1:{client_port}"),
                &format!("--advertise-client-urls=http://127.0.0.1:{client_port}"),
                &format!("--listen-peer-urls=http://127.0.0.1:{peer_port}"),
                &format!("--initial-advertise-peer-urls=http://127.0.0.1:{peer_port}"),
                &format!("--initial-cluster=default=http://127.0.0.1:{peer_port}"),
                "--unsafe-no-fsync",
                "--log-level=warn",
            ],
        )?;
        cp.port = crate::ports::free_loopback_port()?;
        let base: &[&str] = &[
            &format!("--etcd-servers=http://127.0.0.1:{client_port}"),
            "--bind-address=127.0.0.1",
            &format!("--secure-port={}", cp.port),
            &format!("--advertise-address={ADVERTISE_ADDRESS}"),
            &format!("--cert-dir={d}/certs"),
            &format!("--tls-cert-file={d}/apiserver.crt"),
            &format!("--tls-private-key-file={d}/apiserver.key"),
            &format!("--client-ca-file={d}/ca.crt"),
            &format!("--service-cluster-ip-range={SERVICE_CIDR},{SERVICE_CIDR6}"),
            "--service-account-issuer=https://kubernetes.default.svc",
            &format!("--service-account-key-file={d}/sa.pub"),
            &format!("--service-account-signing-key-file={d}/sa.key"),
            // Node (and NodeRestriction) for kubelets with `system:node:<name>` certificates.
            "--authorization-mode=Node,RBAC",
            "--enable-admission-plugins=NodeRestriction",
            // The apiserver's client certificate for kubelets (logs, exec, port-forward).
            &format!("--kubelet-client-certificate={d}/admin.crt"),
            &format!("--kubelet-client-key={d}/admin.key"),
            "--allow-privileged=true",
            "--enable-priority-and-fairness=false",
            "--profiling=false",
            "--endpoint-reconciler-type=lease",
        ];
        let mut apiserver_args: Vec<String> = base.iter().map(|a| a.to_string()).collect();
        apiserver_args.extend_from_slice(extra_apiserver_args);
        let apiserver_args: Vec<&str> = apiserver_args.iter().map(String::as_str).collect();
        cp.spawn("kube-apiserver", &apiserver_args)?;
        cp.write_kubeconfig(
            "admin",
            &format!("https://127.0.0.1:{}", cp.port),
            Credential::Admin,
        )?;
        cp.wait_ready().await?;
        Ok(cp)
    }

    /// Waits for `/readyz`; fails at once, with the log, when etcd or the apiserver exits.
    async fn wait_ready(&mut self) -> Result<()> {
        let client = self.admin_client().await?;
        let start = std::time::Instant::now();
        let limit = Duration::from_secs(90);
        loop {
            for (child, name) in self.processes.iter_mut().zip(["etcd", "kube-apiserver"]) {
                if let Ok(Some(status)) = child.try_wait() {
                    return Err(Error::Prerequisite(format!(
                        "{name} exited ({status}) while starting; its log ends:\n{}",
                        self.log_tail(name)
                    )));
                }
            }
            let req = http::Request::get("/readyz")
                .body(Vec::new())
                .map_err(|e| Error::Prerequisite(e.to_string()))?;
            if client.request_text(req).await.is_ok_and(|t| t.trim() == "ok") {
                return Ok(());
            }
            if start.elapsed() > limit {
                return Err(Error::Timeout(
                    limit,
                    format!(
                        "kube-apiserver /readyz; its log ends:\n{}",
                        self.log_tail("kube-apiserver")
                    ),
                ));
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    fn spawn(&mut self, name: &str, args: &[&str]) -> Result<()> {
        let log =
            std::fs::File::create(self.dir.join(format!("{name}.log"))).map_err(io_err("create log"))?;
        let err = log.try_clone().map_err(io_err("clone log"))?;
        let child = Command::new(self.bin.join(name))
            .args(args)
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(err)
            .spawn()
            .map_err(io_err(format!("start {name}")))?;
        sweep::record_pid(&self.dir, child.id());
        self.processes.push(child);
        Ok(())
    }

    /// The run directory (certificates, logs, kubeconfigs).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Last lines of a component's log, for failure messages.
    pub fn log_tail(&self, name: &str) -> String {
        let text = std::fs::read_to_string(self.dir.join(format!("{name}.log"))).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(15)..].join("\n")
    }

    /// Writes a kubeconfig named `name` for `server` and returns its path.
    pub fn write_kubeconfig(&self, name: &str, server: &str, credential: Credential) -> Result<PathBuf> {
        let d = self.dir.display();
        let user = match credential {
            Credential::Admin => {
                format!("    client-certificate: {d}/admin.crt\n    client-key: {d}/admin.key\n")
            }
            Credential::Token(token) => format!("    token: {token}\n"),
            Credential::Certificate { cert, key } => format!(
                "    client-certificate: {}\n    client-key: {}\n",
                cert.display(),
                key.display()
            ),
        };
        let text = format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: test\n  cluster:\n    server: {server}\n    certificate-authority: {d}/ca.crt\nusers:\n- name: {name}\n  user:\n{user}contexts:\n- name: {name}\n  context:\n    cluster: test\n    user: {name}\ncurrent-context: {name}\n"
        );
        let path = self.dir.join(format!("{name}.kubeconfig"));
        std::fs::write(&path, text).map_err(io_err("write kubeconfig"))?;
        Ok(path)
    }

    /// The certificates (to issue more client certificates from the cluster's CA).
    pub fn pki(&self) -> &Pki {
        &self.pki
    }

    /// Path of the admin kubeconfig.
    pub fn admin_kubeconfig(&self) -> PathBuf {
        self.dir.join("admin.kubeconfig")
    }

    /// A client from a kubeconfig file.
    pub async fn client_from(path: &Path) -> Result<Client> {
        let kc = Kubeconfig::read_from(path).map_err(|e| Error::Prerequisite(format!("kubeconfig: {e}")))?;
        let config = Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
            .await
            .map_err(|e| Error::Prerequisite(format!("kubeconfig: {e}")))?;
        Ok(Client::try_from(config)?)
    }

    /// A cluster-admin client.
    pub async fn admin_client(&self) -> Result<Client> {
        Self::client_from(&self.admin_kubeconfig()).await
    }

    /// Issues a token for a service account with the TokenRequest API, optionally bound to a Pod
    /// (whose `spec.nodeName` then becomes the token's node-name claim).
    pub async fn service_account_token(
        &self,
        namespace: &str,
        name: &str,
        bound_pod: Option<(&str, &str)>,
    ) -> Result<String> {
        let sas: Api<ServiceAccount> = Api::namespaced(self.admin_client().await?, namespace);
        let request = TokenRequest {
            spec: TokenRequestSpec {
                audiences: vec!["https://kubernetes.default.svc".into()],
                expiration_seconds: Some(3600),
                bound_object_ref: bound_pod.map(|(pod, uid)| BoundObjectReference {
                    api_version: Some("v1".into()),
                    kind: Some("Pod".into()),
                    name: Some(pod.into()),
                    uid: Some(uid.into()),
                }),
            },
            ..Default::default()
        };
        let issued: TokenRequest = sas
            .create_subresource("token", name, &PostParams::default(), &request)
            .await?;
        issued
            .status
            .map(|s| s.token)
            .ok_or_else(|| Error::Prerequisite("TokenRequest returned no token".into()))
    }

    /// A client authenticating with `token` (over the loopback address).
    pub async fn token_client(&self, name: &str, token: &str) -> Result<Client> {
        let path = self.write_kubeconfig(
            name,
            &format!("https://127.0.0.1:{}", self.port),
            Credential::Token(token.into()),
        )?;
        Self::client_from(&path).await
    }

    /// Runs kubectl as admin with `args` and optional stdin; returns (success, stdout, stderr).
    pub fn kubectl(&self, args: &[&str], stdin: Option<&str>) -> Result<(bool, String, String)> {
        self.kubectl_as(&self.admin_kubeconfig(), args, stdin)
    }

    /// Runs kubectl with the given kubeconfig.
    pub fn kubectl_as(
        &self,
        kubeconfig: &Path,
        args: &[&str],
        stdin: Option<&str>,
    ) -> Result<(bool, String, String)> {
        use std::io::Write;
        let mut child = Command::new(self.bin.join("kubectl"))
            .arg(format!("--kubeconfig={}", kubeconfig.display()))
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(io_err("start kubectl"))?;
        if let Some(mut input) = child.stdin.take() {
            input
                .write_all(stdin.unwrap_or_default().as_bytes())
                .map_err(io_err("kubectl stdin"))?;
        }
        let out = child.wait_with_output().map_err(io_err("kubectl"))?;
        Ok((
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        ))
    }

    /// `kubectl apply` that must succeed; returns stdout.
    pub fn kubectl_ok(&self, args: &[&str], stdin: Option<&str>) -> Result<String> {
        let (ok, out, err) = self.kubectl(args, stdin)?;
        if ok {
            Ok(out)
        } else {
            Err(Error::Command {
                command: format!("kubectl {}", args.join(" ")),
                detail: err,
            })
        }
    }

    /// Server-side applies one object given as JSON (`--force-conflicts`: the test owns every
    /// field it writes, as a user re-applying their manifest does).
    pub fn apply_json(&self, object: &serde_json::Value) -> Result<String> {
        self.kubectl_ok(
            &["apply", "--server-side", "--force-conflicts", "-f", "-"],
            Some(&object.to_string()),
        )
    }

    /// Installs the CRDs from the kustomize base `config/crd` (its `Kustomization`) and waits until
    /// they are established.
    pub fn install_crds(&self) -> Result<()> {
        let dir = binaries::workspace_root().join("config/crd");
        self.kubectl_ok(
            &["apply", "--server-side", "-k", &dir.display().to_string()],
            None,
        )?;
        self.wait_crds_established()
    }

    /// Waits until Switchyard's CRDs are established (however they were installed). `kubectl
    /// wait` fails at once, instead of waiting, on a CRD read before the apiserver wrote its
    /// first `status.conditions` ("accessor error: <nil>"): that answer is asked again, up to
    /// 20 times 0.5 s apart; any other failure is returned.
    pub fn wait_crds_established(&self) -> Result<()> {
        let args = [
            "wait",
            "--for=condition=Established",
            "--timeout=60s",
            "crd/proxypolicies.switchyard.dev",
            "crd/nodeproxies.switchyard.dev",
        ];
        let mut tries = 0;
        loop {
            match self.kubectl_ok(&args, None) {
                Ok(_) => return Ok(()),
                Err(e) if tries < 20 && e.to_string().contains("accessor error: <nil>") => {
                    tries += 1;
                    std::thread::sleep(std::time::Duration::from_millis(500));
                }
                Err(e) => return Err(e),
            }
        }
    }
}

/// Who a kubeconfig authenticates as.
pub enum Credential {
    /// The admin client certificate.
    Admin,
    /// A bearer token.
    Token(String),
    /// A client certificate and its key (PEM files).
    Certificate {
        /// Certificate file.
        cert: PathBuf,
        /// Key file.
        key: PathBuf,
    },
}

impl Drop for ControlPlane {
    fn drop(&mut self) {
        // apiserver first, then etcd.
        for child in self.processes.iter_mut().rev() {
            sweep::stop_child(child, Duration::from_secs(5));
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
