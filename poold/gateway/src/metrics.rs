//! `GET /metrics` at the gateway: every healthy node's Prometheus text,
//! merged into one exposition, each sample labelled `node="<name>"`
//! (docs/cluster.md, "what goes where"). The web console plots from it as
//! from one poold's, summing over the label.
//!
//! Invariants:
//! - The output is valid exposition text: each family's `# HELP` and
//!   `# TYPE` appear once, followed by all its samples from every node
//!   (concatenating the nodes' texts would repeat them, which strict
//!   parsers reject).
//! - Families keep the order in which they were first seen; samples keep
//!   each node's order, nodes in the order given.
//! - A node's own `node` label, if it ever had one, is not overwritten:
//!   the gateway's comes first and parsers take the first.

use std::collections::HashMap;

/// Families in first-seen order, each with its metadata once and its
/// samples from every node.
#[derive(Debug, Default)]
pub struct Merged {
    order: Vec<String>,
    families: HashMap<String, Family>,
}

#[derive(Debug, Default)]
struct Family {
    /// `# HELP` and `# TYPE` lines, at most one of each.
    meta: Vec<String>,
    samples: Vec<String>,
}

impl Merged {
    /// Adds one node's exposition text.
    pub fn add(&mut self, node: &str, text: &str) {
        let label = format!("node=\"{}\"", escape(node));
        let mut family = String::new();
        for line in text.lines().map(str::trim_end) {
            if line.is_empty() {
                continue;
            }
            if let Some(rest) = line.strip_prefix('#') {
                let mut words = rest.split_whitespace();
                if let (Some(kind @ ("HELP" | "TYPE")), Some(name)) = (words.next(), words.next()) {
                    family = name.to_string();
                    let f = self.family(name);
                    let prefix = format!("# {kind} ");
                    if !f.meta.iter().any(|m| m.starts_with(&prefix)) {
                        f.meta.push(line.to_string());
                    }
                }
                continue;
            }
            let end = line
                .find(|c: char| c == '{' || c.is_whitespace())
                .unwrap_or(line.len());
            let (name, rest) = line.split_at(end);
            // A histogram's `_bucket`/`_sum`/`_count` belong to the family
            // its `# TYPE` named; a sample of no declared family is its own.
            if family.is_empty() || !name.starts_with(family.as_str()) {
                family = name.to_string();
            }
            let sample = match rest.strip_prefix('{') {
                Some(r) if r.starts_with('}') => format!("{name}{{{label}{r}"),
                Some(r) => format!("{name}{{{label},{r}"),
                None => format!("{name}{{{label}}}{rest}"),
            };
            self.family(&family).samples.push(sample);
        }
    }

    fn family(&mut self, name: &str) -> &mut Family {
        if !self.families.contains_key(name) {
            self.order.push(name.to_string());
        }
        self.families.entry(name.to_string()).or_default()
    }

    /// The merged exposition text.
    pub fn render(&self) -> String {
        let mut out = String::new();
        for name in &self.order {
            let f = &self.families[name];
            for line in f.meta.iter().chain(&f.samples) {
                out.push_str(line);
                out.push('\n');
            }
        }
        out
    }
}

/// A label value as the exposition format quotes it.
fn escape(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: &str = "# HELP forkd_sandboxes_active Running sandboxes.
# TYPE forkd_sandboxes_active gauge
forkd_sandboxes_active 2
# HELP forkd_spawn_latency_seconds Spawn latency.
# TYPE forkd_spawn_latency_seconds histogram
forkd_spawn_latency_seconds_bucket{source=\"pool\",le=\"0.01\"} 1
forkd_spawn_latency_seconds_sum{source=\"pool\"} 0.004
forkd_spawn_latency_seconds_count{source=\"pool\"} 1
";

    #[test]
    fn families_appear_once_with_every_nodes_samples_labelled() {
        let mut m = Merged::default();
        m.add("a", A);
        m.add("b\"x", &A.replace(" 2\n", " 3\n"));
        let out = m.render();
        assert_eq!(out.matches("# TYPE forkd_sandboxes_active").count(), 1);
        assert_eq!(
            out.matches("# HELP forkd_spawn_latency_seconds ").count(),
            1
        );
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(
            lines[..4],
            [
                "# HELP forkd_sandboxes_active Running sandboxes.",
                "# TYPE forkd_sandboxes_active gauge",
                "forkd_sandboxes_active{node=\"a\"} 2",
                "forkd_sandboxes_active{node=\"b\\\"x\"} 3",
            ]
        );
        // The histogram's samples follow its own TYPE, both nodes'.
        let h = out.find("# TYPE forkd_spawn_latency_seconds").unwrap();
        let tail = &out[h..];
        assert_eq!(tail.matches("_sum{node=").count(), 2, "{out}");
        assert!(tail.contains("forkd_spawn_latency_seconds_sum{node=\"a\",source=\"pool\"} 0.004"));
        assert!(!tail.contains("forkd_sandboxes_active"), "{out}");
    }

    #[test]
    fn samples_without_labels_or_metadata_are_kept() {
        let mut m = Merged::default();
        m.add("n", "plain 1\nempty{} 2 1700000000\n# a comment\n\n");
        assert_eq!(
            m.render(),
            "plain{node=\"n\"} 1\nempty{node=\"n\"} 2 1700000000\n"
        );
    }
}
