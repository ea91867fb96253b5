//! `forkd-gateway`: one endpoint in front of many poold nodes (docs/cluster.md).

fn main() -> anyhow::Result<()> {
    forkd_gateway::cli::main()
}
