//! The `forkd` CLI.
fn main() -> std::process::ExitCode {
    poold::cli::main()
}
