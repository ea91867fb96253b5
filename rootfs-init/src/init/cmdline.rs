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
    /// virtio-fs host folders to mount (`forkd.vol=TAG:/guest/path:ro|rw`,
    /// repeated).
    pub volumes: Vec<VolumeParam>,
}

/// One `forkd.vol=` word.
#[derive(Debug, Clone, PartialEq)]
pub struct VolumeParam {
    /// The virtio-fs tag.
    pub tag: String,
    /// Absolute guest path to mount it at.
    pub path: String,
    /// Mount read-only.
    pub read_only: bool,
}

impl VolumeParam {
    fn parse(v: &str) -> Option<VolumeParam> {
        let mut it = v.splitn(3, ':');
        let (tag, path, mode) = (it.next()?, it.next()?, it.next()?);
        if tag.is_empty() || !path.starts_with('/') || path.split('/').any(|c| c == "..") {
            return None;
        }
        let read_only = match mode {
            "ro" => true,
            "rw" => false,
            _ => return None,
        };
        Some(VolumeParam {
            tag: tag.into(),
            path: path.into(),
            read_only,
        })
    }
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
            volumes: Vec::new(),
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
                "forkd.vol" => match VolumeParam::parse(v) {
                    Some(vol) => p.volumes.push(vol),
                    None => eprintln!("forkd-init: ignoring malformed forkd.vol={v}"),
                },
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
        assert!(p.volumes.is_empty());
    }

    #[test]
    fn parses_volumes() {
        let p = BootParams::parse(
            "forkd.vol=forkd-vol0:/data:ro forkd.vol=forkd-vol1:/out:rw forkd.vol=x:/a/../b:rw forkd.vol=y:/c:rx",
        );
        assert_eq!(
            p.volumes,
            vec![
                VolumeParam {
                    tag: "forkd-vol0".into(),
                    path: "/data".into(),
                    read_only: true
                },
                VolumeParam {
                    tag: "forkd-vol1".into(),
                    path: "/out".into(),
                    read_only: false
                },
            ]
        );
    }
}
