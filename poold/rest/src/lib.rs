//! forkd-rest: the front-end for forkd's `/v1` API (same paths, JSON
//! fields, status codes and `{"error": "..."}` bodies) plus our own pools,
//! files, streaming exec, logs and TTLs, over the node core
//! (`forkd_node::Node`). Handlers only translate: a request into a node
//! operation, its answer into JSON, its error through [`error::answer`],
//! the one mapping. Reference: docs/api.md; the machine readable one is
//! the OpenAPI document at `GET /openapi.json`. [`server::app`] puts the
//! routes behind the shared edge (`forkd-edge`).
//!
//! # Adding a route
//!
//! Every route poold serves is in [`table`], and only there, registered
//! with utoipa-axum's `routes!(handler, ...)` (handlers of one path go in
//! one `routes!`). `routes!` adds the axum route *and* its OpenAPI
//! operation, both taken from the handler's `#[utoipa::path(...)]`
//! attribute: method, path (axum's `{param}` syntax), `tag`, `params`,
//! `request_body`, `responses`. Bodies are types deriving `ToSchema`
//! (the request and answer types live in the `forkd-api` crate). So:
//!
//! 1. write the handler with a `#[utoipa::path(...)]` attribute (copy one
//!    of its neighbours');
//! 2. add `.routes(routes!(handler))` to [`table`].
//!
//! A route added any other way (`.route(...)`, `nest_service`, a router
//! merged in `server`) has no operation in the document, and the test
//! `tests::every_route_is_documented_and_every_operation_served` fails:
//! it reads the routes axum actually holds and compares them, method by
//! method, with the document's operations. Listeners of their own (not
//! `/v1`) are outside this table and its document.

pub mod branch;
pub mod error;
pub mod files;
pub mod pools;
pub mod pty;
pub mod sandboxes;
pub mod server;
pub mod snapshots;
pub mod workspaces;

use axum::extract::{DefaultBodyLimit, State};
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::{Json, Router};
use forkd_node::Node;
use std::sync::{Arc, OnceLock};
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::OpenApi;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

/// The route table, in two groups: `public` needs no token, `authed`
/// needs one when poold has one (`server` adds the check).
pub struct Table {
    /// `/healthz`.
    pub public: OpenApiRouter<Arc<Node>>,
    /// Everything else.
    pub authed: OpenApiRouter<Arc<Node>>,
}

/// Every route poold serves, each with its OpenAPI operation (see the
/// module doc for how to add one).
pub fn table() -> Table {
    let public = OpenApiRouter::with_openapi(ApiDoc::openapi())
        .routes(routes!(healthz))
        .routes(routes!(healthz_slash));
    let authed = OpenApiRouter::new()
        .routes(routes!(version))
        .routes(routes!(metrics))
        .routes(routes!(openapi_json))
        .routes(routes!(snapshots::list, snapshots::create_snapshot))
        .routes(routes!(snapshots::delete_snapshot))
        .routes(routes!(snapshots::info))
        .routes(routes!(snapshots::compact))
        .routes(routes!(sandboxes::list, sandboxes::spawn))
        .routes(routes!(sandboxes::get, sandboxes::delete))
        .routes(routes!(sandboxes::ping))
        .routes(routes!(sandboxes::exec))
        .routes(routes!(sandboxes::exec_stream))
        .routes(routes!(sandboxes::eval))
        .routes(routes!(pty::pty))
        .routes(routes!(branch::branch))
        .routes(routes!(sandboxes::logs))
        .routes(routes!(sandboxes::set_ttl))
        .routes(routes!(sandboxes::set_network))
        .routes(routes!(files::read, files::write, files::remove))
        .routes(routes!(files::list))
        .routes(routes!(files::stat))
        .routes(routes!(files::mkdir))
        .routes(routes!(workspaces::list, workspaces::create))
        .routes(routes!(workspaces::get, workspaces::delete))
        .routes(routes!(workspaces::suspend))
        .routes(routes!(workspaces::resume))
        .routes(routes!(pools::list))
        .routes(routes!(pools::get, pools::put, pools::delete));
    Table { public, authed }
}

/// The document's fixed parts; the operations come from [`table`].
#[derive(OpenApi)]
#[openapi(
    info(
        title = "poold",
        description = "forkd's REST API (forkd v0.5.3's /v1 plus poold's own routes). Errors are always {\"error\": \"...\"}. Prose reference: docs/api.md.",
    ),
    modifiers(&BearerAuth),
    tags(
        (name = "status", description = "Health, version, metrics, this document"),
        (name = "snapshots", description = "Warm snapshots sandboxes fork from"),
        (name = "sandboxes", description = "Running sandboxes and what runs in them"),
        (name = "files", description = "Files in a sandbox (ours)"),
        (name = "pools", description = "Warm pools of paused children (ours)"),
        (name = "workspaces", description = "Named sandboxes that suspend to a snapshot and resume"),
    )
)]
struct ApiDoc;

/// Declares the bearer token and requires it on every operation but the
/// ones that opt out with `security(())`.
struct BearerAuth;

impl utoipa::Modify for BearerAuth {
    fn modify(&self, doc: &mut utoipa::openapi::OpenApi) {
        let c = doc.components.get_or_insert_with(Default::default);
        c.add_security_scheme(
            "bearer",
            SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()),
        );
        doc.security = Some(vec![utoipa::openapi::security::SecurityRequirement::new::<
            &str,
            [&str; 0],
            &str,
        >("bearer", [])]);
    }
}

/// The whole OpenAPI document (built once).
pub fn openapi() -> &'static utoipa::openapi::OpenApi {
    static DOC: OnceLock<utoipa::openapi::OpenApi> = OnceLock::new();
    DOC.get_or_init(|| {
        let t = table();
        let mut doc = t.public.into_openapi();
        doc.merge(t.authed.into_openapi());
        doc.info.version = env!("CARGO_PKG_VERSION").to_string();
        qualify_operation_ids(&mut doc);
        doc
    })
}

/// Makes every `operationId` unique, as OpenAPI requires and client
/// generators rely on: utoipa names an operation after its handler, and
/// several modules have a `list`, `get` or `delete`; the tag (the module's
/// area) goes in front: `sandboxes_list`, `pools_list`.
fn qualify_operation_ids(doc: &mut utoipa::openapi::OpenApi) {
    for item in doc.paths.paths.values_mut() {
        for op in [
            &mut item.get,
            &mut item.put,
            &mut item.post,
            &mut item.delete,
            &mut item.patch,
        ]
        .into_iter()
        .flatten()
        {
            let tag = op.tags.as_ref().and_then(|t| t.first()).cloned();
            if let (Some(tag), Some(id)) = (tag, op.operation_id.as_mut()) {
                *id = format!("{tag}_{id}");
            }
        }
    }
}

/// The routes that need no token (`/healthz`).
pub fn public_routes(d: Arc<Node>) -> Router {
    let (r, _) = table().public.split_for_parts();
    r.with_state(d)
}

/// Every route but `/healthz` (which needs no auth; see `server`), each
/// large request holding one of `transfers`' slots.
pub fn routes(d: Arc<Node>, transfers: Arc<forkd_edge::transfers::Transfers>) -> Router {
    let (r, _) = table().authed.split_for_parts();
    r.layer(DefaultBodyLimit::max(
        forkd_node::limits::MAX_FILE_BYTES + 4096,
    ))
    .layer(axum::middleware::from_fn_with_state(
        transfers,
        forkd_edge::transfers::turn,
    ))
    .with_state(d)
}

/// `GET /healthz`: poold answers, and whether its forkd-fs mount serves
/// (503 when it does not: every spawn would fail). No token needed, so no
/// sandbox ids: the lost ones are counted, and named in poold's log.
#[utoipa::path(get, path = "/healthz", tag = "status", security(()),
    responses((status = 200, description = "`{\"ok\": true, \"mount\": {ok, checked_unix, error, recoveries, last_recovery: {at_unix, cause, took_ms, lost_sandboxes, discarded_pooled}, kept_holder}}`", body = Object),
        (status = 503, description = "The same with `ok: false`: the mount does not serve and could not be mounted again (`mount.error` says why)", body = Object)))]
async fn healthz(State(d): State<Arc<Node>>) -> impl IntoResponse {
    health_answer(&d)
}

/// `GET /healthz/`: the same, for clients that add a slash.
#[utoipa::path(get, path = "/healthz/", tag = "status", security(()),
    responses((status = 200, description = "As `/healthz`", body = Object),
        (status = 503, description = "As `/healthz`", body = Object)))]
async fn healthz_slash(State(d): State<Arc<Node>>) -> impl IntoResponse {
    health_answer(&d)
}

fn health_answer(d: &Node) -> (StatusCode, Json<serde_json::Value>) {
    let m = d.mount_health();
    let last = m.last_recovery.as_ref().map(|r| {
        serde_json::json!({
            "at_unix": r.at_unix,
            "cause": r.cause,
            "took_ms": r.took_ms,
            "lost_sandboxes": r.lost_sandboxes.len(),
            "discarded_pooled": r.discarded_pooled,
        })
    });
    let code = if m.ok {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    let body = serde_json::json!({
        "ok": m.ok,
        "mount": {
            "ok": m.ok,
            "checked_unix": m.checked_unix,
            "error": m.error,
            "recoveries": m.recoveries,
            "last_recovery": last,
            "kept_holder": m.kept_holder,
        },
    });
    (code, Json(body))
}

/// `GET /openapi.json`: this document.
#[utoipa::path(get, path = "/openapi.json", tag = "status",
    responses((status = 200, description = "The OpenAPI document of every route", body = Object)))]
async fn openapi_json() -> Json<&'static utoipa::openapi::OpenApi> {
    Json(openapi())
}

/// The version, plus what isolates sandboxes on this host: the
/// accelerator poold resolved at start and whether QEMUs are jailed, so a
/// client can tell a KVM host from a weaker TCG one (docs/security.md).
#[utoipa::path(get, path = "/version", tag = "status",
    responses((status = 200, description = "`{version, api, compat, accelerator, jail, isolation, node, hub, e2b}` (`node`: the node's name, null without one; `hub`: the hub URL tags this node lacks come from, null without one; `e2b`: the ports and domain of its E2B planes, null when off)", body = Object)))]
async fn version(
    State(d): State<Arc<Node>>,
    e2b: Option<axum::Extension<server::E2bFront>>,
) -> Json<serde_json::Value> {
    let h = d.health();
    let e2b = e2b.and_then(|axum::Extension(f)| f.0);
    Json(serde_json::json!({
        "node": d.name(),
        "version": h.version,
        "api": "v1",
        "compat": "forkd 0.5.3",
        "accelerator": h.accelerator,
        "jail": h.jail,
        "isolation": h.isolation,
        "hub": d.hub_description(),
        "e2b": e2b,
    }))
}

/// `GET /metrics`: Prometheus text.
#[utoipa::path(get, path = "/metrics", tag = "status",
    responses((status = 200, description = "Prometheus text exposition", body = String, content_type = "text/plain")))]
async fn metrics(State(d): State<Arc<Node>>) -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        d.metrics_text().await,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::{BTreeMap, BTreeSet};

    /// `(METHOD, path)` pairs.
    type Routes = BTreeSet<(String, String)>;

    /// The routes an axum router holds, read from its `Debug` output (axum
    /// has no API that lists routes): the path router's `RouteId → path`
    /// map and, per route, the methods of its `Allow` header. A format
    /// change in axum makes this fail loudly, never pass quietly.
    fn served(router: &Router<Arc<Node>>) -> Routes {
        let dbg = format!("{router:?}");
        let section = dbg
            .split_once("path_router: PathRouter {")
            .and_then(|(_, rest)| rest.split_once("fallback_router:"))
            .map(|(s, _)| s)
            .expect("axum's Router Debug output changed: no path_router");
        let (routes, node) = section
            .split_once("node: Node {")
            .expect("axum's Router Debug output changed: no node");
        let id_after = |s: &str| -> Option<(u64, usize)> {
            let end = s.find(')')?;
            Some((s[..end].parse().ok()?, end + 1))
        };
        let mut paths = BTreeMap::new();
        for part in node.split("RouteId(").skip(1) {
            let (id, end) = id_after(part).expect("a RouteId");
            let p = part[end..]
                .trim_start_matches(": \"")
                .split('"')
                .next()
                .unwrap();
            paths.insert(id, p.to_string());
        }
        let mut out = Routes::new();
        for part in routes.split("RouteId(").skip(1) {
            let (id, _) = id_after(part).expect("a RouteId");
            let path = &paths[&id];
            let allow = part
                .split_once("allow_header: Bytes(b\"")
                .and_then(|(_, r)| r.split_once('"'))
                .map(|(a, _)| a)
                .unwrap_or_else(|| {
                    panic!("route {path} has no method list: added as a service? Register it with routes! in api::table")
                });
            let methods: Vec<&str> = allow.split(',').collect();
            for m in &methods {
                // axum adds HEAD to every GET.
                if *m == "HEAD" && methods.contains(&"GET") {
                    continue;
                }
                out.insert((m.to_string(), path.clone()));
            }
        }
        assert_eq!(
            paths.len(),
            out.iter().map(|(_, p)| p).collect::<BTreeSet<_>>().len(),
            "every path has methods: {dbg}"
        );
        out
    }

    /// The operations of an OpenAPI document.
    fn documented(doc: &utoipa::openapi::OpenApi) -> Routes {
        let mut out = Routes::new();
        for (path, item) in doc.paths.paths.iter() {
            let ops = [
                ("GET", &item.get),
                ("PUT", &item.put),
                ("POST", &item.post),
                ("DELETE", &item.delete),
                ("OPTIONS", &item.options),
                ("HEAD", &item.head),
                ("PATCH", &item.patch),
                ("TRACE", &item.trace),
                ("QUERY", &item.query),
            ];
            for (m, op) in ops {
                if op.is_some() {
                    out.insert((m.to_string(), path.clone()));
                }
            }
        }
        out
    }

    #[test]
    fn every_route_is_documented_and_every_operation_served() {
        let t = table();
        let (public, _) = t.public.split_for_parts();
        let (authed, _) = t.authed.split_for_parts();
        let served: Routes = served(&public).union(&served(&authed)).cloned().collect();
        let documented = documented(openapi());
        let undocumented: Vec<_> = served.difference(&documented).collect();
        let unserved: Vec<_> = documented.difference(&served).collect();
        assert!(
            undocumented.is_empty() && unserved.is_empty(),
            "routes without an OpenAPI operation (register them with routes! and a #[utoipa::path], see api's module doc): {undocumented:?}; operations without a route: {unserved:?}"
        );
        // The check sees what it should: a sample of known routes.
        for r in [
            ("GET", "/healthz"),
            ("GET", "/openapi.json"),
            ("POST", "/v1/sandboxes/{id}/exec/stream"),
            ("DELETE", "/v1/snapshots/{tag}"),
            ("PUT", "/v1/sandboxes/{id}/files"),
        ] {
            assert!(
                served.contains(&(r.0.into(), r.1.into())),
                "{r:?} not seen in {served:?}"
            );
        }
    }

    #[test]
    fn an_undocumented_route_is_seen() {
        let t = table();
        let sneaky = t
            .authed
            .route("/v1/sneaky", axum::routing::get(|| async { "x" }));
        let (router, doc) = sneaky.split_for_parts();
        let extra: Vec<_> = served(&router)
            .difference(&documented(&doc))
            .cloned()
            .collect();
        assert_eq!(extra, [("GET".to_string(), "/v1/sneaky".to_string())]);
    }

    #[test]
    fn operation_ids_are_unique() {
        let v = serde_json::to_value(openapi()).unwrap();
        let mut seen = BTreeSet::new();
        for (path, item) in v["paths"].as_object().unwrap() {
            for (method, op) in item.as_object().unwrap() {
                let id = op["operationId"]
                    .as_str()
                    .unwrap_or_else(|| panic!("{method} {path}: no operationId"));
                assert!(
                    seen.insert(id.to_string()),
                    "operationId {id} twice ({method} {path})"
                );
            }
        }
        assert!(
            seen.contains("sandboxes_list") && seen.contains("pools_list"),
            "{seen:?}"
        );
    }

    #[test]
    fn the_document_names_its_schemas_and_auth() {
        let v = serde_json::to_value(openapi()).unwrap();
        assert!(
            v["openapi"].as_str().unwrap().starts_with("3."),
            "{}",
            v["openapi"]
        );
        let schemas = v["components"]["schemas"].as_object().unwrap();
        for s in [
            "SandboxInfo",
            "SpawnBody",
            "ExecReply",
            "SnapshotInfo",
            "PoolStatus",
            "ErrorBody",
        ] {
            assert!(schemas.contains_key(s), "schema {s} missing");
        }
        assert_eq!(
            v["components"]["securitySchemes"]["bearer"]["scheme"],
            "bearer"
        );
        // /healthz needs no token; everything else inherits the bearer requirement.
        assert_eq!(
            v["paths"]["/healthz"]["get"]["security"],
            serde_json::json!([{}])
        );
        assert!(v["paths"]["/v1/sandboxes"]["post"]
            .get("security")
            .is_none());
        let spawn = &v["paths"]["/v1/sandboxes"]["post"];
        assert_eq!(
            spawn["requestBody"]["content"]["application/json"]["schema"]["$ref"],
            "#/components/schemas/SpawnBody"
        );
    }
}
