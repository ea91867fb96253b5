//! Agent settings: environment variables override the recipe env files baked
//! into the image (`/etc/forkd/agent.env`, and forkd's `/etc/forkd-recipe.env`
//! for compatibility).

use std::collections::BTreeMap;
use std::path::Path;

/// Files read in order; a later file overrides an earlier one, and the
/// process environment overrides both.
pub const ENV_FILES: &[&str] = &["/etc/forkd-recipe.env", "/etc/forkd/agent.env"];

/// The agent's settings, from [`ENV_FILES`] and its environment.
#[derive(Debug, Clone)]
pub struct AgentConfig {
    /// Modules the warm interpreter imports before it reports ready.
    pub warmup_imports: Vec<String>,
    /// Extra Python run in the warm interpreter after the imports.
    pub warmup_code: Option<String>,
    /// forkd's `FORKD_WARMUP_CMD`: a process started alongside the agent.
    pub warmup_cmd: Option<Vec<String>>,
    /// Python interpreter for eval; `None` disables eval.
    pub python: Option<String>,
    /// The warm interpreter's language (forkd's `FORKD_AGENT_LANG`).
    pub lang: Lang,
    /// Node for eval in Node mode (`FORKD_NODE`, else the usual paths).
    pub node: Option<String>,
    /// TCP port for forkd's line protocol; 0 disables it.
    pub compat_port: u16,
}

impl AgentConfig {
    /// Loads the env files and the process environment.
    pub fn load() -> Self {
        let mut vars = BTreeMap::new();
        for f in ENV_FILES {
            if let Ok(text) = std::fs::read_to_string(f) {
                vars.extend(parse_env_file(&text));
            }
        }
        for (k, v) in std::env::vars() {
            if k.starts_with("FORKD_") {
                vars.insert(k, v);
            }
        }
        Self::from_vars(&vars)
    }

    fn from_vars(vars: &BTreeMap<String, String>) -> Self {
        let get = |k: &str| {
            vars.get(k)
                .map(|s| s.trim().to_string())
                .filter(|s| !s.is_empty())
        };
        let warmup_imports = get("FORKD_WARMUP_IMPORTS")
            .map(|s| {
                s.split([',', ' '])
                    .map(str::trim)
                    .filter(|m| !m.is_empty())
                    .map(String::from)
                    .collect()
            })
            .unwrap_or_default();
        let python = match get("FORKD_PYTHON") {
            Some(p) if p == "none" => None,
            Some(p) => Some(p),
            None => ["/usr/bin/python3", "/usr/local/bin/python3"]
                .iter()
                .find(|p| Path::new(p).exists())
                .map(|p| p.to_string()),
        };
        let node = match get("FORKD_NODE") {
            Some(p) if p == "none" => None,
            Some(p) => Some(p),
            None => ["/usr/bin/node", "/usr/local/bin/node", "/usr/bin/nodejs"]
                .iter()
                .find(|p| Path::new(p).exists())
                .map(|p| p.to_string()),
        };
        let lang = match get("FORKD_AGENT_LANG").as_deref() {
            Some("node") => Lang::Node,
            Some("python") | None => Lang::Python,
            Some(other) => {
                eprintln!("forkd-agent: unknown FORKD_AGENT_LANG {other:?} (python or node); using python");
                Lang::Python
            }
        };
        AgentConfig {
            lang,
            node,
            warmup_imports,
            warmup_code: get("FORKD_WARMUP_CODE"),
            warmup_cmd: get("FORKD_WARMUP_CMD").and_then(|c| shlex::split(&c)),
            python,
            compat_port: get("FORKD_COMPAT_PORT")
                .and_then(|p| p.parse().ok())
                .unwrap_or(8888),
        }
    }
}

/// The warm interpreter's language.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Lang {
    /// A Python process running `evald.py`; the default.
    #[default]
    Python,
    /// A Node process running `evald.js` (forkd's Node mode): eval replies
    /// carry `result_json`.
    Node,
}

impl Lang {
    /// forkd's `agent_lang` word.
    pub fn as_str(self) -> &'static str {
        match self {
            Lang::Python => "python",
            Lang::Node => "node",
        }
    }
}

impl AgentConfig {
    /// The program of the warm interpreter for the configured language.
    pub fn interpreter(&self) -> Option<String> {
        match self.lang {
            Lang::Python => self.python.clone(),
            Lang::Node => self.node.clone(),
        }
    }
}

/// Parses `KEY=VALUE` lines; `#` starts a comment; values may be quoted.
pub fn parse_env_file(text: &str) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let line = line.strip_prefix("export ").unwrap_or(line);
        let Some((k, v)) = line.split_once('=') else {
            continue;
        };
        let v = v.trim();
        let v = shlex::split(v)
            .filter(|parts| parts.len() == 1)
            .map(|mut parts| parts.remove(0))
            .unwrap_or_else(|| v.to_string());
        out.insert(k.trim().to_string(), v);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn env_file_quotes_and_comments() {
        let m = parse_env_file("# c\nA=1\nexport B=\"two words\"\nC='x y'\nbad line\n");
        assert_eq!(m["A"], "1");
        assert_eq!(m["B"], "two words");
        assert_eq!(m["C"], "x y");
        assert_eq!(m.len(), 3);
    }

    #[test]
    fn imports_list() {
        let mut v = BTreeMap::new();
        v.insert("FORKD_WARMUP_IMPORTS".into(), "numpy, json".into());
        v.insert("FORKD_PYTHON".into(), "none".into());
        let c = AgentConfig::from_vars(&v);
        assert_eq!(c.warmup_imports, vec!["numpy", "json"]);
        assert!(c.python.is_none());
        assert_eq!(c.lang, Lang::Python);
        assert_eq!(c.interpreter(), None);
        v.insert("FORKD_AGENT_LANG".into(), "node".into());
        v.insert("FORKD_NODE".into(), "/opt/node".into());
        let c = AgentConfig::from_vars(&v);
        assert_eq!(c.lang, Lang::Node);
        assert_eq!(c.interpreter().as_deref(), Some("/opt/node"));
    }
}
