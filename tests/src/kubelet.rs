//! Real nodes: a containerd and a kubelet inside each network-namespace node of [`crate::netns`].
//!
//! Each node gets its own directory (containerd's root and state, its socket, the kubelet's root
//! directory, pod logs, CNI configuration and IPAM state), its own top-level cgroup
//! `swyt<pid>x<seq>-<node>` in every hierarchy (the kubelet's `cgroupRoot`: the pods' cgroups live
//! below it), and its own mount namespace:
//!
//! ```text
//!   holder:     nsenter --net=<node netns> unshare --mount --propagation slave sh -c '...'
//!               fakes the host-wide sysctls the kubelet insists on (it only reads them then),
//!               puts tmpfs over /run, /var/lib and /var/log (paths containerd and the kubelet
//!               hard-code: shim sockets, device-plugin socket, /var/log/containers; and the
//!               node's own hostPath volumes), an empty /lib/modules where the host has none,
//!               then waits
//!   containerd: nsenter --target <holder> --mount --net containerd --config <node>/containerd.toml
//!   kubelet:    nsenter --target <holder> --mount --net kubelet --config <node>/kubelet.yaml ...
//! ```
//! Every mount containerd, the shims, runc and the kubelet make (overlay root file systems, shm,
//! the kubelet's rshared root directory, projected volumes, pinned pod network namespaces) lives in
//! that mount namespace, a slave of the host's: nothing propagates back, and the namespace and its
//! mounts vanish with its last process. Pods get addresses from the CNI bridge plugin on the
//! node's `cbr0` with host-local IPAM from the node's pod CIDRs (the ranges above `.100`, so the
//! harness's own pod namespaces at `.11`... never collide), which the fabric's host-gw routes
//! already reach. hostNetwork pods share the node's network namespace (containerd's).
//!
//! Teardown ([`Drop`]): kubelet, then every process in the node's cgroups (the containers),
//! containerd, every process whose command line names the node directory (the shims), every process
//! left in the node's mount namespace and the holder; then the cgroups and the directory. A crashed
//! run's leftovers are removed by [`crate::sweep`].

use std::{
    net::{Ipv4Addr, Ipv6Addr},
    path::{Path, PathBuf},
    process::{Child, ChildStdin, Command, Stdio},
    time::{Duration, Instant},
};

use crate::{
    Error, Result,
    controlplane::{self, ControlPlane, Credential},
    images, io_err, netns, sweep,
};

/// The sysctls the kubelet wants (`setupKernelTunables`); they are not namespaced, so each node's
/// mount namespace shows these values over the host's files instead of letting the kubelet write
/// the host's (it runs with `protectKernelDefaults`: a value it does not like fails it, it never
/// writes).
const KUBELET_SYSCTLS: [(&str, &str); 6] = [
    ("vm/overcommit_memory", "1"),
    ("vm/panic_on_oom", "0"),
    ("kernel/panic", "10"),
    ("kernel/panic_on_oops", "1"),
    ("kernel/keys/root_maxkeys", "1000000"),
    ("kernel/keys/root_maxbytes", "25000000"),
];

const HOLDER_SCRIPT: &str = r#"set -eu
d=$1
while read -r key value; do
  f="$d/sysctl/$(echo "$key" | tr / .)"
  echo "$value" > "$f"
  mount --bind "$f" "/proc/sys/$key"
done < "$d/sysctl/wanted"
mount -t tmpfs -o mode=755 swyt-run /run
mount -t tmpfs -o mode=755 swyt-var-lib /var/lib
mount -t tmpfs -o mode=755 swyt-var-log /var/log
# A host without kernel module support has no /lib/modules, which DaemonSets (kube-proxy's, the
# agent's) mount with type Directory: the node gets an empty one, over an overlay of /usr/lib.
if [ ! -d /lib/modules ] && [ -L /lib ] && [ "$(readlink /lib)" = usr/lib ]; then
  mkdir -p "$d/usr-lib/upper" "$d/usr-lib/work"
  mount -t overlay -o "lowerdir=/usr/lib,upperdir=$d/usr-lib/upper,workdir=$d/usr-lib/work" swyt-usr-lib /usr/lib
  mkdir /usr/lib/modules
fi
touch "$d/holder.ready"
read -r _ || true
"#;

/// A kubelet node: containerd and kubelet running in a network-namespace node.
pub struct KubeletNode {
    /// Node name (the Kubernetes Node's name).
    pub name: String,
    /// The node's network namespace.
    pub netns: String,
    /// Node IP on the fabric.
    pub ip: Ipv4Addr,
    /// Node IPv6 address on the fabric.
    pub ip6: Ipv6Addr,
    /// The node's directory.
    pub dir: PathBuf,
    /// The node's top-level cgroup name (the kubelet's `cgroupRoot` is `/<cgroup>`).
    pub cgroup: String,
    bin: PathBuf,
    holder: Option<(Child, ChildStdin)>,
    mount_ns: String,
    containerd: Option<Child>,
    kubelet: Option<Child>,
}

fn write(path: &Path, body: &str) -> Result<()> {
    std::fs::write(path, body).map_err(io_err(format!("write {}", path.display())))
}

/// The first three octets of a `/24` (`10.244.1.0/24` → `10.244.1`).
fn v4_prefix(cidr: &str) -> Result<&str> {
    cidr.strip_suffix(".0/24")
        .ok_or_else(|| Error::Prerequisite(format!("not a /24 pod CIDR: {cidr}")))
}

/// The `/64` prefix with its `::` (`fd00:10:244:1::/64` → `fd00:10:244:1::`).
fn v6_prefix(cidr: &str) -> Result<&str> {
    cidr.strip_suffix("/64")
        .ok_or_else(|| Error::Prerequisite(format!("not a /64 pod CIDR: {cidr}")))
}

impl KubeletNode {
    /// Prepares `node` under `dir` (which must not exist): writes the configuration, creates the
    /// cgroup, starts the mount-namespace holder and containerd, and waits until containerd
    /// answers. `cgroup` is the node's top-level cgroup name (`swyt<pid>x<seq>-<node>`).
    pub fn start_runtime(
        cp: &ControlPlane,
        node: &netns::Node,
        dir: PathBuf,
        cgroup: String,
    ) -> Result<Self> {
        let bin = cp.bin.clone();
        for name in ["containerd", "containerd-shim-runc-v2", "ctr", "kubelet"] {
            if !bin.join(name).exists() {
                return Err(Error::Prerequisite(format!(
                    "{} is missing: run scripts/build-control-plane.sh (it builds the node tier)",
                    bin.join(name).display()
                )));
            }
        }
        for dep in [
            "/usr/sbin/runc",
            "/usr/lib/cni/bridge",
            "/usr/lib/cni/host-local",
            "/usr/lib/cni/loopback",
        ] {
            if !Path::new(dep).exists() {
                return Err(Error::Prerequisite(format!(
                    "{dep} is missing: apt-get install runc containernetworking-plugins (scripts/install-deps.sh does)"
                )));
            }
        }
        // A unix socket path has at most 107 bytes (containerd's ttrpc socket is the longest).
        let longest = dir.join("containerd.sock.ttrpc");
        if longest.as_os_str().len() > 100 {
            return Err(Error::Prerequisite(format!(
                "{} is too long for a unix socket: set TMPDIR to a shorter directory",
                longest.display()
            )));
        }
        let mut this = Self {
            name: node.name.clone(),
            netns: node.netns.clone(),
            ip: node.ip,
            ip6: node.ip6,
            dir,
            cgroup,
            bin,
            holder: None,
            mount_ns: String::new(),
            containerd: None,
            kubelet: None,
        };
        for sub in [
            "sysctl",
            "containerd/root",
            "containerd/state",
            "containerd/opt",
            "runc",
            "cni/net.d",
            "cni/ipam",
            "kubelet",
            "pod-logs",
            "volume-plugins",
        ] {
            std::fs::create_dir_all(this.dir.join(sub)).map_err(io_err("create node dir"))?;
        }
        this.write_configs(cp, node)?;
        this.create_cgroup()?;
        this.start_holder()?;
        this.start_containerd()?;
        Ok(this)
    }

    fn d(&self) -> String {
        self.dir.display().to_string()
    }

    /// The containerd socket.
    pub fn socket(&self) -> PathBuf {
        self.dir.join("containerd.sock")
    }

    /// Writes the node's configuration: the sysctls the holder fakes, containerd's, the CNI
    /// network's, the kubelet's credentials and kubeconfig, and the kubelet's.
    fn write_configs(&self, cp: &ControlPlane, node: &netns::Node) -> Result<()> {
        let wanted: String = KUBELET_SYSCTLS
            .iter()
            .map(|(k, v)| format!("{k} {v}\n"))
            .collect();
        write(&self.dir.join("sysctl/wanted"), &wanted)?;
        self.write_containerd_config()?;
        self.write_cni_config(node)?;
        self.write_kubelet_credentials(cp)?;
        self.write_kubelet_config(cp)
    }

    /// containerd's configuration: everything under the node directory (no host-wide socket or
    /// state), CRI with runc and the CNI configuration of [`Self::write_cni_config`].
    fn write_containerd_config(&self) -> Result<()> {
        let d = self.d();
        let containerd = format!(
            r#"version = 4
root = "{d}/containerd/root"
state = "{d}/containerd/state"
imports = []
# NRI would listen on the host-wide /var/run/nri/nri.sock.
disabled_plugins = ["io.containerd.nri.v1.nri"]

[debug]
  level = "info"

[plugins]
  [plugins."io.containerd.server.v1.grpc"]
    address = "{d}/containerd.sock"
  [plugins."io.containerd.server.v1.ttrpc"]
    address = "{d}/containerd.sock.ttrpc"
  [plugins."io.containerd.image-verifier.v1.bindir"]
    bin_dir = "{d}/containerd/image-verifier"
  [plugins."io.containerd.internal.v1.opt"]
    path = "{d}/containerd/opt"
  [plugins."io.containerd.cri.v1.images"]
    snapshotter = "overlayfs"
    [plugins."io.containerd.cri.v1.images".pinned_images]
      sandbox = "{pause}"
  [plugins."io.containerd.cri.v1.runtime"]
    disable_apparmor = true
    netns_mounts_under_state_dir = true
    # Without CAP_SYS_RESOURCE (this machine's root lacks it) no process may lower its OOM score:
    # sandboxes ask for -998, which fails runc. Capped at containerd's own score instead.
    restrict_oom_score_adj = true
    [plugins."io.containerd.cri.v1.runtime".containerd]
      default_runtime_name = "runc"
      [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc]
        runtime_type = "io.containerd.runc.v2"
        [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc.options]
          BinaryName = "/usr/sbin/runc"
          Root = "{d}/runc"
          SystemdCgroup = false
    [plugins."io.containerd.cri.v1.runtime".cni]
      bin_dirs = ["/usr/lib/cni"]
      conf_dir = "{d}/cni/net.d"
  [plugins."io.containerd.grpc.v1.cri"]
    stream_server_address = "127.0.0.1"
    stream_server_port = "0"
"#,
            pause = images::PAUSE_IMAGE,
        );
        write(&self.dir.join("containerd.toml"), &containerd)
    }

    /// The CNI network: the bridge plugin on `cbr0`, host-local IPAM from the node's pod CIDRs
    /// above `.100` (the harness's own pod namespaces are at `.11`...).
    fn write_cni_config(&self, node: &netns::Node) -> Result<()> {
        let d = self.d();
        let (p4, p6) = (v4_prefix(&node.pod_cidr)?, v6_prefix(&node.pod_cidr6)?);
        let cni = serde_json::json!({
            "cniVersion": "1.0.0",
            "name": "swyt",
            "plugins": [{
                "type": "bridge",
                "bridge": "cbr0",
                "isGateway": true,
                "ipMasq": false,
                "hairpinMode": true,
                "ipam": {
                    "type": "host-local",
                    "dataDir": format!("{d}/cni/ipam"),
                    "ranges": [
                        [{"subnet": node.pod_cidr, "rangeStart": format!("{p4}.100"), "rangeEnd": format!("{p4}.250"), "gateway": format!("{p4}.1")}],
                        [{"subnet": node.pod_cidr6, "rangeStart": format!("{p6}100"), "rangeEnd": format!("{p6}250"), "gateway": format!("{p6}1")}],
                    ],
                    "routes": [{"dst": "0.0.0.0/0"}, {"dst": "::/0"}],
                },
            }],
        });
        write(&self.dir.join("cni/net.d/10-swyt.conflist"), &cni.to_string())
    }

    /// The kubelet's client certificate (`system:node:<name>` in `system:nodes`) and its
    /// kubeconfig for the apiserver's fabric address.
    fn write_kubelet_credentials(&self, cp: &ControlPlane) -> Result<()> {
        let (cert, key) = cp
            .pki()
            .client_cert(&format!("system:node:{}", self.name), Some("system:nodes"))?;
        write(&self.dir.join("kubelet-client.crt"), &cert)?;
        write(&self.dir.join("kubelet-client.key"), &key)?;
        let kubeconfig = cp.write_kubeconfig(
            &format!("kubelet-{}", self.name),
            &format!("https://{}:{}", controlplane::ADVERTISE_ADDRESS, cp.port),
            Credential::Certificate {
                cert: self.dir.join("kubelet-client.crt"),
                key: self.dir.join("kubelet-client.key"),
            },
        )?;
        std::fs::rename(&kubeconfig, self.dir.join("kubelet.kubeconfig"))
            .map_err(io_err("move kubeconfig"))?;
        Ok(())
    }

    /// The KubeletConfiguration: cgroupfs below the node's cgroup, containerd's socket, no
    /// evictions or image GC, logs and volume plugins in the node directory.
    fn write_kubelet_config(&self, cp: &ControlPlane) -> Result<()> {
        let d = self.d();
        let kubelet = format!(
            r#"apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
failCgroupV1: false
cgroupDriver: cgroupfs
cgroupRoot: /{cgroup}
cgroupsPerQOS: true
enforceNodeAllocatable: ["none"]
failSwapOn: false
protectKernelDefaults: true
containerRuntimeEndpoint: unix://{d}/containerd.sock
authentication:
  anonymous:
    enabled: false
  webhook:
    enabled: false
  x509:
    clientCAFile: {cp}/ca.crt
authorization:
  mode: AlwaysAllow
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: 10248
resolvConf: ""
clusterDomain: cluster.local
evictionHard:
  memory.available: "0%"
  nodefs.available: "0%"
  nodefs.inodesFree: "0%"
  imagefs.available: "0%"
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
serializeImagePulls: false
podLogsDir: {d}/pod-logs
volumePluginDir: {d}/volume-plugins
rotateCertificates: false
serverTLSBootstrap: false
registerNode: true
"#,
            cgroup = self.cgroup,
            cp = cp.dir().display(),
        );
        write(&self.dir.join("kubelet.yaml"), &kubelet)
    }

    /// Creates `/<cgroup>` in every cgroup v1 hierarchy (the kubelet requires its `cgroupRoot` to
    /// exist), with the root's CPUs and memory nodes in the cpuset hierarchy.
    fn create_cgroup(&self) -> Result<()> {
        for mount in sweep::cgroup_mounts() {
            let dir = mount.join(&self.cgroup);
            if mount.file_name().is_some_and(|n| n == "unified") {
                continue;
            }
            std::fs::create_dir_all(&dir).map_err(io_err(format!("create cgroup {}", dir.display())))?;
            for file in ["cpuset.cpus", "cpuset.mems"] {
                if let Ok(value) = std::fs::read_to_string(mount.join(file)) {
                    write(&dir.join(file), value.trim())?;
                }
            }
        }
        Ok(())
    }

    fn log_file(&self, name: &str) -> Result<(Stdio, Stdio)> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join(format!("{name}.log")))
            .map_err(io_err("open log"))?;
        let err = log.try_clone().map_err(io_err("clone log"))?;
        Ok((Stdio::from(log), Stdio::from(err)))
    }

    fn start_holder(&mut self) -> Result<()> {
        let (out, err) = self.log_file("holder")?;
        let mut child = Command::new("nsenter")
            .arg(format!("--net=/run/netns/{}", self.netns))
            .args([
                "--",
                "unshare",
                "--mount",
                "--propagation",
                "slave",
                "--",
                "sh",
                "-c",
            ])
            .arg(HOLDER_SCRIPT)
            .arg("swyt-holder")
            .arg(&self.dir)
            .stdin(Stdio::piped())
            .stdout(out)
            .stderr(err)
            .spawn()
            .map_err(io_err("start the node's namespace holder"))?;
        let stdin = child
            .stdin
            .take()
            .ok_or_else(|| Error::Prerequisite("holder stdin".into()))?;
        self.holder = Some((child, stdin));
        let ready = self.dir.join("holder.ready");
        let start = Instant::now();
        while !ready.exists() {
            if let Some((child, _)) = self.holder.as_mut()
                && let Ok(Some(status)) = child.try_wait()
            {
                return Err(Error::Prerequisite(format!(
                    "{}: the mount-namespace holder exited ({status}): {}",
                    self.name,
                    self.log_tail("holder")
                )));
            }
            if start.elapsed() > Duration::from_secs(10) {
                return Err(Error::Timeout(
                    Duration::from_secs(10),
                    format!("{}: holder ready", self.name),
                ));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let pid = self.holder_pid();
        self.mount_ns = std::fs::read_link(format!("/proc/{pid}/ns/mnt"))
            .map_err(io_err("read the holder's mount namespace"))?
            .display()
            .to_string();
        Ok(())
    }

    fn holder_pid(&self) -> u32 {
        self.holder.as_ref().map(|(c, _)| c.id()).unwrap_or(0)
    }

    /// A command that runs `program` inside the node (its network and mount namespaces).
    fn in_node(&self, program: &Path) -> Command {
        let mut cmd = Command::new("nsenter");
        cmd.arg(format!("--target={}", self.holder_pid()))
            .args(["--mount", "--net", "--"])
            .arg(program)
            .env(
                "PATH",
                format!(
                    "{}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                    self.bin.display()
                ),
            )
            .stdin(Stdio::null());
        cmd
    }

    fn start_containerd(&mut self) -> Result<()> {
        let (out, err) = self.log_file("containerd")?;
        let child = self
            .in_node(&self.bin.join("containerd"))
            .arg("--config")
            .arg(self.dir.join("containerd.toml"))
            .stdout(out)
            .stderr(err)
            .spawn()
            .map_err(io_err("start containerd"))?;
        self.containerd = Some(child);
        let start = Instant::now();
        let limit = Duration::from_secs(30);
        loop {
            if let Some(child) = self.containerd.as_mut()
                && let Ok(Some(status)) = child.try_wait()
            {
                return Err(Error::Prerequisite(format!(
                    "{}: containerd exited ({status}); its log ends:\n{}",
                    self.name,
                    self.log_tail("containerd")
                )));
            }
            if self.socket().exists() && self.ctr(&["version"]).is_ok() {
                return Ok(());
            }
            if start.elapsed() > limit {
                return Err(Error::Timeout(
                    limit,
                    format!(
                        "{}: containerd ready; its log ends:\n{}",
                        self.name,
                        self.log_tail("containerd")
                    ),
                ));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Runs `ctr` against this node's containerd (namespace `k8s.io`, the CRI's) and returns stdout.
    pub fn ctr(&self, args: &[&str]) -> Result<String> {
        let ctr = self.bin.join("ctr").display().to_string();
        let socket = self.socket().display().to_string();
        let mut full = vec!["--address", &socket, "--namespace", "k8s.io"];
        full.extend_from_slice(args);
        crate::run(&ctr, &full)
    }

    /// Runs `crictl` against this node's containerd and returns stdout.
    pub fn crictl(&self, args: &[&str]) -> Result<String> {
        let crictl = self.bin.join("crictl").display().to_string();
        let endpoint = format!("unix://{}", self.socket().display());
        let mut full = vec![
            "--runtime-endpoint",
            &endpoint,
            "--image-endpoint",
            &endpoint,
            "--timeout",
            "10s",
        ];
        full.extend_from_slice(args);
        crate::run(&crictl, &full)
    }

    /// Imports an image archive (docker-archive or OCI layout tar) into the node's containerd.
    pub fn import_image(&self, archive: &Path) -> Result<()> {
        self.ctr(&["images", "import", &archive.display().to_string()])
            .map(|_| ())
    }

    /// Starts the kubelet (containerd must be running and the sandbox image imported).
    pub fn start_kubelet(&mut self) -> Result<()> {
        let (out, err) = self.log_file("kubelet")?;
        let d = self.d();
        let child = self
            .in_node(&self.bin.join("kubelet"))
            .arg(format!("--config={d}/kubelet.yaml"))
            .arg(format!("--kubeconfig={d}/kubelet.kubeconfig"))
            .arg(format!("--root-dir={d}/kubelet"))
            .arg(format!("--cert-dir={d}/kubelet/pki"))
            .arg(format!("--hostname-override={}", self.name))
            .arg(format!("--node-ip={},{}", self.ip, self.ip6))
            .arg("--v=1")
            .stdout(out)
            .stderr(err)
            .spawn()
            .map_err(io_err("start kubelet"))?;
        self.kubelet = Some(child);
        Ok(())
    }

    /// Fails (with the log's end) if containerd or the kubelet has exited.
    pub fn check_running(&mut self) -> Result<()> {
        let mut exited = None;
        for (name, child) in [
            ("containerd", &mut self.containerd),
            ("kubelet", &mut self.kubelet),
        ] {
            if let Some(c) = child.as_mut()
                && let Ok(Some(status)) = c.try_wait()
            {
                exited = Some((name, status));
                break;
            }
        }
        match exited {
            Some((name, status)) => Err(Error::Prerequisite(format!(
                "{}: {name} exited ({status}); its log ends:\n{}",
                self.name,
                self.log_tail(name)
            ))),
            None => Ok(()),
        }
    }

    /// Last lines of a component's log (`containerd`, `kubelet`, `holder`).
    pub fn log_tail(&self, name: &str) -> String {
        let text = std::fs::read_to_string(self.dir.join(format!("{name}.log"))).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(20)..].join("\n")
    }

    /// Path of a component's log.
    pub fn log_path(&self, name: &str) -> PathBuf {
        self.dir.join(format!("{name}.log"))
    }

    /// PIDs of the processes in the node's mount namespace (containerd, kubelet, shims, holder).
    fn mount_ns_pids(&self) -> Vec<u32> {
        if self.mount_ns.is_empty() {
            return Vec::new();
        }
        let own = std::process::id();
        sweep::all_pids()
            .into_iter()
            .filter(|p| *p != own)
            .filter(|p| {
                std::fs::read_link(format!("/proc/{p}/ns/mnt"))
                    .is_ok_and(|ns| ns.display().to_string() == self.mount_ns)
            })
            .collect()
    }

    /// Stops everything of this node and removes its cgroups and directory (idempotent).
    pub fn stop(&mut self) {
        let grace = Duration::from_secs(5);
        if let Some(mut kubelet) = self.kubelet.take() {
            sweep::stop_child(&mut kubelet, grace);
        }
        // The containers (and anything else in the pods' cgroups).
        sweep::remove_cgroup(&self.cgroup);
        if let Some(mut containerd) = self.containerd.take() {
            sweep::stop_child(&mut containerd, grace);
        }
        // The shims name the node's containerd socket on their command lines.
        sweep::kill_naming(&format!("{}/", self.d()));
        let left = self.mount_ns_pids();
        for pid in &left {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(*pid as i32),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
        sweep::wait_gone(&left, grace);
        if let Some((mut holder, stdin)) = self.holder.take() {
            drop(stdin);
            sweep::stop_child(&mut holder, grace);
        }
        // Containers started between the first sweep and containerd's end.
        sweep::remove_cgroup(&self.cgroup);
        // Nothing is mounted in this namespace under the node's directory; checked anyway.
        sweep::unmount_under(&self.dir);
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl Drop for KubeletNode {
    fn drop(&mut self) {
        self.stop();
    }
}
