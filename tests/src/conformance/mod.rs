//! The conformance matrix against the real kube-proxy (issue 13, item 3): the same Services, seen
//! by the same clients, through kube-proxy and through Switchyard, compared cell by cell.
//!
//! - [`services`]: the dual-stack Services and EndpointSlices of the matrix (every semantic of
//!   `tests/tests/dataplane.rs`), applied once to the one control plane both proxies watch.
//! - [`cell`]: one cell is a client (a pod, a node, the fabric), a target (a ClusterIP, a node
//!   port on some address, an external or load-balancer IP), a protocol and a family, and how many
//!   attempts it takes to see everything that may answer.
//! - [`verdict`]: what a cell shows, reduced to what must agree: which endpoints answered and with
//!   which source address (by owner: a pod, a node, a node's pod bridge, the fabric), refused
//!   (ICMP or reset before the attempt's limit) or dropped (no answer within it), a spread's
//!   uniformity, a health check's status.
//! - [`twin`]: a set of namespace nodes with the echo servers, served by one proxy. Both proxies
//!   get their own twin: the same node names and addresses behind separate fabrics, side by side on
//!   the same apiserver objects at the same time.
//! - [`run`]: every cell on both twins (a few at a time: drops are waits, not work).
//! - [`judge`]: the comparison with the named deliberate differences and known bugs, and the
//!   printed matrix.

pub mod cell;
pub mod judge;
pub mod run;
pub mod services;
pub mod twin;
pub mod verdict;
