//! The poold daemon: the node core and its REST and E2B front-ends.
fn main() -> std::process::ExitCode {
    poold::cli::main()
}
