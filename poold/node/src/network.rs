//! Changing a running sandbox's egress policy (docs/network.md, "Changing
//! a running sandbox's policy"; E2B's `update_network`).
//!
//! Invariants:
//! - the guest can reach at most what the old or the new policy allows at
//!   every moment (`forkd_net::apply_resolved`: the root namespace's
//!   `host_allow` elements the new policy lacks go, then the namespace's
//!   table is swapped in one transaction, then the new elements come);
//! - the policy is checked and its names resolved once, before anything
//!   changes: what was checked is what is written;
//! - the record says `egress_pending` from before the write until after it,
//!   so a poold killed in between writes the recorded policy again when it
//!   adopts the sandbox, or kills the sandbox if it cannot ([`reapply`]);
//! - a write that fails puts the old policy back; if that fails too the
//!   sandbox is killed, never left in a policy nobody recorded;
//! - the workspace a sandbox belongs to (a paused E2B sandbox's, too)
//!   records the new policy in the same durable write, so a resume keeps it;
//! - updates of one sandbox are serialized by its VM lock, which a branch
//!   and a destroy take too.

use crate::error::{Error, Result};
use crate::node::Node;
use crate::state::{SandboxRecord, State};
use forkd_net::EgressPolicy;
use forkd_vmm::Vm;
use std::sync::Arc;

/// Sets sandbox `id`'s egress policy to `policy` (None: the default a
/// spawn of its snapshot gets, its pool's or the config's), replacing the
/// whole previous one; its record after. Durable before it returns.
pub(crate) async fn set_egress(
    n: &Arc<Node>,
    id: &str,
    policy: Option<EgressPolicy>,
) -> Result<SandboxRecord> {
    let sb = n.sandbox(id)?;
    let policy = policy.unwrap_or_else(|| default_for(n, &sb.record().snapshot_tag));
    let resolved = check(&policy).await?;
    let mut vm = sb.lock_vm().await?;
    let before = sb.record();
    let Some(net) = before.net.clone() else {
        return Err(Error::WrongState(format!(
            "sandbox {id} has no network (its snapshot was taken without one): there is no egress to change; take the snapshot with a network (`forkd snapshot create --net`)"
        )));
    };
    let old = before
        .egress
        .clone()
        .unwrap_or_else(forkd_vmm::net::default_egress);
    // Durable first: a poold killed from here on writes it again.
    record(n, &with_egress(&before, &policy, true)).await?;
    sb.set_egress(policy.clone(), true);
    match forkd_vmm::net::apply_resolved(&net, &resolved).await {
        Ok(()) => {
            vm.egress = Some(policy.clone());
            // The network holds it now, whatever the commit says.
            let rec = sb.set_egress(policy, false);
            record(n, &rec).await.map_err(|e| {
                Error::internal(format!(
                    "sandbox {id}'s new egress policy is in force, but recording that failed ({e}); a restart writes it again"
                ))
            })?;
            Ok(rec)
        }
        Err(e) => {
            vm.egress = None;
            // The old policy's names are resolved only now, on this rare
            // path: a slow resolver stays out of the lock on success.
            let back = forkd_snapshot::restore::set_egress(&mut vm, &old).await;
            if let Err(e2) = back {
                drop(vm);
                return Err(kill(n, id, &before, &e, &e2).await);
            }
            vm.egress = Some(old.clone());
            let rec = sb.set_egress(old.clone(), false);
            record(n, &rec).await?;
            Err(Error::internal(format!(
                "writing sandbox {id}'s new egress policy failed ({e:#}); its previous policy stays"
            )))
        }
    }
}

/// The policy a spawn of `tag` gets when it names none: its pool's, else
/// the config's (`net.egress`).
fn default_for(n: &Node, tag: &str) -> EgressPolicy {
    n.pools
        .spec(tag)
        .and_then(|s| s.network)
        .unwrap_or_else(forkd_vmm::net::default_egress)
}

/// Refuses a policy that cannot be written: too many entries, names that
/// do not resolve (the caller's error, before anything changes). Its
/// addresses, resolved once: what is checked is what is written.
async fn check(policy: &EgressPolicy) -> Result<forkd_net::ResolvedPolicy> {
    let invalid = |e: forkd_net::NetError| Error::invalid("network", format!("network: {e}"));
    policy.validate().map_err(invalid)?;
    policy.resolve().await.map_err(invalid)
}

/// `r` with egress `policy`, `pending` or not.
fn with_egress(r: &SandboxRecord, policy: &EgressPolicy, pending: bool) -> SandboxRecord {
    SandboxRecord {
        egress: Some(policy.clone()),
        egress_pending: pending,
        ..r.clone()
    }
}

/// Neither policy could be written: records the old one (what its
/// workspace resumes with) and kills the sandbox, as a kill through the
/// API would (a paused-and-resumed E2B sandbox's workspace with it).
async fn kill(
    n: &Arc<Node>,
    id: &str,
    before: &SandboxRecord,
    e: &anyhow::Error,
    e2: &anyhow::Error,
) -> Error {
    tracing::error!(
        "sandbox {id}: neither its new egress policy ({e:#}) nor its old one ({e2:#}) could be written; killing it"
    );
    // Pending: should poold die before the kill, its restart writes the
    // old policy or kills the sandbox.
    let mut old = before.clone();
    old.egress_pending = true;
    if let Err(e) = record(n, &old).await {
        tracing::error!("sandbox {id}: {e}");
    }
    if let Err(e) = crate::workspace::paused::kill(n, id).await {
        tracing::error!("sandbox {id}: killing it: {e}");
    }
    Error::internal(format!(
        "writing sandbox {id}'s egress policy failed ({e:#}), and so did putting its previous one back: the sandbox was killed rather than left with a policy nobody chose"
    ))
}

/// Commits `rec`'s egress fields (only those: a concurrent TTL change or
/// pause keeps its own), and its workspace's network setting.
async fn record(n: &Node, rec: &SandboxRecord) -> Result<()> {
    let r2 = rec.clone();
    n.state
        .commit(move |s| write_egress(s, &r2))
        .await
        .map_err(Error::from)
}

fn write_egress(s: &mut State, rec: &SandboxRecord) {
    let Some(r) = s.sandboxes.get_mut(&rec.id) else {
        return;
    };
    r.egress = rec.egress.clone();
    r.egress_pending = rec.egress_pending;
    let Some(ws) = r.workspace.clone() else {
        return;
    };
    if let Some(w) = s.workspaces.values_mut().find(|w| w.id == ws) {
        w.settings.network = rec.egress.clone();
        // `net: false` was a deny-all policy; a policy now says it all
        // (a spawn refuses both at once).
        if w.settings.net == Some(false) {
            w.settings.net = None;
        }
    }
}

/// At adoption: writes the policy of a sandbox whose update a dead poold
/// left pending. Err: it could not be written, and the caller kills the
/// sandbox (its network holds the old policy or part of the new).
pub(crate) async fn reapply(vm: &mut Vm, rec: &SandboxRecord) -> anyhow::Result<()> {
    let policy = rec
        .egress
        .clone()
        .unwrap_or_else(forkd_vmm::net::default_egress);
    // Names are looked up again: a resolver's hiccup gets two more tries
    // before the sandbox is given up.
    let mut tries = 0;
    loop {
        vm.egress = None;
        match forkd_snapshot::restore::set_egress(vm, &policy).await {
            Ok(()) => return Ok(()),
            Err(e) if tries == 2 => return Err(e),
            Err(e) => tracing::warn!("sandbox {}: writing its pending egress: {e:#}", rec.id),
        }
        tries += 1;
        tokio::time::sleep(std::time::Duration::from_secs(1)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workspace::record::WorkspaceRecord;

    fn ws_example() -> WorkspaceRecord {
        WorkspaceRecord {
            id: "ws-1".into(),
            name: "sb-1".into(),
            ..WorkspaceRecord::example()
        }
    }

    /// The write takes the egress fields alone and carries the policy to
    /// the sandbox's workspace: a resume spawns with what it has now.
    #[test]
    fn the_egress_write_keeps_other_fields_and_reaches_the_workspace() {
        let mut s = State::default();
        let mut rec = SandboxRecord::example("sb-1");
        rec.workspace = Some("ws-1".into());
        rec.expires_at_unix = 7;
        s.sandboxes.insert(rec.id.clone(), rec.clone());
        let mut ws = ws_example();
        ws.settings.net = Some(false);
        s.workspaces.insert("sb-1".into(), ws);
        let mut newer = rec.clone();
        newer.expires_at_unix = 99; // not the write's to take
        newer.egress = Some(EgressPolicy::deny_all());
        newer.egress_pending = true;
        write_egress(&mut s, &newer);
        let r = &s.sandboxes["sb-1"];
        assert_eq!(r.expires_at_unix, 7);
        assert_eq!(r.egress, Some(EgressPolicy::deny_all()));
        assert!(r.egress_pending);
        let w = &s.workspaces["sb-1"].settings;
        assert_eq!(w.network, Some(EgressPolicy::deny_all()));
        assert_eq!(w.net, None, "net: false would refuse the resume");
    }

    /// A sandbox deleted meanwhile is not written back.
    #[test]
    fn a_deleted_sandbox_stays_deleted() {
        let mut s = State::default();
        write_egress(&mut s, &SandboxRecord::example("sb-gone"));
        assert!(s.sandboxes.is_empty());
    }
}
