//! The poold daemon (REST API, pools, sandbox lifecycle).
fn main() -> std::process::ExitCode {
    eprintln!("poold: the daemon is not built yet (issue 6); use the forkd CLI");
    std::process::ExitCode::FAILURE
}
