//! The `forkd` CLI.
fn main() -> std::process::ExitCode {
    forkd_cli::main()
}
