"""Commands over published artifacts and the store: check (a build's plan), fleet (builds on a Ray cluster), gc,
and the summaries the CLI prints. Imports the build and the runtime."""
