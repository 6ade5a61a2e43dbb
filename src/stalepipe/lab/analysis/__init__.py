"""Reading run records: statistics, token overhead, claims, reports, plots."""
