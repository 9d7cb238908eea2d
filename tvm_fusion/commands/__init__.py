"""The commands: each is a thin client of ``session.ModelSession`` (compile, inspect, bench,
profile, ablate) or of a built artifact (serve), with its report types."""
