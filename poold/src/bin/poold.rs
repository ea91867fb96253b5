//! The poold daemon (REST API, pools, sandbox lifecycle).
fn main() -> std::process::ExitCode {
    poold::daemon::cli::main()
}
