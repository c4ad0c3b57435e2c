"""The digits: the deterministic split of sklearn's digits and the moving-digits videos, and their writers.
The built-in data sets they make (`digits:train`, ...) are named and built by `miles.builtin`."""
