//! Kernel adapters: the only code in the agent that opens netlink sockets, runs commands or reads
//! kernel files. Everything above this layer is pure.

pub mod conntrack;
pub mod error;
pub mod exec;
pub mod genl;
pub mod host;
pub mod ipset;
pub mod iptables;
pub mod ipvs;
pub mod link;
pub mod netlink;
pub mod nfacct;
pub mod nft;
pub mod sysctl;

pub use error::{KernelError, KernelResult};
