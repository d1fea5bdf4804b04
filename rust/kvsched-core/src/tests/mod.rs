//! The core's behaviour tests: the scheduler as a whole, one file per subject, with the helpers they share in
//! `helpers.rs`, and a check that the core's modules depend on each other without cycles (`module_graph.rs`).
//! Unit tests of a single module stay in that module.

mod connector;
mod context_parallel;
mod ec_connector;
mod encoder;
mod events;
mod helpers;
mod hit_cap;
mod module_graph;
mod pins;
mod policy;
mod replay;
mod scheduler;
mod stream;
