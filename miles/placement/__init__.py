"""Where every actor of a job runs: the placement plan (pure, torch- and Ray-free) and its realization on Ray."""
