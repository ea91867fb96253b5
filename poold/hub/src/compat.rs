//! Can this host restore a pulled snapshot? vmstate is tied to the QEMU
//! version and the machine's device list, so `pull` compares what the
//! snapshot recorded (`config.qemu_version`, `config.machine_signature`)
//! with this host before transferring anything.

use forkd_layers::SnapshotRecord;
use forkd_snapshot::{host_memory_mib, VmConfig};
use forkd_vmm::Accel;
use forkd_vmm::{qemu_version, Machine};

/// Reasons the snapshot may not restore here; empty when it matches.
pub fn check(rec: &SnapshotRecord) -> Vec<String> {
    let host_qemu = qemu_version().map_err(|e| format!("{e:#}"));
    check_against(rec, host_qemu, &host_signatures())
}

/// [`check`] against a given QEMU version (or why it is unknown) and the
/// machine signatures this build can produce.
pub fn check_against(
    rec: &SnapshotRecord,
    host_qemu: Result<String, String>,
    host_signatures: &[String],
) -> Vec<String> {
    let mut warnings = Vec::new();
    let recorded = |k: &str| {
        rec.config
            .get(k)
            .and_then(|v| v.as_str())
            .map(str::to_string)
    };
    match (recorded("qemu_version"), host_qemu) {
        (None, _) => warnings.push(format!(
            "snapshot {} records no QEMU version, so whether it restores on this host cannot be checked",
            rec.id
        )),
        (Some(want), Ok(have)) if want != have => warnings.push(format!(
            "snapshot {} was taken with QEMU {want}, this host has QEMU {have}: restoring it will likely fail (\"Unknown savevm section\" or a version error)",
            rec.id
        )),
        (Some(want), Err(why)) => warnings.push(format!(
            "snapshot {} needs QEMU {want}, but this host's QEMU version is unknown ({why})",
            rec.id
        )),
        _ => {}
    }
    if let Some(sig) = recorded("machine_signature") {
        if !host_signatures.contains(&sig) {
            warnings.push(format!(
                "snapshot {} was taken on machine \"{sig}\", which this forkd does not build (it builds e.g. \"{}\"); a child would not match the parent's devices",
                rec.id,
                host_signatures.first().map_or("", String::as_str)
            ));
        }
    }
    warnings
}

/// Refuses a record whose VM config is forged or inconsistent
/// ([`VmConfig::check_sane`]): a hub is not trusted to pick the child's CPU
/// model or size its memory past this host. A record without a VM config
/// (not made by `forkd snapshot create`) passes here; restore refuses it.
pub fn refuse_forged(rec: &SnapshotRecord) -> Result<(), String> {
    if rec.config.get("machine").is_none() {
        return Ok(());
    }
    let cfg = VmConfig::from_record(rec).map_err(|e| format!("{e:#}"))?;
    cfg.check_sane(
        rec.files.get("memory.bin").map(|f| f.size),
        host_memory_mib(),
    )
    .map_err(|e| format!("{e:#}"))
}

/// Every machine signature this build produces (memory and vCPUs do not
/// enter the signature; accelerator and NIC do).
pub fn host_signatures() -> Vec<String> {
    let mut out = Vec::new();
    for accel in [Accel::Tcg, Accel::Kvm] {
        for net in [false, true] {
            let mut m = Machine::new(accel, 512, 1);
            m.net = net;
            out.push(m.signature());
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use forkd_layers::SnapshotId;

    fn rec(config: serde_json::Value) -> SnapshotRecord {
        SnapshotRecord {
            id: SnapshotId::random(),
            parent: None,
            files: Default::default(),
            config,
            lineage: Default::default(),
            created_at_unix: 0,
        }
    }

    #[test]
    fn warns_on_mismatch_only() {
        let sigs = host_signatures();
        let ok = rec(serde_json::json!({"qemu_version": "10.0.2", "machine_signature": sigs[0]}));
        assert!(check_against(&ok, Ok("10.0.2".into()), &sigs).is_empty());
        let w = check_against(&ok, Ok("10.1.0".into()), &sigs);
        assert!(
            w[0].contains("QEMU 10.0.2") && w[0].contains("10.1.0"),
            "{w:?}"
        );
        let w = check_against(&ok, Err("qemu-system-x86_64 not found".into()), &sigs);
        assert!(w[0].contains("unknown"), "{w:?}");
        let odd =
            rec(serde_json::json!({"qemu_version": "10.0.2", "machine_signature": "pc;e1000"}));
        assert_eq!(check_against(&odd, Ok("10.0.2".into()), &sigs).len(), 1);
        assert_eq!(
            check_against(&rec(serde_json::Value::Null), Ok("10.0.2".into()), &sigs).len(),
            1
        );
    }
}
