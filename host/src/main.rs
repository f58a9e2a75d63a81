//! The `sdhost` binary: parse, run, map errors to an exit code.

use clap::Parser;
use std::process::ExitCode;

fn main() -> ExitCode {
    let cli = sdhost::cli::Cli::parse();
    sdhost::app::init_logging(cli.verbose, cli.quiet);
    match sdhost::app::run(cli) {
        Ok(code) => code,
        Err(e) => {
            let msg = e
                .chain()
                .map(|c| c.to_string())
                .collect::<Vec<_>>()
                .join(": ");
            eprintln!("error: {}", sdhost::registry::one_line(&msg));
            ExitCode::FAILURE
        }
    }
}
