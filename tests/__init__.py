"""hybridrl's test suite: a regular package, so that another installed top-level `tests` package
(openrlhf's wheel ships one) cannot shadow it."""
