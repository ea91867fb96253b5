//! Sandbox logs, as E2B's log API serves them (`GET /sandboxes/{id}/logs`,
//! `GET /v2/sandboxes/{id}/logs`): what envd and the orchestrator log of
//! a sandbox, not its console. Here that is one entry per envd request the
//! sandbox plane served (envd's own log line: `Process start`, `File
//! write`, with the method and an operation id) and the lifecycle the
//! control plane drove (created, paused, resumed, killed).
//!
//! Invariants: what a client can make poold hold is bounded:
//! [`MAX_ENTRIES`] per sandbox (the oldest dropped first) and
//! [`MAX_SANDBOXES`] sandboxes (the one logged to least recently dropped
//! first), so the logs of a sandbox outlive it, as E2B's do, until newer
//! ones push them out. They live in memory: a poold restart starts them
//! afresh (docs/e2b.md).

use crate::error::{E2bError, E2bResult};
use serde_json::{json, Value};
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Most entries kept per sandbox.
pub const MAX_ENTRIES: usize = 1000;
/// Most sandboxes whose entries are kept.
pub const MAX_SANDBOXES: usize = 1024;
/// Most entries one query answers (E2B's limit).
pub const MAX_LIMIT: usize = 1000;
/// Longest `search` a v2 query may give (E2B's limit).
pub const MAX_SEARCH: usize = 256;
/// Longest message or field value kept (a request's path is a client's).
pub const MAX_FIELD: usize = 1024;

/// `s`, cut to at most [`MAX_FIELD`] bytes at a character boundary.
fn clip(s: &str) -> String {
    let mut end = s.len().min(MAX_FIELD);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s[..end].to_string()
}

/// An entry's level, E2B's `LogLevel`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Level {
    Debug,
    Info,
    Warn,
    Error,
}

impl Level {
    fn as_str(self) -> &'static str {
        match self {
            Level::Debug => "debug",
            Level::Info => "info",
            Level::Warn => "warn",
            Level::Error => "error",
        }
    }

    fn parse(s: &str) -> Option<Level> {
        Some(match s {
            "debug" => Level::Debug,
            "info" => Level::Info,
            "warn" => Level::Warn,
            "error" => Level::Error,
            _ => return None,
        })
    }
}

/// One log entry.
#[derive(Debug, Clone)]
pub struct Entry {
    /// When it happened.
    pub at: SystemTime,
    pub level: Level,
    pub message: String,
    /// Flat context (`method`, `operation_id`, `path`, ...).
    pub fields: BTreeMap<String, String>,
}

impl Entry {
    fn ms(&self) -> u64 {
        unix_ms(self.at)
    }

    fn timestamp(&self) -> String {
        humantime::format_rfc3339_millis(self.at).to_string()
    }

    /// E2B's `SandboxLogEntry`.
    fn structured(&self) -> Value {
        json!({
            "timestamp": self.timestamp(),
            "level": self.level.as_str(),
            "message": self.message,
            "fields": self.fields,
        })
    }

    /// The raw line of v1's `logs`: the entry as one JSON object, as
    /// envd's logger writes it (E2B's CLI parses it).
    fn line(&self) -> String {
        let mut v = json!(self.fields);
        v["timestamp"] = json!(self.timestamp());
        v["level"] = json!(self.level.as_str());
        v["message"] = json!(self.message);
        v.to_string()
    }
}

fn unix_ms(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .unwrap_or(Duration::ZERO)
        .as_millis() as u64
}

#[derive(Default)]
struct Inner {
    by_sandbox: HashMap<String, VecDeque<Entry>>,
    /// Sandboxes by when they were last logged to, oldest first.
    order: VecDeque<String>,
}

/// Every sandbox's log.
#[derive(Default)]
pub struct Logs {
    inner: Mutex<Inner>,
    /// envd's `operation_id`: numbers requests across sandboxes.
    operations: AtomicU64,
}

impl Logs {
    /// A fresh operation id.
    pub fn operation(&self) -> String {
        (self.operations.fetch_add(1, Ordering::Relaxed) + 1).to_string()
    }

    /// Appends an entry to sandbox `id`'s log, now.
    pub fn record(&self, id: &str, level: Level, message: &str, fields: &[(&str, &str)]) {
        self.push(
            id,
            Entry {
                at: SystemTime::now(),
                level,
                message: clip(message),
                fields: fields
                    .iter()
                    .map(|(k, v)| (k.to_string(), clip(v)))
                    .collect(),
            },
        );
    }

    fn push(&self, id: &str, e: Entry) {
        let mut g = self.inner.lock().unwrap();
        if let Some(pos) = g.order.iter().position(|s| s == id) {
            let s = g.order.remove(pos).expect("the position was just found");
            g.order.push_back(s);
        } else {
            if g.order.len() == MAX_SANDBOXES {
                if let Some(old) = g.order.pop_front() {
                    g.by_sandbox.remove(&old);
                }
            }
            g.order.push_back(id.to_string());
        }
        let log = g.by_sandbox.entry(id.to_string()).or_default();
        if log.len() == MAX_ENTRIES {
            log.pop_front();
        }
        log.push_back(e);
    }

    /// v1: entries at or after `start_ms`, oldest first, at most `limit`,
    /// as `{"logs": [{timestamp, line}], "logEntries": [...]}`.
    pub fn v1(&self, id: &str, q: &V1Query) -> Value {
        let g = self.inner.lock().unwrap();
        let picked: Vec<&Entry> = g
            .by_sandbox
            .get(id)
            .into_iter()
            .flatten()
            .filter(|e| e.ms() >= q.start_ms.unwrap_or(0))
            .take(q.limit)
            .collect();
        json!({
            "logs": picked.iter().map(|e| json!({"timestamp": e.timestamp(), "line": e.line()})).collect::<Vec<_>>(),
            "logEntries": picked.iter().map(|e| e.structured()).collect::<Vec<_>>(),
        })
    }

    /// v2: from `cursor` forward (at or after it, oldest first) or
    /// backward (at or before it, newest first), at least `level`, with
    /// `search` in the message, at most `limit`, as `{"logs": [...]}`.
    pub fn v2(&self, id: &str, q: &V2Query) -> Value {
        let g = self.inner.lock().unwrap();
        let log = g.by_sandbox.get(id);
        let keep = |e: &&Entry| {
            e.level >= q.level && q.search.as_ref().is_none_or(|s| e.message.contains(s))
        };
        let picked: Vec<Value> = match (q.forward, q.cursor_ms) {
            (true, c) => log
                .into_iter()
                .flatten()
                .filter(|e| e.ms() >= c.unwrap_or(0))
                .filter(keep)
                .take(q.limit)
                .map(Entry::structured)
                .collect(),
            (false, c) => log
                .into_iter()
                .flatten()
                .rev()
                .filter(|e| e.ms() <= c.unwrap_or(u64::MAX))
                .filter(keep)
                .take(q.limit)
                .map(Entry::structured)
                .collect(),
        };
        json!({ "logs": picked })
    }
}

/// v1's query: `start` (ms since the epoch), `limit`.
#[derive(Debug, PartialEq)]
pub struct V1Query {
    pub start_ms: Option<u64>,
    pub limit: usize,
}

/// v2's query: `cursor` (ms since the epoch), `limit`, `direction`,
/// `level` (the least), `search`.
#[derive(Debug, PartialEq)]
pub struct V2Query {
    pub cursor_ms: Option<u64>,
    pub limit: usize,
    pub forward: bool,
    pub level: Level,
    pub search: Option<String>,
}

fn pairs(query: Option<&str>) -> Vec<(String, String)> {
    form_urlencoded::parse(query.unwrap_or("").as_bytes())
        .map(|(k, v)| (k.into_owned(), v.into_owned()))
        .collect()
}

fn number(name: &str, v: &str) -> E2bResult<u64> {
    v.parse().map_err(|_| {
        E2bError::bad_request(format!(
            "{name}={v:?}: give a non-negative whole number (milliseconds since the epoch for start and cursor)"
        ))
    })
}

fn limit(v: &str) -> E2bResult<usize> {
    let n = number("limit", v)?;
    if n > MAX_LIMIT as u64 {
        return Err(E2bError::bad_request(format!(
            "limit={n}: at most {MAX_LIMIT} entries per query; page with start or cursor"
        )));
    }
    Ok(n as usize)
}

impl V1Query {
    /// Parses v1's query; anything malformed is a 400.
    pub fn parse(query: Option<&str>) -> E2bResult<V1Query> {
        let mut q = V1Query {
            start_ms: None,
            limit: MAX_LIMIT,
        };
        for (k, v) in pairs(query) {
            match k.as_str() {
                "start" => q.start_ms = Some(number("start", &v)?),
                "limit" => q.limit = limit(&v)?,
                _ => {}
            }
        }
        Ok(q)
    }
}

impl V2Query {
    /// Parses v2's query; anything malformed is a 400.
    pub fn parse(query: Option<&str>) -> E2bResult<V2Query> {
        let mut q = V2Query {
            cursor_ms: None,
            limit: MAX_LIMIT,
            forward: false,
            level: Level::Debug,
            search: None,
        };
        for (k, v) in pairs(query) {
            match k.as_str() {
                "cursor" => q.cursor_ms = Some(number("cursor", &v)?),
                "limit" => q.limit = limit(&v)?,
                "direction" => {
                    q.forward = match v.as_str() {
                        "forward" => true,
                        "backward" => false,
                        _ => {
                            return Err(E2bError::bad_request(format!(
                                "direction={v:?}: give forward or backward"
                            )))
                        }
                    }
                }
                "level" => {
                    q.level = Level::parse(&v).ok_or_else(|| {
                        E2bError::bad_request(format!(
                            "level={v:?}: give debug, info, warn or error"
                        ))
                    })?
                }
                "search" if v.chars().count() > MAX_SEARCH => {
                    return Err(E2bError::bad_request(format!(
                        "search is {} characters, over {MAX_SEARCH}",
                        v.chars().count()
                    )))
                }
                "search" => q.search = Some(v),
                _ => {}
            }
        }
        Ok(q)
    }
}

/// envd's name of a Connect procedure in its log (`process.Process/Start`
/// → `Process start`).
pub fn procedure_message(procedure: &str) -> String {
    let Some((service, method)) = procedure
        .split_once('.')
        .and_then(|(_, rest)| rest.split_once('/'))
    else {
        return procedure.to_string();
    };
    let cap = |s: &str, upper: bool| {
        let mut c = s.chars();
        match c.next() {
            Some(f) if upper => f.to_uppercase().chain(c).collect::<String>(),
            Some(f) => f.to_lowercase().chain(c).collect::<String>(),
            None => String::new(),
        }
    };
    format!("{} {}", cap(service, true), cap(method, false))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(ms: u64) -> SystemTime {
        UNIX_EPOCH + Duration::from_millis(ms)
    }

    fn logs_with(id: &str, entries: &[(u64, Level, &str)]) -> Logs {
        let l = Logs::default();
        for (ms, level, msg) in entries {
            l.push(
                id,
                Entry {
                    at: at(*ms),
                    level: *level,
                    message: msg.to_string(),
                    fields: [("method".to_string(), "POST /files".to_string())].into(),
                },
            );
        }
        l
    }

    #[test]
    fn procedures_are_named_as_envd_names_them() {
        assert_eq!(procedure_message("process.Process/Start"), "Process start");
        assert_eq!(
            procedure_message("filesystem.Filesystem/ListDir"),
            "Filesystem listDir"
        );
        assert_eq!(procedure_message("odd"), "odd");
    }

    #[test]
    fn v1_is_oldest_first_from_start_with_raw_lines() {
        let l = logs_with(
            "s",
            &[
                (1_000, Level::Info, "a"),
                (2_000, Level::Error, "b"),
                (3_000, Level::Info, "c"),
            ],
        );
        let v = l.v1("s", &V1Query::parse(Some("start=2000&limit=5")).unwrap());
        let msgs: Vec<_> = v["logEntries"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e["message"].clone())
            .collect();
        assert_eq!(msgs, [json!("b"), json!("c")]);
        assert_eq!(v["logEntries"][0]["level"], "error");
        assert_eq!(v["logEntries"][0]["timestamp"], "1970-01-01T00:00:02.000Z");
        let line: Value = serde_json::from_str(v["logs"][0]["line"].as_str().unwrap()).unwrap();
        assert_eq!(
            (line["level"].as_str(), line["method"].as_str()),
            (Some("error"), Some("POST /files"))
        );
        assert_eq!(
            l.v1("nobody", &V1Query::parse(None).unwrap())["logs"],
            json!([])
        );
    }

    #[test]
    fn v2_pages_both_ways_with_level_and_search() {
        let l = logs_with(
            "s",
            &[
                (1_000, Level::Debug, "Process start"),
                (2_000, Level::Info, "File write"),
                (3_000, Level::Error, "Process start"),
            ],
        );
        let msgs = |q: &str| -> Vec<(String, String)> {
            l.v2("s", &V2Query::parse(Some(q)).unwrap())["logs"]
                .as_array()
                .unwrap()
                .iter()
                .map(|e| {
                    (
                        e["timestamp"].as_str().unwrap()[17..19].to_string(),
                        e["message"].as_str().unwrap().to_string(),
                    )
                })
                .collect()
        };
        assert_eq!(
            msgs("").iter().map(|m| m.0.as_str()).collect::<Vec<_>>(),
            ["03", "02", "01"],
            "backward by default"
        );
        assert_eq!(msgs("direction=forward&cursor=2000").len(), 2);
        assert_eq!(
            msgs("cursor=2000")
                .iter()
                .map(|m| m.0.as_str())
                .collect::<Vec<_>>(),
            ["02", "01"]
        );
        assert_eq!(msgs("level=info").len(), 2);
        assert_eq!(msgs("search=Process&level=error").len(), 1);
        assert_eq!(msgs("limit=1").len(), 1);
    }

    #[test]
    fn malformed_queries_are_refused() {
        for q in ["limit=1001", "limit=-1", "start=soon"] {
            assert!(V1Query::parse(Some(q)).is_err(), "{q}");
        }
        let long = format!("search={}", "x".repeat(MAX_SEARCH + 1));
        for q in [
            "direction=sideways",
            "level=fatal",
            "cursor=x",
            long.as_str(),
        ] {
            assert!(V2Query::parse(Some(q)).is_err(), "{q}");
        }
    }

    #[test]
    fn what_is_kept_is_bounded() {
        let l = Logs::default();
        l.record(
            "long",
            Level::Info,
            &"é".repeat(MAX_FIELD),
            &[("path", &"p".repeat(10_000))],
        );
        let v = l.v1("long", &V1Query::parse(None).unwrap());
        assert!(v["logEntries"][0]["message"].as_str().unwrap().len() <= MAX_FIELD);
        assert_eq!(
            v["logEntries"][0]["fields"]["path"].as_str().unwrap().len(),
            MAX_FIELD
        );
        for i in 0..MAX_ENTRIES + 5 {
            l.record("s", Level::Info, &i.to_string(), &[]);
        }
        let v = l.v1("s", &V1Query::parse(None).unwrap());
        assert_eq!(v["logEntries"].as_array().unwrap().len(), MAX_ENTRIES);
        assert_eq!(v["logEntries"][0]["message"], "5", "the oldest went first");
        for i in 0..MAX_SANDBOXES {
            l.record(&format!("o{i}"), Level::Info, "x", &[]);
        }
        assert_eq!(
            l.v1("s", &V1Query::parse(None).unwrap())["logs"],
            json!([]),
            "the least recent sandbox went"
        );
        assert_eq!(l.inner.lock().unwrap().by_sandbox.len(), MAX_SANDBOXES);
    }
}
