//! Reading the host's apt sources, to find the Debian mirror the host already
//! uses (forkd never hard-codes a mirror host).

use std::path::Path;

/// One `deb` source: its URI and suites.
#[derive(Debug, Clone, PartialEq)]
pub struct Source {
    /// Mirror URI, e.g. `http://deb.debian.org/debian`.
    pub uri: String,
    /// Suites it serves, e.g. `bookworm`, `bookworm-updates`.
    pub suites: Vec<String>,
}

/// All `deb` sources in /etc/apt (deb822 `.sources` and one-line `.list`).
pub fn sources() -> Vec<Source> {
    let mut out = Vec::new();
    let mut files = vec![Path::new("/etc/apt/sources.list").to_path_buf()];
    if let Ok(rd) = std::fs::read_dir("/etc/apt/sources.list.d") {
        let mut more: Vec<_> = rd.flatten().map(|e| e.path()).collect();
        more.sort();
        files.extend(more);
    }
    for f in files {
        let Ok(text) = std::fs::read_to_string(&f) else {
            continue;
        };
        match f.extension().and_then(|e| e.to_str()) {
            Some("sources") => out.extend(parse_deb822(&text)),
            _ if f.ends_with("sources.list") || f.extension().is_some_and(|e| e == "list") => {
                out.extend(parse_one_line(&text))
            }
            _ => {}
        }
    }
    out
}

/// Parses deb822 stanzas.
pub fn parse_deb822(text: &str) -> Vec<Source> {
    let mut out = Vec::new();
    for stanza in text.split("\n\n") {
        let mut types = "";
        let mut uris = "";
        let mut suites = "";
        let mut enabled = true;
        for line in stanza.lines().filter(|l| !l.trim_start().starts_with('#')) {
            let Some((k, v)) = line.split_once(':') else {
                continue;
            };
            match k.trim() {
                "Types" => types = v.trim(),
                "URIs" => uris = v.trim(),
                "Suites" => suites = v.trim(),
                "Enabled" => enabled = v.trim() != "no",
                _ => {}
            }
        }
        if !enabled || !types.split_whitespace().any(|t| t == "deb") {
            continue;
        }
        for uri in uris.split_whitespace() {
            out.push(Source {
                uri: uri.to_string(),
                suites: suites.split_whitespace().map(String::from).collect(),
            });
        }
    }
    out
}

/// Parses one-line `deb [opts] URI SUITE COMPONENTS...` entries.
pub fn parse_one_line(text: &str) -> Vec<Source> {
    let mut out = Vec::new();
    for line in text.lines().map(str::trim) {
        let Some(rest) = line.strip_prefix("deb ") else {
            continue;
        };
        let rest = match rest.trim_start().strip_prefix('[') {
            Some(r) => r.split_once(']').map(|(_, r)| r).unwrap_or(""),
            None => rest,
        };
        let mut words = rest.split_whitespace();
        if let (Some(uri), Some(suite)) = (words.next(), words.next()) {
            out.push(Source {
                uri: uri.into(),
                suites: vec![suite.into()],
            });
        }
    }
    out
}

/// The mirror to debootstrap `suite` from: `$FORKD_DEBIAN_MIRROR`, else the
/// source that serves `suite`, else any source that serves a Debian suite
/// (same archive, other release).
pub fn mirror_for(suite: &str) -> anyhow::Result<String> {
    if let Ok(m) = std::env::var("FORKD_DEBIAN_MIRROR") {
        if !m.is_empty() {
            return Ok(m);
        }
    }
    let all = sources();
    let is_main_archive = |s: &Source| {
        !s.uri.contains("security") && !s.suites.iter().any(|x| x.contains("security"))
    };
    all.iter()
        .find(|s| s.suites.iter().any(|x| x == suite))
        .or_else(|| {
            all.iter()
                .filter(|s| is_main_archive(s))
                .find(|s| s.suites.iter().any(|x| DEBIAN_SUITES.contains(&x.as_str())))
        })
        .map(|s| s.uri.clone())
        .ok_or_else(|| {
            anyhow::anyhow!(
                "no Debian archive in /etc/apt sources serves {suite}; set FORKD_DEBIAN_MIRROR to a Debian mirror URL"
            )
        })
}

const DEBIAN_SUITES: &[&str] = &["bookworm", "trixie", "forky", "sid", "bullseye"];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deb822_and_one_line() {
        let s = parse_deb822(
            "Types: deb\n# c\nURIs: http://m/debian\nSuites: bookworm bookworm-updates\nComponents: main\n\nTypes: deb-src\nURIs: http://x\nSuites: bookworm\n",
        );
        assert_eq!(s.len(), 1);
        assert_eq!(s[0].uri, "http://m/debian");
        assert_eq!(s[0].suites, vec!["bookworm", "bookworm-updates"]);
        let l =
            parse_one_line("deb [signed-by=/k] http://m/debian trixie main\n# deb http://no x\n");
        assert_eq!(
            l,
            vec![Source {
                uri: "http://m/debian".into(),
                suites: vec!["trixie".into()]
            }]
        );
    }
}
