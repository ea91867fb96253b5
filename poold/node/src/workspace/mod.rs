//! Workspaces: long-lived named sandboxes that suspend to a snapshot and
//! resume from it (docs/workspaces.md).

pub mod record;
