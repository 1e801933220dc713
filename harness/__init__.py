"""mxval harness: cases, runner, diffs, budgets, reports, captured dumps and the CLI."""
