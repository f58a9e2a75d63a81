//! The `sdhost` binary: parse, run, map errors to an exit code (1 for a
//! failure, 130 for a run stopped by Ctrl-C or SIGTERM, 2 for usage errors,
//! which clap reports).

use clap::Parser;
use std::process::ExitCode;

fn main() -> ExitCode {
    let cli = sdhost::cli::Cli::parse();
    sdhost::app::init_logging(cli.verbose, cli.quiet);
    let code = match sdhost::app::run(cli) {
        Ok(code) => code,
        Err(e) if sdhost::term::is_cancelled(&e) => {
            sdhost::term::eprint_line("cancelled: no output was written");
            ExitCode::from(sdhost::cancel::EXIT_CODE)
        }
        Err(e) => {
            sdhost::term::eprint_line(&format!("error: {}", sdhost::term::error_line(&e)));
            ExitCode::FAILURE
        }
    };
    // Where a device failed to set up, the process ends without C++ static
    // destructors (ggml::finish says why).
    ggml::finish(code)
}
