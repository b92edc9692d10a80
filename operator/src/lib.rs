//! Switchyard operator. The wave planner and the ProxyPolicy controller land here (issue 5); this
//! crate exists now so the workspace layout is final.

pub use switchyard_crds as crds;
