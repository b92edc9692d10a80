//! `switchyard.dev/v1alpha1`: ProxyPolicy, NodeProxy and the types they share.

mod advice;
mod common;
mod node_proxy;
mod on_release;
mod preflight;
mod proxy_policy;
mod switch_outcome;

pub use advice::*;
pub use common::*;
pub use node_proxy::*;
pub use on_release::*;
pub use preflight::*;
pub use proxy_policy::*;
pub use switch_outcome::*;
