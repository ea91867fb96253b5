//! `forkd.*` parameters from the kernel command line.

/// Boot parameters forkd-init understands (all optional).
#[derive(Debug, Clone, PartialEq)]
pub struct BootParams {
    /// Root block device (`forkd.root`, default `/dev/vda`).
    pub root: String,
    /// Root filesystem type (`forkd.rootfstype`, default `ext4`).
    pub rootfstype: String,
    /// Mount the root read-only (`forkd.ro`).
    pub read_only: bool,
    /// Guest hostname (`forkd.hostname`, default `forkd`).
    pub hostname: String,
    /// Guest address with prefix for eth0 (`forkd.ip=10.42.0.2/24`).
    pub ip: Option<String>,
    /// Default gateway for eth0 (`forkd.gw=10.42.0.1`).
    pub gateway: Option<String>,
}

impl Default for BootParams {
    fn default() -> Self {
        BootParams {
            root: "/dev/vda".into(),
            rootfstype: "ext4".into(),
            read_only: false,
            hostname: "forkd".into(),
            ip: None,
            gateway: None,
        }
    }
}

impl BootParams {
    /// Parses a kernel command line; unknown words are ignored.
    pub fn parse(cmdline: &str) -> Self {
        let mut p = BootParams::default();
        for word in cmdline.split_whitespace() {
            let (k, v) = word.split_once('=').unwrap_or((word, ""));
            match k {
                "forkd.root" => p.root = v.into(),
                "forkd.rootfstype" => p.rootfstype = v.into(),
                "forkd.ro" => p.read_only = v != "0",
                "forkd.hostname" => p.hostname = v.into(),
                "forkd.ip" => p.ip = Some(v.into()),
                "forkd.gw" => p.gateway = Some(v.into()),
                _ => {}
            }
        }
        p
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_known_words() {
        let p = BootParams::parse(
            "console=ttyS0 forkd.root=/dev/vdb forkd.ro forkd.hostname=h1 forkd.ip=10.0.0.2/24",
        );
        assert_eq!(p.root, "/dev/vdb");
        assert!(p.read_only);
        assert_eq!(p.hostname, "h1");
        assert_eq!(p.ip.as_deref(), Some("10.0.0.2/24"));
        assert_eq!(p.rootfstype, "ext4");
    }
}
